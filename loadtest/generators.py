"""Built-in workloads for `tandem bench`: short chat, long prompts, bulk batch, and a mix.

Each class draws long-tailed prompt and output lengths in its own ranges (see `workload`), and
prompts are exact-length windows of the corpus, so any server sees the same tokens. The mix
interleaves the classes in fixed proportions, in an order drawn from the seed. Arrival times are
set afterwards (`with_arrivals`), so a rate sweep sends the same requests at each rate.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from loadtest.workload import WorkloadRequest, arrival_times, build_workload, stream


@dataclass(frozen=True)
class RequestClass:
    prompt_range: tuple[int, int]
    output_range: tuple[int, int]
    stream: bool  # bulk jobs take one response, people watch a stream


CLASSES = {
    "chat": RequestClass(prompt_range=(16, 512), output_range=(8, 256), stream=True),
    "long": RequestClass(prompt_range=(1024, 3072), output_range=(8, 128), stream=True),
    "bulk": RequestClass(prompt_range=(32, 256), output_range=(32, 128), stream=False),
}
MIX = {"chat": 0.6, "long": 0.2, "bulk": 0.2}
GENERATORS = (*CLASSES, "mix")


def generate(tokenizer: Any, name: str, num: int, seed: int = 0) -> list[WorkloadRequest]:
    """`num` requests of class `name` (or the mix), all arriving at 0."""
    if num < 1:
        raise ValueError(f"the number of requests must be >= 1, got {num}")
    if name == "mix":
        return _mix(tokenizer, num, seed)
    if name not in CLASSES:
        raise ValueError(f"unknown workload {name!r}; built-in: {', '.join(GENERATORS)}")
    shape = CLASSES[name]
    requests = build_workload(
        tokenizer,
        num,
        seed=seed,
        prompt_range=shape.prompt_range,
        output_range=shape.output_range,
    )
    return [dataclasses.replace(r, label=name, stream=shape.stream) for r in requests]


def _mix(tokenizer: Any, num: int, seed: int) -> list[WorkloadRequest]:
    rng = stream(seed, "mix-order")
    names = rng.choices(list(MIX), weights=list(MIX.values()), k=num)
    pools = {
        name: iter(generate(tokenizer, name, names.count(name), seed))
        for name in MIX
        if name in names
    }
    return [next(pools[name]) for name in names]


def with_arrivals(
    requests: Sequence[WorkloadRequest], rate: float | None, seed: int = 0
) -> list[WorkloadRequest]:
    """The same requests, all at once (`rate` None) or as a Poisson process at `rate` per s."""
    times = arrival_times(stream(seed, f"arrivals-{rate}"), len(requests), rate)
    return [dataclasses.replace(r, arrival_time=t) for r, t in zip(requests, times, strict=True)]
