"""A sequence in the engine: counters and ids, plus the sampling state that follows it.

`num_computed_tokens` counts the tokens whose keys and values are in the cache. Every step runs
some of the tokens in [num_computed_tokens, num_tokens); when it reaches `num_tokens` the step's
logits belong to the last token and a new token is sampled. A prompt is thus prefilled in as many
chunks as the token budget needs, a decode step is the case of one token, and a sequence preempted
for recompute simply has its counter reset to 0 (its prompt and output are prefilled again).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from shared.engine.sampling_params import SamplingParams, make_generator

if TYPE_CHECKING:  # the planner's simulated workers share the engine's scheduler, not torch
    import torch


class SequenceStatus(enum.IntEnum):
    """Ordered: every status from FINISHED_STOPPED on counts as finished."""

    WAITING = 0
    RUNNING = 1
    SWAPPED = 2  # preempted, its KV in host memory until blocks free up
    FINISHED_STOPPED = 3  # end of sequence or a stop token
    FINISHED_LENGTH = 4  # max_tokens or the model's context
    FINISHED_ABORTED = 5

    @property
    def is_finished(self) -> bool:
        return self >= SequenceStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
}


@dataclass
class TokenLogprobs:
    logprob: float
    top: list[tuple[int, float]] | None


@dataclass
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprobs] = field(default_factory=list)
    # With `prompt_logprobs` asked: entry p is prompt token p+1's, from the logits at position p,
    # filled chunk by chunk as the prompt is computed (the first token has none).
    prompt_logprobs: list[TokenLogprobs] | None = None
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    generator: torch.Generator | None = None
    num_preemptions: int = 0
    priority: int = 0  # larger is more urgent: preempted last, resumed first
    bulk: bool = False  # a batch job's line: less urgent than any interactive sequence
    # Prefix cache: the root of this sequence's block hash chain (None: not cached), the hashes
    # of its full blocks known so far, how many of its current block_ids are named in the cache,
    # and the prompt tokens whose computation the cache skipped at its first prefill (of them,
    # those copied back from the host tier).
    cache_root: int | None = None
    block_hashes: list[int] = field(default_factory=list)
    num_registered_blocks: int = 0
    num_cached_tokens: int = 0
    num_host_cached_tokens: int = 0
    grammar: Any = None  # its GrammarState (shared.engine.grammar) when constrained
    # A request resumed from its client's tokens: its prompt's last ones were generated before
    # (what penalties on output count, with its own output).
    num_replayed: int = 0

    def __post_init__(self) -> None:
        if self.generator is None:
            self.generator = make_generator(self.params)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def num_schedulable_tokens(self) -> int:
        """Uncomputed tokens a step may run now: all of them, but the last while the sequence's
        grammar still compiles. The step that runs the last token samples the next one, which
        needs the matcher; held back, that step neither waits on the compile nor holds up the
        rest of its batch, and the prompt's earlier chunks still overlap the compile."""
        if self.grammar is not None and not self.grammar.ready:
            return self.num_uncomputed_tokens - 1
        return self.num_uncomputed_tokens

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt followed by output, without building the whole list."""
        prompt_len = len(self.prompt_token_ids)
        if end <= prompt_len:
            return self.prompt_token_ids[start:end]
        if start >= prompt_len:
            return self.output_token_ids[start - prompt_len : end - prompt_len]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - prompt_len]
