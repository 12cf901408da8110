"""`tandem keys` and `shared.curve.generate`: nothing written for a refused command, secret keys
never readable by others (even when writing fails half-way), errors on stderr, and authorized
client keys that are not keys refused at start-up."""

from __future__ import annotations

import argparse

import pytest
import zmq.auth

from services.commands import keys as keys_command
from shared.curve import ClientKeys, CurveError, CurveKeys, generate, load_keys


def _tandem_keys(directory, *clients) -> int:
    return keys_command.run(argparse.Namespace(dir=str(directory), client=list(clients)))


def _files(root) -> list[str]:
    return sorted(str(path.relative_to(root)) for path in root.rglob("*") if path.is_file())


@pytest.mark.parametrize("clients", [("good", "bad-name"), ("bad-name",), ("cluster",)])
def test_a_refused_client_name_writes_nothing(tmp_path, clients):
    with pytest.raises(CurveError, match="client name"):
        generate(tmp_path / "keys", clients)
    assert not (tmp_path / "keys").exists() or _files(tmp_path / "keys") == []


def test_tandem_keys_refuses_on_stderr_with_status_2(tmp_path, capsys):
    assert _tandem_keys(tmp_path / "keys", "agent", "my agent") == 2
    out, err = capsys.readouterr()
    assert out == "" and "client name 'my agent'" in err
    assert not (tmp_path / "keys" / "cluster.key_secret").exists()


def test_tandem_keys_writes_and_prints_the_cluster_key(tmp_path, capsys):
    assert _tandem_keys(tmp_path / "keys", "agent") == 0
    out, err = capsys.readouterr()
    public = CurveKeys.from_dir(tmp_path / "keys").public.decode()
    assert f"cluster public key: {public}" in out and err == ""
    assert {"cluster.key", "cluster.key_secret", "authorized/agent.key"} <= set(
        _files(tmp_path / "keys")
    )


def test_tandem_keys_refuses_an_empty_directory_name(tmp_path, monkeypatch, capsys):
    """`--dir ""` (an unset shell variable, `--dir "$KEYS"`) wrote the cluster's secret key
    into the working directory, where services refuse `--curve-keys-dir ""` as given empty."""
    from services.commands.cli import main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(["keys", "--dir", ""])
    assert exit_info.value.code == 2
    assert "--dir" in capsys.readouterr().err
    assert _files(tmp_path) == []


def test_tandem_keys_reports_an_unwritable_directory(tmp_path, capsys):
    (tmp_path / "file").write_text("not a directory")
    assert _tandem_keys(tmp_path / "file" / "keys") == 2
    out, err = capsys.readouterr()
    assert out == "" and "cannot write CurveZMQ keys" in err


def test_tandem_keys_reports_a_damaged_cluster_key(tmp_path, capsys):
    (tmp_path / "keys").mkdir()
    (tmp_path / "keys" / "cluster.key_secret").write_text("metadata\ncurve\n")
    assert _tandem_keys(tmp_path / "keys") == 2
    out, err = capsys.readouterr()
    assert out == "" and "cannot load CurveZMQ keys" in err


def _secrets_readable_by_others(root) -> list[str]:
    return [str(p) for p in root.rglob("*.key_secret") if p.stat().st_mode & 0o077]


def test_secret_keys_are_never_readable_by_others_even_when_writing_fails(tmp_path, monkeypatch):
    real = zmq.auth.create_certificates
    seen_open = []

    def create_then_fail(directory, name, *args, **kwargs):
        seen_open.extend(_secrets_readable_by_others(tmp_path / "keys"))
        if name == "second":
            raise OSError(28, "No space left on device")
        return real(directory, name, *args, **kwargs)

    monkeypatch.setattr(zmq.auth, "create_certificates", create_then_fail)
    with pytest.raises(CurveError, match="No space left"):
        generate(tmp_path / "keys", ("first", "second"))
    assert seen_open == [] and _secrets_readable_by_others(tmp_path / "keys") == []
    assert (tmp_path / "keys" / "cluster.key_secret").exists()  # what was written is whole


def test_client_keys_that_are_not_z85_keys_are_refused(tmp_path):
    secret = zmq.curve_keypair()[1].decode()
    with pytest.raises(CurveError, match="client key 1 is not a CurveZMQ public key"):
        load_keys(None, secret, ("~" * 40,))
    with pytest.raises(CurveError, match="client key 2"):
        load_keys(None, secret, (zmq.curve_keypair()[0].decode(), "#" * 40))  # overflows Z85
    generate(tmp_path / "keys")
    with pytest.raises(CurveError, match="client key 1"):
        load_keys(str(tmp_path / "keys"), None, ("x" * 39 + "~",))


def test_a_client_secret_file_without_its_secret_is_refused_on_load(tmp_path):
    generate(tmp_path, ("agent",))
    public_only = (tmp_path / "clients" / "agent.key").read_text()
    (tmp_path / "clients" / "agent.key_secret").write_text(public_only)
    with pytest.raises(CurveError, match="holds no secret key"):
        ClientKeys.from_dir(tmp_path, "agent")
