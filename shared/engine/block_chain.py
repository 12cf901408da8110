"""The hashes that name a prompt's full blocks: each block's hash covers its parent's (the block
before, or the root) and its own token ids, so a hash names the whole prefix up to it.

`block_hash` is the definition and the reference. `chain_blocks` hashes a run of blocks, in C
where it builds here (`block_chain.c`, compiled on first use like the scheduler's indexes, about
a second), else with `block_hash` block by block, with one warning saying why. The scheduler
hashes every prompt it places with prefix caches on (an agent's turn re-sends its whole context:
2,048 blocks for 32,768 tokens), and in Python that was 1 us a block, most of it building
`hashlib`'s and `struct`'s objects around a fast compression. The answers are the same:
`tests/unit/test_block_chain.py` compares the two on random prompts and block sizes.
"""

from __future__ import annotations

import functools
import hashlib
import struct
from collections.abc import Callable, Sequence
from pathlib import Path

from kernels import native_build
from shared.config import cache_dir
from shared.logs import get_logger

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

log = get_logger(component="prefix_cache")

# parent hash, token ids, block size, first block, number of blocks -> the blocks' hashes
ChainFunction = Callable[[int, Sequence[int], int, int, int], list[int]]


def digest(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def block_hash(parent: int, token_ids: Sequence[int]) -> int:
    """The hash of one full block after the block hashed `parent`."""
    return digest(struct.pack(f"<Q{len(token_ids)}q", parent, *token_ids))


def python_chain(
    parent: int, token_ids: Sequence[int], block_size: int, first_block: int, num_blocks: int
) -> list[int]:
    """The hashes of blocks `first_block` to `first_block + num_blocks` of `token_ids`, the
    first chained on `parent`. The chain ends before a block holding a token id outside int64:
    no model has one and the workers refuse it, and the wire carries int32s, but an in-process
    caller (the simulator) may hand one over, and the scheduler and the decode workers hash a
    prompt before any worker has checked it. Such a block is never cached, so no hash is the
    truth: nothing matches it."""
    hashes = []
    begin = first_block * block_size
    for start in range(begin, begin + num_blocks * block_size, block_size):
        block = token_ids[start : start + block_size]
        try:
            parent = block_hash(parent, block)
        except struct.error:
            if _outside_int64(block):
                break
            raise
        hashes.append(parent)
    return hashes


def _outside_int64(token_ids: Sequence[int]) -> bool:
    ints = all(isinstance(token, int) for token in token_ids)
    return ints and not all(INT64_MIN <= token <= INT64_MAX for token in token_ids)


@functools.cache
def native_chain() -> ChainFunction:
    """`python_chain` in C; `NativeUnavailable` if it cannot be built or loaded here."""
    source = Path(__file__).with_name("block_chain.c")
    module = native_build.load_extension(source, "_tandem_block_chain", cache_dir() / "native")
    return module.chain


@functools.cache
def _auto_chain() -> ChainFunction:
    """C where it builds here, else Python (said once)."""
    try:
        return native_chain()
    except native_build.NativeUnavailable as error:
        log.warning("native block chain unavailable, hashing in Python", reason=str(error))
        return python_chain


def chain_blocks(
    parent: int, token_ids: Sequence[int], block_size: int, first_block: int, num_blocks: int
) -> list[int]:
    """`python_chain`'s answer, from C where it builds."""
    return _auto_chain()(parent, token_ids, block_size, first_block, num_blocks)
