"""compose/docker-engine.sh's refusals, which start nothing: no command, and a private dockerd
that holds the pidfile but does not answer (it is neither used nor started twice)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "compose" / "docker-engine.sh"


def run_script(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=120, env=env
    )


def test_no_command_is_a_usage_error():
    done = run_script(env=dict(os.environ))
    assert done.returncode == 2
    assert "usage: " in done.stderr and "COMMAND [ARG...]" in done.stderr


@pytest.mark.skipif(
    not (shutil.which("docker") and shutil.which("dockerd")),
    reason="needs docker and dockerd installed (compose/docker-engine.sh installs them in CI)",
)
def test_a_dockerd_that_holds_the_pidfile_but_does_not_answer_is_reported(tmp_path):
    holder = subprocess.Popen(["sleep", "60"])  # stands in for a hung dockerd: alive, silent
    try:
        (tmp_path / "docker.pid").write_text(str(holder.pid))
        env = dict(
            os.environ,
            TANDEM_DOCKER_DIR=str(tmp_path),
            DOCKER_HOST=f"unix://{tmp_path}/nothing-here.sock",  # no engine answers there
        )
        done = run_script("true", env=env)
    finally:
        holder.kill()
        holder.wait()
    assert done.returncode == 1
    assert f"dockerd {holder.pid} holds {tmp_path}/docker.pid but does not answer" in done.stderr
    assert not (tmp_path / "dockerd.log").exists()  # no second dockerd was started
