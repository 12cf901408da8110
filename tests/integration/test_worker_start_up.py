"""A worker refuses settings it cannot run with before it loads the model (a minute and more on
a big one), not after: a KV budget that holds no block of the model's, a metrics port or a KV
address another program holds."""

from __future__ import annotations

import signal
import threading
import time

import pytest

from services.decode.service import DecodeWorker
from services.prefill.service import PrefillWorker
from services.worker import loop
from services.worker.config import WorkerConfig
from shared.config import ConfigError


@pytest.fixture
def loading_forbidden(monkeypatch):
    def load_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the settings were checked")

    monkeypatch.setattr(loop, "load_model", load_model)


def worker_config(tmp_path, model_dir, **settings) -> WorkerConfig:
    return WorkerConfig(
        scheduler_address=f"ipc://{tmp_path}/s.sock",
        model=str(model_dir),
        dtype="float32",
        **settings,
    )


@pytest.mark.parametrize("worker_class", [PrefillWorker, DecodeWorker])
def test_a_kv_budget_without_one_block_is_refused_before_loading(
    tmp_path, tiny_model_dir, loading_forbidden, worker_class
):
    config = worker_config(
        tmp_path, tiny_model_dir, kv_cache_bytes=1, address=f"ipc://{tmp_path}/kv.sock"
    )
    with pytest.raises(ConfigError, match="--kv-cache-bytes / TANDEM_KV_CACHE_BYTES"):
        worker_class(config)


def test_a_metrics_port_in_use_is_refused_before_loading(
    tmp_path, tiny_model_dir, loading_forbidden, taken_port
):
    config = worker_config(tmp_path, tiny_model_dir, metrics_port=taken_port)
    with pytest.raises(ConfigError, match=rf"--metrics-port.*127.0.0.1:{taken_port}.*in use"):
        PrefillWorker(config)


def test_a_decode_address_in_use_is_refused_before_loading(
    tmp_path, tiny_model_dir, loading_forbidden, taken_port
):
    config = worker_config(tmp_path, tiny_model_dir, address=f"tcp://127.0.0.1:{taken_port}")
    with pytest.raises(ConfigError, match=r"address \(--address / TANDEM_ADDRESS\).*in use"):
        DecodeWorker(config)


def test_a_worker_stopped_while_waiting_for_the_scheduler_stops_at_once(tmp_path, tiny_model_dir):
    """SIGTERM set the stop flag, which the handshake never read: a worker whose scheduler was
    not there went on saying HELLO for a minute (past `tandem up`'s and Docker's grace, so it
    was killed), then died on a HandshakeError traceback."""
    config = worker_config(tmp_path, tiny_model_dir, kv_cache_bytes=1 << 20)  # (nobody there)
    worker = PrefillWorker(config)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    stopper = threading.Timer(0.5, worker.stop)
    stopper.start()
    started = time.monotonic()
    try:
        worker.serve_forever()  # (in the main thread: it sets the signal handlers)
    finally:
        stopper.cancel()
        for number, handler in handlers.items():
            signal.signal(number, handler)
    assert time.monotonic() - started < 5
    assert not worker.registered


def test_a_metrics_host_not_of_this_machine_is_refused_before_loading(
    tmp_path, tiny_model_dir, loading_forbidden
):
    config = worker_config(tmp_path, tiny_model_dir, metrics_port=0, metrics_host="192.0.2.1")
    with pytest.raises(ConfigError, match=r"--metrics-host.*192.0.2.1:0"):
        PrefillWorker(config)
