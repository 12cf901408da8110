"""`best_of`'s ranking: the n candidates of highest mean logprob per generated token."""

from services.gateway.openai_shapes import ChoiceResult, TokenLogprob
from services.gateway.responses import best_of


def tokens(*logprobs: float | None) -> list[TokenLogprob]:
    return [TokenLogprob("t", b"t", lp) for lp in logprobs]


def test_the_best_mean_per_token_wins_and_is_numbered_first():
    logprobs = [tokens(-1.0, -1.0), tokens(-0.1, -0.5, -0.3), tokens(-3.0)]
    candidates = [
        ChoiceResult(i, f"c{i}", "length", [7] * len(lps), None) for i, lps in enumerate(logprobs)
    ]
    chosen = best_of(candidates, logprobs, 2)
    # Means: -1.0, -0.3, -3.0 (a longer candidate is not penalized for its length).
    assert [(c.index, c.text) for c in chosen] == [(0, "c1"), (1, "c0")]


def test_an_echoed_prompts_logprobs_do_not_count_and_an_empty_candidate_ranks_last():
    # Candidate 0 echoes a prompt of two tokens (the first without a logprob) before its one.
    logprobs = [tokens(None, -9.0, -0.2), tokens(-0.5), []]
    candidates = [
        ChoiceResult(0, "p0", "length", [7], None),
        ChoiceResult(1, "p1", "length", [7], None),
        ChoiceResult(2, "p2", "stop", [], None),
    ]
    assert [c.text for c in best_of(candidates, logprobs, 3)] == ["p0", "p1", "p2"]
