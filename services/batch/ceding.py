"""Long loops of a worker thread that leave the service's loop its turns.

A thread that reads a file line by line beside the event loop starves it: each read drops the
GIL and takes it back at once, before the loop's thread (woken onto the same core) runs, and
every such hand-over restarts the loop thread's 5 ms wait for a forced switch. Reading back
50,000 answers left the loop no turn for 0.1 to 0.5 s. Sleeping for no time now and then
yields the core as well, and the loop's thread takes the GIL.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")
CEDE_EVERY = 256  # items between turns left to other threads (some 1.5 ms of answers read)


def ceding(items: Iterable[T], every: int = CEDE_EVERY) -> Iterator[T]:
    """`items`, the thread yielding the GIL and its core after each `every` of them."""
    for count, item in enumerate(items, 1):
        yield item
        if count % every == 0:
            time.sleep(0)
