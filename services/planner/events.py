"""The simulator's clock: a heap of timed callbacks run in time order (ties: scheduling order)."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from typing import Any


class EventQueue:
    def __init__(self) -> None:
        self.now = 0.0
        self.num_events = 0  # callbacks run so far
        self._heap: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._sequence = itertools.count()  # same-time events keep the order they were scheduled

    def at(self, time: float, callback: Callable[..., None], *args: Any) -> None:
        """Runs `callback(*args)` at simulated `time` (never before now)."""
        heapq.heappush(self._heap, (max(time, self.now), next(self._sequence), callback, args))

    def run_next(self) -> bool:
        """Advances the clock to the next event and runs it; False when none is left."""
        if not self._heap:
            return False
        self.now, _, callback, args = heapq.heappop(self._heap)
        self.num_events += 1
        callback(*args)
        return True

    def __len__(self) -> int:
        return len(self._heap)
