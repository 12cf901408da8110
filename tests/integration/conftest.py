"""Service-level tests: one real worker process loop in a thread, real ZeroMQ sockets, and the test
playing the other parties (scheduler, gateway, peer worker) on their sockets. A tiny random Llama
saved to disk stands in for the real model: these tests are about the protocol, not the numbers."""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import pytest
import zmq

from shared import wire
from shared.engine.model_files import resolve_model_dir
from tests.helpers import tiny_hf_model

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-llama")
    tiny_hf_model("llama", seed=21).save_pretrained(directory)
    real_dir, _ = resolve_model_dir()
    for name in TOKENIZER_FILES:
        if (real_dir / name).exists():
            shutil.copy(real_dir / name, directory / name)
    return directory


class FakeScheduler:
    """The scheduler's side of a worker's link: a ROUTER that accepts HELLO and records all."""

    def __init__(self, context: zmq.Context, address: str):
        self.socket = context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(address)
        self.identity: bytes | None = None

    def expect(self, kind, timeout_s: float = 10.0, where=lambda m: True):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.socket.poll(100):
                continue
            identity, message = wire.recv_from(self.socket)
            if isinstance(message, wire.Hello):
                self.identity = identity
                wire.send_to(
                    self.socket,
                    identity,
                    wire.HelloAck(
                        schema_version=wire.SCHEMA_VERSION,
                        accepted=True,
                        error=None,
                        heartbeat_interval_s=0.1,
                    ),
                )
            if isinstance(message, kind) and where(message):
                return message
        kinds = kind if isinstance(kind, tuple) else (kind,)
        names = " or ".join(k.__name__ for k in kinds)
        raise TimeoutError(f"no {names} within {timeout_s} s")

    def send(self, message: wire.Message) -> None:
        assert self.identity is not None, "the worker has not said HELLO yet"
        wire.send_to(self.socket, self.identity, message)


class WorkerThread:
    """Runs a worker's loop in a thread until stopped."""

    def __init__(self, worker):
        self.worker = worker
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        self.worker.link.handshake(timeout_s=20)
        self.worker.registered = True  # (as `serve_forever`)
        while not self.worker._stopping:
            self.worker.run_once()

    def start(self) -> WorkerThread:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.worker.stop()
        self.thread.join(timeout=10)
        self.worker.close()
