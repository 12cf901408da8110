"""Preemption by swap: a host-RAM pool for preempted sequences' KV, and the choice between swap
and recompute by estimated cost.

When a running sequence needs a block and none is free, the step scheduler preempts the newest
running sequence. Its KV can either be copied to host RAM and back later (cost: the bytes moved
twice, at the measured copy rate) or dropped and recomputed from its tokens (cost: the tokens run
again as a prompt, at the measured prefill rate). Short contexts are cheap to recompute, long
ones cheap to move; the choice is made per sequence from rates measured on this machine, and
swap is only chosen while the host pool has room.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from shared.engine.pace import INITIAL_PREFILL_TOKENS_PER_S, prefill_rate, smoothed_rate

PREEMPTION_MODES = ("auto", "swap", "recompute")
# A starting guess, replaced by measurements as soon as there are any: a memcpy-bound copy (the
# prefill rate's is `pace.INITIAL_PREFILL_TOKENS_PER_S`).
INITIAL_COPY_BYTES_PER_S = 2e9


@dataclass
class SwapSpace:
    """Preempted sequences' keys and values in host memory, bounded in bytes.

    The prefix cache's host tier (`host_tier.py`) lends the room swapped sequences leave:
    `reclaim(bytes)` tells it how much it may keep after a reservation, so a swap-out always
    finds the room `fits` promised."""

    capacity_bytes: int
    used_bytes: int = 0
    reserved_bytes: int = 0  # promised to swap-outs chosen this step, not yet copied
    _entries: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    reclaim: Callable[[int], None] | None = field(default=None, repr=False)

    @property
    def room_bytes(self) -> int:
        """Bytes neither swapped nor promised to a swap-out."""
        return self.capacity_bytes - self.used_bytes - self.reserved_bytes

    def fits(self, num_bytes: int) -> bool:
        return num_bytes <= self.room_bytes

    def reserve(self, num_bytes: int) -> None:
        if not self.fits(num_bytes):
            raise ValueError(f"swap space has no room for {num_bytes} bytes")
        self.reserved_bytes += num_bytes
        if self.reclaim is not None:
            self.reclaim(self.room_bytes)

    def put(self, request_id: str, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Stores a copy that `reserve` made room for."""
        num_bytes = _nbytes(keys, values)
        if request_id in self._entries or num_bytes > self.reserved_bytes:
            raise ValueError(f"swap space holds no reservation for {request_id!r}")
        device = torch.device("cpu")
        self._entries[request_id] = (keys.to(device), values.to(device))
        self.reserved_bytes -= num_bytes
        self.used_bytes += num_bytes

    def take(self, request_id: str) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self._entries.pop(request_id)
        self.used_bytes -= _nbytes(keys, values)
        return keys, values

    def discard(self, request_id: str) -> None:
        if request_id in self._entries:
            self.take(request_id)

    def __len__(self) -> int:
        return len(self._entries)


@dataclass
class PreemptionCosts:
    """Measured rates, and the choice they imply for one sequence."""

    mode: str = "auto"  # auto: by cost; swap: whenever the pool has room; recompute: always
    copy_bytes_per_s: float = INITIAL_COPY_BYTES_PER_S
    prefill_tokens_per_s: float = INITIAL_PREFILL_TOKENS_PER_S

    def __post_init__(self) -> None:
        if self.mode not in PREEMPTION_MODES:
            raise ValueError(
                f"preemption_mode must be one of {', '.join(PREEMPTION_MODES)}, got {self.mode!r}"
            )

    def choose(self, num_bytes: int, num_tokens: int, space: SwapSpace) -> str:
        if self.mode == "recompute" or not space.fits(num_bytes):
            return "recompute"
        if self.mode == "swap":
            return "swap"
        swap_s = 2 * num_bytes / self.copy_bytes_per_s  # out now, in later
        recompute_s = num_tokens / self.prefill_tokens_per_s
        return "swap" if swap_s < recompute_s else "recompute"

    def record_copy(self, num_bytes: int, seconds: float) -> None:
        if num_bytes > 0 and seconds > 0:
            self.copy_bytes_per_s = smoothed_rate(self.copy_bytes_per_s, num_bytes / seconds)

    def record_prefill(self, num_tokens: int, seconds: float) -> None:
        self.prefill_tokens_per_s = prefill_rate(self.prefill_tokens_per_s, num_tokens, seconds)


class Stopwatch:
    """The wall time of a block. Given a CUDA device, the device work the block queued counts
    too: it synchronizes before reading the clock (the calls return before their kernels run,
    and a rate from their return times was orders of magnitude too high)."""

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device

    def __enter__(self) -> Stopwatch:
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.seconds = time.perf_counter() - self.start


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)
