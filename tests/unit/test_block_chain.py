"""The prefix cache's block chain: the C hashes (`block_chain.c`) are the Python reference's,
whatever the block size, the offset, the parent and the token values (a chain ends before a
token outside int64); bad arguments are refused with a clear error by both; the chain falls
back to Python where the C cannot be built."""

from __future__ import annotations

import array
import random
import struct
import sys

import pytest

from kernels import native_build
from shared.engine import block_chain
from shared.engine.block_chain import block_hash, native_chain, python_chain
from shared.engine.prefix_cache import chain_hashes, prompt_chain
from shared.wire import TokenArray

INT64 = (-(2**63), 2**63 - 1)


@pytest.fixture(scope="module")
def native():
    return native_chain()


def random_tokens(rng: random.Random, count: int, outside: float = 0.0) -> list[int]:
    """Mostly vocabulary ids, some at and near the ends of int64, a share `outside` it."""
    extremes = [*INT64, -1, 0, 2**32, -(2**31)]
    beyond = [2**63, 2**64 - 1, -(2**63) - 1]
    tokens = []
    for _ in range(count):
        draw = rng.random()
        if draw < outside:
            tokens.append(rng.choice(beyond))
        else:
            tokens.append(rng.choice(extremes) if draw < 0.1 else rng.randrange(49_152))
    return tokens


# 15 tokens fill BLAKE2b's 128-byte block exactly with the parent, 31 fill two: the last full
# block is the final one, a case apart from a padded one.
@pytest.mark.parametrize("block_size", [1, 2, 7, 15, 16, 17, 31, 32, 33, 100])
def test_the_c_chain_is_the_python_one(native, block_size):
    rng = random.Random(block_size)
    for trial in range(40):
        outside = 0.002 if trial % 4 == 0 else 0.0  # some chains end early (below)
        tokens = random_tokens(rng, rng.randrange(0, 40 * block_size), outside)
        num_full = len(tokens) // block_size
        first = rng.randrange(0, num_full + 1)
        count = rng.randrange(0, num_full - first + 1)
        parent = rng.choice([0, 2**64 - 1, rng.randrange(2**64)])
        expected = python_chain(parent, tokens, block_size, first, count)
        assert native(parent, tokens, block_size, first, count) == expected
        assert native(parent, tuple(tokens), block_size, first, count) == expected


@pytest.mark.parametrize("block_size", [1, 15, 16, 17])
def test_int32_token_arrays_are_read_in_place_and_hash_as_lists(native, block_size):
    """A prompt as the wire decodes it (`TokenArray`) is hashed from its buffer; other buffers
    (bytes, int64 arrays) are still read as sequences of ints."""
    rng = random.Random(block_size)
    for _ in range(20):
        tokens = [rng.choice([-(2**31), 2**31 - 1, -1, 0, rng.randrange(49_152)])
                  for _ in range(rng.randrange(0, 20 * block_size))]  # fmt: skip
        num_full = len(tokens) // block_size
        first = rng.randrange(0, num_full + 1)
        count = rng.randrange(0, num_full - first + 1)
        expected = python_chain(5, tokens, block_size, first, count)
        assert native(5, TokenArray(tokens), block_size, first, count) == expected
        assert native(5, memoryview(TokenArray(tokens)), block_size, first, count) == expected
        assert native(5, array.array("q", tokens), block_size, first, count) == expected
    data = bytes(range(32))
    assert native(5, data, 16, 0, 2) == python_chain(5, list(data), 16, 0, 2)
    with pytest.raises(ValueError, match="blocks 1 to 3 of 32 tokens in blocks of 16"):
        native(0, TokenArray(range(32)), 16, 1, 2)
    frozen = TokenArray(range(32))
    native(0, frozen, 16, 0, 2)
    frozen.append(1)  # the buffer was let go: the array may grow again


def test_a_chain_is_each_block_hashed_on_the_one_before(native):
    tokens = list(range(48))
    first = block_hash(7, tokens[:16])
    second = block_hash(first, tokens[16:32])
    assert native(7, tokens, 16, 0, 2) == python_chain(7, tokens, 16, 0, 2) == [first, second]
    assert native(first, tokens, 16, 1, 2) == [second, block_hash(second, tokens[32:])]


def test_the_hash_is_the_schemes():
    """`blake2b64-chain-v1`: a change of the hash must come with a new scheme name."""
    assert block_hash(0, [1, 2, 3]) == 0xEB57CDA0323EEEE1
    assert block_hash(2**64 - 1, [-1]) == 0x2787B85CCF3569F5


def test_the_prefix_cache_chains_agree_with_the_reference():
    rng = random.Random(3)
    tokens = random_tokens(rng, 96)
    key = "blake2b64-chain-v1|m|float32|16|tenants:own"
    chain = prompt_chain(key, 16, tokens, "tenant")
    assert len(chain) == 5  # the block holding the last token is left out
    assert chain_hashes(123, tokens, 16) == python_chain(123, tokens, 16, 0, 6)
    assert chain_hashes(0, tokens, 16, parent=chain[1], start=2) == [
        *chain[2:],
        block_hash(chain[-1], tokens[80:]),  # the block of the last token, which a prompt's leaves
    ]
    assert chain_hashes(0, tokens[:15], 16) == [] and chain_hashes(0, tokens, 16, start=9) == []


def test_a_chain_ends_before_a_block_with_a_token_outside_int64(native):
    """The wire takes any int, and the scheduler hashes a SUBMIT's prompt before any worker
    has checked it: such a block is never cached, so the chain stops there, and the workers
    refuse the request (a message cannot crash the scheduler or a decode worker)."""
    tokens = list(range(64))
    for outside in (2**63, 2**64 - 1, -(2**63) - 1):
        spoiled = tokens[:40] + [outside] + tokens[41:]
        expected = python_chain(9, tokens, 16, 0, 2)  # blocks 0 and 1; block 2 holds it
        assert native(9, spoiled, 16, 0, 4) == python_chain(9, spoiled, 16, 0, 4) == expected
        assert native(9, spoiled, 16, 2, 2) == python_chain(9, spoiled, 16, 2, 2) == []
    edges = [*INT64] * 8  # the ends themselves are hashed
    assert native(9, edges, 16, 0, 1) == python_chain(9, edges, 16, 0, 1) != []
    assert prompt_chain("k|tenants:own", 16, [2**63] * 40, "t") == []


def test_bad_arguments_are_refused_by_both(native):
    tokens = list(range(32))
    for chain in (native, python_chain):
        with pytest.raises((OverflowError, struct.error)):
            chain(-1, tokens, 16, 0, 1)
        with pytest.raises((TypeError, struct.error)):
            chain(0, ["1"] * 16, 16, 0, 1)
    with pytest.raises(TypeError, match="token ids must be ints, got float"):
        native(0, [1.0] * 16, 16, 0, 1)
    with pytest.raises(ValueError, match="blocks 1 to 3 of 32 tokens in blocks of 16"):
        native(0, tokens, 16, 1, 2)
    with pytest.raises(ValueError, match="block_size must be positive"):
        native(0, tokens, 0, 0, 1)
    with pytest.raises(ValueError, match="not negative"):
        native(0, tokens, 16, -1, 1)
    # Past the tokens however large (the sum overflowed and the C read past the list).
    with pytest.raises(ValueError, match="blocks .* of 32 tokens"):
        native(0, tokens, 16, sys.maxsize, 1)
    with pytest.raises(TypeError, match="token_ids must be a sequence"):
        native(0, 5, 16, 0, 1)


def test_auto_hashes_in_python_where_the_c_cannot_be_built(monkeypatch):
    def unavailable():
        raise native_build.NativeUnavailable("no C compiler ('cc' not found)")

    monkeypatch.setattr(block_chain, "native_chain", unavailable)
    block_chain._auto_chain.cache_clear()
    try:
        assert block_chain._auto_chain() is python_chain
        assert chain_hashes(5, list(range(32)), 16) == python_chain(5, list(range(32)), 16, 0, 2)
    finally:
        block_chain._auto_chain.cache_clear()
