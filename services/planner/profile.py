"""A worker profile: how long a prefill step, a decode step and a KV transfer take on some hardware.

Measured by `tandem profile` on the machine at hand and saved as JSON, so a plan can be made for
hardware that is not at hand. The simulator reads three curves from it:

* prefill: step time by prompt tokens in the step (piecewise linear between the measured points,
  extended along the last segment beyond them), plus a cost per pair of a token computed and a
  token of context before its chunk (a cached prefix, a long prompt's earlier chunks), which
  its attention reads: 200 tokens after 512 cached took 1.6 times as long as 200 alone, after
  1,024 twice (Zen 4, one thread), both within 4% of one cost per pair;
* decode: step time by batch size and context per sequence (bilinear on the measured grid, the
  same extension outside it);
* KV transfer: a fixed latency plus bytes over a bandwidth, with the KV bytes per token of the
  model.

The file also carries the worker settings it was measured with (block size, token budget, KV
pool) and free-form metadata (the machine, the date, whether it was shared while measured).
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

PROFILE_VERSION = 1


class ProfileError(ValueError):
    """A profile file that cannot be used, with the reason."""


def _interpolate(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise linear through (xs, ys), extended along the end segments; one point: constant.
    An end segment that runs the wrong way (a noisy measurement timed the longest point faster
    than the one before) is not extended: past it, its end's value, where its line would have
    timed a long step near zero."""
    if len(xs) == 1:
        return ys[0]
    if x > xs[-1] and ys[-1] < ys[-2]:
        return ys[-1]
    if x < xs[0] and ys[0] > ys[1]:
        return ys[0]
    i = min(max(bisect.bisect_right(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def _check_axis(name: str, values: Sequence[float]) -> None:
    """Sizes measured at: positive numbers, increasing (a NaN compares false to all, so it
    passed an order check alone and timed every step NaN)."""
    if (
        not isinstance(values, list | tuple)
        or not values
        or not all(_is_number(v) and 0 < v < math.inf for v in values)
        or any(b <= a for a, b in zip(values, values[1:], strict=False))
    ):
        raise ProfileError(
            f"{name} must be a non-empty increasing list of positive numbers, got {values!r}"
        )


def _check_kv_bytes(value: object) -> None:
    """A positive integer (a fraction made the pool's block count a float: the core crashed)."""
    if not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
        raise ProfileError(f"kv_bytes_per_token must be a positive integer, got {value!r}")


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


# The profile's fields of one number each (the lists are checked as axes and times).
SCALAR_FIELDS = ("transfer_latency_s", "transfer_bytes_per_s", "prefill_s_per_context_pair")
MIN_CHUNK_BUDGET = 16  # the least prompt-token budget a step may have (the simulator's too)


@dataclass(frozen=True)
class WorkerSettings:
    """The engine settings a profile was measured with; the simulated workers use them."""

    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    step_time_target_s: float | None = 0.2  # prefill: prompt tokens capped to about this long
    kv_cache_bytes: int = 512 << 20
    # Decode: batch lines beside interactive work only while the step stays within 1 + this of
    # its time without them (the worker's --bulk-step-slack; None: no bound).
    bulk_step_slack: float | None = 0.25

    def __post_init__(self) -> None:
        # Read from a file: each was a division by zero or a refusal deep in a simulation.
        for name, least in (("block_size", 1), ("max_num_seqs", 1), ("kv_cache_bytes", 1),
                            ("max_num_batched_tokens", MIN_CHUNK_BUDGET)):  # fmt: skip
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ProfileError(f"settings.{name} must be an integer >= {least}, got {value!r}")
        target = self.step_time_target_s
        if target is not None and not (isinstance(target, int | float) and 0 < target < math.inf):
            raise ProfileError(f"settings.step_time_target_s must be positive, got {target!r}")
        slack = self.bulk_step_slack
        if slack is not None and not (
            isinstance(slack, int | float) and not isinstance(slack, bool) and 0 <= slack < math.inf
        ):
            raise ProfileError(f"settings.bulk_step_slack must be >= 0 and finite, got {slack!r}")


@dataclass(frozen=True)
class WorkerProfile:
    prefill_tokens: list[int]  # prompt tokens in one step
    prefill_seconds: list[float]  # its step time
    decode_batch_sizes: list[int]
    decode_contexts: list[int]  # tokens of context per sequence
    decode_seconds: list[list[float]]  # [batch size index][context index]
    kv_bytes_per_token: int
    transfer_latency_s: float
    transfer_bytes_per_s: float
    settings: WorkerSettings = field(default_factory=WorkerSettings)
    # Prefill: seconds per (token computed, token of context before its chunk); 0: not measured
    # (profiles older than it), every chunk timed as a prompt of its own.
    prefill_s_per_context_pair: float = 0.0
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check_axis("prefill_tokens", self.prefill_tokens)
        _check_axis("decode_batch_sizes", self.decode_batch_sizes)
        _check_axis("decode_contexts", self.decode_contexts)
        if len(self.prefill_seconds) != len(self.prefill_tokens):
            raise ProfileError("prefill_seconds needs one time per prefill_tokens entry")
        if len(self.decode_seconds) != len(self.decode_batch_sizes) or any(
            len(row) != len(self.decode_contexts) for row in self.decode_seconds
        ):
            raise ProfileError("decode_seconds must be [batch sizes][contexts]")
        times = self.prefill_seconds + [t for row in self.decode_seconds for t in row]
        # (JSON reads `Infinity`: interpolated, inf - inf timed steps NaN, out of heap order.)
        if any(not 0 < t < math.inf for t in times):
            raise ProfileError("every measured step time must be a positive finite number")
        _check_kv_bytes(self.kv_bytes_per_token)
        if not 0 < self.transfer_bytes_per_s < math.inf:
            raise ProfileError("transfer_bytes_per_s must be positive")
        if not 0 <= self.transfer_latency_s < math.inf:  # (NaN compares false)
            raise ProfileError("transfer_latency_s must be a non-negative number")
        if not 0 <= self.prefill_s_per_context_pair < math.inf:
            raise ProfileError("prefill_s_per_context_pair must be a non-negative number")

    def prefill_time(self, num_tokens: int, num_context_pairs: int = 0) -> float:
        """Seconds for a prefill step carrying `num_tokens` prompt tokens, whose chunks have
        `num_context_pairs` (tokens computed x tokens of context before them, summed)."""
        seconds = _interpolate(self.prefill_tokens, self.prefill_seconds, num_tokens)
        return max(seconds + self.prefill_s_per_context_pair * num_context_pairs, 1e-6)

    def decode_time(self, batch_size: float, context: float) -> float:
        """Seconds for a decode step of `batch_size` sequences of `context` tokens each (mean)."""
        sizes, rows, contexts = self.decode_batch_sizes, self.decode_seconds, self.decode_contexts
        if len(sizes) == 1:
            return max(_interpolate(contexts, rows[0], context), 1e-6)
        # Only the two rows around the batch size count: each at the context, then between them.
        i = min(max(bisect.bisect_right(sizes, batch_size), 1), len(sizes) - 1)
        low = _interpolate(contexts, rows[i - 1], context)
        high = _interpolate(contexts, rows[i], context)
        x0, x1 = sizes[i - 1], sizes[i]
        return max(low + (high - low) * (batch_size - x0) / (x1 - x0), 1e-6)

    def transfer_time(self, num_tokens: int) -> float:
        """Seconds to hand the KV of `num_tokens` tokens from a prefill to a decode worker."""
        num_bytes = num_tokens * self.kv_bytes_per_token
        return self.transfer_latency_s + num_bytes / self.transfer_bytes_per_s

    def slowed(self, prefill: float = 1.0, decode: float = 1.0) -> WorkerProfile:
        """The same curves with every prefill and decode step time multiplied by these factors:
        workers timed slower where they run (beside other services) than where profiled."""
        if not (prefill > 0 and decode > 0):
            raise ProfileError("step time factors must be positive")
        return dataclasses.replace(
            self,
            prefill_seconds=[t * prefill for t in self.prefill_seconds],
            prefill_s_per_context_pair=self.prefill_s_per_context_pair * prefill,
            decode_seconds=[[t * decode for t in row] for row in self.decode_seconds],
            metadata={**self.metadata, "slowed": {"prefill": prefill, "decode": decode}},
        )

    def slowed_by_batch(self, factors: Sequence[tuple[float, float]]) -> WorkerProfile:
        """Decode step times multiplied by a factor that depends on the batch size, given as
        (batch size, factor) points (linear between them, constant beyond the first and the
        last): the profile fitted, batch size by batch size, to the steps a run took."""
        points = sorted(factors)
        if not points or any(not (b > 0 and f > 0) for b, f in points):
            raise ProfileError(f"batch factors must be positive (batch, factor) pairs: {points}")
        if len({b for b, _ in points}) != len(points):
            raise ProfileError(f"batch factors name a batch size twice: {points}")
        sizes, values = [b for b, _ in points], [f for _, f in points]

        def factor(batch_size: float) -> float:
            clamped = min(max(batch_size, sizes[0]), sizes[-1])
            return _interpolate(sizes, values, clamped)

        rows = [
            [t * factor(batch_size) for t in row]
            for batch_size, row in zip(self.decode_batch_sizes, self.decode_seconds, strict=True)
        ]
        metadata = {**self.metadata, "slowed_by_batch": [list(p) for p in points]}
        return dataclasses.replace(self, decode_seconds=rows, metadata=metadata)

    @classmethod
    def median_of(cls, profiles: Sequence[WorkerProfile]) -> WorkerProfile:
        """Point by point, the median of profiles measured on one grid with the same settings
        (several measured at once on shared cores: each point of one run may have caught a
        bad moment of the machine's time slicing, rarely the same in all)."""
        if not profiles:
            raise ProfileError("no profile to take the median of")
        first = profiles[0]
        for other in profiles[1:]:
            if (
                other.prefill_tokens != first.prefill_tokens
                or other.decode_batch_sizes != first.decode_batch_sizes
                or other.decode_contexts != first.decode_contexts
                or other.settings != first.settings
                or other.kv_bytes_per_token != first.kv_bytes_per_token
            ):
                raise ProfileError("profiles of different grids, settings or models")
        median = statistics.median
        return cls(
            prefill_tokens=first.prefill_tokens,
            prefill_seconds=[
                median(ts) for ts in zip(*(p.prefill_seconds for p in profiles), strict=True)
            ],
            decode_batch_sizes=first.decode_batch_sizes,
            decode_contexts=first.decode_contexts,
            decode_seconds=[
                [median(ts) for ts in zip(*rows, strict=True)]
                for rows in zip(*(p.decode_seconds for p in profiles), strict=True)
            ],
            kv_bytes_per_token=first.kv_bytes_per_token,
            transfer_latency_s=median([p.transfer_latency_s for p in profiles]),
            transfer_bytes_per_s=median([p.transfer_bytes_per_s for p in profiles]),
            settings=first.settings,
            prefill_s_per_context_pair=median([p.prefill_s_per_context_pair for p in profiles]),
            metadata={**first.metadata, "median_of": len(profiles)},
        )

    @property
    def num_kv_blocks(self) -> int:
        """Blocks in a decode worker's pool, from the pool's bytes."""
        block_bytes = self.kv_bytes_per_token * self.settings.block_size
        return max(1, self.settings.kv_cache_bytes // block_bytes)

    def to_dict(self) -> dict[str, Any]:
        return {"version": PROFILE_VERSION, **asdict(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> WorkerProfile:
        data = dict(data)
        version = data.pop("version", None)
        if version != PROFILE_VERSION:
            raise ProfileError(f"profile version {version!r}, expected {PROFILE_VERSION}")
        # Before the fields' types are checked: compiled (`services/compiled.py`), the class
        # refuses a float there with a TypeError that names no field.
        _check_kv_bytes(data.get("kv_bytes_per_token"))
        for name in SCALAR_FIELDS:  # (compared to numbers below: "fast" named no field)
            if name in data and not _is_number(data[name]):
                raise ProfileError(f"{name} must be a number, got {data[name]!r}")
        try:
            settings = WorkerSettings(**data.pop("settings", {}))
            return cls(settings=settings, **data)
        except TypeError as error:
            raise ProfileError(f"profile fields: {error}") from None

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> WorkerProfile:
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        # (Not text: a UnicodeDecodeError; nested past the parser's depth: a RecursionError.)
        except (OSError, ValueError, RecursionError) as error:
            raise ProfileError(f"cannot read profile {path}: {error}") from None
        if not isinstance(data, dict):
            raise ProfileError(f"profile {path} is not a JSON object")
        return cls.from_dict(data)


@dataclass(frozen=True)
class SharedCores:
    """Workers that share one machine's cores (a local cluster): a step's time comes from the
    profile measured with as many workers busy at once as are busy when the step starts, this
    one included. `profiles[k - 1]`: measured with k busy (1: alone); past the last, the last.
    On hardware of their own (a GPU each) workers need none of this."""

    profiles: tuple[WorkerProfile, ...]

    def __post_init__(self) -> None:
        if not self.profiles:
            raise ProfileError("shared cores need at least the profile measured alone")
        first = self.profiles[0]
        for other in self.profiles[1:]:
            # (The workers run with the first's settings: another's times are other work.)
            if (other.settings, other.kv_bytes_per_token) != (
                first.settings,
                first.kv_bytes_per_token,
            ):
                raise ProfileError(
                    "shared-cores profiles must be of one model and the same worker settings"
                )

    def profile_for(self, num_busy: int) -> WorkerProfile:
        return self.profiles[min(max(num_busy, 1), len(self.profiles)) - 1]
