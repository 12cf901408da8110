"""`kernels/native_build.py`: a C extension is built once per source, headers and flags, and an
edit of a header it includes builds it afresh (the scheduler's C indexes share one)."""

from __future__ import annotations

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
