"""Prompt logprobs: how likely the model found each prompt token, given the tokens before it.

A prompt chunk's forward yields a hidden state per token; the one at position p predicts token
p+1. For a sequence that asks (`SamplingParams.prompt_logprobs`), the chunk's rows whose next
token is still prompt go through the LM head, and each row's log-softmax gives the prompt
token's logprob and the top n. Rows are scored a slice at a time, so a long chunk never holds
more than `ROWS_PER_SLICE` rows of vocabulary-wide logits. Entries are written by position, so a
chunk computed again (a batch re-run chunk by chunk, a recompute after preemption) writes the
same entries again rather than adding to them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from shared.engine.sequence import Sequence, TokenLogprobs

ROWS_PER_SLICE = 256  # 256 x a 49,152-token vocabulary in float32: 48 MiB at a time


@dataclass(frozen=True)
class ScoredRows:
    """A chunk's rows that predict prompt tokens: batch rows [row, row + count) are positions
    [position, position + count) of `sequence`."""

    sequence: Sequence
    row: int
    position: int
    count: int


def rows_to_score(sequence: Sequence, row: int, start: int, num_tokens: int) -> ScoredRows | None:
    """The rows of a chunk (its tokens [start, start + num_tokens) at batch row `row`) whose
    next token is a prompt token, when the sequence asks for prompt logprobs."""
    if sequence.prompt_logprobs is None or sequence.output_token_ids:
        return None  # (not asked, or a recompute: they went out with the first token)
    end = min(start + num_tokens, sequence.num_prompt_tokens - 1)
    return ScoredRows(sequence, row, start, end - start) if end > start else None


@torch.inference_mode()
def score(
    scored: ScoredRows, hidden: torch.Tensor, logits_of: Callable[[torch.Tensor], torch.Tensor]
) -> None:
    """Writes the logprobs of the prompt tokens `scored` predicts into its sequence's
    `prompt_logprobs`; `hidden` is the step's hidden states, `logits_of` the model's LM head."""
    seq = scored.sequence
    entries = seq.prompt_logprobs
    assert entries is not None and seq.params.prompt_logprobs is not None
    num_top = seq.params.prompt_logprobs
    del entries[scored.position :]  # (a chunk computed again replaces what it wrote)
    if len(entries) != scored.position:
        raise RuntimeError(f"prompt logprobs from {scored.position} follow {len(entries)} only")
    for first in range(0, scored.count, ROWS_PER_SLICE):
        count = min(ROWS_PER_SLICE, scored.count - first)
        position = scored.position + first
        rows = hidden[scored.row + first : scored.row + first + count]
        logprobs = torch.log_softmax(logits_of(rows), dim=-1)
        targets = torch.tensor(
            seq.prompt_token_ids[position + 1 : position + 1 + count], device=logprobs.device
        )
        chosen = logprobs.gather(1, targets.unsqueeze(1)).squeeze(1).tolist()
        if num_top:
            values, ids = logprobs.topk(min(num_top, logprobs.shape[-1]), dim=-1)
            pairs = zip(ids.tolist(), values.tolist(), strict=True)
            tops = [list(zip(i, v, strict=True)) for i, v in pairs]
        else:
            tops = [[] for _ in range(count)]
        entries.extend(TokenLogprobs(lp, top) for lp, top in zip(chosen, tops, strict=True))
