"""Heaps with lazy deletion, the scheduler's indexes' one device.

An index keeps its entries in a `heapq` list and never searches it to delete: when an entry's
subject changes, a fresh entry is pushed and the old one is left behind, *stale*. Whoever reads
the heap asks whether an entry is live (`is_live`), drops stale entries met at the top, and skips
those met further down. A heap grows by its stale entries only until it holds more than twice
the live ones (plus slack), when it is rebuilt from them: amortized, a change costs O(log n).

`in_order` walks a heap smallest first without taking it apart (k entries cost O(k log k)), so a
choice can look past the top (an unhealthy worker, a request that does not fit) and leave the
heap as it was.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator
from typing import Any

REBUILD_SLACK = 64  # stale entries tolerated beyond twice the live ones before a rebuild


def in_order(heap: list) -> Iterator[Any]:
    """The heap's entries smallest first, found as they are asked for (a frontier of the heap's
    children), the heap left as it is. The heap must not change while the walk goes on."""
    if not heap:
        return
    frontier = [(heap[0], 0)]
    size = len(heap)
    while frontier:
        entry, index = heapq.heappop(frontier)
        yield entry
        child = 2 * index + 1
        if child < size:
            heapq.heappush(frontier, (heap[child], child))
            if child + 1 < size:
                heapq.heappush(frontier, (heap[child + 1], child + 1))


def live_top(heap: list, is_live: Callable[[Any], bool]) -> Any | None:
    """The smallest live entry, the stale ones above it dropped; None if there is none."""
    while heap and not is_live(heap[0]):
        heapq.heappop(heap)
    return heap[0] if heap else None


def push(heap: list, entry: Any, num_live: int, is_live: Callable[[Any], bool]) -> None:
    """Pushes `entry`; rebuilds the heap from its live entries (once each: a subject pushed
    twice unchanged has two live entries) when the stale ones dominate."""
    heapq.heappush(heap, entry)
    if len(heap) > 2 * num_live + REBUILD_SLACK:
        heap[:] = [e for e in dict.fromkeys(heap) if is_live(e)]
        heapq.heapify(heap)
