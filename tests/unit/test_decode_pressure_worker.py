"""The decode worker's blocks under odd reservations: whatever a RESERVE asks, the pool comes
back whole once its lease is over. The worker is driven through its own entry (`_handle`, its
timers) on the tiny model, no scheduler on the other end of its link."""

from __future__ import annotations

import math
import time

import pytest
import zmq

from services.decode.service import DecodeWorker
from services.worker.config import WorkerConfig
from shared import wire
from shared.engine.sampling_params import SamplingParams
from tests.integration.conftest import tiny_model_dir  # noqa: F401 (a fixture)

BLOCK_SIZE = 4


@pytest.fixture
def worker(tmp_path, tiny_model_dir):  # noqa: F811
    context = zmq.Context()
    config = WorkerConfig(
        scheduler_address=f"ipc://{tmp_path}/scheduler",
        address=f"ipc://{tmp_path}/decode",
        peer_id="d",
        model=str(tiny_model_dir),
        dtype="float32",
        kv_cache_bytes=1 << 16,
        block_size=BLOCK_SIZE,
    )
    decode = DecodeWorker(config, context)
    yield decode
    decode.close()
    context.destroy(linger=0)


def lapse_every_lease(worker: DecodeWorker) -> None:
    worker._on_timers(time.monotonic() + 1e9)


@pytest.mark.parametrize("lease_s", [math.nan, math.inf, 0.0, -1.0])
def test_a_lease_that_would_never_lapse_is_refused(worker, lease_s):
    """A NaN lease compared false with every deadline check: its blocks were held for good."""
    worker._handle(wire.Reserve(request_id="r", num_tokens=10, lease_s=lease_s), None)
    lapse_every_lease(worker)
    assert "r" not in worker.reservations
    assert worker.blocks.num_free_blocks == worker.blocks.num_blocks


def test_cached_blocks_past_the_reserved_tokens_are_not_pinned(worker):
    """A RESERVE whose token_ids ran past its num_tokens pinned every cached block of them,
    more than the reservation holds: allocating the rest raised, and the pinned ones leaked."""
    prompt = list(range(10, 27))  # four full blocks, cached by this turn
    worker.engine.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0))
    assert worker.blocks.num_free_blocks == worker.blocks.num_blocks
    reserve = wire.Reserve(request_id="r", num_tokens=6, lease_s=30.0, token_ids=prompt)
    worker._handle(reserve, None)
    reservation = worker.reservations["r"]
    assert len(reservation.block_ids) == 2 and reservation.num_cached_blocks == 1
    lapse_every_lease(worker)
    worker.blocks.check_invariants()
    assert worker.blocks.num_free_blocks == worker.blocks.num_blocks
