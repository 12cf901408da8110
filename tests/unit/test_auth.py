"""API keys: parsing, wrong configurations, checks, and the tenant a key charges."""

from __future__ import annotations

import pytest

from services.gateway.auth import ApiKeys, Caller, KeyConfigError, tenant_of
from services.gateway.openai_protocol import ApiError
from services.gateway.service import GatewayConfig
from shared.config import ConfigError, config_from_args

KEY_A = "a" * 16 + "-alpha"
KEY_B = "b" * 24


def test_keys_map_to_tenants_and_bare_keys_leave_it_to_user():
    keys = ApiKeys.parse([f"{KEY_A}=alpha", KEY_B])
    assert keys.check(KEY_A) == Caller("alpha") and keys.check(KEY_B) == Caller(None)
    assert tenant_of(keys.check(KEY_A), user="mallory") == "alpha"  # `user` cannot move it
    assert tenant_of(keys.check(KEY_B), user="bob") == "bob"
    assert tenant_of(keys.check(KEY_B), user=None) == "default"
    assert keys.check_header(f"Bearer {KEY_A}") == Caller("alpha")
    assert keys.check_header(f"bearer  {KEY_B} ") == Caller(None)


@pytest.mark.parametrize(
    "header,needle",
    [
        (None, "didn't provide"),
        ("", "didn't provide"),
        (f"Basic {KEY_A}", "didn't provide"),
        ("Bearer " + KEY_A[:-1], "Incorrect API key"),
        ("Bearer " + KEY_A + "x", "Incorrect API key"),
    ],
)
def test_missing_or_wrong_keys_are_401_in_openais_shape(header, needle):
    keys = ApiKeys.parse([f"{KEY_A}=alpha"])
    with pytest.raises(ApiError) as raised:
        keys.check_header(header)
    error = raised.value
    assert error.status == 401 and needle in error.message
    assert error.body()["error"]["code"] == "invalid_api_key"


def test_no_keys_means_open_doors():
    keys = ApiKeys.parse([])
    assert not keys.enabled and keys.check(None) == Caller(None)


@pytest.mark.parametrize(
    "entries,needle",
    [
        (["short"], "at least 16"),
        (["has space in it ok long"], "at least 16"),
        ([f"{KEY_A}=bad tenant"], "tenant after '='"),
        ([f"{KEY_A}="], "tenant after '='"),
        ([KEY_A, f"{KEY_A}=t"], "listed twice"),
        # The RPC door's wire carries 256 characters of key: a longer one served HTTP and
        # refused every RPC call (400), so it is refused at start-up.
        (["k" * 257], "at most 256"),
    ],
)
def test_wrong_keys_are_refused_by_entry(entries, needle):
    with pytest.raises(KeyConfigError, match=needle):
        ApiKeys.parse(entries)


def test_keys_file_and_environment(tmp_path):
    path = tmp_path / "keys"
    path.write_text(f"# the team's keys\n{KEY_A}=alpha\n\n{KEY_B}\n")
    config = config_from_args(
        GatewayConfig, environ={"TANDEM_API_KEYS_FILE": str(path), "TANDEM_API_KEYS": ""}
    )
    assert config.keys().tenants == {KEY_A: "alpha", KEY_B: None}
    with pytest.raises(ConfigError, match="TANDEM_API_KEYS.*at least 16"):
        config_from_args(GatewayConfig, environ={"TANDEM_API_KEYS": "abc"})
    with pytest.raises(ConfigError, match="cannot read the API keys file"):
        config_from_args(GatewayConfig, environ={"TANDEM_API_KEYS_FILE": str(tmp_path / "no")})


def test_a_keys_file_error_names_its_line_and_comments_may_be_indented(tmp_path):
    path = tmp_path / "keys"
    path.write_text(f"\ufeff{KEY_A}=alpha\n\n    # the batch service's\n{KEY_B} = batch\nshort\n")
    with pytest.raises(KeyConfigError, match=f"^line 5 of {path}: a key is at least 16"):
        ApiKeys.load([KEY_A + "-env"], str(path))
    path.write_text(f"\ufeff{KEY_A}=alpha\n\n    # the batch service's\n{KEY_B} = batch\n")
    assert ApiKeys.load([], str(path)).tenants == {KEY_A: "alpha", KEY_B: "batch"}


def test_a_keys_file_that_is_not_text_is_a_config_error(tmp_path):
    path = tmp_path / "keys"
    path.write_bytes(b"\xff\xfe\x00binary")
    with pytest.raises(KeyConfigError, match="cannot read the API keys file"):
        ApiKeys.load([], str(path))
