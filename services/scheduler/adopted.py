"""Requests an earlier life of the scheduler placed, adopted from the decode workers holding them.

A restarted scheduler knows nothing of the requests that were decoding when the old one
stopped. Their tokens go from the decode worker straight to the gateway, so they go on; but
should that worker then die (or say GOODBYE, or hand one back for recompute), nobody would tell
the gateway, whose client would wait out the request timeout (an hour). So the core adopts
them: an id a registered decode worker's heartbeat lists that the core does not track and has
not given up on is such a request (or a stale listing of one that just ended), remembered here
with the workers listing it. The core tells every gateway when one is lost (the heartbeat
names no gateway; a gateway drops a delta for an attempt it does not run), and counts each
against its worker's seats, which it takes (the heartbeat's free blocks already count its KV).

An id its worker's heartbeats leave out `unlisted_beats` times in a row ended there, and the
gateway had the end from the worker: it is forgotten, as is every id of a worker that left.
A worker lists at most `wire.MAX_HELD_IDS` ids a heartbeat, and at most that many are adopted
from it, so the memory is bounded by the workers registered.

Prefill workers' listings are not adopted: a request of theirs that brought no token yet is
resumed by its gateway when the scheduler restarts, and one whose first token went out is held
by its decode worker too (its reservation), which lists it.

A gateway's cancel may come before the listing (its client left in the moment between the
restart and the worker's first heartbeat to the new scheduler): a cancel of an id neither
tracked, adopted nor given up on is kept here for a while (`cancel_ahead`), and a worker that
then lists the id is told to let it go instead of its being adopted. At most
`MAX_CANCELS_AHEAD` are kept, each for the time the core gives (a heartbeat timeout: a worker
holding it lists it by then, or is taken for dead), so a flood of cancels of ids nobody holds
costs a bounded memory.
"""

from __future__ import annotations

from collections import OrderedDict

from shared import wire

# Cancels kept for ids no worker has listed yet: as many as one heartbeat lists.
MAX_CANCELS_AHEAD = wire.MAX_HELD_IDS


class AdoptedRequest:
    """One request a worker listed (its own `__init__`: compiled code runs a dataclass's as
    Python, and a restart adopts every request in flight)."""

    __slots__ = ("request_id", "num_unlisted_beats", "last_unlisted_beat")

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.num_unlisted_beats = 0  # heartbeats in a row of its worker that left it out
        self.last_unlisted_beat = -2  # the worker's heartbeat number of the last that did


class Listing:
    """What a heartbeat changed: the ids adopted from it, and those forgotten (unlisted)."""

    __slots__ = ("adopted", "forgotten")

    def __init__(self, adopted: list[str], forgotten: list[str]) -> None:
        self.adopted = adopted
        self.forgotten = forgotten


class AdoptedRequests:
    def __init__(self, unlisted_beats: int) -> None:
        self.unlisted_beats = unlisted_beats
        self._by_worker: dict[str, dict[str, AdoptedRequest]] = {}
        # Each id's workers, in the order they adopted it (almost always one: a second is a
        # worker that still holds a reservation the old scheduler gave up on).
        self._holders: dict[str, list[str]] = {}
        # Cancels of ids not listed yet (`cancel_ahead`): each one's reason and the time it is
        # kept until, in that order (each is kept as long, so the first ends first).
        self._cancels_ahead: OrderedDict[str, tuple[float, str]] = OrderedDict()

    def __len__(self) -> int:
        """The requests adopted (each once, however many workers list it)."""
        return len(self._holders)

    def holds(self, request_id: str) -> bool:
        return request_id in self._holders

    def holders(self, request_id: str) -> list[str]:
        return list(self._holders.get(request_id, []))

    def held_by(self, peer_id: str, request_id: str) -> bool:
        return request_id in self._by_worker.get(peer_id, {})

    def of_worker(self, peer_id: str) -> list[str]:
        """The ids adopted from this worker, sorted: as `core._drop_worker` takes a worker's
        requests, in an order that is no accident of how they were listed."""
        return sorted(self._by_worker.get(peer_id, {}))

    def heard(
        self, peer_id: str, unknown_ids: list[str], heartbeat_number: int, full: bool
    ) -> Listing:
        """A heartbeat of the worker listed `unknown_ids` (the ids it holds that the core
        neither tracks nor gave up on), its `heartbeat_number`th since it registered. A `full`
        list (the most a heartbeat carries) proves nothing missing."""
        entries = self._by_worker.get(peer_id)
        if entries is None:
            if not unknown_ids:
                return Listing([], [])  # the usual heartbeat: nothing adopted, nothing listed
            entries = self._by_worker[peer_id] = {}
        adopted: list[str] = []
        for request_id in unknown_ids:
            if request_id in entries or len(entries) >= wire.MAX_HELD_IDS:
                continue
            entries[request_id] = AdoptedRequest(request_id)
            self._holders.setdefault(request_id, []).append(peer_id)
            adopted.append(request_id)
        forgotten: list[str] = []
        if not full and len(entries) > len(adopted):
            # (A worker whose last is forgotten leaves `_by_worker` there: see `forget`.)
            forgotten = self._unlisted(peer_id, entries, set(unknown_ids), heartbeat_number)
        return Listing(adopted, forgotten)

    def _unlisted(
        self,
        peer_id: str,
        entries: dict[str, AdoptedRequest],
        listed: set[str],
        heartbeat_number: int,
    ) -> list[str]:
        """Counts a heartbeat that left adopted ids out; forgets those left out often enough
        in a row (the first may be stale, as `core.UNLISTED_BEATS` says)."""
        forgotten: list[str] = []
        for request_id in sorted(entries):
            if request_id in listed:
                continue
            entry = entries[request_id]
            in_a_row = entry.last_unlisted_beat == heartbeat_number - 1
            entry.num_unlisted_beats = entry.num_unlisted_beats + 1 if in_a_row else 1
            entry.last_unlisted_beat = heartbeat_number
            if entry.num_unlisted_beats >= self.unlisted_beats:
                forgotten.append(request_id)
        for request_id in forgotten:
            self.forget(peer_id, request_id)
        return forgotten

    def forget(self, peer_id: str, request_id: str) -> bool:
        """The worker no longer holds the request (ended, cancelled); whether it was adopted."""
        entries = self._by_worker.get(peer_id)
        if entries is None or entries.pop(request_id, None) is None:
            return False
        if not entries:
            del self._by_worker[peer_id]
        holders = self._holders[request_id]
        holders.remove(peer_id)
        if not holders:
            del self._holders[request_id]
        return True

    def forget_worker(self, peer_id: str) -> list[str]:
        """The worker left: its adopted ids, sorted, forgotten."""
        request_ids = self.of_worker(peer_id)
        for request_id in request_ids:
            self.forget(peer_id, request_id)
        return request_ids

    def cancel_ahead(self, request_id: str, reason: str, now: float, keep_s: float) -> None:
        """A cancel of an id no worker has listed yet, kept `keep_s` (the same for every one)
        for the listing that may follow (at most `MAX_CANCELS_AHEAD`: the oldest go first)."""
        cancels = self._cancels_ahead
        while cancels:  # those past their time go (the first in time ends the scan)
            first_id, first = cancels.popitem(last=False)
            if first[0] >= now:
                cancels[first_id] = first
                cancels.move_to_end(first_id, last=False)
                break
        cancels.pop(request_id, None)  # (again: kept from now, last in the order)
        cancels[request_id] = (now + keep_s, reason)
        while len(cancels) > MAX_CANCELS_AHEAD:
            cancels.popitem(last=False)

    def has_cancels_ahead(self) -> bool:
        return bool(self._cancels_ahead)

    def num_cancels_ahead(self) -> int:
        return len(self._cancels_ahead)

    def take_cancel_ahead(self, request_id: str, now: float) -> str | None:
        """The reason of a cancel kept for the id and still in time, taken; or None."""
        cancel = self._cancels_ahead.pop(request_id, None)
        return cancel[1] if cancel is not None and cancel[0] >= now else None
