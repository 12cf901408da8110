"""Garbage collection for a process whose heap is mostly long-lived objects.

The scheduler holds every queued request (about ten objects the cyclic collector tracks each:
the SUBMIT, its prompt list, the core's records, index entries), so at 100,000 queued it tracks
over a million objects, and each full collection walks all of them: 0.9-1.0 s in which the loop
neither dispatches nor answers a heartbeat. CPython triggers a full collection once a quarter as
many objects again have survived into the oldest generation, so under a steady stream that
pause comes back every few seconds (`loadtest/scheduler_scale.py`, `--gc`).

`SurvivorFreezer` moves what each full collection kept into the permanent generation
(`gc.freeze`), so the next one walks only what arrived since. Objects freed by their reference
counts are freed as ever, frozen or not; what a frozen object escapes is collection as part of a
reference cycle that died. The scheduler core makes no cyclic garbage
(`tests/unit/test_gc_policy.py` holds it to that); for the rest of the process (sockets,
logging, the metrics thread) the freezer thaws everything once per `thaw_every_s`, so the full
collection after that walks the whole heap once and takes whatever cycles died frozen: one long
pause an hour instead of one every few seconds.

`collector_paused` turns the collector off around work that makes no cyclic garbage, where its
passes are pure cost: the simulator's run (a million simulated requests took 314 s of CPU with
the collector walking their records and arrivals, none of them garbage, and 230 s without).

`untrack_atoms` takes a list of atoms (ints, strings) off the collector's books: a SUBMIT's
prompt, hundreds of token ids, is held by the scheduler while it queues and was walked item by
item by every collection it lived through (a tenth of the core's time at 100,000 queued).

`CollectionTimer` times every collection (the scheduler's `/metrics`:
`tandem:scheduler_gc_pause_seconds` by generation), so the pauses are seen, not guessed.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import time
from collections.abc import Callable, Iterator

DEFAULT_THAW_EVERY_S = 3600.0


def _gc_untrack_function() -> Callable[[object], None] | None:
    """CPython's `PyObject_GC_UnTrack` (stable C API; it leaves an untracked object be), called
    holding the GIL; None where the interpreter has no C API to call."""
    pythonapi = getattr(ctypes, "pythonapi", None)
    if pythonapi is None:
        return None
    prototype = ctypes.PYFUNCTYPE(None, ctypes.py_object)
    return prototype(("PyObject_GC_UnTrack", pythonapi))


_gc_untrack = _gc_untrack_function()


def untrack_atoms(values: list) -> None:
    """Takes `values`, a list whose items are all atoms (ints, floats, strings, bytes: objects
    the collector does not track), off the collector's books, as CPython does by itself for
    such tuples and dicts. Only a container can be part of a reference cycle, so the collector
    loses nothing by skipping the list; a container put in it later would be unseen through
    it (a cycle through the list would leak, never be freed wrongly: an untracked referrer only
    keeps things alive)."""
    if _gc_untrack is not None:
        _gc_untrack(values)


def num_full_collections() -> int:
    return gc.get_stats()[-1]["collections"]


class SurvivorFreezer:
    """Call `after_collections` on the loop's timer: it freezes the survivors of any full
    collection since the last call, and thaws the heap once per `thaw_every_s`."""

    def __init__(
        self,
        thaw_every_s: float = DEFAULT_THAW_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        if not thaw_every_s > 0:
            raise ValueError(f"thaw_every_s must be positive, got {thaw_every_s}")
        self.thaw_every_s = thaw_every_s
        self.clock = clock
        self.num_freezes = 0
        self.num_thaws = 0
        gc.freeze()  # what the start made (modules, configuration) lives as long as the process
        self._seen_full_collections = num_full_collections()
        self._last_thaw = clock()

    def after_collections(self) -> None:
        now = self.clock()
        if now - self._last_thaw >= self.thaw_every_s:
            gc.unfreeze()  # back in the oldest generation: the next full collection walks it all
            self._last_thaw = now
            self.num_thaws += 1
            self._seen_full_collections = num_full_collections()
            return
        full = num_full_collections()
        if full != self._seen_full_collections:
            gc.freeze()
            self._seen_full_collections = full
            self.num_freezes += 1

    def close(self) -> None:
        """Thaws the heap: the process's collection as it was."""
        gc.unfreeze()


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """The cyclic collector off while the block runs, back as it was after. Only for code that
    makes no cyclic garbage (held to that by a test): whatever it lets go, reference counting
    frees at once; a cycle it dropped would wait for the next collection after the block."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


class CollectionTimer:
    """Hands each collection's generation and wall seconds to `observe` (from the thread that
    triggered it), until `close`."""

    def __init__(self, observe: Callable[[int, float], None]):
        self.observe = observe
        self._started = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.observe(info["generation"], time.perf_counter() - self._started)

    def close(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)
