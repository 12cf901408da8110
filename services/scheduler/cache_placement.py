"""The scheduler core's cache-aware choices for one request, read from the prefix index.

The core asks four questions of a request (a SUBMIT) and this module answers them from the
index of which worker holds which cached prefix (`prefix_index.py`) with the pure policies of
`cache_routing.py`: which prefill worker has the least predicted wait; how much each decode
worker is to be preferred; whether the chosen decode worker prefills the rest itself; and how
many prompt tokens some worker holds (what fair share does not charge). Everything here is a
prediction: the workers look their own caches up, so a wrong answer costs time, never tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from services.scheduler.cache_routing import (
    PrefillCandidate,
    RoutingWeights,
    choose_prefill,
    decode_affinity,
    local_prefill_wait_s,
    predicted_wait_s,
)
from services.scheduler.prefix_index import PrefixIndex
from services.scheduler.registry import WorkerState
from shared import wire


def prefill_tokens(submit: wire.Submit | wire.PrefillJob) -> Sequence[int]:
    """What a prefill computes: the prompt, and the tokens a resumed request has already (the
    message's own prompt when it has none: no message changes the ids it was given)."""
    if not submit.output_token_ids:
        return submit.prompt_token_ids
    return list(submit.prompt_token_ids) + list(submit.output_token_ids)


class CachePlacement:
    def __init__(self, weights: RoutingWeights, local_prefill_max_tokens: int):
        self.index = PrefixIndex()
        self.weights = weights
        self.local_prefill_max_tokens = local_prefill_max_tokens
        # Each request's chain, hashed once while the core holds it: its admission, its
        # dispatch and its reservation's answer each ask, with other requests' between them.
        # Kept for that very SUBMIT under the same cache key, until the core `forget`s it.
        self._chains: dict[str, tuple[wire.Submit, tuple[str | None, int], list[int]]] = {}

    @property
    def active(self) -> bool:
        """Some worker keeps a prefix cache."""
        return self.index.cache_key is not None

    def _hashes(self, submit: wire.Submit) -> list[int]:
        return self.prompt_hashes(submit)

    def prompt_hashes(self, submit: wire.Submit) -> list[int]:
        """The chain of the request's full blocks, hashed once (hashing a long prompt is the
        costliest step of a choice, and a request's life asks it four times or more). None for
        a prompt whose logprobs are asked: a worker computes it whole (a cached block has no
        logits) and caches none of it, so no worker's cache saves it a token, and fair share
        charges it all."""
        if submit.sampling.prompt_logprobs is not None:
            return []
        key = (self.index.cache_key, self.index.block_size)
        kept = self._chains.get(submit.request_id)
        if kept is not None and kept[0] is submit and kept[1] == key:
            return kept[2]
        hashes = self.index.prompt_hashes(prefill_tokens(submit), submit.tenant)
        self._chains[submit.request_id] = (submit, key, hashes)
        return hashes

    def forget(self, request_id: str) -> None:
        """The request left the core: its chain goes."""
        self._chains.pop(request_id, None)

    @property
    def num_chains_kept(self) -> int:
        return len(self._chains)

    def cached_on(self, peer_id: str, submit: wire.Submit) -> int:
        """Prompt tokens `peer_id` holds cached (never the block holding the last token)."""
        return self.index.num_cached_tokens(peer_id, self._hashes(submit)) if self.active else 0

    def most_cached(self, submit: wire.Submit, peer_ids: Sequence[str]) -> int:
        """The most of the prompt any of `peer_ids` holds cached."""
        if not self.active:
            return 0
        hashes = self._hashes(submit)
        return max((self.index.num_cached_tokens(p, hashes) for p in peer_ids), default=0)

    def choose_prefill(
        self,
        workers: Sequence[WorkerState],
        submit: wire.Submit,
        queued_tokens: Callable[[WorkerState], int],
        room: Callable[[WorkerState], int],
    ) -> WorkerState:
        """The prefill worker with the least predicted wait, its cached prefix counted."""
        if len(workers) == 1:
            return workers[0]
        hashes = self._hashes(submit) if self.active else []
        candidates = [
            PrefillCandidate(
                peer_id=w.peer_id,
                num_queued_tokens=queued_tokens(w),
                num_cached_tokens=self.index.num_cached_tokens(w.peer_id, hashes),
                tokens_per_s=w.prefill_tokens_per_s,
                room=room(w),
            )
            for w in workers
        ]
        chosen = choose_prefill(candidates, len(prefill_tokens(submit)), self.weights)
        return next(w for w in workers if w.peer_id == chosen.peer_id)

    def decode_affinity(self, submit: wire.Submit) -> Callable[[WorkerState], float] | None:
        """How much each decode worker is to be preferred (None: no worker keeps a cache)."""
        if not self.active:
            return None
        hashes, num_tokens = self._hashes(submit), len(prefill_tokens(submit))
        return lambda w: decode_affinity(
            self.index.num_cached_tokens(w.peer_id, hashes),
            num_tokens,
            len(w.request_ids),
            w.max_num_seqs,
        )

    def prefills_locally(
        self,
        submit: wire.Submit,
        num_cached_blocks: int,
        decode: WorkerState,
        prefill: WorkerState,
        prefill_held_tokens: int,
    ) -> bool:
        """The decode worker holds all of the prompt but a short suffix (a conversation's next
        turn): it prefills that itself, no KV sent, when that gives the first token no later than
        the prefill worker would. A decode worker in the middle of a big batch is slow to start
        (a step in progress, then a long step), and a prefill worker with little in hand is
        quick, so under load even a short suffix goes to the prefill worker (whose cache may hold
        the prefix too). `prefill_held_tokens`: what the prompt would wait behind on the prefill
        worker (for an interactive prompt, not the batch lines it holds: those yield). Never a
        resumed request (its output is no prompt), nor a batch line: its first token is no one's
        wait, and the decode worker's steps are a job's pace (a 1,000-line job prefilled a third
        of its lines there while the prefill worker idled a third of the time). Nor a prompt
        whose logprobs are asked: it is computed whole, cached prefix or not (the prefill worker
        computes it all and sends only the blocks the decode worker lacks)."""
        if num_cached_blocks == 0 or submit.output_token_ids or submit.bulk:
            return False
        if submit.sampling.prompt_logprobs is not None:
            return False
        # At least the last token is computed (a prompt whose every block is pinned runs its
        # last again: its logits give the first token), so 0 means never.
        uncached = max(1, len(submit.prompt_token_ids) - num_cached_blocks * decode.block_size)
        if uncached > self.local_prefill_max_tokens:
            return False
        local_s = local_prefill_wait_s(
            decode.step_s, decode.num_running, uncached, decode.prefill_tokens_per_s
        )
        remote = PrefillCandidate(
            peer_id=prefill.peer_id,
            num_queued_tokens=prefill_held_tokens,
            num_cached_tokens=self.cached_on(prefill.peer_id, submit),
            tokens_per_s=prefill.prefill_tokens_per_s,
        )
        # Seconds against seconds: the routing weights tilt between prefill workers, not here.
        return local_s <= predicted_wait_s(remote, len(prefill_tokens(submit)), RoutingWeights())
