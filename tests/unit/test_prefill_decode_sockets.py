"""The prefill worker's sockets to decode workers after transfers time out, its timers driven
by the test: only a socket that the timed-out transfer went on, and that nothing was
acknowledged on since, is dropped. (The worker's state alone, without a model; the whole path
runs in tests/integration/test_prefill_worker.py.)"""

from __future__ import annotations

import types

import zmq

from services.prefill.service import PendingTransfer, PrefillWorker
from services.worker.peer_sockets import PeerSockets


def worker_state(context: zmq.Context) -> PrefillWorker:
    worker = object.__new__(PrefillWorker)
    worker.transfers, worker._opened_at, worker._last_ack_at = {}, {}, {}
    worker._registration = 0  # (its transfers' registration: none of them is of an earlier)
    worker.decode_sockets = PeerSockets(lambda: context.socket(zmq.DEALER), 60.0)
    worker.events = types.SimpleNamespace(kv_failed=lambda *args: None)
    worker.reported = []
    worker._report = lambda job, reason, *args: worker.reported.append((job.request_id, reason))
    worker.log = types.SimpleNamespace(warning=lambda *args, **kwargs: None)
    return worker


def transfer(address: str, request_id: str, sent_at: float, timeout_s: float = 10.0):
    job = types.SimpleNamespace(decode_address=address, request_id=request_id)
    return PendingTransfer(job, None, sent_at + timeout_s, 1, sent_at)


def test_a_stale_transfers_timeout_leaves_the_new_socket_be(tmp_path, monkeypatch):
    """A decode worker restarted at its address: the first timed-out transfer drops the old
    socket, a new job opens another, and the old socket's other transfers, timing out later,
    dropped the new one too (with what was queued on it, and the acks it would bring)."""
    context = zmq.Context()
    worker = worker_state(context)
    address = f"ipc://{tmp_path}/decode"
    clock = types.SimpleNamespace(now=0.0)
    monkeypatch.setattr("services.prefill.service.time.monotonic", lambda: clock.now)
    try:
        assert worker._check_decode(address) is None  # the old socket, opened at 0
        worker.transfers["t0"] = transfer(address, "t0", sent_at=0.0)
        worker.transfers["t1"] = transfer(address, "t1", sent_at=5.0)
        worker._on_timers(11.0)  # t0 timed out, nothing acknowledged: the socket goes
        assert address not in worker.decode_sockets
        clock.now = 12.0
        assert worker._check_decode(address) is None  # a new job: a new socket
        worker.transfers["t2"] = transfer(address, "t2", sent_at=12.0)
        worker._on_timers(16.0)  # t1, sent on the old socket, times out
        assert address in worker.decode_sockets and "t2" in worker.transfers
        assert worker.reported == [("t0", "error"), ("t1", "error")]
        worker._on_timers(23.0)  # t2 went on the new one: silent since, it goes
        assert address not in worker.decode_sockets
    finally:
        worker.decode_sockets.close()
        context.term()
