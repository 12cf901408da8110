"""The scheduler's C (`queue_index.c`, `decode_room.c`, `prefill_room.c`) and the prefix cache's
block chain (`block_chain.c`) under AddressSanitizer and UndefinedBehaviorSanitizer.

A read past an array or a use after free in the C indexes would not fail a twin test reliably (the
memory read may hold anything, or what was there before): it would crash a scheduler some day,
or decide from garbage. So the twin tests run once more in a child process whose build of the
C indexes is instrumented (`TANDEM_NATIVE_CFLAGS`, a cache of its own), with the sanitizers'
runtimes preloaded (the interpreter is not instrumented) and Python's allocator set to malloc so
that every C array is an allocation the sanitizer watches. Any report ends the child (no
recovery) and fails this test with it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SANITIZE = "-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer -g"


def runtime(name: str) -> str:
    """A sanitizer runtime of the system's gcc (the compiler `native_build` uses here)."""
    found = subprocess.run(
        ["gcc", f"-print-file-name={name}"], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert os.path.isabs(found), f"gcc has no {name}: install its sanitizer runtimes"
    return found


def test_the_twin_tests_run_clean_under_the_sanitizers(tmp_path):
    env = {
        **os.environ,
        "TANDEM_CACHE_DIR": str(tmp_path),
        "TANDEM_NATIVE_CFLAGS": SANITIZE,
        "CC": "gcc",
        "PYTHONMALLOC": "malloc",
        "LD_PRELOAD": f"{runtime('libasan.so')} {runtime('libubsan.so')}",
        "ASAN_OPTIONS": "detect_leaks=0",  # the interpreter's own allocations are not ours
    }
    tests = [
        "tests/unit/test_queue_index_native.py",
        "tests/unit/test_decode_room_native.py",
        "tests/unit/test_prefill_room_native.py",
        "tests/unit/test_scheduler_indexes.py::test_indexed_core_decides_as_the_scanning_one[native]",
        "tests/unit/test_scheduler_indexes.py"
        "::test_indexed_core_decides_as_the_scanning_one_with_prefix_caches[native]",
        "tests/unit/test_block_chain.py",
    ]
    # -s: a sanitizer's report goes to the process's stderr, which pytest's capture would lose
    # when the report ends the process.
    command = [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider"]
    command += ["-p", "no:faulthandler", "-k", "not compiler", *tests]
    done = subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0 and "Sanitizer" not in output, output[-6000:]
    passed = re.search(r"(\d+) passed", output)
    assert passed and int(passed.group(1)) >= 58, output[-2000:]  # the twins all ran
    for source in ("queue_index", "decode_room", "prefill_room", "block_chain"):
        built = list((tmp_path / "native").glob(f"{source}-*.so"))
        assert built, f"no instrumented build of {source}.c ran"
