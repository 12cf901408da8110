"""`kernels/native_build.py`: a C extension is built once per source, headers and flags, and an
edit of a header it includes builds it afresh (the scheduler's C indexes share one)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kernels import native_build

SOURCE = """
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include "answer.h"

static PyObject *answer(PyObject *module, PyObject *unused) { return PyLong_FromLong(ANSWER); }
static PyMethodDef functions[] = {{"answer", answer, METH_NOARGS, NULL}, {NULL, NULL, 0, NULL}};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_answer", NULL, -1, functions};
PyMODINIT_FUNC PyInit__answer(void) { return PyModule_Create(&module); }
"""


def build(tmp_path: Path, answer: int):
    source, header = tmp_path / "answer.c", tmp_path / "answer.h"
    source.write_text(SOURCE)
    header.write_text(f"#define ANSWER {answer}\n")
    return native_build.load_extension(source, "_answer", tmp_path / "build", (header,))


def test_an_edited_header_builds_afresh_and_an_unchanged_one_reuses_the_build(tmp_path):
    assert build(tmp_path, 41).answer() == 41
    assert build(tmp_path, 42).answer() == 42  # the header alone changed
    built = sorted((tmp_path / "build").glob("answer-*.so"))
    assert len(built) == 2
    mtimes = [path.stat().st_mtime_ns for path in built]
    assert build(tmp_path, 42).answer() == 42
    assert [path.stat().st_mtime_ns for path in built] == mtimes  # nothing rebuilt
    assert len(list((tmp_path / "build").glob("answer-*.so"))) == 2


def test_a_failed_compile_says_why_and_leaves_nothing(tmp_path):
    source = tmp_path / "broken.c"
    source.write_text("this is not C\n")
    with pytest.raises(native_build.NativeUnavailable, match=r"failed: .*broken\.c:1:.*error:"):
        native_build.load_extension(source, "_broken", tmp_path / "build")
    assert not list((tmp_path / "build").glob("*"))


def test_a_build_tool_that_cannot_start_or_outlives_its_time_raises_the_callers_error(tmp_path):
    class ToolFailed(RuntimeError):
        pass

    missing = [str(tmp_path / "no-such-tool")]
    with pytest.raises(ToolFailed, match="the tool failed: .*No such file"):
        native_build.run_build_tool(missing, label="the tool", error=ToolFailed, timeout_s=5)
    slow = ["sleep", "5"]
    with pytest.raises(ToolFailed, match="sleep failed: .*timed out after 0.2 seconds"):
        native_build.run_build_tool(slow, label="sleep", error=ToolFailed, timeout_s=0.2)


def test_a_failed_build_tool_without_diagnostics_reports_its_last_lines(tmp_path):
    script = "; ".join(f"echo line{i}" for i in range(8)) + "; exit 3"
    with pytest.raises(RuntimeError, match=r"sh failed: line3 / line4 / line5 / line6 / line7$"):
        native_build.run_build_tool(
            ["sh", "-c", script], label="sh", error=RuntimeError, timeout_s=5
        )


# A compiler that takes its time: `-c` writes an object, a link writes the library in two parts
# (a real linker also writes its output gradually), each refusing a missing input.
SLOW_COMPILER = """#!/bin/sh
out=""; input=""; previous=""
for arg in "$@"; do
    if [ "$previous" = "-o" ]; then
        out="$arg"
    else
        case "$arg" in *.o|*.c) input="$arg" ;; esac
    fi
    previous="$arg"
done
[ -f "$input" ] || { echo "$input: error: no such input" >&2; exit 1; }
sleep 0.3
case " $* " in
    *" -c "*) echo object > "$out" ;;
    *) echo first half > "$out"; sleep 0.3; echo second half >> "$out" ;;
esac
"""


def test_builds_at_once_under_one_process_id_each_get_a_whole_library(tmp_path, monkeypatch):
    """Every container of the compose file runs tandem as process 1 and shares the /cache
    volume: workers starting together compiled into the same temporary files, named by the
    process id, so one removed or renamed away another's object or half-written library (a
    worker failed to start, or the cache kept a truncated library). Threads share a process id
    just as those containers do."""
    import threading

    compiler = tmp_path / "slow-cc"
    compiler.write_text(SLOW_COMPILER)
    compiler.chmod(0o755)
    monkeypatch.setenv("CC", str(compiler))
    source = tmp_path / "kernel.c"
    source.write_text("int answer(void) { return 42; }\n")
    build_dir = tmp_path / "build"
    results: list[Path | BaseException] = []

    def build_it() -> None:
        try:
            results.append(native_build.compile_cached(source, build_dir, ("-O2",), ("-shared",)))
        except BaseException as error:  # noqa: BLE001 - reported by the assertion below
            results.append(error)

    builders = [threading.Thread(target=build_it) for _ in range(3)]
    for builder in builders:
        builder.start()
    for builder in builders:
        builder.join()
    assert all(isinstance(result, Path) for result in results), results
    (library,) = set(results)
    # The linker's whole output, then the seal that marks the build whole (`_seal`).
    assert library.read_bytes().startswith(b"first half\nsecond half\ntandem-native-build-sha256:")
    assert list(build_dir.iterdir()) == [library]  # no temporary file left behind


def test_a_build_directory_that_cannot_be_written_is_a_build_failure(tmp_path):
    """A cache directory the process cannot write (a read-only mount, a home directory of
    another user) raised OSError past every caller's fallback: the block chain's hashing
    failed on every call instead of hashing in Python, and a bfloat16 worker with
    `--decode-attention auto` failed to start instead of keeping the torch reference."""
    source = tmp_path / "kernel.c"
    source.write_text("int answer(void) { return 42; }\n")
    occupied = tmp_path / "not-a-directory"
    occupied.write_text("")
    with pytest.raises(native_build.NativeUnavailable, match="cannot write .*not-a-directory"):
        native_build.compile_cached(source, occupied / "build", ("-O2",), ("-shared",))


ARM_CPUINFO = """processor\t: 0
BogoMIPS\t: 243.75
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid {extra}
CPU implementer\t: 0x41
CPU architecture: 8
CPU part\t: {part}
"""


def test_arm_cpus_with_other_features_get_other_builds(tmp_path):
    """Linux on ARM names the CPU's features `Features`, not `flags`: every ARM CPU got the key
    "unknown", so a cache shared between a Graviton2 and a Graviton3 node handed one the
    other's `-march=native` library (SVE instructions on a CPU without them)."""
    keys = []
    for extra, part in (("", "0xd0c"), ("sve sve2 bf16", "0xd40")):
        cpuinfo = tmp_path / f"cpuinfo-{part}"
        cpuinfo.write_text(ARM_CPUINFO.format(extra=extra, part=part))
        keys.append(native_build.cpu_flags(cpuinfo))
    assert keys[0] != keys[1]
    assert b"unknown" not in keys
    x86 = tmp_path / "cpuinfo-x86"
    x86.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2\nprocessor\t: 1\nflags\t\t: fpu\n")
    assert native_build.cpu_flags(x86) == b"flags\t\t: fpu sse2 avx2"
    assert native_build.cpu_flags(tmp_path / "absent") == b"unknown"


LOAD_AND_CALL = "import ctypes, sys; print(ctypes.CDLL(sys.argv[1]).answer())"


@pytest.mark.parametrize("kept", [0, 0.5], ids=["empty", "half"])
def test_a_cached_library_cut_short_is_built_again(tmp_path, kept):
    """A library in the cache that is cut short (a copy of the cache volume interrupted, a crash
    before the build's data reached the disk) was handed out as it was: dlopen of half a
    library killed the loading process with SIGBUS (no error, no fallback), an empty one was
    refused on every start. The cache must build it again."""
    source = tmp_path / "kernel.c"
    source.write_text("int answer(void) { return 42; }\n")
    build_dir = tmp_path / "build"
    library = native_build.compile_cached(source, build_dir, ("-O2", "-fPIC"), ("-shared",))
    whole = library.read_bytes()
    library.write_bytes(whole[: int(len(whole) * kept)])
    again = native_build.compile_cached(source, build_dir, ("-O2", "-fPIC"), ("-shared",))
    loaded = subprocess.run(
        [sys.executable, "-c", LOAD_AND_CALL, str(again)], capture_output=True, text=True
    )
    assert (loaded.returncode, loaded.stdout) == (0, "42\n"), loaded.stderr
    assert sorted(build_dir.iterdir()) == [again]  # no temporary file left behind


def test_a_compiler_named_with_arguments_builds(tmp_path, monkeypatch):
    """`$CC` may carry a wrapper or flags (`ccache gcc`, `gcc -m64`), as make and setuptools
    take it: the whole value was looked up as one program name, so such a setting reported "no
    C compiler" and every native path fell back to Python."""
    monkeypatch.setenv("CC", "env cc")
    source = tmp_path / "kernel.c"
    source.write_text("int answer(void) { return 42; }\n")
    library = native_build.compile_cached(
        source, tmp_path / "build", ("-O2", "-fPIC"), ("-shared",)
    )
    loaded = subprocess.run(
        [sys.executable, "-c", LOAD_AND_CALL, str(library)], capture_output=True, text=True
    )
    assert (loaded.returncode, loaded.stdout) == (0, "42\n"), loaded.stderr
