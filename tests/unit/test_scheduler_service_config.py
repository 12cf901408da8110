"""The scheduler's start-up: a queue time limit that fails batch lines before they ever compete
as interactive is said, with both values, in a warning (a cluster without batch jobs may want
a short limit: it is not refused)."""

from __future__ import annotations

import pytest
import zmq
from structlog.testing import capture_logs

from services.scheduler.fair_share import FairShareConfig
from services.scheduler.service import SchedulerConfig, SchedulerService

BULK_MAX_WAIT_S = FairShareConfig().bulk_max_wait_s  # 300 s


def start_up_logs(tmp_path, **settings) -> list[dict]:
    context = zmq.Context()
    config = SchedulerConfig(address=f"ipc://{tmp_path}/s.sock", indexes="python", **settings)
    with capture_logs() as logs:
        service = SchedulerService(config, context)
    service.socket.close(linger=0)
    context.term()
    return logs


@pytest.mark.parametrize("limit", [60.0, BULK_MAX_WAIT_S])
def test_a_queue_limit_within_the_bulk_wait_is_warned_of_with_both_values(tmp_path, limit):
    """A batch line waiting `bulk_max_wait_s` competes as interactive ("a job is never starved
    forever"); with the 504 at or before that, under steady chat load it never did, and a whole
    job's lines failed, nothing said why."""
    warnings = [
        e for e in start_up_logs(tmp_path, max_queue_time_s=limit) if e["log_level"] == "warning"
    ]
    assert len(warnings) == 1, warnings
    warning = warnings[0]
    assert warning["max_queue_time_s"] == limit
    assert warning["bulk_max_wait_s"] == BULK_MAX_WAIT_S
    assert "--max-queue-time-s" in warning["event"] and "504" in warning["event"]


def test_the_default_queue_limit_is_not_warned_of(tmp_path):
    logs = start_up_logs(tmp_path)  # 600 s
    assert not [e for e in logs if e["log_level"] == "warning"], logs
