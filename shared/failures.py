"""When a service stops shrugging off failures: a few are one bad message each, many in a row
are the service's own state gone wrong.

The scheduler and the workers survive a message whose handling raises (they log it, count it,
and refuse the request it names) so that one poisoned request cannot end a process and every
request in it, then the next process it is resumed on. But a failure that left the state wrong
fails every message after it, and a service that answers everything with a refusal is worse than
a dead one: a worker that refuses at once looks idle and draws the traffic. `FailureWindow`
tells the two apart by their rate; past it the service exits and is started afresh, with clean
state (crash-only, as before the guard).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

DEFAULT_LIMIT = 20  # failures ...
DEFAULT_WINDOW_S = 10.0  # ... within this long: they persist


class PersistentFailures(Exception):
    """More messages failed than a few poisoned requests explain."""


class FailureWindow:
    def __init__(
        self,
        limit: int = DEFAULT_LIMIT,
        window_s: float = DEFAULT_WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        if limit < 1 or not window_s > 0:
            raise ValueError(f"limit must be >= 1 and window_s > 0, got {limit}, {window_s}")
        self.limit = limit
        self.window_s = window_s
        self._clock = clock
        self._times: deque[float] = deque()

    def record(self) -> None:
        """Counts one failure; raises `PersistentFailures` when more than `limit` fell within
        `window_s` (this one included)."""
        now = self._clock()
        self._times.append(now)
        while self._times[0] <= now - self.window_s:
            self._times.popleft()
        if len(self._times) > self.limit:
            raise PersistentFailures(
                f"{len(self._times)} messages failed within {self.window_s:g} s: the "
                "service's own state is in doubt; exiting to start afresh"
            )
