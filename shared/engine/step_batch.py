"""The input of one forward step: a batch that may mix prompt chunks and single decode tokens.

Each sequence contributes a run of new tokens (a whole prompt, a prompt chunk, or one decode
token) that follow the `start_position` tokens already in its KV cache. The batch flattens the new
tokens of all sequences in order; `query_start_loc` marks where each sequence's run starts, and the
model returns the logits of each run's last token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SequenceChunk:
    """One sequence's share of a step."""

    token_ids: Sequence[int]  # the new tokens to run (at least one)
    start_position: int  # tokens of this sequence already in the KV cache
    block_ids: Sequence[int]  # its block table, covering start_position + len(token_ids) tokens


@dataclass(frozen=True)
class StepBatch:
    token_ids: torch.Tensor  # int64 [num_tokens]: new tokens of all sequences, flattened in order
    positions: torch.Tensor  # int64 [num_tokens]: each token's position in its sequence
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]: sequence i's tokens are [q[i], q[i+1])
    context_lens: torch.Tensor  # int32 [num_seqs]: tokens in the cache once this step has run
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks]: padded with 0 past each table
    slot_mapping: torch.Tensor  # int64 [num_tokens]: cache slot (block * block_size + offset)
    last_token_indices: torch.Tensor  # int64 [num_seqs]: row of each sequence's last new token
    max_query_len: int  # longest run of new tokens (1 for a pure decode step)
    max_context_len: int  # longest context, so attention needs no device sync to size itself

    @property
    def num_seqs(self) -> int:
        return self.context_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.token_ids.shape[0]


def build_step_batch(
    chunks: Sequence[SequenceChunk], block_size: int, device: torch.device | str = "cpu"
) -> StepBatch:
    if not chunks:
        raise ValueError("a step needs at least one sequence")
    query_lens = [len(c.token_ids) for c in chunks]
    if min(query_lens) < 1:
        raise ValueError("every sequence in a step needs at least one new token")
    context_lens = [c.start_position + n for c, n in zip(chunks, query_lens, strict=True)]
    max_blocks = max(-(-n // block_size) for n in context_lens)
    tables = []
    for chunk, context_len in zip(chunks, context_lens, strict=True):
        if len(chunk.block_ids) * block_size < context_len:
            raise ValueError(
                f"block table of {len(chunk.block_ids)} blocks cannot hold {context_len} tokens"
            )
        used = list(chunk.block_ids[:max_blocks])
        tables.append(used + [0] * (max_blocks - len(used)))

    flat_tokens = [t for c in chunks for t in c.token_ids]
    q_lens = torch.tensor(query_lens, dtype=torch.int64)
    starts = torch.tensor([c.start_position for c in chunks], dtype=torch.int64)
    query_start_loc = torch.zeros(len(chunks) + 1, dtype=torch.int64)
    torch.cumsum(q_lens, 0, out=query_start_loc[1:])
    # Position of every token: its sequence's start plus its offset within the run.
    seq_of_token = torch.repeat_interleave(torch.arange(len(chunks)), q_lens)
    offsets = torch.arange(len(flat_tokens)) - query_start_loc[:-1][seq_of_token]
    positions = starts[seq_of_token] + offsets
    block_tables = torch.tensor(tables, dtype=torch.int64)
    slots = (
        block_tables[seq_of_token, positions // block_size] * block_size + positions % block_size
    )
    return StepBatch(
        token_ids=torch.tensor(flat_tokens, dtype=torch.int64, device=device),
        positions=positions.to(device),
        query_start_loc=query_start_loc.to(torch.int32).to(device),
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
        block_tables=block_tables.to(torch.int32).to(device),
        slot_mapping=slots.to(device),
        last_token_indices=(query_start_loc[1:] - 1).to(device),
        max_query_len=max(query_lens),
        max_context_len=max(context_lens),
    )
