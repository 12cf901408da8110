"""Decode steps replayed from CUDA graphs, one per batch-size bucket.

A decode step on a GPU is launch-bound: a few hundred small kernels (per layer: norms, three
matmuls, rotary, the KV write, attention, the MLP), each launched from Python, while the GPU
itself is busy a fraction of the step. A CUDA graph records the launches of one step once and
replays them with one call. A graph replays fixed shapes at fixed addresses, so, as vLLM and
SGLang do:

* batch sizes are rounded up to a **bucket** (1, 2, 4, 8, then every 8 up to `max_num_seqs`),
  one graph each; a step with more sequences, or with any prompt chunk, runs eagerly;
* every bucket owns **static input tensors** (tokens, positions, KV slots, context lengths,
  block tables at the model's full width) that a step copies its batch into before the replay;
* the rows past the real sequences are **padding** that cannot disturb them: token 0 at position
  0, KV slot -1 (the KV write skips negative slots, so padding writes nothing), a context of
  one token in block 0 (read, never written: every row of a matmul, norm or attention is its
  own), and their logits are dropped.

The model's decode path needs nothing host-side per step once the batch is built (the Triton
attention kernel reads each context length on the device and loops to it), which is what makes
it capturable. Capturing is behind `capture`, so the same buffers, padding and bucketing run on
the CPU with `eager_capture` (replay = run the step again on the static buffers): the tests
check there that a padded, bucketed replay gives each sequence the logits and KV of its own
eager step. Only `cuda_capture` itself needs a GPU (`loadtest/gpu_check.sh`).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

import torch

from shared.engine.kv_cache import KVCache
from shared.engine.model import LlamaModel
from shared.engine.step_batch import StepBatch

SMALL_BUCKETS = (1, 2, 4, 8)
BUCKET_STEP = 8  # past the small ones, every this many sequences

# A step's function over the static buffers -> how to run it again (returning its logits).
Capture = Callable[[Callable[[], torch.Tensor]], Callable[[], torch.Tensor]]


def graph_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """The batch sizes a graph is kept for: 1, 2, 4, 8, then every 8, the last `max_num_seqs`
    (so every batch up to it has a bucket)."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes = [b for b in SMALL_BUCKETS if b < max_num_seqs]
    sizes += range(SMALL_BUCKETS[-1] + BUCKET_STEP, max_num_seqs, BUCKET_STEP)
    return (*sizes, max_num_seqs)


def bucket_for(num_seqs: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket holding `num_seqs` sequences; None past the largest."""
    index = bisect.bisect_left(buckets, num_seqs)
    return buckets[index] if index < len(buckets) else None


def padding_batch(bucket: int, max_blocks: int, block_size: int, device: torch.device) -> StepBatch:
    """A decode batch of `bucket` padding rows at the full table width: what the static buffers
    hold before any step (so a capture's runs write no KV) and past a step's real rows."""
    rows = torch.arange(bucket, dtype=torch.int64, device=device)
    return StepBatch(
        token_ids=torch.zeros(bucket, dtype=torch.int64, device=device),
        positions=torch.zeros(bucket, dtype=torch.int64, device=device),
        query_start_loc=torch.arange(bucket + 1, dtype=torch.int32, device=device),
        context_lens=torch.ones(bucket, dtype=torch.int32, device=device),
        block_tables=torch.zeros(bucket, max_blocks, dtype=torch.int32, device=device),
        slot_mapping=torch.full((bucket,), -1, dtype=torch.int64, device=device),
        last_token_indices=rows,
        max_query_len=1,
        max_context_len=max_blocks * block_size,
    )


def fill_static(static: StepBatch, batch: StepBatch) -> None:
    """Copies a decode batch of at most `static.num_seqs` sequences into the static buffers,
    and makes every row past it padding again (a bigger batch may have used them last)."""
    n, width = batch.num_seqs, batch.block_tables.shape[1]
    static.token_ids[:n].copy_(batch.token_ids)
    static.positions[:n].copy_(batch.positions)
    static.context_lens[:n].copy_(batch.context_lens)
    static.slot_mapping[:n].copy_(batch.slot_mapping)
    static.block_tables[:n, :width].copy_(batch.block_tables)
    static.block_tables[:n, width:].zero_()
    static.token_ids[n:].zero_()
    static.positions[n:].zero_()
    static.context_lens[n:].fill_(1)
    static.slot_mapping[n:].fill_(-1)
    static.block_tables[n:].zero_()


def eager_capture(step: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """No graph: a replay runs the step again (on the CPU, and to test everything but capture)."""
    return step


def cuda_capture(step: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """Records the step's launches in a CUDA graph (after warm-up runs on a side stream, which
    compile Triton kernels and size cuBLAS's workspace); a replay relaunches them and returns
    the same output tensor, overwritten."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        output = step()

    def replay() -> torch.Tensor:
        graph.replay()
        return output

    return replay


class DecodeGraphs:
    """Pure decode steps of up to `max(buckets)` sequences, replayed per bucket; each bucket's
    graph is captured the first time a step needs it."""

    def __init__(
        self,
        model: LlamaModel,
        kv_cache: KVCache,
        max_num_seqs: int,
        max_model_len: int,
        capture: Capture = cuda_capture,
    ):
        self.model = model
        self.kv_cache = kv_cache
        self.buckets = graph_buckets(max_num_seqs)
        self.max_blocks = -(-max_model_len // kv_cache.block_size)
        self.capture = capture
        self._static: dict[int, StepBatch] = {}
        self._replays: dict[int, Callable[[], torch.Tensor]] = {}
        self.num_replays = 0

    @property
    def captured_buckets(self) -> set[int]:
        return set(self._replays)

    def takes(self, batch: StepBatch) -> bool:
        """A pure decode step with a bucket, whose tables fit the full width."""
        return (
            batch.max_query_len == 1
            and bucket_for(batch.num_seqs, self.buckets) is not None
            and batch.block_tables.shape[1] <= self.max_blocks
        )

    def run(self, batch: StepBatch) -> torch.Tensor:
        """The step's float32 logits [num_seqs, vocab], as `LlamaModel.step` gives them."""
        if not self.takes(batch):
            raise ValueError(
                f"not a decode step a graph takes: {batch.num_seqs} sequences, "
                f"max_query_len {batch.max_query_len}, {batch.block_tables.shape[1]} blocks wide"
            )
        bucket = bucket_for(batch.num_seqs, self.buckets)
        assert bucket is not None  # takes() said so
        replay = self._replays.get(bucket) or self._capture(bucket)
        fill_static(self._static[bucket], batch)
        self.num_replays += 1
        return replay()[: batch.num_seqs]

    def _capture(self, bucket: int) -> Callable[[], torch.Tensor]:
        static = padding_batch(bucket, self.max_blocks, self.kv_cache.block_size, self.model.device)
        self._static[bucket] = static
        replay = self.capture(lambda: self.model.step(static, self.kv_cache))
        self._replays[bucket] = replay
        return replay
