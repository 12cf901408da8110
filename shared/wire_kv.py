"""The KV handoff: a prefill worker's DEALER to the decode worker's ROUTER (KV_TRANSFER, KV_ACK)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from shared.wire_base import (
    MAX_REQUEST_ID_LEN,
    FrameLike,
    GeneratorState,
    KvBlocks,
    Message,
    MessageType,
    RequestId,
    SamplingSpec,
    TokenDelta,
    TokenIds,
)
from shared.wire_codec import _as_view, _unpack_header


# Tensors make `==` ambiguous, so KvTransfer compares by identity (eq=False).
@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class KvTransfer(Message):
    """Prefill worker -> decode worker (DEALER to its ROUTER): a prefilled request and its KV."""

    TYPE: ClassVar[MessageType] = MessageType.KV_TRANSFER
    request_id: RequestId
    prompt_token_ids: TokenIds
    output_token_ids: TokenIds  # at least the first sampled token (already streamed)
    sampling: SamplingSpec
    gateway_address: str  # where the decode worker streams the following tokens
    num_tokens: int  # tokens whose K/V the sequence has; the last block may be partly filled
    block_size: int  # tokens per block in `keys`/`values`; must equal the decode worker's
    # The first block carried: the receiver holds blocks [0, first_block) from its own cache
    # (pinned at reservation), so keys/values hold blocks first_block.. only.
    first_block: int = 0
    keys: KvBlocks  # [num_layers, num_blocks, block_size, num_kv_heads, head_dim]
    values: KvBlocks  # same shape and dtype as keys
    # uint8, torch.Generator.get_state() after the first token, so a seeded request draws on
    # where it left off; None for greedy requests.
    generator_state: GeneratorState | None = None
    priority: int = 0  # the request's priority, as in PrefillJob
    bulk: bool = False  # as in PrefillJob: a batch job's line, preempted before interactive ones
    cache_salt: str | None = None  # as in PrefillJob: names the blocks in the decode cache
    # The delta the prefill worker streamed (the first token, its logprobs): the decode worker
    # streams it again ahead of its own first token, so a gateway the first one never reached
    # (its connection cut, or it is late) misses nothing. None: nothing to repeat.
    first_delta: TokenDelta | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class KvAck(Message):
    """Decode worker -> prefill worker, answer to KV_TRANSFER; the prefill side frees its copy."""

    TYPE: ClassVar[MessageType] = MessageType.KV_ACK
    request_id: RequestId
    ok: bool  # admitted: the decode worker owns the request now
    error: str | None  # why not (lease lapsed, shape mismatch, ...)


def undecodable_transfer_id(frames: Sequence[FrameLike]) -> str | None:
    """The request a KV_TRANSFER names that failed to decode (a tensor frame cut short, a frame
    too many, a field out of bounds), read from its header alone; None if the frames are no
    KV_TRANSFER or name no request. The decode worker refuses it by that id at once: dropped
    unanswered, its request waited out the prefill worker's transfer timeout before it was
    re-routed, and its reservation stayed held meanwhile."""
    try:
        if len(frames) < 2 or _as_view(frames[0]).tobytes() != bytes((MessageType.KV_TRANSFER,)):
            return None
        fields = _unpack_header(_as_view(frames[1]))
    except (TypeError, ValueError):  # (a WireError is one: frames of any shape, a peer's)
        return None
    request_id = fields.get("request_id") if type(fields) is dict else None
    if type(request_id) is not str or not 0 < len(request_id) <= MAX_REQUEST_ID_LEN:
        return None
    return request_id
