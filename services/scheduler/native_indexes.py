"""Which of the scheduler's indexes run in C: the fair queue's (`queue_index.c`) and the
registry's rooms (`decode_room.c`, `prefill_room.c`), each compiled on first use
(`kernels/native_build.py`) beside a Python twin that stays the reference and the fallback.

One setting chooses for all (`SchedulerLimits.indexes`, the scheduler's `--indexes`): `auto` (C
where it builds here, else Python with one warning saying why), `native` (fail without it) or
`python`. The answers are the same either way: the twin tests drive both with the same changes
and compare every answer (`tests/unit/test_queue_index_native.py`,
`tests/unit/test_decode_room_native.py`, `tests/unit/test_prefill_room_native.py`), and the
core's twin test runs on either.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from kernels import native_build
from services.scheduler.worker_index import DecodeRoom, PrefillRoom
from shared.config import cache_dir
from shared.logs import get_logger

INDEXES = ("auto", "native", "python")
# An index of either kind: the Python class or its C twin, alike to their callers. Typed
# loosely on purpose: the compiled scheduler (`services/compiled.py`) checks annotated types
# at run time.
NativeOrPython = Any
HERE = Path(__file__).parent
HEADERS = (HERE / "native_common.h",)

log = get_logger(component="scheduler")


def check_choice(choice: str) -> None:
    if choice not in INDEXES:
        raise ValueError(f"indexes must be one of {', '.join(INDEXES)}, got {choice!r}")


def pick(choice: str, python_type: type, native_type: Callable[[], type]) -> type:
    """The Python type, or the C one `native_type` loads, as `choice` says (see the module
    doc)."""
    check_choice(choice)
    if choice == "python":
        return python_type
    if choice == "native":
        return native_type()
    built = _native_or_none(native_type)
    return python_type if built is None else built


@functools.cache
def _native_or_none(native_type: Callable[[], type]) -> type | None:
    """`auto`'s answer, once per process and type: a failed build is not retried for every
    core (the planner makes one per configuration it simulates), and is said once."""
    try:
        return native_type()
    except native_build.NativeUnavailable as error:
        log.warning("native index unavailable, using the Python one", reason=str(error))
        return None


def load(source_name: str, module_name: str) -> ModuleType:
    """The extension module built from `source_name` beside this file."""
    build_dir = cache_dir() / "native"
    return native_build.load_extension(HERE / source_name, module_name, build_dir, HEADERS)


@functools.cache
def native_decode_room() -> type:
    """The C room; `NativeUnavailable` if it cannot be built or loaded here."""
    return load("decode_room.c", "_tandem_decode_room").DecodeRoom


def decode_room_type(choice: str) -> type:
    return pick(choice, DecodeRoom, native_decode_room)


@functools.cache
def native_prefill_room() -> type:
    """The C room; `NativeUnavailable` if it cannot be built or loaded here."""
    return load("prefill_room.c", "_tandem_prefill_room").PrefillRoom


def prefill_room_type(choice: str) -> type:
    return pick(choice, PrefillRoom, native_prefill_room)


def kind(index: object, python_type: type) -> str:
    """Which an index is: `native` (C) or `python`."""
    return "python" if type(index) is python_type else "native"
