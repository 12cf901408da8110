"""The in-process engine: continuous batching over the paged model, one step at a time.

`step()` reads as three calls: the scheduler picks this step's chunks, the model runs them in one
forward, and post-processing samples a token for every sequence whose prompt (or recompute) is now
complete, checks the stop conditions and retires finished sequences. This loop is the colocated
baseline and the bare engine the served cluster is measured against.

A request that makes the forward or the sampler raise ends alone with the error; the rest of
its batch goes on (`_forward`, `_sample`). Only a model that fails a forward of its own too
raises out of the step: then the worker is at fault, not a request.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Iterator
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, field
from typing import Any

import torch

from kernels.paged_attention import triton_decodes
from shared.engine import prompt_logprobs
from shared.engine.block_manager import BlockManager
from shared.engine.decode_cost import DecodeCost
from shared.engine.decode_graphs import DecodeGraphs
from shared.engine.grammar import GrammarBinding
from shared.engine.host_tier import HostTier
from shared.engine.kv_cache import KVCache, bytes_per_block, num_blocks_for_budget
from shared.engine.model import LlamaModel
from shared.engine.prefix_blocks import cache_computed_blocks, take_cached_prefix
from shared.engine.prefix_cache import CacheKey, PrefixCache, chain_hashes, root_hash
from shared.engine.retention import Clock
from shared.engine.sampling import Sampler, SamplerOutput, SamplingRow
from shared.engine.sampling_params import SamplingParams, token_seed
from shared.engine.scheduler import MIN_CHUNK, ScheduledChunk, StepPlan, StepScheduler
from shared.engine.sequence import Sequence, SequenceStatus, TokenLogprobs
from shared.engine.step_batch import SequenceChunk, build_step_batch
from shared.engine.swap import PreemptionCosts, Stopwatch, SwapSpace
from shared.errors import InvalidRequestError
from shared.logs import get_logger

log = get_logger(component="engine")
COMPILE_POLL_S = 0.02  # how long a step with nothing to run waits on a pending grammar compile
DEAD_END = (
    "the output constraint allows no next token: its grammar leads nowhere from here, or asks"
    " for text this model's vocabulary cannot spell"
)


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = 16
    kv_cache_bytes: int = 1 << 30  # sizes the block pool unless num_blocks is given
    num_blocks: int | None = None
    max_num_seqs: int = 64  # sequences in one step
    max_num_batched_tokens: int = 512  # tokens in one step (the chunked-prefill budget)
    max_model_len: int | None = None  # defaults to the context the model serves (context_len)
    # Prefill role: a finished sequence keeps its blocks until `release()`, so its KV can be
    # exported to a decode worker first.
    retain_finished: bool = False
    swap_bytes: int = 0  # host memory for preempted sequences' KV (0: recompute only)
    preemption_mode: str = "auto"  # auto (by measured cost), swap or recompute
    # Decode role: a sequence preempted for recompute leaves the engine (`take_evicted`) to be
    # prefilled again elsewhere, instead of recomputing its prompt on this decode worker.
    hand_back_recomputed: bool = False
    # Prefill role: how long a step with prompt chunks may take. The prompt tokens per step are
    # capped from the measured prefill rate (never below MIN_CHUNK), so a prompt that arrives
    # mid-step waits about this long at most, and steps that finish prompts are kept light.
    # Time to first token under a long-prompt flood against prefill throughput; None: the token
    # budget alone (the most throughput).
    step_time_target_s: float | None = None
    # Bulk decode rows (batch jobs' lines) beside interactive work: they join a step only while
    # its predicted time (`decode_cost.py`, from the measured decode steps) stays within
    # 1 + this of the step without them. A chat's tokens against a job's throughput; None: no
    # bound (every bulk row in every step).
    bulk_step_slack: float | None = None
    # Prefix cache: full blocks named by a chained hash are kept after their sequences finish
    # and shared by later sequences that start with the same tokens (only the uncached suffix
    # is computed). `prefix_cache_max_blocks` bounds the unreferenced blocks kept (None: the
    # whole pool). `cache_model_id` names the weights in the cache key (workers pass the model
    # path), beside the dtype and block size the engine adds.
    enable_prefix_caching: bool = True
    prefix_cache_max_blocks: int | None = None
    cache_model_id: str = ""
    # The cache's host tier: evicted cached blocks' KV kept in the swap space's host memory, up
    # to this many bytes of it (0: off; swap_bytes bounds it, and swapped sequences come first).
    host_cache_bytes: int = 0
    # Think time: a finished sequence's cached blocks are evicted after all others for this
    # long (its conversation's next turn likely follows a tool call); 0: plain LRU.
    finished_retention_s: float = 0.0
    # Structured outputs: compiled grammars kept (bytes, LRU) and a compile's time limit.
    grammar_cache_bytes: int = 256 << 20
    grammar_compile_timeout_s: float = 30.0
    # CUDA only: pure decode steps of up to max_num_seqs sequences replayed from CUDA graphs,
    # one per batch-size bucket (`decode_graphs.py`); prompt chunks stay eager.
    cuda_graphs: bool = False

    def __post_init__(self) -> None:
        for name in ("block_size", "kv_cache_bytes", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("num_blocks", "max_model_len"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.prefix_cache_max_blocks is not None and self.prefix_cache_max_blocks < 0:
            raise ValueError(
                f"prefix_cache_max_blocks must be >= 0, got {self.prefix_cache_max_blocks}"
            )
        if self.swap_bytes < 0:
            raise ValueError(f"swap_bytes must be >= 0, got {self.swap_bytes}")
        if self.host_cache_bytes < 0:
            raise ValueError(f"host_cache_bytes must be >= 0, got {self.host_cache_bytes}")
        if not self.finished_retention_s >= 0:
            raise ValueError(f"finished_retention_s must be >= 0, got {self.finished_retention_s}")
        if self.step_time_target_s is not None and not self.step_time_target_s > 0:
            raise ValueError(f"step_time_target_s must be > 0, got {self.step_time_target_s}")
        if self.bulk_step_slack is not None and not 0 <= self.bulk_step_slack < math.inf:
            raise ValueError(
                f"bulk_step_slack must be >= 0 and finite (None: no bound), "
                f"got {self.bulk_step_slack}"
            )
        PreemptionCosts(self.preemption_mode)  # validates the mode
        if self.grammar_cache_bytes < 1 or not self.grammar_compile_timeout_s > 0:
            raise ValueError("grammar_cache_bytes and grammar_compile_timeout_s must be > 0")


@dataclass
class RequestOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] = field(default_factory=list)
    # On a prompt's first token, when asked: its tokens' logprobs (`Sequence.prompt_logprobs`).
    prompt_logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None  # "stop", "length" or "abort" once finished
    error: str | None = None  # why an "abort" the engine chose (a grammar, or the sampler, failed)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class GenerationResult:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[TokenLogprobs]
    finish_reason: str
    num_cached_tokens: int = 0  # prompt tokens the prefix cache spared computing
    prompt_logprobs: list[TokenLogprobs] | None = None  # when asked: the prompt's, but the 1st
    error: str | None = None  # why it ended "abort"


class LLMEngine:
    def __init__(
        self,
        model: LlamaModel,
        config: EngineConfig | None = None,
        tokenizer: object = None,
        clock: Clock = time.monotonic,
    ):
        """`tokenizer` (a transformers tokenizer) enables structured outputs; `clock` times the
        cache's retention deadlines."""
        self.model = model
        self.config = config or EngineConfig()
        self.clock = clock
        mc = model.config
        self.max_model_len = min(
            self.config.max_model_len or mc.context_len,
            model.max_positions,
            mc.attention_window or model.max_positions,  # past it, the model's answers differ
        )
        num_blocks = self.config.num_blocks or num_blocks_for_budget(
            mc, self.config.block_size, model.dtype, self.config.kv_cache_bytes
        )
        self.kv_cache = KVCache(mc, num_blocks, self.config.block_size, model.dtype, model.device)
        self.decode_graphs = self._decode_graphs()
        self.cache_key = CacheKey(
            self.config.cache_model_id or f"{mc.model_type}:{mc.num_layers}x{mc.hidden_size}",
            str(model.dtype).removeprefix("torch."),
            self.config.block_size,
        )
        self.prefix_cache = (
            PrefixCache(self.config.prefix_cache_max_blocks, clock)
            if self.config.enable_prefix_caching
            else None
        )
        self.last_step_num_seqs = 0  # sequences in the latest step (its batch size)
        self.last_step_context_tokens = 0  # the tokens those sequences attended, summed
        # The latest step ran nothing and only waited on grammar compiles (`_await_compiles`):
        # no sample of the step time.
        self.last_step_idle = False
        self.num_computed_prompt_tokens = 0  # prompt tokens run through the model, ever
        self.swap_space = SwapSpace(self.config.swap_bytes)
        self.preemption = PreemptionCosts(self.config.preemption_mode)
        self._bytes_per_block = bytes_per_block(mc, self.config.block_size, model.dtype)
        host_cache_bytes = min(self.config.host_cache_bytes, self.config.swap_bytes)
        self.host_tier = (
            HostTier(
                host_cache_bytes,
                self._bytes_per_block,
                self.kv_cache,
                self.swap_space,
                clock,
            )
            if self.prefix_cache is not None and host_cache_bytes > 0
            else None
        )
        self.block_manager = BlockManager(
            num_blocks, self.config.block_size, self.prefix_cache, self.host_tier
        )
        self.decode_cost = DecodeCost()  # the decode-only steps' time by their rows
        bounded = self.config.bulk_step_slack is not None
        self.scheduler = StepScheduler(
            self.block_manager,
            self.config.max_num_seqs,
            self.config.max_num_batched_tokens,
            choose_preemption=self._choose_preemption,
            hand_back_recomputed=self.config.hand_back_recomputed,
            max_bulk_decode_rows=self._max_bulk_decode_rows if bounded else None,
        )
        self.sampler = Sampler()
        self.num_sampler_failures = 0  # rows the sampler raised on (`_sample`): bugs, each logged
        self.num_model_failures = 0  # sequences the model raised on alone (`_forward`)
        self.eos_token_ids = frozenset(mc.eos_token_ids)
        self.grammar = GrammarBinding(
            tokenizer,
            mc.vocab_size,
            self.eos_token_ids,
            self.config.grammar_cache_bytes,
            self.config.grammar_compile_timeout_s,
        )
        self._sequences: dict[str, Sequence] = {}
        self._retained: dict[str, Sequence] = {}
        self._ids = itertools.count()

    # -- requests -----------------------------------------------------------------------------

    def add_request(
        self,
        prompt_token_ids: SequenceOf[int],
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        num_generated: int = 0,
        bulk: bool = False,
    ) -> str:
        """Queues a prompt. `cache_salt` (a tenant, or a request's own salt) keeps its cached
        blocks apart from those of other salts: only equal salts share a prefix.
        `num_generated`: the prompt's last tokens were generated before (a request resumed from
        its client's tokens); a constrained request's grammar replays them. `bulk`: a batch
        job's line, queued after interactive prompts and preempted before them."""
        self._validate_prompt(prompt_token_ids, params)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self._sequences:
            raise InvalidRequestError("request_id", f"{request_id!r} is already running")
        seq = Sequence(request_id, list(prompt_token_ids), params, priority=priority, bulk=bulk)
        if params.prompt_logprobs is None:
            seq.cache_root = self._cache_root(cache_salt)
        else:  # computed whole: a cached prefix would have no logits (and it is not cached)
            seq.prompt_logprobs = []
        replayed = (
            prompt_token_ids[len(prompt_token_ids) - num_generated :] if num_generated else ()
        )
        self.grammar.attach(seq, replayed)
        seq.num_replayed = num_generated
        self._sequences[request_id] = seq
        self.scheduler.add(seq)
        return request_id

    def add_prefilled(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        output_token_ids: list[int],
        params: SamplingParams,
        block_ids: list[int],
        generator_state: torch.Tensor | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        bulk: bool = False,
    ) -> None:
        """Admits a sequence whose prompt KV is already in `block_ids` (written by the caller).

        The blocks were reserved from this engine's block manager and now belong to the sequence.
        Its last output token has not run yet; it joins the running batch at the next step.
        """
        if request_id in self._sequences:
            raise InvalidRequestError("request_id", f"{request_id!r} is already running")
        if not output_token_ids:
            raise ValueError("a prefilled sequence carries at least its first sampled token")
        self._validate_token_ids([*prompt_token_ids, *output_token_ids], params, "token_ids")
        # (A worker with a smaller pool than the one the cluster admitted the request for.)
        self._validate_fits_the_pool(len(prompt_token_ids), params)
        seq = Sequence(request_id, list(prompt_token_ids), params, priority=priority, bulk=bulk)
        seq.output_token_ids = list(output_token_ids)
        seq.num_computed_tokens = seq.num_tokens - 1
        if len(block_ids) * self.block_manager.block_size < seq.num_computed_tokens:
            raise ValueError("the reserved blocks cannot hold the transferred KV")
        seq.block_ids = block_ids
        seq.cache_root = self._cache_root(cache_salt)
        if generator_state is not None and seq.generator is not None:
            seq.generator.set_state(generator_state)
        self.grammar.attach(seq)  # its matcher replays output_token_ids
        self._sequences[request_id] = seq
        self.scheduler.add_running(seq)

    def abort(self, request_id: str) -> bool:
        """Cancels a request; its blocks return to the pool. False if it is not in the engine."""
        self.release(request_id)
        seq = self._sequences.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
        self.swap_space.discard(request_id)
        return True

    def take_evicted(self) -> list[Sequence]:
        """Sequences preempted for recompute and handed back (`hand_back_recomputed`) since
        the last call; they are no longer in the engine."""
        evicted, self.scheduler.evicted = self.scheduler.evicted, []
        for seq in evicted:
            self._sequences.pop(seq.request_id, None)
        return evicted

    def sequence(self, request_id: str) -> Sequence | None:
        """A request still in the engine (waiting, running or swapped)."""
        return self._sequences.get(request_id)

    def retained(self, request_id: str) -> Sequence:
        """A finished sequence still holding its blocks (`retain_finished`)."""
        return self._retained[request_id]

    def export_kv(self, request_id: str, first_block: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Host-memory copies of a retained sequence's computed tokens' keys and values from
        block `first_block` on, [layers, blocks, ...]: the wire sends tensors from CPU memory."""
        seq = self._retained[request_id]
        num_blocks = self.block_manager.num_blocks_for(seq.num_computed_tokens)
        keys, values = self.kv_cache.read_blocks(seq.block_ids[first_block:num_blocks])
        return keys.cpu(), values.cpu()

    def pin_cached_prefix(self, token_ids: SequenceOf[int], cache_salt: str | None) -> list[int]:
        """Takes (one more holder of) the cached blocks that `token_ids`' full blocks start with,
        for KV about to arrive for them; the caller frees them like any block."""
        root = self._cache_root(cache_salt)
        if root is None:
            return []
        hashes = chain_hashes(root, token_ids, self.block_manager.block_size)
        return take_cached_prefix(self.block_manager, hashes)

    def release(self, request_id: str) -> bool:
        """Frees a retained sequence's blocks."""
        seq = self._retained.pop(request_id, None)
        if seq is None:
            return False
        self.block_manager.free(seq.block_ids)
        seq.block_ids = []
        return True

    def _cache_root(self, cache_salt: str | None) -> int | None:
        if self.prefix_cache is None:
            return None
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise InvalidRequestError("cache_salt", "must be a string")
        return root_hash(self.cache_key, cache_salt)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work

    def _validate_token_ids(
        self, token_ids: SequenceOf[int], params: SamplingParams, param: str = "prompt"
    ) -> None:
        """Every id the model reads (the tokens) or the sampler indexes logits by (the stop
        ids, suppressed until `min_tokens`; the biased ids) is in the vocabulary: one past it
        raised in the middle of a step, which ends the worker and every sequence in its batch."""
        vocab = self.model.config.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in token_ids):
            raise InvalidRequestError(param, f"token ids must be integers in [0, {vocab})")
        if any(not 0 <= t < vocab for t in params.stop_token_ids):
            raise InvalidRequestError("stop_token_ids", f"ids must be in [0, {vocab})")
        if any(not 0 <= t < vocab for t in params.logit_bias_ids):
            raise InvalidRequestError("logit_bias", f"token ids must be in [0, {vocab})")

    def _validate_prompt(self, prompt_token_ids: SequenceOf[int], params: SamplingParams) -> None:
        num_prompt = len(prompt_token_ids)
        if num_prompt == 0:
            raise InvalidRequestError("prompt", "the prompt is empty")
        self._validate_token_ids(prompt_token_ids, params)
        if num_prompt >= self.max_model_len:
            raise InvalidRequestError(
                "prompt",
                f"the prompt has {num_prompt} tokens; the model's context is "
                f"{self.max_model_len} tokens, which leaves no room to generate",
            )
        if num_prompt + params.max_tokens > self.max_model_len:
            raise InvalidRequestError(
                "max_tokens",
                f"the prompt ({num_prompt} tokens) plus max_tokens ({params.max_tokens}) exceeds "
                f"the model's context of {self.max_model_len} tokens",
            )
        self._validate_fits_the_pool(num_prompt, params)

    def _validate_fits_the_pool(self, num_prompt: int, params: SamplingParams) -> None:
        """A sequence that could outgrow the whole pool would preempt itself at its last block
        and never fit again: swapped out, it held every arrival back for good."""
        capacity = self.block_manager.num_blocks * self.block_manager.block_size
        if num_prompt + params.max_tokens > capacity:
            raise InvalidRequestError(
                "max_tokens",
                f"the prompt plus max_tokens ({num_prompt + params.max_tokens} tokens) can never "
                f"fit the KV cache of {capacity} tokens",
            )

    # -- the step -----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        self.scheduler.prompt_token_cap = self.prompt_token_cap()
        plan = self.scheduler.schedule()
        self.last_step_num_seqs = len(plan.chunks)
        self.last_step_context_tokens = sum(
            c.sequence.num_computed_tokens + c.num_tokens for c in plan.chunks
        )
        self._swap(plan)
        self.last_step_idle = False
        if not plan.chunks:
            self._await_compiles()
            return []
        # Grammar masks of the rows this step samples whose matchers are built fill on their
        # own thread while the forward runs (a matcher changes only when a token is accepted,
        # after sampling; whatever happens, no fill is left running past the step).
        self.sampler.fill_masks_ahead(
            self._built_matchers(plan.chunks), self.model.config.vocab_size
        )
        try:
            started = time.perf_counter()
            with Stopwatch(self.model.device) as watch:
                ran, logits, failed = self._forward(plan.chunks)
            if not failed:  # (a step run again chunk by chunk is no sample of the rate)
                self._record_prefill_rate(ran, watch.seconds)
            outputs = [self._model_failed(c.sequence, e) for c, e in failed] + self._postprocess(
                ran, logits
            )
            # (The sampling counts: a row's token waits for it too. Unbounded, nothing reads it.)
            if not failed and self.scheduler.max_bulk_decode_rows is not None:
                self._record_decode_step(ran, time.perf_counter() - started)
            return outputs
        finally:
            self.sampler.settle_masks()

    def _await_compiles(self) -> None:
        """A step with nothing to run while a sequence's grammar compiles (its sampling chunk
        held back) waits a little for the compile instead of returning at once: the worker's
        loop steps a busy engine without pause, and spun for as long as the compile took. The
        wait is short, so the loop still reads its messages (a new request, a cancel)."""
        scheduler = self.scheduler
        candidates = itertools.chain(scheduler.running, scheduler.waiting)
        self.last_step_idle = self.grammar.wait_for_compiles(candidates, COMPILE_POLL_S)

    def _record_prefill_rate(self, chunks: list[ScheduledChunk], seconds: float) -> None:
        # Prompt chunks are longer than one token; a step with enough of them samples the rate
        # (its decode tokens ride along and are counted in the time, not the tokens).
        num_prompt_tokens = sum(c.num_tokens for c in chunks if c.num_tokens > 1)
        self.preemption.record_prefill(num_prompt_tokens, seconds)

    def _record_decode_step(self, chunks: list[ScheduledChunk], seconds: float) -> None:
        if all(c.num_tokens == 1 for c in chunks):
            self.decode_cost.record(len(chunks), seconds)

    def _max_bulk_decode_rows(self, num_rows: int, num_prompt_tokens: int) -> int | None:
        """The bulk decode rows that may join a step of `num_rows` other decode rows and
        `num_prompt_tokens` prompt tokens (timed at the measured prefill rate), within the
        slack of its time without them."""
        prompt_s = num_prompt_tokens / self.preemption.prefill_tokens_per_s
        slack = self.config.bulk_step_slack
        return self.decode_cost.max_extra_rows(num_rows, slack, prompt_s)

    def _built_matchers(self, chunks: list[ScheduledChunk]) -> list[Any]:
        """The grammar matchers, already built, of the sequences this step will sample (those
        whose last token runs in it)."""
        return [
            c.sequence.grammar.matcher
            for c in chunks
            if c.sequence.grammar is not None
            and c.sequence.grammar.matcher is not None
            and c.sequence.num_computed_tokens + c.num_tokens == c.sequence.num_tokens
        ]

    def prompt_token_cap(self) -> int | None:
        """Prompt tokens that fit the step time target at the measured prefill rate."""
        target = self.config.step_time_target_s
        if target is None:
            return None
        return max(MIN_CHUNK, int(target * self.preemption.prefill_tokens_per_s))

    def _choose_preemption(self, seq: Sequence, num_blocks: int) -> str:
        num_bytes = num_blocks * self._bytes_per_block
        mode = self.preemption.choose(num_bytes, seq.num_computed_tokens, self.swap_space)
        if mode == "swap":
            self.swap_space.reserve(num_bytes)
        return mode

    def _swap(self, plan: StepPlan) -> None:
        """Copies swapped-in KV back to its new blocks, then swapped-out KV to host memory."""
        device = self.model.device
        for seq, block_ids in plan.swap_in:
            keys, values = self.swap_space.take(seq.request_id)
            with Stopwatch(device) as watch:
                self.kv_cache.write_blocks(block_ids, keys, values)
            self.preemption.record_copy(len(block_ids) * self._bytes_per_block, watch.seconds)
        for seq, block_ids in plan.swap_out:
            with Stopwatch(device) as watch:  # the read and its copy to host memory
                keys, values = self.kv_cache.read_blocks(block_ids)
                self.swap_space.put(seq.request_id, keys, values)
            self.preemption.record_copy(len(block_ids) * self._bytes_per_block, watch.seconds)

    def _decode_graphs(self) -> DecodeGraphs | None:
        if not self.config.cuda_graphs:
            return None
        head_dim = self.model.config.head_dim
        if not triton_decodes(True, 1, head_dim):  # the graphs record the Triton kernel's steps
            raise ValueError(
                f"cuda_graphs records the Triton decode kernel, which takes head sizes that are "
                f"powers of two; this model's is {head_dim} (leave cuda_graphs off)"
            )
        if self.model.device.type != "cuda":
            device = self.model.device
            raise ValueError(f"cuda_graphs needs a CUDA device, the model is on {device}")
        return DecodeGraphs(self.model, self.kv_cache, self.config.max_num_seqs, self.max_model_len)

    def _forward(
        self, chunks: list[ScheduledChunk]
    ) -> tuple[list[ScheduledChunk], torch.Tensor, list[tuple[ScheduledChunk, Exception]]]:
        """The chunks that ran, their logits (a row each) and the chunks the model raised on.
        Should the batch's forward raise (a bug some request's shape hits; on a GPU, memory
        the batch ran out of), each chunk runs alone, writing its KV slots again (a chunk's
        forward writes only its own new tokens' slots, which no other sequence reads before
        they are computed), and only the chunks that raise again fail. If none runs (one
        alone included), the requests are to blame only if the model runs a forward of its
        own (`_model_works`); if not, the fault is the worker's: the error propagates, the
        worker ends, and the scheduler resumes its requests elsewhere."""
        try:
            return chunks, self._run(chunks), []
        except Exception as error:
            if len(chunks) == 1:
                failed = [(chunks[0], error)]
                ran, rows = [], []
            else:
                log.error("the model failed on a batch; running its chunks one by one",
                          num_chunks=len(chunks), exc_info=error)  # fmt: skip
                ran, rows, failed = self._forward_one_by_one(chunks)
        if not ran and not self._model_works():
            raise failed[0][1]
        logits = torch.cat(rows) if rows else torch.empty(0, device=self.model.device)
        return ran, logits, failed

    def _forward_one_by_one(
        self, chunks: list[ScheduledChunk]
    ) -> tuple[list[ScheduledChunk], list[torch.Tensor], list[tuple[ScheduledChunk, Exception]]]:
        ran, rows, failed = [], [], []
        for chunk in chunks:
            try:  # (a copy: a CUDA graph's logits are its static buffer, the next run's too)
                rows.append(self._run([chunk]).clone())
            except Exception as error:
                failed.append((chunk, error))
            else:
                ran.append(chunk)
        return ran, rows, failed

    def _model_works(self) -> bool:
        """Whether the model runs a forward of its own: one token into a free block of the
        pool, given back after. With no block free it cannot tell, and says no."""
        if not self.block_manager.can_allocate(1):
            return False
        block_ids = self.block_manager.allocate(1)
        try:
            self._run_batch([SequenceChunk(token_ids=[0], start_position=0, block_ids=block_ids)])
        except Exception as error:
            log.error("the model failed a forward of its own too", exc_info=error)
            return False
        finally:
            self.block_manager.free(block_ids)
        return True

    def _model_failed(self, seq: Sequence, error: Exception) -> RequestOutput:
        """A sequence whose chunk the model raised on alone ends with the error."""
        log.error("the model failed on a request", request_id=seq.request_id, exc_info=error)
        self.num_model_failures += 1
        self._finish(seq, SequenceStatus.FINISHED_ABORTED)
        why = f"the model failed on this request ({type(error).__name__})"
        return RequestOutput(seq.request_id, [], finish_reason="abort", error=why)

    def _run(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        sequence_chunks = [
            SequenceChunk(
                token_ids=c.sequence.token_ids_slice(
                    c.sequence.num_computed_tokens,
                    c.sequence.num_computed_tokens + c.num_tokens,
                ),
                start_position=c.sequence.num_computed_tokens,
                block_ids=c.sequence.block_ids,
            )
            for c in chunks
        ]
        scored = self._prompt_rows(chunks)
        if not scored:
            return self._run_batch(sequence_chunks)
        # Some prompt asks for its logprobs: every token's hidden state, not the last alone.
        batch = build_step_batch(sequence_chunks, self.config.block_size, self.model.device)
        hidden = self.model.forward(batch, self.kv_cache)
        for rows in scored:
            prompt_logprobs.score(rows, hidden, self.model.logits)
        return self.model.logits(hidden.index_select(0, batch.last_token_indices))

    @staticmethod
    def _prompt_rows(chunks: list[ScheduledChunk]) -> list[prompt_logprobs.ScoredRows]:
        scored, row = [], 0
        for c in chunks:
            start = c.sequence.num_computed_tokens
            rows = prompt_logprobs.rows_to_score(c.sequence, row, start, c.num_tokens)
            if rows is not None:
                scored.append(rows)
            row += c.num_tokens
        return scored

    def _run_batch(self, chunks: list[SequenceChunk]) -> torch.Tensor:
        batch = build_step_batch(chunks, self.config.block_size, self.model.device)
        if self.decode_graphs is not None and self.decode_graphs.takes(batch):
            return self.decode_graphs.run(batch)
        return self.model.step(batch, self.kv_cache)

    def _postprocess(
        self, chunks: list[ScheduledChunk], logits: torch.Tensor
    ) -> list[RequestOutput]:
        sampled_rows, rows, outputs = [], [], []
        for index, chunk in enumerate(chunks):
            seq = chunk.sequence
            start = seq.num_computed_tokens
            self.num_computed_prompt_tokens += max(
                0, min(seq.num_prompt_tokens - start, chunk.num_tokens)
            )
            seq.num_computed_tokens += chunk.num_tokens
            cache_computed_blocks(seq, self.block_manager)
            if seq.num_computed_tokens == seq.num_tokens:  # its last token ran: sample the next
                # (Its grammar is ready: the scheduler runs this chunk only once the compile
                # ended or its deadline passed, so the step never waits on it here.)
                error = self.grammar.prepare(seq)
                if error is not None:  # its grammar failed to compile: it ends here
                    self._finish(seq, SequenceStatus.FINISHED_ABORTED)
                    outputs.append(
                        RequestOutput(seq.request_id, [], finish_reason="abort", error=error)
                    )
                    continue
                sampled_rows.append(index)
                rows.append(self._sampling_row(seq))
        if not rows:
            return outputs
        sampled, failed = self._sample(logits[sampled_rows], rows)
        for i, index in enumerate(sampled_rows):
            seq = chunks[index].sequence
            if i in failed:  # the sampler raised on this row alone: it ends, the batch goes on
                error = failed[i]
                log.error("the sampler failed on a request", request_id=seq.request_id,
                          exc_info=error)  # fmt: skip
                self.num_sampler_failures += 1
                self._finish(seq, SequenceStatus.FINISHED_ABORTED)
                why = f"the sampler failed on this request ({type(error).__name__})"
                outputs.append(RequestOutput(seq.request_id, [], finish_reason="abort", error=why))
                continue
            token = sampled.token_ids[i]
            if seq.grammar is not None and not seq.grammar.accept(token):
                # A dead end: the output so far can never be completed (a grammar whose rules
                # lead nowhere, or text this vocabulary cannot spell). It ends now, with the
                # reason, instead of drawing token 0 until max_tokens.
                self._finish(seq, SequenceStatus.FINISHED_ABORTED)
                out = RequestOutput(seq.request_id, [], finish_reason="abort", error=DEAD_END)
                outputs.append(out)
                continue
            seq.output_token_ids.append(token)
            out = RequestOutput(seq.request_id, [token])
            if seq.prompt_logprobs is not None and len(seq.output_token_ids) == 1:
                out.prompt_logprobs = seq.prompt_logprobs
            if sampled.logprobs[i] is not None:
                lp = TokenLogprobs(sampled.logprobs[i], sampled.top_logprobs[i])
                seq.output_logprobs.append(lp)
                out.new_logprobs.append(lp)
            status = self._stop_status(seq, token)
            if status is not None:
                self._finish(seq, status)
                out.finish_reason = status.finish_reason
            outputs.append(out)
        return outputs

    def _sample(
        self, logits: torch.Tensor, rows: list[SamplingRow]
    ) -> tuple[SamplerOutput, dict[int, Exception]]:
        """The sampler over the step's rows, and what it raised on each row it failed on. Should the
        batch raise (a bug some row's parameters hit: a stop id past the vocabulary once made
        every worker that took one request exit, batch and all), each row is sampled alone,
        and only the rows that raise again fail. (A seeded row may have drawn in the failed
        pass: this step's token may differ from an undisturbed run's, the later ones not, their
        draws being keyed by their place, `_sampling_row`.)"""
        try:
            return self.sampler(logits, rows), {}
        except Exception as error:
            log.error("the sampler failed on a batch; sampling row by row", exc_info=error)
        token_ids: list[int] = []
        logprobs: list[float | None] = []
        top_logprobs: list[list[tuple[int, float]] | None] = []
        failed: dict[int, Exception] = {}
        for i, row in enumerate(rows):
            try:
                one = self.sampler(logits[i : i + 1], [row])
            except Exception as error:
                failed[i] = error
                one = SamplerOutput([0], [None], [None])
            token_ids += one.token_ids
            logprobs += one.logprobs
            top_logprobs += one.top_logprobs
        return SamplerOutput(token_ids, logprobs, top_logprobs), failed

    def _finish(self, seq: Sequence, status: SequenceStatus) -> None:
        del self._sequences[seq.request_id]
        if self.config.retain_finished:
            block_ids = list(seq.block_ids)
            self.block_manager.share(block_ids)  # keep them past the scheduler's free
            self.scheduler.finish(seq, status)
            seq.block_ids = block_ids
            self._retained[seq.request_id] = seq
        else:
            self.scheduler.finish(seq, status, self._retain_until(status))

    def _retain_until(self, status: SequenceStatus) -> float | None:
        """A turn that ended normally keeps its blocks ahead of others for its think time."""
        retention = self.config.finished_retention_s
        if retention <= 0 or status == SequenceStatus.FINISHED_ABORTED:
            return None
        return self.clock() + retention

    def _sampling_row(self, seq: Sequence) -> SamplingRow:
        params = seq.params
        suppressed: tuple[int, ...] = ()
        # vLLM's meaning: below min_tokens neither EOS nor a stop token can be drawn, whether or
        # not ignore_eos is set (ignore_eos only keeps a drawn EOS from ending the sequence).
        if seq.num_output_tokens < params.min_tokens:
            suppressed = tuple(params.stop_token_ids) + tuple(self.eos_token_ids)
        prompt_ids, output_ids = seq.prompt_token_ids, seq.output_token_ids
        if seq.num_replayed and params.has_penalties:  # (output-only penalties count them)
            split = len(prompt_ids) - seq.num_replayed
            prompt_ids, output_ids = prompt_ids[:split], prompt_ids[split:] + output_ids
        if params.seed is not None and seq.generator is not None:
            # A seeded token's draw is keyed by its place in the output (the tokens replayed
            # from before count): the same whether the request ran undisturbed, was handed
            # over with its generator, or was resumed from its tokens with a new one.
            index = seq.num_replayed + seq.num_output_tokens
            seq.generator.manual_seed(token_seed(params.seed, index))
        return SamplingRow(
            params=params,
            generator=seq.generator,
            prompt_token_ids=prompt_ids,
            output_token_ids=output_ids,
            suppressed_token_ids=suppressed,
            grammar_matcher=seq.grammar.matcher if seq.grammar is not None else None,
        )

    def _stop_status(self, seq: Sequence, token: int) -> SequenceStatus | None:
        params = seq.params
        if seq.grammar is not None and seq.grammar.is_terminated:
            # The structure is complete (its matcher took EOS): nothing can extend it validly,
            # so it ends here even under ignore_eos or min_tokens (the sampler lets EOS through).
            return SequenceStatus.FINISHED_STOPPED
        if seq.num_output_tokens >= params.min_tokens and (
            token in params.stop_token_ids
            or (not params.ignore_eos and token in self.eos_token_ids)
        ):
            return SequenceStatus.FINISHED_STOPPED
        if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            if seq.grammar is not None and seq.grammar.only_end_allowed():
                # Cut where the structure was complete anyway: the answer is whole, and says so
                # (clients such as the OpenAI SDK's `parse` refuse a "length" answer).
                return SequenceStatus.FINISHED_STOPPED
            return SequenceStatus.FINISHED_LENGTH
        return None

    # -- convenience ----------------------------------------------------------------------------

    def run_until_done(self) -> Iterator[RequestOutput]:
        while self.has_unfinished:
            yield from self.step()

    def generate(
        self,
        prompts: SequenceOf[SequenceOf[int]],
        params: SamplingParams | SequenceOf[SamplingParams],
    ) -> list[GenerationResult]:
        """Runs prompts to completion with continuous batching; results in prompt order."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
        sequences = {rid: self._sequences[rid] for rid in ids}
        finish, errors = {}, {}
        for out in self.run_until_done():
            if out.finished:
                finish[out.request_id] = out.finish_reason
                errors[out.request_id] = out.error
        return [
            GenerationResult(
                rid,
                sequences[rid].prompt_token_ids,
                sequences[rid].output_token_ids,
                sequences[rid].output_logprobs,
                finish[rid],
                sequences[rid].num_cached_tokens,
                sequences[rid].prompt_logprobs,
                errors[rid],
            )
            for rid in ids
        ]
