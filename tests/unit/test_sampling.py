"""Tests of the sampler: parameter validation, exact filtering and penalties, the sampled
distribution (chi-square), per-request reproducibility, and logprobs."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from shared.engine.sampling import Sampler, SamplingRow, apply_penalties, filter_probs
from shared.engine.sampling_params import SamplingParams, make_generator
from shared.errors import InvalidRequestError

# A hand-made distribution with distinct probabilities; sorted: 1, 3, 4, 2, 5, 0.
PROBS = [0.04, 0.3, 0.11, 0.25, 0.2, 0.1]
LOGITS = torch.tensor(PROBS).log()

# Upper 0.001 quantiles of the chi-square distribution, by degrees of freedom.
CHI2_CRITICAL_P001 = {2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322}


def make_row(params: SamplingParams, prompt=(), output=(), suppressed=()) -> SamplingRow:
    return SamplingRow(params, make_generator(params), list(prompt), list(output), suppressed)


def filtered(logits: torch.Tensor, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, **kw):
    """filter_probs on one row given plain numbers."""
    return filter_probs(
        logits.unsqueeze(0),
        torch.tensor([temperature]),
        torch.tensor([top_k]),
        torch.tensor([top_p]),
        torch.tensor([min_p]),
        **kw,
    )[0]


def restricted(keep: list[int], probs=PROBS) -> torch.Tensor:
    """PROBS with everything outside `keep` zeroed, renormalized."""
    out = torch.zeros(len(probs))
    out[keep] = torch.tensor([probs[i] for i in keep])
    return out / out.sum()


def draw_many(params: SamplingParams, logits: torch.Tensor, num_draws: int, **row_kw) -> list[int]:
    """`num_draws` independent draws: one batch whose rows share one seeded generator."""
    generator = make_generator(params)
    rows = [SamplingRow(params, generator, [], [], **row_kw) for _ in range(num_draws)]
    return Sampler()(logits.expand(num_draws, -1), rows).token_ids


# --- SamplingParams --------------------------------------------------------------------------

INVALID = [
    ("max_tokens", 0),
    ("max_tokens", True),
    ("max_tokens", 2.0),
    ("temperature", -0.1),
    ("temperature", math.nan),
    ("temperature", math.inf),
    ("temperature", "1"),
    ("temperature", True),
    ("top_k", -2),
    ("top_k", 2.0),
    ("top_k", False),
    ("top_p", 0.0),
    ("top_p", 1.01),
    ("top_p", math.nan),
    ("min_p", -0.01),
    ("min_p", 1.5),
    ("seed", -1),
    ("seed", 2**64),
    ("seed", True),
    ("seed", 1.0),
    ("presence_penalty", 2.01),
    ("presence_penalty", -2.5),
    ("presence_penalty", -math.inf),
    ("frequency_penalty", 3),
    ("frequency_penalty", math.nan),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("repetition_penalty", math.inf),
    ("logprobs", -1),
    ("logprobs", 21),
    ("logprobs", True),
    ("prompt_logprobs", -1),
    ("prompt_logprobs", 21),
    ("prompt_logprobs", 2.0),
    ("ignore_eos", 1),
    ("min_tokens", -1),
    ("min_tokens", 17),  # more than the default max_tokens of 16
    ("min_tokens", False),
    ("stop_token_ids", (1, -1)),
    ("stop_token_ids", (True,)),
    ("stop_token_ids", "12"),
    ("stop_token_ids", 7),
    ("stop_token_ids", tuple(range(4097))),  # past the wire's longest list
    ("constraint", {"kind": "regex", "spec": "a+"}),
    ("logit_bias", {1: 100.5}),
    ("logit_bias", {1: -101}),
    ("logit_bias", {1: math.nan}),
    ("logit_bias", {1: math.inf}),
    ("logit_bias", {-1: 5.0}),
    ("logit_bias", {"7": 5.0}),  # a JSON key: the gateway makes it an int
    ("logit_bias", {True: 5.0}),
    ("logit_bias", {1: "5"}),
    ("logit_bias", [(1, 2.0), (1, 3.0)]),
    ("logit_bias", [(1,)]),
    ("logit_bias", "1:5"),
    ("logit_bias", {i: 1.0 for i in range(4097)}),
]


@pytest.mark.parametrize(("field", "value"), INVALID)
def test_invalid_field_is_named(field: str, value: object) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        SamplingParams(**{field: value})
    assert caught.value.param == field


def test_every_field_has_an_invalid_case() -> None:
    fields = set(SamplingParams.__dataclass_fields__)
    assert fields == {field for field, _ in INVALID}


def test_limits_are_accepted_and_numbers_normalized() -> None:
    params = SamplingParams(
        max_tokens=1,
        temperature=0,
        top_k=-1,
        top_p=1,
        min_p=1,
        seed=0,
        presence_penalty=-2,
        frequency_penalty=2,
        repetition_penalty=0.01,
        logprobs=20,
        min_tokens=1,
        stop_token_ids=[2, 0],
    )
    assert isinstance(params.temperature, float) and isinstance(params.top_p, float)
    assert params.stop_token_ids == (2, 0)
    assert SamplingParams(max_tokens=3, min_tokens=3, logprobs=0).min_tokens == 3


def test_greedy() -> None:
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(temperature=0.8, top_k=1).greedy
    assert not SamplingParams().greedy
    assert not SamplingParams(top_k=2, top_p=0.01).greedy


def test_extreme_accepted_values_never_draw_from_nan() -> None:
    """Values the checks take but float32 cannot carry: a temperature whose division overflows
    (vLLM takes below 1e-5 as greedy), a top_p that rounds to 0 (the best token is always
    kept), a repetition penalty of inf on a logit of exactly 0 (0 * inf). Each made the
    distribution NaN, and the draw silently token 0."""
    logits = torch.tensor([[0.0, 20.0, 3.0, 5.0, 0.0, 1.0, 2.0, 7.5]])
    for params in (
        SamplingParams(temperature=1e-38, seed=1),
        SamplingParams(top_p=1e-300, seed=1),
        SamplingParams(temperature=1e-30, top_p=1e-300, seed=1),
    ):
        assert Sampler()(logits, [make_row(params)]).token_ids == [1], params
    assert SamplingParams(temperature=1e-6).greedy and not SamplingParams(temperature=1e-5).greedy
    seen_zero = apply_penalties(logits[0], SamplingParams(repetition_penalty=1e39), [0], [])
    assert not seen_zero.isnan().any() and seen_zero[0] == 0.0


@pytest.mark.parametrize("temperature", [1.0, 0.5, 1e-5])
def test_a_tiny_repetition_penalty_never_draws_from_nan(temperature: float) -> None:
    """A repetition penalty the checks take (> 0) but so small that a seen token's positive
    logit divided by it overflows float32 (5 / 1e-40): the infinite logits made the
    distribution NaN, and every draw silently token 0, a token neither seen nor likely. The
    tokens pushed to infinity are the only ones left to draw."""
    logits = torch.tensor([[0.0, 20.0, 3.0, 5.0, 0.0, 1.0, 2.0, 7.5]])
    draws = set()
    for seed in range(20):
        params = SamplingParams(repetition_penalty=1e-40, temperature=temperature, seed=seed)
        draws |= set(Sampler()(logits, [make_row(params, prompt=[2, 3])]).token_ids)
    assert draws <= {2, 3}


def test_a_rows_min_p_leaves_its_batch_mates_probabilities_alone() -> None:
    """The min-p floor renormalized every row once any had one: a neighbour's min_p moved this
    row's probabilities (ulps, but a seeded draw must not depend on its batch)."""
    logits = 3 * torch.randn(1, 49152, generator=torch.Generator().manual_seed(0))
    alone = filter_probs(logits, *(torch.tensor([v]) for v in (0.7, 0, 1.0, 0.0)))
    pair = filter_probs(logits.expand(2, -1), torch.tensor([0.7, 0.7]), torch.tensor([0, 0]),
                        torch.tensor([1.0, 1.0]), torch.tensor([0.0, 0.1]))  # fmt: skip
    assert torch.equal(pair[0], alone[0])


def test_params_are_frozen() -> None:
    with pytest.raises(AttributeError):
        SamplingParams().temperature = 0.5  # type: ignore[misc]


# --- generators and reproducibility ---------------------------------------------------------


def test_make_generator() -> None:
    assert make_generator(SamplingParams(temperature=0, seed=3)) is None
    first, second = (make_generator(SamplingParams(seed=3)) for _ in range(2))
    assert torch.equal(torch.rand(5, generator=first), torch.rand(5, generator=second))
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    unseeded = [make_generator(SamplingParams()) for _ in range(2)]
    assert torch.equal(torch.rand(3), expected)  # the global RNG was left alone
    assert unseeded[0].initial_seed() != unseeded[1].initial_seed()


NEIGHBOURS = [
    SamplingParams(temperature=0),
    SamplingParams(seed=1234),  # same seed, different params, its own generator
    SamplingParams(temperature=1.3, top_k=1200, top_p=0.5),  # unseeded, top-k past the candidates
    SamplingParams(temperature=0.5, frequency_penalty=1.0, repetition_penalty=1.2),
    SamplingParams(min_p=0.2, seed=7, logprobs=3),
]


def target_tokens(
    target: SamplingParams, scale: float, position: int, neighbours: list[SamplingParams]
) -> list[int]:
    """The target's tokens over 8 steps, at `position` in a batch with `neighbours` around it;
    its logits are the same at each step whatever the batch, the neighbours' are not."""
    vocab = 1500
    rows = [make_row(p, prompt=[1, 2, 3]) for p in neighbours]
    rows.insert(position, make_row(target, prompt=[1, 2, 3]))
    batch_noise = torch.Generator().manual_seed(len(neighbours) * 100 + position)
    tokens = []
    for step in range(8):
        logits = 4 * torch.randn(len(rows), vocab, generator=batch_noise)
        own = torch.randn(vocab, generator=torch.Generator().manual_seed(step))
        logits[position] = scale * own
        token_ids = Sampler()(logits, rows).token_ids
        for row, token in zip(rows, token_ids, strict=True):
            row.output_token_ids.append(token)
        tokens.append(token_ids[position])
    return tokens


@pytest.mark.parametrize(
    ("target", "scale"),
    [
        (SamplingParams(temperature=0.9, top_k=40, top_p=0.95, min_p=0.01, seed=1234), 4.0),
        # flat logits: the top-p set outgrows the 1024 candidates, the full sort decides
        (SamplingParams(temperature=1.0, top_p=0.9, seed=99), 0.5),
    ],
)
def test_seed_reproduces_whatever_the_batch(target: SamplingParams, scale: float) -> None:
    alone = target_tokens(target, scale, 0, [])
    assert len(set(alone)) > 1  # it does sample
    assert target_tokens(target, scale, 0, NEIGHBOURS) == alone
    assert target_tokens(target, scale, 5, NEIGHBOURS) == alone
    assert target_tokens(target, scale, 1, NEIGHBOURS[2:4]) == alone
    assert target_tokens(target, scale, 7, NEIGHBOURS + NEIGHBOURS[::-1]) == alone


def test_different_seeds_differ() -> None:
    logits = torch.zeros(1, 1000)
    draws = {
        Sampler()(logits, [make_row(SamplingParams(seed=seed))]).token_ids[0] for seed in range(8)
    }
    assert len(draws) > 1


# --- filtering ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("filters", "keep"),
    [
        ({}, [0, 1, 2, 3, 4, 5]),
        ({"top_k": 2}, [1, 3]),
        ({"top_k": 6}, [0, 1, 2, 3, 4, 5]),
        ({"top_k": 99}, [0, 1, 2, 3, 4, 5]),
        ({"top_p": 0.01}, [1]),  # never empty
        ({"top_p": 0.5}, [1, 3]),
        ({"top_p": 0.6}, [1, 3, 4]),
        ({"top_p": 0.99}, [0, 1, 2, 3, 4, 5]),
        ({"top_k": 3, "top_p": 0.7}, [1, 3]),  # top-p of the renormalized top-3: 0.4 + 0.33
        ({"min_p": 0.5}, [1, 3, 4]),  # p >= 0.15
        ({"min_p": 1.0}, [1]),
        ({"top_k": 4, "min_p": 0.6}, [1, 3, 4]),  # p >= 0.18
        ({"top_p": 0.9, "min_p": 0.35}, [1, 3, 4, 2]),  # p >= 0.105 among the top-p 0.9
    ],
)
def test_filters_keep_exactly(filters: dict, keep: list[int]) -> None:
    torch.testing.assert_close(filtered(LOGITS, **filters), restricted(keep))
    torch.testing.assert_close(filtered(LOGITS, num_candidates=1, **filters), restricted(keep))


@pytest.mark.parametrize("num_candidates", [1, 2, 3, 1024])
def test_top_k_keeps_every_token_tied_with_the_kth(num_candidates: int) -> None:
    """As transformers' and vLLM's top-k: a token as likely as the k-th is kept too (16-bit
    logits tie often); keeping exactly k dropped tied tokens by the sort's order."""
    logits = torch.tensor([0.0, 3.0, 2.0, 2.0, 2.0, 1.0])
    probs = filtered(logits, top_k=2, num_candidates=num_candidates)
    assert (probs > 0).tolist() == [False, True, True, True, True, False]
    torch.testing.assert_close(probs, restricted([1, 2, 3, 4], logits.exp().tolist()))
    nucleus = filtered(logits, top_k=2, top_p=0.99, num_candidates=num_candidates)
    assert (nucleus > 0).tolist() == [False, True, True, True, True, False]


def test_temperature_comes_before_top_p() -> None:
    # At temperature 0.25 the probabilities go as p**4; token 1 alone holds 0.58 of the mass.
    sharpened = [p**4 for p in PROBS]
    torch.testing.assert_close(filtered(LOGITS, 0.25), restricted(list(range(6)), sharpened))
    torch.testing.assert_close(filtered(LOGITS, 0.25, top_p=0.5), restricted([1]))
    torch.testing.assert_close(filtered(LOGITS, 2.0), torch.softmax(LOGITS / 2, dim=0))


def test_filters_differ_per_row() -> None:
    settings_per_row = [(1.0, 2, 1.0, 0.0), (1.0, 0, 0.6, 0.0), (1.0, 0, 1.0, 0.5), (2.0, 0, 1, 0)]
    columns = [torch.tensor(column) for column in zip(*settings_per_row, strict=True)]
    probs = filter_probs(LOGITS.expand(4, -1), *columns)
    for row, (temperature, top_k, top_p, min_p) in zip(probs, settings_per_row, strict=True):
        torch.testing.assert_close(row, filtered(LOGITS, temperature, top_k, top_p, min_p))


def reference_filter(logits: np.ndarray, temperature, top_k, top_p, min_p) -> np.ndarray:
    """The specification, step by step, in float64."""
    x = logits / temperature
    order = np.argsort(-x, kind="stable")
    keep = np.zeros(len(x), dtype=bool)
    keep[order[: top_k if top_k > 0 else len(x)]] = True
    probs = np.where(keep, np.exp(x - x.max()), 0.0)
    probs /= probs.sum()
    mass, kept_by_p = 0.0, keep.copy()
    if top_p < 1:
        kept_by_p[:] = False
        for token in order:
            if mass >= top_p:
                break
            kept_by_p[token] = keep[token]
            mass += probs[token]
    probs = np.where(kept_by_p, probs, 0.0)
    probs = np.where(probs >= min_p * probs.max(), probs, 0.0)
    return probs / probs.sum()


@settings(max_examples=150, deadline=None)
@given(
    logits=st.lists(st.integers(-40, 40), min_size=2, max_size=12, unique=True),
    temperature=st.sampled_from([0.3, 1.0, 2.5]),
    top_k=st.integers(0, 14),
    top_p=st.one_of(st.just(1.0), st.floats(0.05, 1.0)),
    min_p=st.one_of(st.just(0.0), st.floats(0.0, 1.0)),
    num_candidates=st.integers(1, 12),
)
def test_filters_match_the_reference(logits, temperature, top_k, top_p, min_p, num_candidates):
    x = np.array(logits, dtype=np.float64) / 8  # distinct values, no ties in the ranking
    expected = reference_filter(x, temperature, top_k, top_p, min_p)
    # Float32 rounding may decide differently where a cumulative mass or a min-p floor lies
    # within rounding of the threshold; such cases are ambiguous, not wrong.
    sorted_probs = np.sort(reference_filter(x, temperature, top_k, 1.0, 0.0))[::-1]
    assume(top_p == 1.0 or np.all(np.abs(np.cumsum(sorted_probs) - top_p) > 1e-5))
    kept = reference_filter(x, temperature, top_k, top_p, 0.0)
    kept = kept[kept > 0]
    assume(min_p == 0.0 or np.all(np.abs(kept - min_p * kept.max()) > 1e-6))
    x32 = torch.tensor(x, dtype=torch.float32)
    got = filtered(x32, temperature, top_k, top_p, min_p, num_candidates=num_candidates)
    assert np.array_equal(got.numpy() > 0, expected > 0)
    np.testing.assert_allclose(got.numpy(), expected, atol=1e-5)


@pytest.mark.parametrize(
    ("params", "support"),
    [
        (SamplingParams(top_k=2, seed=1), {1, 3}),
        (SamplingParams(top_p=0.6, seed=2), {1, 3, 4}),
        (SamplingParams(min_p=0.5, seed=3), {1, 3, 4}),
        (SamplingParams(top_k=3, top_p=0.7, seed=4), {1, 3}),
        (SamplingParams(temperature=5.0, seed=5), {0, 1, 2, 3, 4, 5}),
    ],
)
def test_draws_stay_in_the_support(params: SamplingParams, support: set[int]) -> None:
    assert set(draw_many(params, LOGITS, 3000)) == support


@pytest.mark.parametrize(
    ("params", "keep"),
    [
        (SamplingParams(temperature=0.7, seed=11), list(range(8))),
        (SamplingParams(temperature=1.5, top_k=5, top_p=0.9, seed=12), None),
    ],
)
def test_draws_follow_the_distribution(params: SamplingParams, keep) -> None:
    logits = torch.tensor([0.3, -0.2, 1.1, 0.0, 0.8, -0.6, 0.5, 0.2])
    num_draws = 20_000
    expected = filtered(logits, params.temperature, params.top_k, params.top_p).double()
    support = expected > 0
    if keep is not None:
        assert support.nonzero().squeeze(1).tolist() == keep
    counts = torch.bincount(torch.tensor(draw_many(params, logits, num_draws)), minlength=8)
    assert torch.all(counts[~support] == 0)
    expected_counts = num_draws * expected[support]
    statistic = ((counts[support] - expected_counts) ** 2 / expected_counts).sum().item()
    assert statistic < CHI2_CRITICAL_P001[int(support.sum()) - 1]


# --- logit bias -------------------------------------------------------------------------------


def test_logit_bias_is_normalized_to_pairs_sorted_by_id() -> None:
    assert SamplingParams(logit_bias={5: 100, 2: -1}).logit_bias == ((2, -1.0), (5, 100.0))
    assert SamplingParams(logit_bias=[[9, 0.5]]).logit_bias == ((9, 0.5),)
    assert SamplingParams(logit_bias={5: 1}).logit_bias_ids == (5,)


def test_the_longest_logit_bias_fits_the_wire() -> None:
    from shared.engine.sampling_params import MAX_LOGIT_BIAS
    from shared.wire_base import MAX_LIST_LEN

    assert MAX_LOGIT_BIAS == MAX_LIST_LEN
    assert len(SamplingParams(logit_bias={i: 1.0 for i in range(MAX_LOGIT_BIAS)}).logit_bias)


def test_the_most_stop_token_ids_fit_the_wire() -> None:
    """More stop_token_ids than the wire's longest list passed every check, and the gateway's
    SUBMIT then failed to encode: a 500 for a client's mistake."""
    from shared import wire
    from shared.engine.sampling_params import MAX_STOP_TOKEN_IDS
    from shared.wire_convert import sampling_spec

    params = SamplingParams(stop_token_ids=tuple(range(MAX_STOP_TOKEN_IDS)))
    submit = wire.Submit(request_id="r", prompt_token_ids=[1], sampling=sampling_spec(params),
                         tenant="t", priority=0, gateway_peer_id="g", arrival_time=0.0,
                         first_token_deadline_s=1.0)  # fmt: skip
    assert len(wire.decode(wire.encode(submit)).sampling.stop_token_ids) == MAX_STOP_TOKEN_IDS
    with pytest.raises(InvalidRequestError, match="at most"):
        SamplingParams(stop_token_ids=tuple(range(MAX_STOP_TOKEN_IDS + 1)))


def test_logit_bias_moves_the_greedy_choice_and_leaves_logprobs_the_models() -> None:
    """LOGITS' argmax is 1; +100 on 5 forces 5, -100 on 1 bans it (3 is next), a small bias
    moves the choice only where it overturns the order."""
    cases = [({5: 100}, 5), ({1: -100}, 3), ({0: 1.0}, 1), ({0: 2.1}, 0)]
    rows = [make_row(SamplingParams(temperature=0, logit_bias=b, logprobs=1)) for b, _ in cases]
    out = Sampler()(LOGITS.expand(len(rows), -1), rows)
    assert out.token_ids == [expected for _, expected in cases]
    raw = torch.log_softmax(LOGITS, dim=-1)
    for token_id, logprob, top in zip(out.token_ids, out.logprobs, out.top_logprobs, strict=True):
        assert logprob == pytest.approx(raw[token_id].item())
        assert top[0][0] == 1  # the model's own best token, bias or not


def test_a_biased_row_leaves_the_plain_greedy_path_and_its_batch_mates_alone() -> None:
    biased = make_row(SamplingParams(temperature=0, logit_bias={2: 50}))
    plain = make_row(SamplingParams(temperature=0))
    assert not biased.is_plain_greedy and plain.is_plain_greedy
    assert Sampler()(LOGITS.expand(2, -1), [biased, plain]).token_ids == [2, 1]


def test_a_suppressed_token_stays_suppressed_whatever_its_bias() -> None:
    row = make_row(SamplingParams(temperature=0, logit_bias={5: 100}), suppressed=[5])
    assert Sampler()(LOGITS.unsqueeze(0), [row]).token_ids == [1]


def test_biased_draws_follow_the_biased_distribution() -> None:
    """A bias b multiplies a token's probability by e^b before renormalizing."""
    bias = {0: 2.0, 1: -1.0, 5: 0.7}
    params = SamplingParams(seed=21, logit_bias=bias)
    num_draws = 20_000
    shifted = LOGITS.clone().double()
    for token_id, value in bias.items():
        shifted[token_id] += value
    expected = torch.softmax(shifted, dim=-1)
    counts = torch.bincount(torch.tensor(draw_many(params, LOGITS, num_draws)), minlength=6)
    expected_counts = num_draws * expected
    statistic = ((counts - expected_counts) ** 2 / expected_counts).sum().item()
    assert statistic < CHI2_CRITICAL_P001[5]


# --- penalties, suppression, greedy -----------------------------------------------------------


def test_penalties_by_hand() -> None:
    logits = torch.tensor([1.0, -1.0, 2.0, 0.5, -0.5, 3.0])
    prompt, output = [0, 0, 3], [1, 2, 2]
    repetition = SamplingParams(repetition_penalty=2.0)
    expected = torch.tensor([0.5, -2.0, 1.0, 0.25, -0.5, 3.0])  # seen tokens 0, 1, 2, 3
    assert torch.equal(apply_penalties(logits, repetition, prompt, output), expected)
    counted = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    expected = torch.tensor([1.0, -1.75, 0.75, 0.5, -0.5, 3.0])  # output only: 1 once, 2 twice
    assert torch.equal(apply_penalties(logits, counted, prompt, output), expected)
    both = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    expected = torch.tensor([0.5, -2.75, -0.25, 0.25, -0.5, 3.0])  # repetition first
    assert torch.equal(apply_penalties(logits, both, prompt, output), expected)
    encouraging = SamplingParams(frequency_penalty=-1.0)
    expected = torch.tensor([1.0, 0.0, 4.0, 0.5, -0.5, 3.0])
    assert torch.equal(apply_penalties(logits, encouraging, prompt, output), expected)
    assert torch.equal(logits, torch.tensor([1.0, -1.0, 2.0, 0.5, -0.5, 3.0]))  # untouched


def test_greedy_takes_the_argmax() -> None:
    logits = torch.randn(16, 500, generator=torch.Generator().manual_seed(0))
    rows = [make_row(SamplingParams(temperature=0)) for _ in range(16)]
    assert Sampler()(logits, rows).token_ids == logits.argmax(dim=1).tolist()
    rows[3] = make_row(SamplingParams(temperature=0.7, top_k=1))  # greedy too
    rows[5] = make_row(SamplingParams(seed=3))  # forces the general path
    token_ids, expected = Sampler()(logits, rows).token_ids, logits.argmax(dim=1).tolist()
    del token_ids[5], expected[5]
    assert token_ids == expected


def test_penalties_steer_the_sampler() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.9]])
    greedy = SamplingParams(temperature=0, presence_penalty=0.5)
    assert Sampler()(logits, [make_row(greedy, output=[0])]).token_ids == [1]
    assert Sampler()(logits, [make_row(greedy, output=[1])]).token_ids == [2]


def test_suppressed_tokens_are_never_chosen() -> None:
    logits = torch.tensor([0.0, 9.0, 1.0, 0.5])
    greedy = SamplingParams(temperature=0)
    assert Sampler()(logits[None], [make_row(greedy, suppressed=[1])]).token_ids == [2]
    sampling = SamplingParams(temperature=2.0, seed=0)
    draws = draw_many(sampling, logits, 2000, suppressed_token_ids=[1, 3])
    assert set(draws) == {0, 2}


def test_caller_logits_are_not_modified() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    before = logits.clone()
    rows = [
        make_row(SamplingParams(repetition_penalty=1.5, seed=1), [1, 2], [3], suppressed=[4]),
        make_row(SamplingParams(temperature=0, frequency_penalty=1.0), [1], [5, 5]),
        make_row(SamplingParams(top_p=0.5, min_p=0.1, seed=2, logprobs=2)),
    ]
    Sampler()(logits, rows)
    assert torch.equal(logits, before)


# --- logprobs -------------------------------------------------------------------------------


def test_logprobs_are_the_models_own() -> None:
    logits = torch.randn(4, 8, generator=torch.Generator().manual_seed(2))
    penalized = SamplingParams(temperature=0.5, repetition_penalty=1.3, logprobs=3, seed=1)
    rows = [
        make_row(penalized, prompt=[1], output=[2]),
        make_row(SamplingParams(temperature=0)),
        make_row(SamplingParams(temperature=0, logprobs=0), suppressed=[0]),
        make_row(SamplingParams(top_p=0.3, logprobs=20, seed=2)),
    ]
    out = Sampler()(logits, rows)
    raw = torch.log_softmax(logits, dim=1)
    for i in (0, 2, 3):
        assert out.logprobs[i] == pytest.approx(raw[i, out.token_ids[i]].item(), abs=1e-6)
    assert out.logprobs[1] is None and out.top_logprobs[1] is None
    assert out.top_logprobs[2] == []
    for i, n in ((0, 3), (3, 8)):  # 20 asked, the vocabulary has 8
        values, ids = raw[i].sort(descending=True)
        assert [t for t, _ in out.top_logprobs[i]] == ids[:n].tolist()
        assert [v for _, v in out.top_logprobs[i]] == pytest.approx(values[:n].tolist())


def test_misuse_is_refused() -> None:
    with pytest.raises(ValueError, match="generator"):
        Sampler()(torch.zeros(1, 4), [SamplingRow(SamplingParams(), None, [], [])])
    with pytest.raises(ValueError, match="rows"):
        Sampler()(torch.zeros(2, 4), [make_row(SamplingParams(temperature=0))])


def test_a_resumed_requests_first_token_is_held_to_what_is_left_of_min_tokens() -> None:
    """The prefill worker samples one token: EOS and stop tokens are masked only while the
    request, its earlier tokens counted, is short of min_tokens (they were masked whenever
    min_tokens was set)."""
    from services.prefill.service import first_token_params

    params = SamplingParams(max_tokens=50, min_tokens=5)
    assert first_token_params(params, 0).min_tokens == 1
    assert first_token_params(params, 4).min_tokens == 1
    assert first_token_params(params, 5).min_tokens == 0
    assert first_token_params(params, 9) == dataclasses.replace(params, max_tokens=1, min_tokens=0)
