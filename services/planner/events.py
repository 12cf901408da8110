"""The simulator's clock: a heap of timed callbacks run in time order (ties: scheduling order).

Events that come in time order of themselves (a fixed delay after each other event, or a
workload's arrivals) can wait in a `Lane` instead: a queue whose first entry alone sits in the
heap. They run exactly when they would from the heap (each keeps the sequence number it was
given when scheduled), and the heap stays as small as the events that need it (steps,
transfers), however many requests wait to arrive or to time out.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable
from typing import Any

Entry = tuple[float, int, Callable[..., None], tuple[Any, ...]]  # time, sequence, callback, args


class EventQueue:
    def __init__(self) -> None:
        self.now = 0.0
        self.num_events = 0  # callbacks run so far
        self._heap: list[Entry] = []
        self._sequence = itertools.count()  # same-time events keep the order they were scheduled

    def at(self, time: float, callback: Callable[..., None], *args: Any) -> None:
        """Runs `callback(*args)` at simulated `time` (never before now)."""
        heapq.heappush(self._heap, (max(time, self.now), next(self._sequence), callback, args))

    def lane(self) -> Lane:
        return Lane(self)

    def _stamp(self, time: float, callback: Callable[..., None], args: tuple[Any, ...]) -> Entry:
        """What `at` puts in the heap, for a lane to hold back."""
        return (max(time, self.now), next(self._sequence), callback, args)

    def _push(self, entry: Entry) -> None:
        heapq.heappush(self._heap, entry)

    def run_next(self) -> bool:
        """Advances the clock to the next event and runs it; False when none is left."""
        if not self._heap:
            return False
        self.now, _, callback, args = heapq.heappop(self._heap)
        self.num_events += 1
        callback(*args)
        return True

    def earliest(self, excluding: set[Callable[..., None]]) -> float | None:
        """The time of the next event whose callback is none of `excluding` (a lane's first
        entry counts), None if there is none. It reads the whole heap: for an idle moment."""
        return min((e[0] for e in self._heap if e[2] not in excluding), default=None)

    def __len__(self) -> int:
        return len(self._heap)


class Lane:
    """Events scheduled in time order (each no earlier than the one before), run as if each had
    been put in the heap when it was scheduled."""

    def __init__(self, events: EventQueue):
        self._events = events
        self._entries: deque[Entry] = deque()

    def at(self, time: float, callback: Callable[..., None], *args: Any) -> None:
        """As `EventQueue.at`, for a time no earlier than the lane's last (else ValueError)."""
        entry = self._events._stamp(time, callback, args)
        if self._entries and entry[0] < self._entries[-1][0]:
            last = self._entries[-1][0]
            raise ValueError(f"a lane's events come in time order: {entry[0]} after {last}")
        self._entries.append(entry)
        if len(self._entries) == 1:
            self._enter_heap(entry)

    def _enter_heap(self, entry: Entry) -> None:
        """The first entry waits in the heap under its own time and sequence number."""
        time, sequence, _, _ = entry
        self._events._push((time, sequence, self._run_first, ()))

    def _run_first(self) -> None:
        _, _, callback, args = self._entries.popleft()
        if self._entries:
            self._enter_heap(self._entries[0])
        callback(*args)

    def __len__(self) -> int:
        return len(self._entries)
