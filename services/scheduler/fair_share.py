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
  spend its interactive share; one re-entering banks no credit against the other bulk parties
  either: they keep a virtual time of their own). A bulk request that has waited
  `bulk_max_wait_s` joins the interactive choice (with its aging), so a stream of interactive
  work that always fills the cluster cannot starve a job forever.

`policy="fcfs"` keeps the counters (for the status) but serves strictly in arrival order, as the
peers do: when the oldest request cannot be placed, nothing is (head-of-line blocking), so a
benchmark can compare the two in one run. The module is pure: state in, decision out, the clock
passed in.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from services.scheduler.native_indexes import NativeOrPython, kind
from services.scheduler.queue_index import QueueIndex
from services.scheduler.queue_index_native import queue_index_type
from services.scheduler.queued import BULK_CLASS, Party, QueuedRequest

POLICIES = ("fair", "fcfs")

# Parties are remembered until this many are known, then the idle ones are forgotten (and the
# bound doubles past what is left); tenants come from the client's `user` field, so without it
# the accounts grow with every name ever sent.
FIRST_PARTIES_SWEEP = 1024
# Idle parties whose counter is ahead of the virtual time (so forgetting them gives them credit)
# are kept up to this many; past it, those least ahead are forgotten first. While nothing is
# backlogged the virtual time stands still, so under light load with new names every party
# leaves ahead of it: this bound is then what the accounts hold, and a sweep's length.
MAX_IDLE_PARTIES_AHEAD = 8192


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
        if any(not 0 < w < math.inf for w in weights):  # (an infinite weight is never charged)
            raise ValueError(f"weights must be positive and finite, got {weights}")
        costs = (self.prompt_token_cost, self.output_token_cost)
        if not all(0 <= cost < math.inf for cost in costs):  # (inf: every account ties at inf)
            raise ValueError(f"token costs must be non-negative and finite, got {costs}")
        if not self.max_wait_s > 0:
            raise ValueError(f"max_wait_s must be positive, got {self.max_wait_s}")
        if not self.bulk_max_wait_s > 0:
            raise ValueError(f"bulk_max_wait_s must be positive, got {self.bulk_max_wait_s}")
        if not 0 < self.bulk_weight < math.inf:  # (as the weights above)
            raise ValueError(f"bulk_weight must be positive and finite, got {self.bulk_weight}")

    def class_of(self, num_prompt_tokens: int) -> str:
        return self.class_names[bisect.bisect_right(self.class_thresholds, num_prompt_tokens)]

    def weight(self, party: Party) -> float:
        if party.class_name == BULK_CLASS:
            return self.tenant_weights.get(party.tenant, 1.0) * self.bulk_weight
        class_weight = self.class_weights[self.class_names.index(party.class_name)]
        return self.tenant_weights.get(party.tenant, 1.0) * class_weight


class LengthRanges:
    """Which prompt lengths the caller can place now, as inclusive ranges of
    `num_prompt_tokens`: one set for interactive requests, one for bulk ones. Called on a
    request, it says whether the request's length lies in its kind's ranges. Given to a choice
    as `lengths`, it is a promise that no request outside them is admissible, so the choice
    passes over whole parties and classes whose queued lengths lie outside. (Its own
    `__init__`, not a dataclass's, which compiled code runs as Python: dispatch makes one per
    pass. Treated as frozen.)"""

    __slots__ = ("interactive", "bulk")

    def __init__(
        self,
        interactive: tuple[tuple[int, int], ...] = (),
        bulk: tuple[tuple[int, int], ...] = (),
    ) -> None:
        self.interactive = interactive
        self.bulk = bulk

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, LengthRanges):
            return NotImplemented
        return self.interactive == other.interactive and self.bulk == other.bulk

    def __hash__(self) -> int:
        return hash((self.interactive, self.bulk))

    def __repr__(self) -> str:
        return f"LengthRanges(interactive={self.interactive!r}, bulk={self.bulk!r})"

    @property
    def empty(self) -> bool:
        return not self.interactive and not self.bulk

    # (loops, not any(...): every choice asks these several times)
    def meet(self, bulk: bool, low: int, high: int) -> bool:
        """Whether some range of the kind meets [low, high]."""
        for lo, hi in self.bulk if bulk else self.interactive:  # noqa: SIM110
            if lo <= high and low <= hi:
                return True
        return False

    def __call__(self, item: QueuedRequest) -> bool:
        n = item.num_prompt_tokens
        for lo, hi in self.bulk if item.bulk else self.interactive:  # noqa: SIM110
            if lo <= n <= hi:
                return True
        return False


class FairQueue:
    """The scheduler's queue under the policy; see the module doc. Its requests and parties are
    kept in ordered indexes (`queue_index.py`), so a choice costs no scan of either."""

    def __init__(self, config: FairShareConfig, indexes: str = "auto"):
        """`indexes`: C or Python (`native_indexes.py`); the same decisions either way."""
        self.config = config
        self.counters: dict[Party, float] = {}  # weighted service received
        self.served_tokens: dict[Party, int] = {}  # unweighted prompt + output tokens, for status
        self.virtual_time = 0.0
        # The same among the bulk parties: served apart, from spare capacity, they compete
        # with each other, so one re-entering must not bank the credit of its time away either.
        self.bulk_virtual_time = 0.0
        self._index: NativeOrPython = queue_index_type(indexes)()
        # The C index makes the whole choice in one call (`queue_index.c`); the Python one
        # is walked by the methods below, the reference.
        self._native_choice = getattr(self._index, "choose", None)
        self._last_was_aged = False  # aging takes every other choice at most
        self._party_objects: dict[tuple[str, str], Party] = {}
        self._num_tracked: dict[Party, int] = {}  # the caller's requests per party (`track`)
        self._sweep_at = FIRST_PARTIES_SWEEP

    @property
    def index_kind(self) -> str:
        """Which queue index serves: `native` (C) or `python`."""
        return kind(self._index, QueueIndex)

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._index

    def __iter__(self) -> Iterator[QueuedRequest]:
        return iter(self._index.queued())

    def num_queued_by_party(self) -> dict[Party, int]:
        return self._index.num_queued_by_party()

    def num_queued(self, bulk: bool) -> int:
        """Requests queued of one kind: batch lines, or the rest."""
        return self._index.num_queued(bulk)

    def num_interactive_queued_tokens(self) -> int:
        return self._index.num_queued_tokens(False)

    def num_queued_tokens_in(self, party: Party) -> int:
        return self._index.queued_tokens_of(party)

    def holds_bulk(self) -> bool:
        """Some bulk request is queued."""
        return self._index.num_parties(BULK_CLASS) > 0

    def oldest_bulk_arrival(self) -> float | None:
        """When the bulk request queued longest arrived (the first to age); None with none."""
        oldest = self._index.oldest(True)
        return None if oldest is None else oldest.arrival

    def num_backlogged_interactive_parties(self) -> int:
        return sum(self._index.num_parties(name) for name in self.config.class_names)

    def backlogged_interactive_weight(self) -> float:
        """The weights (`FairShareConfig.weight`) of the backlogged interactive parties summed:
        per class, its parties at the class's weight, corrected for the tenants that
        `tenant_weights` names (a few, by configuration): no pass over the parties."""
        config = self.config
        total = 0.0
        for class_name, class_weight in zip(config.class_names, config.class_weights, strict=True):
            num_parties = self._index.num_parties(class_name)
            if not num_parties:
                continue
            total += class_weight * num_parties
            for tenant, tenant_weight in config.tenant_weights.items():
                if self._index.backlogged(Party(tenant, class_name)):
                    total += class_weight * (tenant_weight - 1.0)
        return total

    def party_for(self, tenant: str, num_prompt_tokens: int, bulk: bool = False) -> Party:
        class_name = BULK_CLASS if bulk else self.config.class_of(num_prompt_tokens)
        # One object per party, so that the many dict lookups by party find it by identity.
        party = self._party_objects.get((tenant, class_name))
        if party is None:
            if len(self._party_objects) >= self._sweep_at:
                self.forget_idle_parties()
                self._sweep_at = max(FIRST_PARTIES_SWEEP, 2 * len(self._party_objects))
            party = self._party_objects[tenant, class_name] = Party(tenant, class_name)
        return party

    def track(self, party: Party) -> None:
        """The caller holds one more request of `party` (queued or running: it may charge it
        yet), so the party's account must be kept."""
        self._num_tracked[party] = self._num_tracked.get(party, 0) + 1

    def untrack(self, party: Party) -> None:
        """The caller let go of one request of `party` (`track`)."""
        left = self._num_tracked[party] - 1
        if left:
            self._num_tracked[party] = left
        else:
            del self._num_tracked[party]

    def forget_idle_parties(self) -> int:
        """Forgets the accounts of idle parties (nothing queued, no request tracked); returns how
        many. One whose counter the virtual time has reached changes no decision by leaving:
        it would re-enter at the virtual time either way, and nothing can charge it meanwhile.
        One still ahead would re-enter with that lead forgotten, so those are kept, up to
        `MAX_IDLE_PARTIES_AHEAD` (past it the least ahead go first: the smallest credit given)."""
        idle = [
            party
            for party in self._party_objects.values()
            if party not in self._num_tracked and not self._index.backlogged(party)
        ]
        ahead = [p for p in idle if self.counters.get(p, 0.0) > self.virtual_time]
        forgotten = [p for p in idle if not self.counters.get(p, 0.0) > self.virtual_time]
        if len(ahead) > MAX_IDLE_PARTIES_AHEAD:
            ahead.sort(key=lambda p: self.counters[p])
            forgotten += ahead[: len(ahead) - MAX_IDLE_PARTIES_AHEAD]
        for party in forgotten:
            del self._party_objects[party.tenant, party.class_name]
            self.counters.pop(party, None)
            self.served_tokens.pop(party, None)
        return len(forgotten)

    def push(self, item: QueuedRequest) -> None:
        if item.request_id in self._index:
            raise ValueError(f"request {item.request_id!r} is already queued")
        party = self.party_for(item.tenant, item.num_prompt_tokens, item.bulk)
        if not self._index.backlogged(party):  # (re-)entering: no credit for the time it was away
            self._advance_virtual_time()
            self.counters[party] = max(self.counters.get(party, 0.0), self._entry_level(party))
        self._index.add(party, item, self.counters[party])

    def remove(self, request_id: str) -> QueuedRequest | None:
        found = self._index.discard(request_id)
        if found is None:
            return None
        party, item = found
        if self._index.party_size(party) == 0:
            self._advance_virtual_time()  # the leaving party's counter still counts here
            self._index.drop_party(party)
        return item

    def pop_next(
        self,
        now: float,
        admissible: Callable[[QueuedRequest], bool] = lambda _: True,
        lengths: LengthRanges | None = None,
    ) -> QueuedRequest | None:
        """Removes and returns the next request to serve, charging its prompt; None if no queued
        request is admissible. `lengths`, if given, promises that no request outside its ranges
        is admissible."""
        item, by_aging = self._choose_with_bulk(now, admissible, lengths)
        if item is None:
            return None
        self._last_was_aged = by_aging
        party = self._index.party_of(item.request_id)
        self.remove(item.request_id)
        self.charge(party, num_prompt_tokens=item.num_prompt_tokens - item.num_cached_tokens)
        return item

    def peek_next(
        self,
        now: float,
        admissible: Callable[[QueuedRequest], bool] = lambda _: True,
        lengths: LengthRanges | None = None,
    ) -> QueuedRequest | None:
        """The request `pop_next` would return, left in the queue."""
        last_was_aged = self._last_was_aged
        item = self._choose_with_bulk(now, admissible, lengths)[0]
        self._last_was_aged = last_was_aged
        return item

    def _choose_with_bulk(
        self, now: float, admissible: Callable[[QueuedRequest], bool], lengths: LengthRanges | None
    ) -> tuple[QueuedRequest | None, bool]:
        """The interactive choice (bulk requests past `bulk_max_wait_s` count as interactive);
        when it has no one to place, the fair choice among the bulk requests."""
        if self._native_choice is not None and (lengths is None or type(lengths) is LengthRanges):
            item, by_aging, no_one_overdue = self._native_choice(
                now,
                admissible,
                lengths,
                self._last_was_aged,
                self.config.max_wait_s,
                self.config.bulk_max_wait_s,
                self.config.policy == "fcfs",
            )
            if no_one_overdue:
                self._last_was_aged = False  # aging's turn starts afresh
            return item, by_aging
        # The oldest of each kind first: the walks below must find their heaps settled.
        oldest, aged_bulk = self._index.oldest(False), self._index.oldest(True)
        if aged_bulk is not None and now - aged_bulk.arrival < self.config.bulk_max_wait_s:
            aged_bulk = None
        # Someone is overdue if the oldest of either kind is (the oldest waited longest).
        max_wait = self.config.max_wait_s
        if not (
            (oldest is not None and now - oldest.arrival >= max_wait)
            or (aged_bulk is not None and now - aged_bulk.arrival >= max_wait)
        ):
            self._last_was_aged = False  # no one is overdue: aging's turn starts afresh
            overdue: Iterator[QueuedRequest] = iter(())
        else:
            overdue = self._overdue(now, lengths)
        if lengths is not None and lengths.empty:
            return None, False  # nothing can be placed: no need to look
        item, by_aging = self._choose_interactive(
            now, admissible, lengths, overdue, oldest, aged_bulk
        )
        if item is None:  # work conservation: what interactive work leaves goes to bulk
            item, by_aging = self._choose_bulk(admissible, lengths)
        return item, by_aging

    def _interactive(self, now: float, item: QueuedRequest) -> bool:
        return not item.bulk or now - item.arrival >= self.config.bulk_max_wait_s

    def _overdue(self, now: float, lengths: LengthRanges | None) -> Iterator[QueuedRequest]:
        """Every overdue interactive request (a bulk one waiting `bulk_max_wait_s` counts),
        oldest first (ties: the first queued), found as asked for; of lengths `lengths` may
        place, if given."""
        max_wait, bulk_max_wait = self.config.max_wait_s, self.config.bulk_max_wait_s

        def waiting(bulk: bool) -> Iterator[tuple[float, int, QueuedRequest]]:
            if lengths is None:
                items = self._index.by_arrival(bulk)
            else:
                items = self._index.by_arrival_within(
                    bulk, lambda low, high: lengths.meet(bulk, low, high)
                )
            for item in items:
                age = now - item.arrival
                if age < max_wait or (bulk and age < bulk_max_wait):
                    return
                yield item.arrival, self._index.sequence_of(item.request_id), item

        for _, _, item in heapq.merge(waiting(False), waiting(True), key=lambda e: e[:2]):
            yield item

    def waited_longer(self, now: float, seconds: float) -> list[QueuedRequest]:
        """The queued requests that have waited more than `seconds`."""
        found = []
        for bulk in (False, True):
            for item in self._index.by_arrival(bulk):
                if not now - item.arrival > seconds:
                    break
                found.append(item)
        return found

    def _resuming(self, eligible: Callable[[QueuedRequest], bool]) -> list[QueuedRequest]:
        """The eligible resuming requests, oldest first (ties: the first queued)."""
        items = [item for item in self._index.resumed_items() if eligible(item)]
        return sorted(items, key=lambda i: (i.arrival, self._index.sequence_of(i.request_id)))

    def _choose_interactive(
        self,
        now: float,
        admissible: Callable[[QueuedRequest], bool],
        lengths: LengthRanges | None,
        overdue: Iterator[QueuedRequest],
        oldest: QueuedRequest | None,
        aged_bulk: QueuedRequest | None,
    ) -> tuple[QueuedRequest | None, bool]:
        """(the next interactive request, whether aging chose it: it is the oldest admissible
        overdue one). `oldest`: the oldest interactive request; `aged_bulk`: the oldest bulk
        request if it counts as interactive."""
        if oldest is None and aged_bulk is None:
            return None, False

        def eligible(item: QueuedRequest) -> bool:
            return self._interactive(now, item)

        first = next((item for item in self._resuming(eligible) if admissible(item)), None)
        if first is not None:
            return first, False
        if self.config.policy == "fcfs":  # strict: the oldest, or no one (head-of-line blocking)
            oldest = _earliest(self._index, oldest, aged_bulk)
            return (oldest if admissible(oldest) else None), False
        oldest_overdue = next((item for item in overdue if admissible(item)), None)
        if oldest_overdue is not None and not self._last_was_aged:
            return oldest_overdue, True
        class_names = [c for c in self._index.class_names() if c != BULK_CLASS or aged_bulk]
        fair = self._least_served(
            class_names, lambda item: eligible(item) and admissible(item), lengths
        )
        if fair is None:
            return oldest_overdue, oldest_overdue is not None
        return fair, fair is oldest_overdue

    def _choose_bulk(
        self, admissible: Callable[[QueuedRequest], bool], lengths: LengthRanges | None
    ) -> tuple[QueuedRequest | None, bool]:
        """The choice when no interactive request can be placed: among every request, which
        comes down to the bulk ones (the interactive ones were all found inadmissible)."""
        if not len(self._index):
            return None, False
        first = next((i for i in self._resuming(lambda _: True) if admissible(i)), None)
        if first is not None:
            return first, False
        if self.config.policy == "fcfs":
            oldest = _earliest(self._index, self._index.oldest(False), self._index.oldest(True))
            return (oldest if admissible(oldest) else None), False
        return self._least_served([BULK_CLASS], admissible, lengths), False

    def _least_served(
        self,
        class_names: list[str],
        admissible: Callable[[QueuedRequest], bool],
        lengths: LengthRanges | None,
    ) -> QueuedRequest | None:
        """The fair choice: the first admissible request of the least-served backlogged party
        (ties: by tenant, then class) among these classes."""

        def lengths_meet(class_name: str, low: int, high: int) -> bool:
            return lengths is None or lengths.meet(class_name == BULK_CLASS, low, high)

        # The usual case at once: the least-served party's first request can be placed.
        party = self._index.least_served_party(class_names, lengths_meet)
        if party is not None:
            first = self._index.first_of(party)
            if admissible(first):
                return first
        # No queued prompt's length fits (a full decode pool asks for shorter ones than any),
        # so none is admissible (`LengthRanges`' promise): no walk over every party to find
        # none. (The C index checks this in its own choice.)
        if (
            lengths is not None
            and isinstance(self._index, QueueIndex)
            and not self._index.some_length_fits(lengths.meet)
        ):
            return None
        for party in self._index.parties_by_counter(class_names, lengths_meet):
            for item in self._index.party_in_order(party):
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
        if self._index.backlogged(party):
            self._index.set_counter(party, self.counters[party])

    def _advance_virtual_time(self) -> None:
        """The virtual time follows the least-served backlogged party, and never goes back.
        Bulk parties, served only from spare capacity, would hold it back: they do not count
        there, but have their own (`bulk_virtual_time`), which follows the least-served bulk
        party alike."""
        classes = [c for c in self._index.class_names() if c != BULK_CLASS]
        least = self._index.min_counter(classes)
        if least is not None:
            self.virtual_time = max(self.virtual_time, least)
        least_bulk = self._index.min_counter([BULK_CLASS])
        if least_bulk is not None:
            self.bulk_virtual_time = max(self.bulk_virtual_time, least_bulk)

    def _entry_level(self, party: Party) -> float:
        """The least counter `party` (re-)enters with: no credit for the time it was away. A
        bulk party enters at no less than either virtual time (its aged lines compete with
        interactive parties too)."""
        if party.class_name == BULK_CLASS:
            return max(self.virtual_time, self.bulk_virtual_time)
        return self.virtual_time


def _earliest(
    index: NativeOrPython, first: QueuedRequest | None, second: QueuedRequest | None
) -> QueuedRequest:
    """The earlier of two requests (ties: the first queued); either may be None, not both."""
    if second is None:
        assert first is not None, "either may be None, not both"
        return first
    if first is None:
        return second
    key = lambda i: (i.arrival, index.sequence_of(i.request_id))  # noqa: E731
    return first if key(first) <= key(second) else second
