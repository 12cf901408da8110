"""The two in-process baselines the served pipeline is measured against, on the same workload.

(a) Static batching, as transformers' `generate` does it: requests are taken in arrival order in
batches of `batch_size`, left-padded to the batch's longest prompt, and every batch runs until its
longest `max_tokens` (`min_new_tokens = max_new_tokens`, EOS ignored, greedy). Only each request's
own `max_tokens` count as output; the rest is the padding waste that continuous batching avoids.
A batch starts once its last request has arrived and the previous batch is done. A streamer times
every decoding step, so a request's first token is the batch's first step; it finishes when its
batch returns, since `generate` hands nothing back before then.

(b) Our engine in-process: `LLMEngine` with continuous batching, every request added when it
arrives (greedy, `ignore_eos`, its own `max_tokens`), stepped until all finish. No processes, no
sockets, no serialization: the served cluster's overhead is measured against this loop.

Both record the same `RequestRecord`s as the bench client (times since the run started; a request
is "sent" when it arrives), so all three are summarized by the same code.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch

from loadtest.metrics import Clock, RequestRecord, Result, summarize
from loadtest.workload import WorkloadRequest
from shared.engine.engine import EngineConfig, LLMEngine, RequestOutput
from shared.engine.model import LlamaModel
from shared.engine.sampling_params import SamplingParams


def prompt_ids(request: WorkloadRequest, tokenizer: Any) -> list[int]:
    if request.prompt_token_ids is not None:
        return request.prompt_token_ids
    return tokenizer.encode(request.prompt, add_special_tokens=False)


def wait_until(clock: Clock, moment: float) -> None:
    delay = moment - clock()
    if delay > 0:
        time.sleep(delay)


# --- (a) static batching -----------------------------------------------------------------------


class StepTimes:
    """A `generate` streamer that notes when each decoding step's tokens come out.

    `generate` first puts the prompt ids, then one tensor of new tokens per step."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if self._prompt_seen:
            self.times.append(self.clock())
        self._prompt_seen = True

    def end(self) -> None:
        pass


def left_pad(batch: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(ids) for ids in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, ids in enumerate(batch):
        input_ids[row, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
        attention_mask[row, width - len(ids) :] = 1
    return input_ids, attention_mask


def generate_batch(
    hf_model: Any, batch: list[list[int]], num_new: int, pad_id: int, streamer: StepTimes
) -> None:
    input_ids, attention_mask = left_pad(batch, pad_id)
    output = hf_model.generate(
        input_ids=input_ids.to(hf_model.device),
        attention_mask=attention_mask.to(hf_model.device),
        max_new_tokens=num_new,
        min_new_tokens=num_new,  # ignore_eos: EOS is suppressed until the longest is done
        do_sample=False,
        pad_token_id=pad_id,
        streamer=streamer,
    )
    generated = output.shape[1] - input_ids.shape[1]
    if generated != num_new:
        raise RuntimeError(f"generate made {generated} tokens per row, not {num_new}")


def run_static(
    hf_model: Any,
    tokenizer: Any,
    requests: Sequence[WorkloadRequest],
    batch_size: int = 16,
    honor_arrivals: bool = True,
) -> Result:
    pad_id = tokenizer.pad_token_id
    if pad_id is None:  # left padding is masked out, so any id serves; EOS is the custom
        pad_id = tokenizer.eos_token_id
    records = [RequestRecord(i, r.max_tokens, None) for i, r in enumerate(requests)]
    with torch.inference_mode():
        # Warm-up, padded, so that first-call costs (also of the masked path) stay off the clock.
        generate_batch(hf_model, [[pad_id] * 4, [pad_id] * 2], 2, pad_id, StepTimes(Clock()))
        clock = Clock()
        for start in range(0, len(requests), batch_size):
            batch = list(range(start, min(start + batch_size, len(requests))))
            if honor_arrivals:
                wait_until(clock, max(requests[i].arrival_time for i in batch))
            ids = [prompt_ids(requests[i], tokenizer) for i in batch]
            streamer = StepTimes(clock)
            longest = max(requests[i].max_tokens for i in batch)
            generate_batch(hf_model, ids, longest, pad_id, streamer)
            done = clock()
            for i, prompt in zip(batch, ids, strict=True):
                record, own = records[i], requests[i].max_tokens
                record.num_prompt_tokens = len(prompt)
                record.send_time = requests[i].arrival_time if honor_arrivals else 0.0
                record.chunk_times = streamer.times[:own]
                record.first_token_time = streamer.times[0]
                record.finish_time = done
                record.completion_tokens = own
    extra = {"batch_size": batch_size, "honor_arrivals": honor_arrivals}
    return Result("static", summarize(records), records, extra)


# --- (b) the bare engine -----------------------------------------------------------------------


def run_engine(
    model: LlamaModel,
    tokenizer: Any,
    requests: Sequence[WorkloadRequest],
    config: EngineConfig | None = None,
    honor_arrivals: bool = True,
) -> Result:
    engine = LLMEngine(model, config or EngineConfig())
    records = [RequestRecord(i, r.max_tokens, None) for i, r in enumerate(requests)]
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival_time)
    waiting = deque(order if honor_arrivals else range(len(requests)))
    with torch.inference_mode():
        engine.generate([[0] * 4], SamplingParams(max_tokens=2, temperature=0.0))  # warm-up
        clock = Clock()
        while waiting or engine.has_unfinished:
            _admit(engine, requests, records, waiting, clock, honor_arrivals, tokenizer)
            if not engine.has_unfinished:
                wait_until(clock, requests[waiting[0]].arrival_time)
                continue
            _record_step(engine.step(), records, clock())
    for record, request in zip(records, requests, strict=True):
        if record.completion_tokens != request.max_tokens:
            record.error = f"generated {record.completion_tokens} tokens, not {request.max_tokens}"
    extra = {
        "engine_config": vars(engine.config),
        "honor_arrivals": honor_arrivals,
        "preemptions": dict(engine.scheduler.num_preemptions_by_mode),
    }
    return Result("engine", summarize(records), records, extra)


def _admit(
    engine: LLMEngine,
    requests: Sequence[WorkloadRequest],
    records: list[RequestRecord],
    waiting: deque[int],
    clock: Clock,
    honor_arrivals: bool,
    tokenizer: Any,
) -> None:
    """Adds every request that has arrived by now (all of them, when arrivals are ignored)."""
    now = clock()
    while waiting and (not honor_arrivals or requests[waiting[0]].arrival_time <= now):
        i = waiting.popleft()
        request, record = requests[i], records[i]
        ids = prompt_ids(request, tokenizer)
        params = SamplingParams(
            max_tokens=request.max_tokens, temperature=0.0, ignore_eos=request.ignore_eos
        )
        engine.add_request(ids, params, request_id=str(i))
        record.num_prompt_tokens = len(ids)
        record.send_time = request.arrival_time if honor_arrivals else now


def _record_step(outputs: list[RequestOutput], records: list[RequestRecord], now: float) -> None:
    for out in outputs:
        record = records[int(out.request_id)]
        record.chunk_times.append(now)
        if record.first_token_time is None:
            record.first_token_time = now
        record.completion_tokens = (record.completion_tokens or 0) + len(out.new_token_ids)
        if out.finished:
            record.finish_time = now
