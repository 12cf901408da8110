"""Where the bare engine's time goes: a few steps of a workload under torch.profiler.

The engine's phases are timed from outside, without touching its code: this engine's own
scheduler, sampler and (through a proxy) model are wrapped in timers that also mark
`torch.profiler.record_function` ranges. The report gives each phase's share of the step time
(what is left is batch building and post-processing in Python) and the top operators by self CPU
time. The first steps of a burst are mostly prompt chunks; `skip_steps` moves the window on to
decode-heavy steps.
"""

from __future__ import annotations

import functools
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import torch

from loadtest.baselines import prompt_ids
from loadtest.workload import WorkloadRequest
from shared.engine.engine import EngineConfig, LLMEngine
from shared.engine.model import LlamaModel
from shared.engine.sampling_params import SamplingParams


class PhaseTimer:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                with torch.profiler.record_function(f"engine.{name}"):
                    return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - start

        return timed


class TimedModel:
    """The model with a timed `step`; everything else passes through. The shared model object
    itself is left alone."""

    def __init__(self, model: LlamaModel, timer: PhaseTimer) -> None:
        self._model = model
        self.step = timer.wrap("forward", model.step)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


def instrumented_engine(model: LlamaModel, config: EngineConfig, timer: PhaseTimer) -> LLMEngine:
    engine = LLMEngine(model, config)
    engine.model = TimedModel(model, timer)  # type: ignore[assignment]
    engine.scheduler.schedule = timer.wrap("schedule", engine.scheduler.schedule)
    engine.sampler = timer.wrap("sample", engine.sampler)  # type: ignore[assignment]
    return engine


def profile_engine(
    model: LlamaModel,
    tokenizer: Any,
    requests: Sequence[WorkloadRequest],
    config: EngineConfig | None = None,
    num_steps: int = 20,
    skip_steps: int = 0,
    top: int = 15,
) -> str:
    """Runs `skip_steps` steps, then profiles `num_steps`; returns the report as text."""
    timer = PhaseTimer()
    engine = instrumented_engine(model, config or EngineConfig(), timer)
    for i, request in enumerate(requests):
        params = SamplingParams(max_tokens=request.max_tokens, temperature=0.0, ignore_eos=True)
        engine.add_request(prompt_ids(request, tokenizer), params, request_id=str(i))
    with torch.inference_mode():
        for _ in range(skip_steps):
            engine.step()
        timer.seconds.clear()
        activities = [torch.profiler.ProfilerActivity.CPU]
        if model.device.type == "cuda":  # kernel times too: is the GPU busy or waiting on Python?
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as prof:
            start, steps = time.perf_counter(), 0
            while steps < num_steps and engine.has_unfinished:
                engine.step()
                steps += 1
            wall = time.perf_counter() - start
    return format_report(timer.seconds, wall, steps, prof, top)


def format_report(phases: dict[str, float], wall: float, steps: int, prof: Any, top: int) -> str:
    lines = [f"{steps} engine steps in {wall:.2f} s ({wall / max(steps, 1) * 1e3:.0f} ms/step)"]
    accounted = sum(phases.values())
    for name, seconds in sorted(phases.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {name:<10} {seconds:7.3f} s  {seconds / wall:6.1%}")
    other = wall - accounted
    lines.append(
        f"  {'other':<10} {other:7.3f} s  {other / wall:6.1%}  (batch building, "
        "post-processing, profiler)"
    )
    averages = prof.key_averages()
    table = averages.table(sort_by="self_cpu_time_total", row_limit=top)
    report = "\n".join(lines) + "\n\ntop operators by self CPU time:\n" + table
    # Kernels are the events on the device itself (as the table's own total counts them).
    kernels = [
        e
        for e in averages
        if e.device_type == torch.autograd.DeviceType.CUDA and not e.is_user_annotation
    ]
    if kernels:
        launches = sum(e.count for e in kernels)
        busy = sum(e.self_device_time_total for e in kernels) / 1e6
        report += (
            f"\nGPU busy {busy:.3f} s of {wall:.3f} s wall ({busy / wall:.1%}), "
            f"{launches / max(steps, 1):.0f} kernels per step\n"
            + averages.table(sort_by="self_device_time_total", row_limit=top)
        )
    return report
