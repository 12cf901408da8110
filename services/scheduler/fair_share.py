"""Who goes next: a fair share of prefill capacity between tenants and prompt-length classes.

Peers serve first come, first served, so one tenant's flood or one stream of long prompts takes
the whole cluster. tandem shares it instead, in the manner of the virtual token counter (VTC,
"Fairness in Serving Large Language Models", OSDI 2024):

* A request belongs to a *party*: its tenant (the API key, else the `user` field, else a default)
  and its class by prompt length (short below the first threshold, long above; more thresholds
  give more classes).
* Each party has a counter of the service it received, in weighted tokens: every prompt token
  prefilled adds `prompt_token_cost / weight`, every generated token `output_token_cost / weight`,
  where the weight is the tenant's weight times the class's. The prompt is charged when the
  request is dispatched (so the next choice already sees it), generated tokens when the request
  reports them.
* The next request comes from the backlogged party with the smallest counter. A party that had
  nothing queued re-enters at no less than the *virtual time* (the smallest counter among parties
  that were backlogged), so being idle banks no credit: it competes from now on, not from then.
* Within a party, a higher `priority` goes first, then the shorter prompt (shortest job first:
  the least mean time to first token, as a worker shares its steps; within a class the lengths
  differ by less than the class bounds, and aging caps what a longer prompt can wait), then the
  earlier arrival.
* Aging: a request that has waited `max_wait_s` is overdue. While any is, every other choice
  serves the oldest overdue request, whatever the counters say; the choices between stay fair.
  So an overdue request waits at most two choices per older overdue one, and a tenant that
  floods past its share (all its requests overdue) cannot take everything through aging.
* Work conservation: the choice skips requests the caller cannot place right now (`admissible`),
  so capacity never idles while something that fits is waiting.

`policy="fcfs"` keeps the counters (for the status) but serves strictly in arrival order, as the
peers do: when the oldest request cannot be placed, nothing is (head-of-line blocking), so a
benchmark can compare the two in one run. The module is pure: state in, decision out, the clock
passed in.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

POLICIES = ("fair", "fcfs")


@dataclass(frozen=True)
class FairShareConfig:
    policy: str = "fair"
    class_thresholds: tuple[int, ...] = (1024,)  # prompt tokens at which each next class starts
    class_names: tuple[str, ...] = ("short", "long")
    class_weights: tuple[float, ...] = (1.0, 1.0)
    tenant_weights: dict[str, float] = field(default_factory=dict)  # missing tenants weigh 1
    prompt_token_cost: float = 1.0
    output_token_cost: float = 2.0  # a generated token costs more than a prompt token (as VTC)
    max_wait_s: float = 30.0  # aging bound

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        thresholds = list(self.class_thresholds)
        if thresholds != sorted(set(thresholds)) or any(t <= 0 for t in thresholds):
            raise ValueError(
                f"class_thresholds must be increasing positive token counts, got {thresholds}"
            )
        num_classes = len(thresholds) + 1
        for name in ("class_names", "class_weights"):
            if len(getattr(self, name)) != num_classes:
                raise ValueError(
                    f"{name} needs {num_classes} entries (one per class: thresholds + 1), "
                    f"got {len(getattr(self, name))}"
                )
        weights = list(self.class_weights) + list(self.tenant_weights.values())
        if any(not w > 0 for w in weights):
            raise ValueError(f"weights must be positive, got {weights}")
        if not (self.prompt_token_cost >= 0 and self.output_token_cost >= 0):
            raise ValueError("token costs must be non-negative")
        if not self.max_wait_s > 0:
            raise ValueError(f"max_wait_s must be positive, got {self.max_wait_s}")

    def class_of(self, num_prompt_tokens: int) -> str:
        return self.class_names[bisect.bisect_right(self.class_thresholds, num_prompt_tokens)]

    def weight(self, party: Party) -> float:
        class_weight = self.class_weights[self.class_names.index(party.class_name)]
        return self.tenant_weights.get(party.tenant, 1.0) * class_weight


@dataclass(frozen=True, order=True)
class Party:
    tenant: str
    class_name: str


@dataclass(frozen=True)
class QueuedRequest:
    request_id: str
    tenant: str
    num_prompt_tokens: int
    priority: int  # larger is more urgent, within the tenant's party
    arrival: float  # the policy's clock, seconds
    # Work resuming (its worker was lost, or it was handed back for recompute): its client is
    # mid-stream, so it goes before anything new, oldest first, under either policy.
    resumed: bool = False


# A party's queue is a heap of (-priority, prompt tokens, arrival, insertion number, request id).
_Key = tuple[int, int, float, int, str]
_CounterKey = tuple[float, str, str, "Party"]


class FairQueue:
    """The scheduler's queue under the policy; see the module doc."""

    def __init__(self, config: FairShareConfig):
        self.config = config
        self.counters: dict[Party, float] = {}  # weighted service received
        self.served_tokens: dict[Party, int] = {}  # unweighted prompt + output tokens, for status
        self.virtual_time = 0.0
        self._items: dict[str, tuple[Party, QueuedRequest]] = {}
        self._parties: dict[Party, list[_Key]] = {}  # backlogged parties only
        # Indexes, so that a choice costs no scan of the queue or of the parties (a scheduler
        # holds 100,000 requests of 10,000 tenants). Both heaps are lazy: an entry whose request
        # left (or was queued again: a new sequence number) or whose party's counter moved on
        # is stale, skipped when met and dropped when it reaches the top.
        self._sequence_of: dict[str, int] = {}  # request id -> its live entries' number
        self._by_arrival: list[tuple[float, int, str]] = []  # every queued request, oldest first
        # Backlogged parties, least served first, one heap per class: (counter, tenant, class,
        # party), so that ties compare strings, not dataclasses (the order of `Party`). Per
        # class, so a choice that can only place some prompt lengths skips the other classes.
        self._by_counter: dict[str, list[_CounterKey]] = {n: [] for n in config.class_names}
        # Per class: how many requests are queued, and bounds on their prompt lengths (widened
        # as requests come, reset when the class empties: never narrower than the truth).
        self._class_sizes: dict[str, list[int]] = {}  # class -> [count, min tokens, max tokens]
        self._resumed: dict[str, QueuedRequest] = {}  # the queued requests that are resuming
        self._sequence = itertools.count()  # ties in arrival time keep insertion order
        self._last_was_aged = False  # aging takes every other choice at most

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._items

    def __iter__(self) -> Iterator[QueuedRequest]:
        return (item for _, item in self._items.values())

    def num_queued_by_party(self) -> dict[Party, int]:
        return {party: len(heap) for party, heap in self._parties.items()}

    def party_for(self, tenant: str, num_prompt_tokens: int) -> Party:
        return Party(tenant, self.config.class_of(num_prompt_tokens))

    def push(self, item: QueuedRequest) -> None:
        if item.request_id in self._items:
            raise ValueError(f"request {item.request_id!r} is already queued")
        party = self.party_for(item.tenant, item.num_prompt_tokens)
        heap = self._parties.get(party)
        if heap is None:  # (re-)entering: no credit for the time it was away
            self._advance_virtual_time()
            self.counters[party] = max(self.counters.get(party, 0.0), self.virtual_time)
            heap = self._parties[party] = []
            self._push_counter(party)
        sequence = next(self._sequence)
        key = (-item.priority, item.num_prompt_tokens, item.arrival, sequence, item.request_id)
        heapq.heappush(heap, key)
        self._items[item.request_id] = (party, item)
        self._sequence_of[item.request_id] = sequence
        heapq.heappush(self._by_arrival, (item.arrival, sequence, item.request_id))
        sizes = self._class_sizes.setdefault(party.class_name, [0, item.num_prompt_tokens, 0])
        sizes[0] += 1
        sizes[1] = min(sizes[1], item.num_prompt_tokens)
        sizes[2] = max(sizes[2], item.num_prompt_tokens)
        if item.resumed:
            self._resumed[item.request_id] = item

    def remove(self, request_id: str) -> QueuedRequest | None:
        entry = self._items.pop(request_id, None)
        if entry is None:
            return None
        party, item = entry
        del self._sequence_of[request_id]
        self._resumed.pop(request_id, None)
        sizes = self._class_sizes[party.class_name]
        sizes[0] -= 1
        if sizes[0] == 0:
            del self._class_sizes[party.class_name]
        heap = self._parties[party]
        if heap[0][-1] == request_id:  # the usual case: the party's first is served
            heapq.heappop(heap)
        else:
            heap = [key for key in heap if key[-1] != request_id]
            heapq.heapify(heap)
            self._parties[party] = heap
        if not heap:
            self._advance_virtual_time()
            del self._parties[party]
        if len(self._by_arrival) > 2 * len(self._items) + 64:  # mostly stale: rebuild
            self._by_arrival = [e for e in self._by_arrival if self._is_live(e)]
            heapq.heapify(self._by_arrival)
        return item

    def pop_next(
        self,
        now: float,
        admissible: Callable[[QueuedRequest], bool] = lambda _: True,
        token_range: tuple[int, int] | None = None,
    ) -> QueuedRequest | None:
        """Removes and returns the next request to serve, charging its prompt; None if no queued
        request is admissible. `token_range` (low, high), if given, promises that no request
        with a prompt outside it is admissible: the classes outside are not looked at."""
        if self._oldest() is None or now - self._oldest().arrival < self.config.max_wait_s:
            self._last_was_aged = False  # no one is overdue: aging's turn starts afresh
        item, by_aging = self._choose(admissible, now, token_range)
        if item is None:
            return None
        self._last_was_aged = by_aging
        party, _ = self._items[item.request_id]
        self.remove(item.request_id)
        self.charge(party, num_prompt_tokens=item.num_prompt_tokens)
        return item

    def peek_next(
        self,
        now: float,
        admissible: Callable[[QueuedRequest], bool] = lambda _: True,
        token_range: tuple[int, int] | None = None,
    ) -> QueuedRequest | None:
        """The request `pop_next` would return, left in the queue."""
        return self._choose(admissible, now, token_range)[0]

    def _is_live(self, entry: tuple[float, int, str]) -> bool:
        return self._sequence_of.get(entry[2]) == entry[1]

    def _oldest(self) -> QueuedRequest | None:
        """The earliest queued request (ties: the first queued); drops stale tops."""
        heap = self._by_arrival
        while heap and not self._is_live(heap[0]):
            heapq.heappop(heap)
        return self._items[heap[0][2]][1] if heap else None

    def _overdue(self, now: float) -> Iterator[QueuedRequest]:
        """Every overdue request, oldest first, found as it is asked for."""
        for entry in _heap_order(self._by_arrival):
            if now - entry[0] < self.config.max_wait_s:
                return
            if self._is_live(entry):
                yield self._items[entry[2]][1]

    def _choose(
        self,
        admissible: Callable[[QueuedRequest], bool],
        now: float,
        token_range: tuple[int, int] | None = None,
    ) -> tuple[QueuedRequest | None, bool]:
        """(the next request, whether aging chose it: it is the oldest admissible overdue one)."""
        if not self._items:
            return None, False
        resuming = sorted(self._resumed.values(), key=_by_arrival)
        first = next((item for item in resuming if admissible(item)), None)
        if first is not None:
            return first, False
        if self.config.policy == "fcfs":  # strict: the oldest, or no one (head-of-line blocking)
            oldest = self._oldest()
            return (oldest if admissible(oldest) else None), False
        oldest_overdue = next((item for item in self._overdue(now) if admissible(item)), None)
        if oldest_overdue is not None and not self._last_was_aged:
            return oldest_overdue, True
        fair = self._least_served(admissible, token_range)
        if fair is None:
            return oldest_overdue, oldest_overdue is not None
        return fair, fair is oldest_overdue

    def _least_served(
        self,
        admissible: Callable[[QueuedRequest], bool],
        token_range: tuple[int, int] | None = None,
    ) -> QueuedRequest | None:
        """The fair choice: the first admissible request of the least-served backlogged party."""
        heaps = [
            heap
            for class_name, heap in self._by_counter.items()
            if token_range is None or self._class_meets(class_name, token_range)
        ]
        seen: set[tuple[str, str]] = set()
        for counter, tenant, class_name, party in heapq.merge(*map(_heap_order, heaps)):
            if (tenant, class_name) in seen or not self._is_current(counter, party):
                continue  # stale: the party left, or its counter moved on
            seen.add((tenant, class_name))
            for key in _heap_order(self._parties[party]):
                item = self._items[key[-1]][1]
                if admissible(item):
                    return item
        return None

    def charge(
        self, party: Party, *, num_prompt_tokens: int = 0, num_output_tokens: int = 0
    ) -> None:
        """Adds weighted service to `party`'s counter."""
        cost = (
            num_prompt_tokens * self.config.prompt_token_cost
            + num_output_tokens * self.config.output_token_cost
        )
        counter = self.counters.get(party, self.virtual_time)
        self.counters[party] = counter + cost / self.config.weight(party)
        served = self.served_tokens.get(party, 0)
        self.served_tokens[party] = served + num_prompt_tokens + num_output_tokens
        if party in self._parties:
            self._push_counter(party)

    def _push_counter(self, party: Party) -> None:
        heap = self._by_counter[party.class_name]
        heapq.heappush(heap, (self.counters[party], party.tenant, party.class_name, party))
        if len(heap) > 2 * len(self._parties) + 64:  # mostly stale: rebuild
            heap[:] = [
                (self.counters[p], p.tenant, p.class_name, p)
                for p in self._parties
                if p.class_name == party.class_name
            ]
            heapq.heapify(heap)

    def _class_meets(self, class_name: str, token_range: tuple[int, int]) -> bool:
        """Whether the prompt lengths queued in the class may meet the range."""
        sizes = self._class_sizes.get(class_name)
        return sizes is not None and sizes[1] <= token_range[1] and token_range[0] <= sizes[2]

    def _is_current(self, counter: float, party: Party) -> bool:
        return party in self._parties and self.counters[party] == counter

    def _advance_virtual_time(self) -> None:
        """The virtual time follows the least-served backlogged party, and never goes back."""
        tops = []
        for heap in self._by_counter.values():
            while heap and not self._is_current(heap[0][0], heap[0][3]):
                heapq.heappop(heap)  # stale
            if heap:
                tops.append(heap[0][0])
        if tops:
            self.virtual_time = max(self.virtual_time, min(tops))


def _by_arrival(item: QueuedRequest) -> float:
    return item.arrival


def _heap_order(heap: list) -> Iterator:
    """The heap's entries smallest first, found as they are asked for (a frontier of the heap's
    children: k entries cost O(k log k)), the heap left as it is."""
    if not heap:
        return
    frontier = [(heap[0], 0)]
    while frontier:
        entry, index = heapq.heappop(frontier)
        yield entry
        for child in (2 * index + 1, 2 * index + 2):
            if child < len(heap):
                heapq.heappush(frontier, (heap[child], child))
