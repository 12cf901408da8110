"""A TANDEM_ environment variable no tandem process reads is named, with the setting it resembles;
the list of names read is held to the config classes and to the code, so it cannot go stale."""

import dataclasses
import re
import shutil
from pathlib import Path

import pytest

from services.batch.service import BatchServiceConfig
from services.gateway.service import GatewayConfig
from services.scheduler.service import SchedulerConfig
from services.worker.config import WorkerConfig
from shared import env_names
from shared.config import env_name
from tests.helpers import run_tandem

ROOT = Path(__file__).resolve().parents[2]
# What a user runs and deploys (the tests' own names are TANDEM_TEST_*, or misspelled on purpose).
PRODUCT_DIRS = ("services", "shared", "kernels", "loadtest", "compose")
PRODUCT_FILES = ("docker-compose.yml", ".ci/run")
# Docstrings' examples of the naming rule, no setting.
PLACEHOLDERS = {"TANDEM_SOME_FIELD", "TANDEM_SOME_SETTING", "TANDEM_NAME"}
NAME = re.compile(r"\bTANDEM_[A-Z0-9_]*[A-Z0-9]\b")


def _product_sources() -> list[Path]:
    """The product's files, but the list itself (it holds every name, read or not)."""
    found = [ROOT / name for name in PRODUCT_FILES]
    for directory in PRODUCT_DIRS:
        for path in (ROOT / directory).rglob("*"):
            if path.is_file() and (
                path.suffix in (".py", ".sh", ".yml", ".yaml") or path.name.startswith("Dockerfile")
            ):
                found.append(path)
    return [path for path in found if path != ROOT / "shared" / "env_names.py"]


def _names_in_sources() -> dict[str, Path]:
    names: dict[str, Path] = {}
    for path in _product_sources():
        for name in NAME.findall(path.read_text(errors="replace")):
            names.setdefault(name, path)
    return {
        name: path
        for name, path in names.items()
        if name not in PLACEHOLDERS and not name.startswith(env_names.TEST_PREFIX)
    }


def test_the_settings_are_the_config_classes_fields():
    fields = {
        env_name(field.name)
        for config in (GatewayConfig, WorkerConfig, SchedulerConfig, BatchServiceConfig)
        for field in dataclasses.fields(config)
    }
    assert fields == env_names.SETTINGS


def test_every_name_the_product_reads_is_known_and_every_known_one_is_read():
    in_sources = _names_in_sources()
    unknown = {name: str(path) for name, path in in_sources.items() if name not in env_names.KNOWN}
    assert not unknown, f"add these to shared/env_names.py: {unknown}"
    stale = env_names.OTHERS - in_sources.keys()
    assert not stale, f"nothing reads these any more: {stale}"


def test_unread_names_are_the_prefixed_ones_no_process_reads():
    environ = {
        "TANDEM_HEARTBEAT_TIMOUT_S": "3",  # misspelled
        "TANDEM_PORT": "8000",
        "TANDEM_COMPILED": "on",
        "TANDEM_TEST_DEVICE": "cuda",  # the test suite's
        "TANDEMONIUM": "x",  # not the prefix
        "PATH": "/bin",
        "TANDEM_FROBNICATE": "1",
    }
    assert env_names.unread_names(environ) == ["TANDEM_FROBNICATE", "TANDEM_HEARTBEAT_TIMOUT_S"]


@pytest.mark.parametrize(
    ("name", "suggested"),
    [
        ("TANDEM_HEARTBEAT_TIMOUT_S", "TANDEM_HEARTBEAT_TIMEOUT_S"),
        ("TANDEM_SCHEDULER_ADRESS", "TANDEM_SCHEDULER_ADDRESS"),
        ("TANDEM_KV_CACHE_BYTE", "TANDEM_KV_CACHE_BYTES"),
        ("TANDEM_FROBNICATE", None),
    ],
)
def test_the_warning_names_the_setting_it_resembles(name, suggested):
    warning = env_names.unread_warning(name)
    assert f"{name} is not a tandem setting and is ignored" in warning
    if suggested:
        assert f"did you mean {suggested}?" in warning
    else:
        assert "did you mean" not in warning


def test_the_command_warns_of_a_misspelled_setting(tmp_path):
    """The scheduler refuses the timeout it was given by flag; before that it says the
    environment's misspelled one is ignored (it ran on the default, unsaid)."""
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "TANDEM_HEARTBEAT_TIMOUT_S": "30"}
    result = run_tandem("scheduler", "--heartbeat-timeout-s", "0", env=env)
    assert result.returncode == 2
    assert (
        "tandem scheduler: warning: environment variable TANDEM_HEARTBEAT_TIMOUT_S is not a tandem "
        "setting and is ignored (did you mean TANDEM_HEARTBEAT_TIMEOUT_S?)"
    ) in result.stderr
    clean = run_tandem("scheduler", "--heartbeat-timeout-s", "0", env={**env, "TANDEM_PORT": "1"})
    assert clean.stderr.count("warning") == 1  # the known one says nothing


def test_up_says_it_once_its_children_do_not_get_it(monkeypatch, tmp_path):
    """`tandem up` hands its environment to every child: each would repeat the warning."""
    from services.commands import cli, up

    monkeypatch.setenv("TANDEM_MAX_NUM_SEQ", "8")
    monkeypatch.setenv("TANDEM_MAX_NUM_SEQS", "16")
    args = cli.build_parser(["up"]).parse_args(["up", "--port", "1"])
    cluster = up.LocalCluster(args, echo_logs=False)
    shutil.rmtree(cluster.run_dir, ignore_errors=True)
    child = cluster._popen(["scheduler", "--heartbeat-timeout-s", "0"], {})
    output = child.communicate(timeout=60)[0].decode()
    assert child.returncode == 2 and "heartbeat_timeout_s" in output
    assert "TANDEM_MAX_NUM_SEQ " not in output and "warning" not in output
