"""The fair queue's indexes: its requests by party, by arrival and by prompt length, and its
backlogged parties by counter, so that no choice scans the queue or the parties.

A scheduler may hold 100,000 requests of 10,000 tenants; the policy (`fair_share.py`) asks a few
questions of them for every decision, and each is answered from an ordered view here:

* which parties are backlogged, least served first (one lazy heap per class of `(counter,
  tenant, class, version, party)`; a party's entry is live while its version is current: every
  change of its counter and every re-entry pushes a new one);
* the requests by arrival, oldest first (lazy heaps of `(arrival, sequence, request id)`, one for
  interactive requests and one for bulk ones): the oldest, and the overdue ones;
* the resuming requests (few: they go first);
* the prompt tokens queued per party and per kind (interactive or bulk), for the wait forecast;
* bounds on the prompt lengths queued per party and per class (widened as requests come, reset
  when the party or class empties: never narrower than the truth), so a choice that can place
  only some lengths passes over a party or a whole class at once.

Ties keep the order of insertion: a request's *sequence* number is the order in which it was
queued, as the policy's scans over `items` (a dict, in insertion order) saw them.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

from services.scheduler import lazy_heap

if TYPE_CHECKING:
    from services.scheduler.queued import Party, QueuedRequest

# A party's queue is a heap of (-priority, prompt tokens, arrival, sequence, request id).
PartyKey = tuple[int, int, float, int, str]
ArrivalEntry = tuple[float, int, str]
CounterEntry = tuple[float, str, str, int, "Party"]


class QueueIndex:
    def __init__(self) -> None:
        self.items: dict[str, tuple[Party, QueuedRequest, int]] = {}  # id -> party, item, seq
        self.parties: dict[Party, list[PartyKey]] = {}  # backlogged parties' heaps
        self.resumed: dict[str, QueuedRequest] = {}
        self._sequence = itertools.count()
        self._by_arrival: dict[bool, list[ArrivalEntry]] = {False: [], True: []}  # by bulk
        self._num_by_kind = {False: 0, True: 0}
        self._tokens_by_kind = {False: 0, True: 0}  # prompt tokens queued
        self.party_tokens: dict[Party, int] = {}  # a backlogged party's prompt tokens queued
        # The same entries per kind and length bucket (lengths of one bit length), so a walk
        # for the oldest placeable request passes over the buckets none of which can be.
        self._by_bucket: dict[tuple[bool, int], list[ArrivalEntry]] = {}
        self._num_by_bucket: dict[tuple[bool, int], int] = {}
        self._by_counter: dict[str, list[CounterEntry]] = {}  # class -> its parties' entries
        self._num_parties: dict[str, int] = {}  # class -> backlogged parties
        self._version: dict[Party, int] = {}  # a backlogged party's current entry
        self._versions = itertools.count()
        # [min, max] prompt tokens queued. A request at a bound leaving marks them stale: they
        # are recomputed before they are next read (kept only widening, they went stale, and a
        # walk then sorted every party that could no longer place anything).
        self._party_lengths: dict[Party, list[int]] = {}
        self._stale_lengths: set[Party] = set()
        self.class_lengths: dict[str, list[int]] = {}

    # -- changes ------------------------------------------------------------------------------

    def add(self, party: Party, item: QueuedRequest, counter: float) -> None:
        sequence = next(self._sequence)
        heap = self.parties.get(party)
        if heap is None:
            heap = self.parties[party] = []
            self._num_parties[party.class_name] = self._num_parties.get(party.class_name, 0) + 1
            self.set_counter(party, counter)
        key = (-item.priority, item.num_prompt_tokens, item.arrival, sequence, item.request_id)
        heapq.heappush(heap, key)
        self.items[item.request_id] = (party, item, sequence)
        arrivals = self._by_arrival[item.bulk]
        self._num_by_kind[item.bulk] += 1
        self._tokens_by_kind[item.bulk] += item.num_prompt_tokens
        self.party_tokens[party] = self.party_tokens.get(party, 0) + item.num_prompt_tokens
        lazy_heap.push(
            arrivals,
            (item.arrival, sequence, item.request_id),
            self._num_by_kind[item.bulk],
            self._arrival_live,
        )
        bucket = (item.bulk, item.num_prompt_tokens.bit_length())
        self._num_by_bucket[bucket] = self._num_by_bucket.get(bucket, 0) + 1
        lazy_heap.push(
            self._by_bucket.setdefault(bucket, []),
            (item.arrival, sequence, item.request_id),
            self._num_by_bucket[bucket],
            self._arrival_live,
        )
        if item.resumed:
            self.resumed[item.request_id] = item
        _widen(self._party_lengths, party, item.num_prompt_tokens)
        _widen(self.class_lengths, party.class_name, item.num_prompt_tokens)

    def discard(self, request_id: str) -> tuple[Party, QueuedRequest] | None:
        """Takes a request out. A party left empty stays listed (its counter still counts for
        the virtual time) until `drop_party`."""
        entry = self.items.pop(request_id, None)
        if entry is None:
            return None
        party, item, _ = entry
        self._num_by_kind[item.bulk] -= 1
        self._tokens_by_kind[item.bulk] -= item.num_prompt_tokens
        self.party_tokens[party] -= item.num_prompt_tokens
        self._num_by_bucket[item.bulk, item.num_prompt_tokens.bit_length()] -= 1
        self.resumed.pop(request_id, None)
        if item.num_prompt_tokens in self._party_lengths[party]:
            self._stale_lengths.add(party)
        heap = self.parties[party]
        if heap[0][-1] == request_id:  # the usual case: the party's first is served
            heapq.heappop(heap)
        else:
            heap[:] = [key for key in heap if key[-1] != request_id]
            heapq.heapify(heap)
        return party, item

    def drop_party(self, party: Party) -> None:
        """A party whose queue emptied is no longer backlogged."""
        del self.parties[party]
        del self._version[party]
        del self._party_lengths[party]
        self._stale_lengths.discard(party)
        del self.party_tokens[party]
        self._num_parties[party.class_name] -= 1
        if self._num_parties[party.class_name] == 0:
            del self._num_parties[party.class_name]
            del self.class_lengths[party.class_name]

    def set_counter(self, party: Party, counter: float) -> None:
        """A backlogged party's counter moved (or it entered): its entry follows."""
        version = self._version[party] = next(self._versions)
        heap = self._by_counter.setdefault(party.class_name, [])
        entry = (counter, party.tenant, party.class_name, version, party)
        lazy_heap.push(heap, entry, self._num_parties[party.class_name], self._counter_live)

    # -- views --------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.items)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.items

    def queued(self) -> Iterator[QueuedRequest]:
        """Every queued request, in the order they were queued."""
        for _, item, _ in self.items.values():
            yield item

    def sequence_of(self, request_id: str) -> int:
        return self.items[request_id][2]

    def party_of(self, request_id: str) -> Party:
        return self.items[request_id][0]

    def backlogged(self, party: Party) -> bool:
        """Listed: it has requests queued, or had until `drop_party` is called."""
        return party in self.parties

    def party_size(self, party: Party) -> int:
        return len(self.parties[party])

    def num_queued_by_party(self) -> dict[Party, int]:
        return {party: len(heap) for party, heap in self.parties.items()}

    def queued_tokens_of(self, party: Party) -> int:
        return self.party_tokens.get(party, 0)

    def resumed_items(self) -> list[QueuedRequest]:
        return list(self.resumed.values())

    def first_of(self, party: Party) -> QueuedRequest:
        """The party's first request in its order."""
        return self.items[self.parties[party][0][-1]][1]

    def num_queued(self, bulk: bool) -> int:
        return self._num_by_kind[bulk]

    def num_queued_tokens(self, bulk: bool) -> int:
        return self._tokens_by_kind[bulk]

    def num_parties(self, class_name: str) -> int:
        """The class's backlogged parties."""
        return self._num_parties.get(class_name, 0)

    def oldest(self, bulk: bool) -> QueuedRequest | None:
        """The earliest queued request of the kind (ties: the first queued)."""
        top = lazy_heap.live_top(self._by_arrival[bulk], self._arrival_live)
        return self.items[top[2]][1] if top is not None else None

    def by_arrival(self, bulk: bool) -> Iterator[QueuedRequest]:
        """The requests of the kind, oldest first (ties: the first queued), as asked for."""
        heap = self._by_arrival[bulk]
        lazy_heap.live_top(heap, self._arrival_live)
        for entry in lazy_heap.in_order(heap):
            if self._arrival_live(entry):
                yield self.items[entry[2]][1]

    def by_arrival_within(
        self, bulk: bool, lengths_meet: Callable[[int, int], bool]
    ) -> Iterator[QueuedRequest]:
        """As `by_arrival`, passing over the length buckets `lengths_meet` rules out (some of
        the rest may still be outside: the caller checks each request)."""
        walks = []
        for (kind, bits), heap in self._by_bucket.items():
            low, high = bucket_lengths(bits)
            if kind == bulk and lengths_meet(low, high):
                lazy_heap.live_top(heap, self._arrival_live)
                walks.append(lazy_heap.in_order(heap))
        for entry in heapq.merge(*walks):
            if self._arrival_live(entry):
                yield self.items[entry[2]][1]

    def min_counter(self, class_names: Iterable[str]) -> float | None:
        """The least counter among the backlogged parties of these classes."""
        tops = []
        for class_name in class_names:
            top = lazy_heap.live_top(self._by_counter.get(class_name, []), self._counter_live)
            if top is not None:
                tops.append(top[0])
        return min(tops, default=None)

    def class_names(self) -> list[str]:
        """The classes with backlogged parties."""
        return list(self._num_parties)

    def least_served_party(
        self, class_names: Iterable[str], lengths_meet: Callable[[str, int, int], bool]
    ) -> Party | None:
        """The first party `parties_by_counter` would give, if it passes `lengths_meet`; else
        None (the caller then walks them all)."""
        best = None
        for class_name in class_names:
            bounds = self.class_lengths.get(class_name)
            if bounds is None or not lengths_meet(class_name, bounds[0], bounds[1]):
                continue
            top = lazy_heap.live_top(self._by_counter[class_name], self._counter_live)
            if top is not None and (best is None or top < best):
                best = top
        if best is None:
            return None
        bounds = self.party_lengths(best[4])
        return best[4] if lengths_meet(best[4].class_name, bounds[0], bounds[1]) else None

    def parties_by_counter(
        self, class_names: Iterable[str], lengths_meet: Callable[[str, int, int], bool]
    ) -> Iterator[Party]:
        """The backlogged parties of these classes, least counter first (ties: by tenant, then
        class), passing over those whose queued prompt lengths `lengths_meet` rules out."""
        walks = []
        for class_name in class_names:
            bounds = self.class_lengths.get(class_name)
            if bounds is None or not lengths_meet(class_name, bounds[0], bounds[1]):
                continue
            heap = self._by_counter[class_name]
            lazy_heap.live_top(heap, self._counter_live)
            walks.append(lazy_heap.in_order(heap))
        for entry in heapq.merge(*walks):
            party = entry[4]
            if not self._counter_live(entry):
                continue
            bounds = self.party_lengths(party)
            if lengths_meet(party.class_name, bounds[0], bounds[1]):
                yield party

    def some_length_fits(self, meet: Callable[[bool, int, int], bool]) -> bool:
        """Whether some queued request's length may meet `meet(bulk, low, high)`, by the
        length buckets' counts (which removals keep exact)."""
        for (bulk, bits), count in self._num_by_bucket.items():
            low, high = bucket_lengths(bits)
            if count > 0 and meet(bulk, low, high):
                return True
        return False

    def party_lengths(self, party: Party) -> list[int]:
        """The backlogged party's [min, max] prompt tokens queued, exact."""
        bounds = self._party_lengths[party]
        heap = self.parties[party]
        if party in self._stale_lengths and heap:
            bounds[:] = [min(key[1] for key in heap), max(key[1] for key in heap)]
            self._stale_lengths.discard(party)
        return bounds

    def party_in_order(self, party: Party) -> Iterator[QueuedRequest]:
        """A party's requests in its order: the first at once, the rest sorted if asked for."""
        heap = self.parties[party]
        if heap:
            yield self.items[heap[0][-1]][1]
            for key in sorted(heap)[1:]:
                yield self.items[key[-1]][1]

    def _arrival_live(self, entry: ArrivalEntry) -> bool:
        found = self.items.get(entry[2])
        return found is not None and found[2] == entry[1]

    def _counter_live(self, entry: CounterEntry) -> bool:
        return self._version.get(entry[4]) == entry[3]


def bucket_lengths(bits: int) -> tuple[int, int]:
    """A length bucket's lengths: those of bit length `bits`."""
    return (0, 0) if bits == 0 else (1 << (bits - 1), (1 << bits) - 1)


def _widen(bounds: dict, key: object, num_tokens: int) -> None:
    found = bounds.get(key)
    if found is None:
        bounds[key] = [num_tokens, num_tokens]
    elif num_tokens < found[0]:
        found[0] = num_tokens
    elif num_tokens > found[1]:
        found[1] = num_tokens
