"""Bucketing a batch by padding: a partition within its bound, and the same attention either way."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.attention_plan import bucket_by_padding, plan_attention
from kernels.attention_reference import paged_attention_reference
from tests.kernels.test_paged_attention import BATCHES, make_batch, naive_attention


def plan_for(batch, block_size: int, **bounds):
    """The plan of a test batch; `bounds` override the planner's grouping bounds."""
    return plan_attention(
        batch.block_tables,
        batch.context_lens,
        batch.query_start_loc,
        block_size=block_size,
        max_query_len=batch.max_query_len,
        max_context_len=batch.max_context_len,
        **bounds,
    )


lengths = st.lists(
    st.integers(1, 2000).flatmap(lambda ctx: st.tuples(st.integers(1, ctx), st.just(ctx))),
    min_size=1,
    max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(seqs=lengths, slack=st.sampled_from([1.0, 1.25, 2.0]), min_waste=st.sampled_from([0, 4096]))
def test_buckets_partition_the_batch_within_the_padding_bound(seqs, slack, min_waste):
    query_lens = [q for q, _ in seqs]
    context_lens = [c for _, c in seqs]
    groups = bucket_by_padding(query_lens, context_lens, slack=slack, min_waste=min_waste)
    assert sorted(i for g in groups for i in g) == list(range(len(seqs)))
    for group in groups:
        contexts = [context_lens[i] for i in group]
        assert contexts == sorted(contexts, reverse=True)
        real = sum(query_lens[i] * context_lens[i] for i in group)
        padded = len(group) * max(query_lens[i] for i in group) * contexts[0]
        assert padded - real <= max(min_waste, (slack - 1.0) * real)


def test_equal_sequences_stay_in_one_group_and_an_outlier_gets_its_own():
    assert bucket_by_padding([1] * 8, [300] * 8) == [list(range(8))]
    groups = bucket_by_padding([1] * 31 + [1], [50] * 31 + [1000], min_waste=0)
    assert groups == [[31], list(range(31))]
    chunk_and_prompts = bucket_by_padding([512, 20, 20, 20], [1024, 20, 20, 20], min_waste=0)
    assert chunk_and_prompts == [[0], [1, 2, 3]]


def test_small_waste_is_not_worth_a_group():
    assert len(bucket_by_padding([1, 1], [40, 10])) == 1  # 30 wasted pairs
    assert len(bucket_by_padding([1, 1], [40, 10], min_waste=0)) == 2


@pytest.mark.parametrize("kind", sorted(BATCHES))
@pytest.mark.parametrize("block_size", [1, 16])
def test_one_group_per_sequence_gives_the_same_attention(kind, block_size):
    batch = make_batch(
        BATCHES[kind], num_heads=6, num_kv_heads=2, head_dim=16, block_size=block_size
    )
    plan = plan_for(batch, block_size, slack=1.0, min_waste=0, decode_min_waste=0)
    assert len(plan.decode) + len(plan.prefill) > 1
    out = paged_attention_reference(*batch.args(), **batch.kwargs(), plan=plan)
    assert (out - naive_attention(batch)).abs().max() < 1e-5


def test_a_long_tailed_decode_batch_splits_and_matches():
    seqs = [(5, 1)] * 6 + [(300, 1), (290, 1)]
    batch = make_batch(seqs, num_heads=4, num_kv_heads=2, head_dim=8, block_size=16)
    plan = plan_for(batch, 16, decode_min_waste=0)
    assert [g.num_seqs for g in plan.decode] == [2, 6] and not plan.prefill
    out = paged_attention_reference(*batch.args(), **batch.kwargs(), plan=plan)
    assert (out - naive_attention(batch)).abs().max() < 1e-5
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("block_size", [1, 16])
def test_fresh_prompts_attend_with_the_causal_flag_and_match(block_size):
    # Unequal lengths: padded query rows and keys past the shorter prompts must stay unseen.
    batch = make_batch(
        [(23, 23), (5, 5), (40, 40)],
        num_heads=6,
        num_kv_heads=2,
        head_dim=16,
        block_size=block_size,
    )
    plan = plan_for(batch, block_size, slack=100.0, min_waste=10**9)
    assert [group.causal for group in plan.prefill] == [True]
    out = paged_attention_reference(*batch.args(), **batch.kwargs(), plan=plan)
    assert (out - naive_attention(batch)).abs().max() < 1e-5


def test_a_prompt_after_cached_context_keeps_the_mask():
    # (30, 12): 18 cached tokens, so query i sees keys 0..18+i, which the causal flag would cut.
    batch = make_batch([(30, 12), (7, 7)], num_heads=6, num_kv_heads=2, head_dim=16, block_size=16)
    plan = plan_for(batch, 16, slack=100.0, min_waste=10**9)
    assert [group.causal for group in plan.prefill] == [False]
    out = paged_attention_reference(*batch.args(), **batch.kwargs(), plan=plan)
    assert (out - naive_attention(batch)).abs().max() < 1e-5


def test_decode_groups_waste_less_than_prefill_groups():
    # Ten 40-token contexts beside a 200-token one: 1,600 padded keys in one group, within the
    # prefill bound of 4,096 pairs but past decode's 256. One short context rides with the long
    # one (160 padded keys), the rest form their own group.
    seqs = [(200, 1)] + [(40, 1)] * 10
    batch = make_batch(seqs, num_heads=4, num_kv_heads=2, head_dim=8, block_size=16)
    assert [g.num_seqs for g in plan_for(batch, 16).decode] == [2, 9]
    assert bucket_by_padding([1] * 11, [200] + [40] * 10) == [list(range(11))]
    assert [g.num_seqs for g in plan_for(batch, 16, decode_min_waste=4096).decode] == [11]
