"""Token deltas by position. Two workers stream one request to its gateway on two connections
(the first token from the prefill worker, the rest from the decode worker), and ZeroMQ orders
messages per connection only; so each delta says where its tokens sit in the output, the decode
worker repeats the first token ahead of its own, and the gateway keeps each token once.
"""

from __future__ import annotations

import dataclasses

from shared import wire


def joined(first: wire.TokenDelta, then: wire.TokenDelta) -> wire.TokenDelta:
    """`first`'s tokens followed by `then`'s, as one delta (`then` ends it: finish, error)."""
    logprobs = top_logprobs = None
    # An end with no tokens (max_tokens reached, an error) has no logprobs to add: the first's
    # stay (dropped, a gateway that missed the first delta had its token without them).
    then_logprobs = [] if not then.token_ids else then.logprobs
    if first.logprobs is not None and then_logprobs is not None:
        logprobs = [*first.logprobs, *then_logprobs]
        top_logprobs = [*_tops(first), *(_tops(then) if then.token_ids else [])]
    return dataclasses.replace(
        then,
        token_ids=[*first.token_ids, *then.token_ids],
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        # (The prompt's, which come with the first token: the repeat is for a gateway that
        # missed the first worker's delta, so it must carry all that delta carried.)
        prompt_logprobs=first.prompt_logprobs,
        prompt_top_logprobs=first.prompt_top_logprobs,
        num_cached_tokens=first.num_cached_tokens,
        index=first.index,
    )


def after(delta: wire.TokenDelta, num_had: int) -> wire.TokenDelta | None:
    """What `delta` adds to an output of which `num_had` tokens arrived already: the delta
    without its repeated head, or None if it brings nothing (no new token, no end). A delta
    without an index comes after what arrived. Raises ValueError if tokens before it are
    missing: no worker sends them again."""
    start = num_had if delta.index is None else delta.index
    if start > num_had:
        raise ValueError(f"tokens {num_had}..{start - 1} of the output never arrived")
    skip = num_had - start
    if skip == 0:
        return delta
    if skip >= len(delta.token_ids) and delta.finish_reason is None and delta.error is None:
        return None
    return dataclasses.replace(
        delta,
        token_ids=delta.token_ids[skip:],
        logprobs=None if delta.logprobs is None else delta.logprobs[skip:],
        top_logprobs=None if delta.top_logprobs is None else delta.top_logprobs[skip:],
        prompt_logprobs=None,  # (they came with the first token, which arrived already)
        prompt_top_logprobs=None,
        index=num_had,
    )


def _tops(delta: wire.TokenDelta) -> list[list[tuple[int, float]]]:
    return delta.top_logprobs if delta.top_logprobs is not None else [[] for _ in delta.token_ids]
