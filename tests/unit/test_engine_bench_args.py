"""`loadtest.engine_bench` refuses wrong flags before it loads any model (exit status 2)."""

import subprocess
import sys

import pytest


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--linear-backend", "mkl"], "invalid choice: 'mkl'"),
        (["--device", "tpu"], "device must be cpu, cuda or cuda:N"),
        (["--dtype", "float8"], "invalid choice: 'float8'"),
    ],
)
def test_wrong_flags_exit_2_naming_the_problem(argv, needle):
    result = subprocess.run(
        [sys.executable, "-m", "loadtest.engine_bench", *argv],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert needle in result.stderr
