"""The batch-only half of the CPU attention path: which sequences attend together, and how.

The torch reference (`kernels/attention_reference.py`) attends a group of sequences as one padded
batch: their blocks gathered into `[seqs, padded_len, kv_heads, head_dim]`, their queries padded to
the group's longest run, and one masked `scaled_dot_product_attention`. Padding is work: a group
costs `seqs * max_query_len * padded_len` query-key pairs whatever its members really need. One
1,000-token context among thirty 50-token ones makes the decode group twenty times too wide, and a
512-token chunk beside four 20-token prompts makes the prefill group five times too tall; measured
on a long-tailed workload, padded prefill attention was a quarter of a mixed step.

So sequences are bucketed: sorted by context length (longest first), they are cut into runs whose
padded cost stays within `slack` times their real cost, or within `min_waste` pairs of it (one
more group costs a few kernel calls per layer, which only pays for a real saving). Decode
(one new token) and prefill (a run of new tokens) sequences are bucketed apart.

Everything here depends only on the batch, so a model plans once per step, not once per layer.
It reads the lengths on the host: free on the CPU; on CUDA, where this path serves only steps
with prompt chunks (decode runs the Triton kernel), one device sync per step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

DEFAULT_SLACK = 1.25  # a group may pad to this multiple of its real query-key pairs...
DEFAULT_MIN_WASTE = 4096  # ...or waste this many pairs, whichever is more
# Decode groups (one query per sequence) waste less: a padded key costs its gather and its
# zeroing, on the CPU about what one more group costs per ~256 keys. Measured on a bfloat16 and a
# float32 decode step of 8 to 20 long-tailed contexts (30 to 1,200 tokens) in a worker-sized
# cache: 256 gave 1.13-1.3x (bfloat16) and 1.9-2.4x (float32) faster steps than 4096; 512 and
# 1,024 were as fast in bfloat16, slower in float32; one group per sequence was slower again.
DEFAULT_DECODE_MIN_WASTE = 256


@dataclass(frozen=True)
class AttentionGroup:
    """Sequences attended in one padded batch: how to gather their context, and the mask."""

    block_ids: torch.Tensor  # [num_seqs * num_blocks]: the blocks to gather, sequence by sequence
    num_seqs: int
    padded_len: int  # num_blocks * block_size: gathered positions per sequence
    padding_rows: torch.Tensor  # rows of the flat gather past each context, zeroed after the copy
    mask: torch.Tensor  # boolean SDPA mask, True where a query may see a key
    bias: torch.Tensor | None  # decode: the mask as float32 0 / -inf, [seqs, 1, 1, padded_len]
    query_rows: torch.Tensor | None  # decode: its rows of the query (None: all, in order);
    #                                  prefill: rows gathered into the padded [seqs, max_q] query
    output_rows: torch.Tensor | None  # prefill: the real query rows, in padded order
    real: torch.Tensor | None  # prefill: [seqs, max_q], which padded query rows are real
    max_query_len: int
    # prefill: no member has context before its run of queries, so SDPA's own causal flag (query
    # i sees keys 0..i) is the mask on every real row, and lets the CPU flash kernel skip key
    # blocks past each query block, where a mask makes it visit them all.
    causal: bool = False


@dataclass(frozen=True)
class DecodeRows:
    """The decode sequences of a batch, for a kernel that reads each one's context through its
    block table itself (`kernels.cpu_decode_attention`): nothing to gather, pad or group."""

    seq_ids: torch.Tensor  # int32 [n]: the sequences (rows of the block tables) that decode
    query_rows: torch.Tensor  # int32 [n]: each one's query row (its new token)
    max_context_len: int  # the longest of their contexts


@dataclass(frozen=True)
class AttentionPlan:
    decode: tuple[AttentionGroup, ...]  # sequences with one new token
    prefill: tuple[AttentionGroup, ...]  # sequences with a run of new tokens (prompt or chunk)
    # With `paged_decode`, the decode sequences as rows instead of groups (`decode` is empty).
    decode_rows: DecodeRows | None = None

    @property
    def is_plain_decode(self) -> bool:
        """One decode group holding every query row in order: its output is the whole output."""
        return not self.prefill and len(self.decode) == 1 and self.decode[0].query_rows is None


def bucket_by_padding(
    query_lens: Sequence[int],
    context_lens: Sequence[int],
    *,
    slack: float = DEFAULT_SLACK,
    min_waste: int = DEFAULT_MIN_WASTE,
) -> list[list[int]]:
    """Sequence indices cut into groups, each sorted by context length, longest first.

    A sequence joins the current group when the group's padded cost (members x longest query x
    longest context) stays within `max(min_waste, (slack - 1) * real)` pairs of the real cost
    (the sum of each member's query x context); otherwise it starts the next group.
    """
    order = sorted(range(len(context_lens)), key=lambda i: (-context_lens[i], -query_lens[i]))
    groups: list[list[int]] = []
    members: list[int] = []
    max_query = max_context = real = 0
    for i in order:
        query, context = query_lens[i], context_lens[i]
        if members:
            grown_real = real + query * context
            padded = (len(members) + 1) * max(max_query, query) * max_context
            if padded - grown_real <= max(min_waste, (slack - 1.0) * grown_real):
                members.append(i)
                max_query, real = max(max_query, query), grown_real
                continue
            groups.append(members)
        members, max_query, max_context, real = [i], query, context, query * context
    if members:
        groups.append(members)
    return groups


def plan_attention(
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    block_size: int,
    max_query_len: int,
    max_context_len: int,
    slack: float = DEFAULT_SLACK,
    min_waste: int = DEFAULT_MIN_WASTE,
    decode_min_waste: int = DEFAULT_DECODE_MIN_WASTE,
    paged_decode: bool = False,
) -> AttentionPlan:
    """The groups of one step's batch; see the module doc. `min_waste` bounds the prefill
    groups, `decode_min_waste` the decode ones. With `paged_decode`, the decode sequences are
    not grouped but listed (`AttentionPlan.decode_rows`), for a kernel that reads the cache
    through the block tables."""
    contexts = context_lens.tolist()
    _check_max_context_len(contexts, max_context_len)
    # A pure decode step: query row i is sequence i's new token.
    if max_query_len == 1 and not paged_decode:
        buckets = bucket_by_padding(
            [1] * len(contexts), contexts, slack=slack, min_waste=decode_min_waste
        )
        if len(buckets) == 1:
            group = _group(block_tables, context_lens, block_size, max_context_len, None, 1)
            return AttentionPlan(decode=(group,), prefill=())
    query_lens = (query_start_loc[1:] - query_start_loc[:-1]).tolist()
    decoding = [i for i, q in enumerate(query_lens) if q == 1]
    prefilling = [i for i, q in enumerate(query_lens) if q != 1]

    def groups(seq_ids: list[int], waste: int) -> tuple[AttentionGroup, ...]:
        buckets = bucket_by_padding(
            [query_lens[i] for i in seq_ids],
            [contexts[i] for i in seq_ids],
            slack=slack,
            min_waste=waste,
        )
        return tuple(
            _member_group(
                torch.tensor([seq_ids[j] for j in bucket], device=block_tables.device),
                block_tables,
                context_lens,
                query_start_loc,
                block_size,
            )
            for bucket in buckets
        )

    if not paged_decode:
        return AttentionPlan(groups(decoding, decode_min_waste), groups(prefilling, min_waste))
    rows = None
    if decoding:
        seq_ids = torch.tensor(decoding, dtype=torch.int32, device=block_tables.device)
        query_rows = query_start_loc[:-1].index_select(0, seq_ids).contiguous()
        rows = DecodeRows(seq_ids, query_rows, max(contexts[i] for i in decoding))
    return AttentionPlan(decode=(), prefill=groups(prefilling, min_waste), decode_rows=rows)


def _check_max_context_len(contexts: list[int], max_context_len: int) -> None:
    """A pure decode step is gathered `max_context_len` keys wide: below a real context, that
    context would be cut short silently. The lengths are on the host here, so this costs nothing."""
    longest = max(contexts, default=0)
    if longest > max_context_len:
        raise ValueError(f"max_context_len {max_context_len} is below a context of {longest}")


def _member_group(
    members: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    block_size: int,
) -> AttentionGroup:
    """The group of the sequences `members` (indices into the batch), queries where they lie."""
    contexts = context_lens[members]
    starts = query_start_loc[members].long()
    query_lens = query_start_loc[members + 1] - query_start_loc[members]
    max_query_len = int(query_lens.max())
    return _group(
        block_tables[members],
        contexts,
        block_size,
        int(contexts.max()),
        starts,
        max_query_len,
        None if max_query_len == 1 else query_lens,
    )


def _group(
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
    max_context_len: int,
    starts: torch.Tensor | None,
    max_query_len: int,
    query_lens: torch.Tensor | None = None,
) -> AttentionGroup:
    num_seqs = block_tables.shape[0]
    num_blocks = -(-max_context_len // block_size)
    padded_len = num_blocks * block_size
    device = context_lens.device
    # Only the columns that some sequence uses; whole blocks copy far faster than single slots.
    block_ids = block_tables[:, :num_blocks].reshape(-1)
    # Stale or NaN cache rows past a context must not reach the output through 0 * NaN, so they
    # are zeroed in the copy. They are a few rows per sequence: zeroing them by index is far
    # cheaper than a masked pass over the whole copy (broadcast masked_fill_ is slow on CPU).
    key_positions = torch.arange(padded_len, device=device)
    padding_rows = (key_positions >= context_lens[:, None]).view(-1).nonzero()[:, 0]
    if query_lens is None:  # decode
        mask = (key_positions < context_lens[:, None])[:, None, None, :]
        bias = torch.zeros(mask.shape, device=device).masked_fill_(~mask, float("-inf"))
        return AttentionGroup(
            block_ids, num_seqs, padded_len, padding_rows, mask, bias, starts, None, None, 1
        )
    offsets = torch.arange(max_query_len, device=device)
    real = offsets < query_lens[:, None]
    # Padded query rows repeat the first row: they stay in bounds, see a key, and are dropped.
    rows = torch.where(real, starts[:, None] + offsets, starts[:, None])
    positions = (context_lens - query_lens)[:, None] + offsets
    mask = (key_positions <= positions[:, :, None])[:, None]
    causal = bool((context_lens == query_lens).all())
    return AttentionGroup(
        block_ids,
        num_seqs,
        padded_len,
        padding_rows,
        mask,
        None,
        rows.reshape(-1),
        rows[real],
        real,
        max_query_len,
        causal,
    )
