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
* Bulk class: a batch job's lines (`bulk`) take only capacity interactive work leaves. Each
  choice is made first among the interactive requests alone (with their aging); only when none
  of them can be placed does a bulk request go, chosen fairly between the bulk parties (a
  tenant's bulk lines are its own party, `Party(tenant, "bulk")`, so running a job does not
  spend its interactive share). A bulk request that has waited `bulk_max_wait_s` joins the
  interactive choice (with its aging), so a stream of interactive work that always fills the
  cluster cannot starve a job forever.

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
BULK_CLASS = "bulk"  # the class of every bulk request, whatever its length


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
    bulk_max_wait_s: float = 300.0  # a bulk request waiting this long competes as interactive
    bulk_weight: float = 1.0  # the bulk parties' weight among themselves

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
        if not self.bulk_max_wait_s > 0:
            raise ValueError(f"bulk_max_wait_s must be positive, got {self.bulk_max_wait_s}")
        if not self.bulk_weight > 0:
            raise ValueError(f"bulk_weight must be positive, got {self.bulk_weight}")

    def class_of(self, num_prompt_tokens: int) -> str:
        return self.class_names[bisect.bisect_right(self.class_thresholds, num_prompt_tokens)]

    def weight(self, party: Party) -> float:
        if party.class_name == BULK_CLASS:
            return self.tenant_weights.get(party.tenant, 1.0) * self.bulk_weight
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
    bulk: bool = False  # a batch job's line: spare capacity only (see the module doc)
    # Of its prompt, the tokens a worker holds cached (as the scheduler's index predicts): not
    # computed, so not charged. Its class still goes by the whole prompt.
    num_cached_tokens: int = 0


# A party's queue is a heap of (-priority, prompt tokens, arrival, insertion number, request id).
_Key = tuple[int, int, float, int, str]


class FairQueue:
    """The scheduler's queue under the policy; see the module doc."""

    def __init__(self, config: FairShareConfig):
        self.config = config
        self.counters: dict[Party, float] = {}  # weighted service received
        self.served_tokens: dict[Party, int] = {}  # unweighted prompt + output tokens, for status
        self.virtual_time = 0.0
        self.bulk_virtual_time = 0.0  # the same among the bulk parties
        self._items: dict[str, tuple[Party, QueuedRequest]] = {}
        self._parties: dict[Party, list[_Key]] = {}  # backlogged parties only
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

    def party_for(self, tenant: str, num_prompt_tokens: int, bulk: bool = False) -> Party:
        return Party(tenant, BULK_CLASS if bulk else self.config.class_of(num_prompt_tokens))

    def push(self, item: QueuedRequest) -> None:
        if item.request_id in self._items:
            raise ValueError(f"request {item.request_id!r} is already queued")
        party = self.party_for(item.tenant, item.num_prompt_tokens, item.bulk)
        heap = self._parties.get(party)
        if heap is None:  # (re-)entering: no credit for the time it was away
            self._advance_virtual_time()
            self.counters[party] = max(self.counters.get(party, 0.0), self._entry_level(party))
            heap = self._parties[party] = []
        key = (
            -item.priority,
            item.num_prompt_tokens,
            item.arrival,
            next(self._sequence),
            item.request_id,
        )
        heapq.heappush(heap, key)
        self._items[item.request_id] = (party, item)

    def remove(self, request_id: str) -> QueuedRequest | None:
        entry = self._items.pop(request_id, None)
        if entry is None:
            return None
        party, item = entry
        heap = [key for key in self._parties[party] if key[-1] != request_id]
        if heap:
            heapq.heapify(heap)
            self._parties[party] = heap
        else:
            self._advance_virtual_time()
            del self._parties[party]
        return item

    def pop_next(
        self, now: float, admissible: Callable[[QueuedRequest], bool] = lambda _: True
    ) -> QueuedRequest | None:
        """Removes and returns the next request to serve, charging its prompt; None if no queued
        request is admissible."""
        item, by_aging = self._choose_with_bulk(now, admissible)
        if item is None:
            return None
        self._last_was_aged = by_aging
        party, _ = self._items[item.request_id]
        self.remove(item.request_id)
        self.charge(party, num_prompt_tokens=item.num_prompt_tokens - item.num_cached_tokens)
        return item

    def peek_next(
        self, now: float, admissible: Callable[[QueuedRequest], bool] = lambda _: True
    ) -> QueuedRequest | None:
        """The request `pop_next` would return, left in the queue."""
        last_was_aged = self._last_was_aged
        item = self._choose_with_bulk(now, admissible)[0]
        self._last_was_aged = last_was_aged
        return item

    def _choose_with_bulk(
        self, now: float, admissible: Callable[[QueuedRequest], bool]
    ) -> tuple[QueuedRequest | None, bool]:
        """The interactive choice (bulk requests past `bulk_max_wait_s` count as interactive);
        when it has no one to place, the fair choice among the bulk requests."""

        def interactive(item: QueuedRequest) -> bool:
            return not item.bulk or now - item.arrival >= self.config.bulk_max_wait_s

        overdue = [item for item in self._overdue(now) if interactive(item)]
        if not overdue:
            self._last_was_aged = False  # no one is overdue: aging's turn starts afresh
        item, by_aging = self._choose(admissible, overdue, interactive)
        if item is None:  # work conservation: what interactive work leaves goes to bulk
            item, by_aging = self._choose(admissible, [])
        return item, by_aging

    def _overdue(self, now: float) -> list[QueuedRequest]:
        """Every overdue request, oldest first."""
        overdue = [i for _, i in self._items.values() if now - i.arrival >= self.config.max_wait_s]
        return sorted(overdue, key=lambda item: item.arrival)

    def _choose(
        self,
        admissible: Callable[[QueuedRequest], bool],
        overdue: list[QueuedRequest],
        eligible: Callable[[QueuedRequest], bool] = lambda _: True,
    ) -> tuple[QueuedRequest | None, bool]:
        """(the next request among the `eligible`, whether aging chose it: it is the oldest
        admissible overdue one)."""
        candidates = [item for _, item in self._items.values() if eligible(item)]
        if not candidates:
            return None, False
        resuming = sorted((i for i in candidates if i.resumed), key=_by_arrival)
        first = next((item for item in resuming if admissible(item)), None)
        if first is not None:
            return first, False
        if self.config.policy == "fcfs":  # strict: the oldest, or no one (head-of-line blocking)
            oldest = min(candidates, key=lambda i: i.arrival)
            return (oldest if admissible(oldest) else None), False
        oldest_overdue = next((item for item in overdue if admissible(item)), None)
        if oldest_overdue is not None and not self._last_was_aged:
            return oldest_overdue, True
        fair = self._least_served(lambda item: eligible(item) and admissible(item))
        if fair is None:
            return oldest_overdue, oldest_overdue is not None
        return fair, fair is oldest_overdue

    def _least_served(self, admissible: Callable[[QueuedRequest], bool]) -> QueuedRequest | None:
        """The fair choice: the first admissible request of the least-served backlogged party."""
        for party in sorted(self._parties, key=lambda p: (self.counters[p], p)):
            for key in _in_order(self._parties[party]):
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
        counter = self.counters.get(party, self._entry_level(party))
        self.counters[party] = counter + cost / self.config.weight(party)
        served = self.served_tokens.get(party, 0)
        self.served_tokens[party] = served + num_prompt_tokens + num_output_tokens

    def _advance_virtual_time(self) -> None:
        """The virtual time follows the least-served backlogged party, and never goes back.
        Bulk parties, served only from spare capacity, would hold it back: they do not count
        there, but have their own, which follows the least-served bulk party alike."""
        counters = [self.counters[p] for p in self._parties if p.class_name != BULK_CLASS]
        if counters:
            self.virtual_time = max(self.virtual_time, min(counters))
        bulk = [self.counters[p] for p in self._parties if p.class_name == BULK_CLASS]
        if bulk:
            self.bulk_virtual_time = max(self.bulk_virtual_time, min(bulk))

    def _entry_level(self, party: Party) -> float:
        """The least counter `party` (re-)enters with; a bulk party's is no less than either
        virtual time."""
        if party.class_name == BULK_CLASS:
            return max(self.virtual_time, self.bulk_virtual_time)
        return self.virtual_time


def _by_arrival(item: QueuedRequest) -> float:
    return item.arrival


def _in_order(heap: list[_Key]) -> Iterator[_Key]:
    """The heap's keys smallest first: the top at once, the rest sorted only if asked for."""
    if heap:
        yield heap[0]
        yield from sorted(heap)[1:]
