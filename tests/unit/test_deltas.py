"""Token deltas by position: the decode worker's repeat of the first token joined to its own,
and what a gateway keeps of a delta given the tokens it has."""

from __future__ import annotations

import dataclasses

import pytest

from shared import wire
from shared.deltas import after, joined


def delta(tokens, index, logprobs=None, finish=None, cached=None) -> wire.TokenDelta:
    tops = None if logprobs is None else [[(t, lp)] for t, lp in zip(tokens, logprobs, strict=True)]
    return wire.TokenDelta(request_id="r", token_ids=tokens, logprobs=logprobs,
                           top_logprobs=tops, finish_reason=finish, index=index,
                           num_cached_tokens=cached)  # fmt: skip


def test_joined_puts_the_first_ahead_and_keeps_the_later_ones_end():
    both = joined(delta([7], 3, [-0.5], cached=16), delta([8, 9], 4, [-1.0, -2.0], "length"))
    assert both.token_ids == [7, 8, 9] and both.index == 3 and both.finish_reason == "length"
    assert both.logprobs == [-0.5, -1.0, -2.0]
    assert both.top_logprobs == [[(7, -0.5)], [(8, -1.0)], [(9, -2.0)]]
    assert both.num_cached_tokens == 16  # the prefill's count travels with its token


def test_the_repeated_first_token_carries_the_prompts_logprobs_once():
    """The decode worker repeats the first token for a gateway that missed the prefill
    worker's delta: the prompt's logprobs, which come with that token, came no more (a client
    asking for them got none, and no error). A gateway that had the first token drops them
    with the repeat."""
    first = dataclasses.replace(
        delta([7], 0, [-0.5]), prompt_logprobs=[-1.0, -2.0], prompt_top_logprobs=[[], []]
    )
    both = joined(first, delta([8], 1, [-1.0]))
    assert both.prompt_logprobs == [-1.0, -2.0] and both.prompt_top_logprobs == [[], []]
    assert after(both, 0).prompt_logprobs == [-1.0, -2.0]
    rest = after(both, 1)
    assert rest.token_ids == [8] and rest.prompt_logprobs is rest.prompt_top_logprobs is None


def test_joined_to_an_end_without_tokens_keeps_the_first_tokens_logprobs():
    """The decode worker joins the repeated first delta to an end of no tokens (a transfer
    already at max_tokens; an error): the first token's logprobs went with it no more."""
    both = joined(delta([7], 0, [-0.5]), delta([], 1, finish="length"))
    assert both.token_ids == [7] and both.finish_reason == "length"
    assert both.logprobs == [-0.5] and both.top_logprobs == [[(7, -0.5)]]
    assert joined(delta([7], 0), delta([], 1, finish="length")).logprobs is None


def test_joined_without_logprobs_on_both_sides_has_none():
    assert joined(delta([7], 0), delta([8], 1)).logprobs is None
    assert joined(delta([7], 0, [-0.5]), delta([8], 1)).logprobs is None


def test_after_passes_a_delta_that_starts_where_the_output_ends():
    fresh = delta([8], 2)
    assert after(fresh, 2) is fresh
    assert after(delta([8], None), 5).token_ids == [8]  # no index: it comes after


def test_after_cuts_the_tokens_already_had_with_their_logprobs():
    cut = after(delta([7, 8, 9], 3, [-0.5, -1.0, -2.0]), 4)
    assert (cut.token_ids, cut.index, cut.logprobs) == ([8, 9], 4, [-1.0, -2.0])
    assert cut.top_logprobs == [[(8, -1.0)], [(9, -2.0)]]


def test_after_drops_a_repeat_that_brings_nothing_but_keeps_an_end():
    assert after(delta([7], 3), 4) is None
    assert after(delta([7, 8], 3), 5) is None
    end = after(delta([7], 3, finish="stop"), 4)
    assert end.token_ids == [] and end.finish_reason == "stop" and end.index == 4


def test_after_refuses_a_delta_beyond_a_hole():
    with pytest.raises(ValueError, match="tokens 2..3 of the output never arrived"):
        after(delta([9], 4), 2)
