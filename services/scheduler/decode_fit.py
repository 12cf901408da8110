"""Dispatch among decode workers whose KV pools differ (mixed hardware, or workers started with
different `--kv-cache-bytes`): a decode worker refuses a request whose prompt plus max_tokens
could outgrow its whole pool (it would preempt itself at its last block and never fit again,
`Engine.add_prefilled`), so such a request may go only to a worker whose pool holds it
(`WorkerRegistry.pick_decode`). The fair choice must then pass over one that no such worker has
room for now: it waits in the queue for one, and the requests behind it go on meanwhile.

A cluster of equal pools never asks: admission refused (400) what its pools cannot hold, so
every request fits every worker, and dispatch goes by prompt lengths alone (`LengthRanges`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

from services.scheduler.fair_share import LengthRanges
from services.scheduler.queued import QueuedRequest
from services.scheduler.registry import WorkerRegistry


class NeedsTokens(Protocol):
    """What a tracked request tells: the most tokens its sequence may hold on a decode worker."""

    num_needed_tokens: int


class DecodeFitAdmission:
    """Admits what `admission` admits and some decode worker whose pool holds it has room for
    now (as it would be placed: a young batch line by the batch seats). `promise`: the ranges
    of prompt lengths the choice may pass whole parties over by (`LengthRanges`), unchanged:
    this admits fewer, never more. (Its own `__init__`: compiled code runs a dataclass's as
    Python. Treated as frozen.)"""

    __slots__ = (
        "admission",
        "promise",
        "requests",
        "registry",
        "now",
        "bulk_max_wait_s",
        "refused",
    )

    def __init__(
        self,
        admission: Callable[[QueuedRequest], bool],
        promise: LengthRanges,
        requests: Mapping[str, NeedsTokens],
        registry: WorkerRegistry,
        now: float,
        bulk_max_wait_s: float,
    ) -> None:
        self.admission = admission
        self.promise = promise
        self.requests = requests
        self.registry = registry
        self.now = now
        self.bulk_max_wait_s = bulk_max_wait_s
        # Per kind (interactive, batch line), the (tokens now, tokens needed) refused in this
        # pass: whoever needs as much of both is refused too, with no scan of the workers
        # (a backlog of long requests waiting for a big worker is walked at every pass).
        self.refused: tuple[list[tuple[int, int]], list[tuple[int, int]]] = ([], [])

    def __call__(self, item: QueuedRequest) -> bool:
        if not self.admission(item):
            return False
        num_needed_tokens = self.requests[item.request_id].num_needed_tokens
        if num_needed_tokens <= self.registry.smallest_decode_pool:
            return True  # any worker's pool holds it: the prompt's length said where it fits
        bulk = item.bulk and self.now - item.arrival < self.bulk_max_wait_s  # (as `_place`)
        # Room for the prompt and the first decode step, as the reservation asks.
        num_tokens = item.num_prompt_tokens + 1
        refused = self.refused[1 if bulk else 0]
        for tokens, needed in refused:
            if num_tokens >= tokens and num_needed_tokens >= needed:
                return False
        if self.registry.decode_takes(num_tokens, num_needed_tokens, self.now, bulk):
            return True
        refused.append((num_tokens, num_needed_tokens))
        return False
