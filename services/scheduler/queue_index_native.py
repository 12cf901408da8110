"""The fair queue's indexes in C (`queue_index.c`), compiled on first use; the Python
`QueueIndex` (`queue_index.py`) stays the reference and the fallback.

A decision asks the queue index a dozen questions; in C each is a few hundred nanoseconds
instead of microseconds, with the same answers: `tests/unit/test_queue_index_native.py` drives
both with the same changes and compares every answer, and the core's twin test
(`test_scheduler_indexes.py`) runs on either. The C type answers the hot questions itself; the
merged walks taken only when the usual choice fails (overdue requests by arrival, parties by
counter past the least served) are written here over its single-heap walks.

`native_indexes.py` chooses between them, with the scheduler's other C index.
"""

from __future__ import annotations

import functools
import heapq
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from services.scheduler import native_indexes
from services.scheduler.queue_index import QueueIndex, bucket_lengths
from services.scheduler.queued import BULK_CLASS, Party, QueuedRequest


def queue_index_type(choice: str) -> type:
    """The index class `choice` (`native_indexes.INDEXES`) names."""
    return native_indexes.pick(choice, QueueIndex, native_type)


@functools.cache
def native_type() -> type:
    """The C index with its merged walks; `NativeUnavailable` if it cannot be built or loaded
    here."""
    module = native_indexes.load("queue_index.c", "_tandem_queue_index")
    module.set_bulk_class(BULK_CLASS)

    native_base: Any = module.QueueIndex  # a type loaded at run time: mypy cannot name it

    class NativeQueueIndex(native_base):
        __slots__ = ()

        def by_arrival(self, bulk: bool) -> Iterator[QueuedRequest]:
            """The requests of the kind, oldest first (ties: the first queued)."""
            return (item for _, _, item in self.arrival_walk(bulk, -1))

        def by_arrival_within(
            self, bulk: bool, lengths_meet: Callable[[int, int], bool]
        ) -> Iterator[QueuedRequest]:
            """As `by_arrival`, passing over the length buckets `lengths_meet` rules out."""
            walks = []
            for bits in self.bucket_bits(bulk):
                low, high = bucket_lengths(bits)
                if lengths_meet(low, high):
                    walks.append(self.arrival_walk(bulk, bits))
            return (item for _, _, item in heapq.merge(*walks))

        def parties_by_counter(
            self, class_names: Iterable[str], lengths_meet: Callable[[str, int, int], bool]
        ) -> Iterator[Party]:
            """The backlogged parties of these classes, least counter first (ties: by tenant,
            then class), passing over those whose queued prompt lengths `lengths_meet` rules
            out."""
            walks = []
            for class_name in class_names:
                bounds = self.class_lengths(class_name)
                if bounds is not None and lengths_meet(class_name, *bounds):
                    walks.append(self.counter_walk(class_name))
            for entry in heapq.merge(*walks):
                party = entry[4]
                if lengths_meet(party.class_name, *self.party_lengths(party)):
                    yield party

    return NativeQueueIndex
