"""Which workers a placement must compare: the few that can win, found from the indexes.

The placement's choices (`cache_placement.py`, `cache_routing.py`) are pure comparisons over
candidates; comparing all of a thousand workers per decision is what this module avoids,
without changing a single answer:

* A worker whose cache holds none of a prompt (it lacks the prompt's first block) predicts the
  wait of an idle cache: among such workers of one measured prefill rate, the one holding the
  fewest tokens (then with the most room, then the smallest peer id) is the placement's choice,
  provided one more held token lengthens the predicted wait (it does, but for weights that round
  it away: then the group is compared whole). So the candidates are the workers holding the
  prompt's first block (`cache_holders.py`) and the least loaded of the rest per rate.
* The most any worker holds of a prompt is the most any holder of its first block holds.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from services.scheduler.cache_routing import RoutingWeights, wait_s
from services.scheduler.registry import WorkerRegistry, WorkerState


def prefill_candidates(
    registry: WorkerRegistry,
    weights: RoutingWeights,
    num_prompt_tokens: int,
    bulk: bool,
    now: float,
    holders: set[str],
) -> list[WorkerState]:
    """The healthy prefill workers whose window takes the prompt, whose KV cache holds it,
    and that can be the placement's choice: the `holders` of its prefix, and the least loaded
    other per rate."""
    # Past the smallest prefill pool, workers too small are out (they would refuse it).
    num_needed = num_prompt_tokens + 1 if num_prompt_tokens >= registry.smallest_prefill_pool else 0
    candidates = []
    if holders:
        for peer_id in holders:
            worker = registry.get(peer_id)
            if (
                worker is not None
                and worker.role == "prefill"
                and worker.pool_tokens >= num_needed
                and registry.window_takes(worker, num_prompt_tokens, bulk)
                and registry.is_healthy(worker, now)
            ):
                candidates.append(worker)
    for group in registry.prefill_takers_by_load(num_prompt_tokens, bulk, now):
        others = _not_held(group, holders, num_needed)
        first = next(others, None)
        if first is None:
            continue
        candidates.append(first)
        held = registry.held_tokens(first)
        if not _longer_wait(weights, first.prefill_tokens_per_s, held, num_prompt_tokens):
            candidates += others
    return candidates


def _not_held(
    group: Iterable[WorkerState], holders: set[str], num_needed: int
) -> Iterator[WorkerState]:
    """Those not in `holders` whose pool holds `num_needed` tokens, lazily (a group can be
    every worker; the first one is the usual answer)."""
    for worker in group:
        if worker.peer_id not in holders and worker.pool_tokens >= num_needed:
            yield worker


def _longer_wait(
    weights: RoutingWeights, tokens_per_s: float, num_held_tokens: int, num_tokens: int
) -> bool:
    """Whether one more token held makes a strictly longer predicted wait at this rate."""
    longer = wait_s(num_held_tokens + 1, 0, tokens_per_s, num_tokens, weights)
    return longer > wait_s(num_held_tokens, 0, tokens_per_s, num_tokens, weights)
