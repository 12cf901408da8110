"""Messages the wire accepts but no sound peer sends, through the scheduler service's own entry
(`SchedulerService._handle`, its HELLO checks, the core, the metrics, the tick): ints past
int32 and int64 (MessagePack carries up to 2**64 - 1), NaN and infinite floats, ids and peers
nobody registered, reports from the wrong worker. Each must be answered, refused or read
within bounds: an exception ends the scheduler's loop, and every request in it with it.

Found so far (each was a crash): a token id of 2**63 or more (the prefix hash), a priority past
int64, a decode worker's free blocks past int64 (the C rooms), a HELLO whose KV shape does not
fit 64 bits, and a SUBMIT naming a gateway that never said HELLO (its first token's address).
"""

from __future__ import annotations

import contextlib
import math
import random
import sys
from collections.abc import Iterator

import pytest
import zmq

from services.scheduler.service import SchedulerConfig, SchedulerService
from shared import wire
from shared.engine.prefix_cache import CacheKey, worker_cache_key

CACHE_KEY = worker_cache_key(CacheKey("smollm2", "float32", 16), False)
ODD_INTS = [0, 1, -1, 16, 2**31 - 1, 2**31, -(2**31) - 1, 2**63 - 1, -(2**63), 2**64 - 1, 10**9]
ODD_FLOATS = [0.0, -0.0, -1.0, 1e-300, 1e300, sys.float_info.max, math.inf, -math.inf, math.nan]


class OddPeers:
    """Random messages, round-tripped through the wire (what fails to encode is skipped: the
    codec refuses it, tested in test_wire.py), handed to the service as its loop would."""

    def __init__(self, service: SchedulerService, seed: int, caches: bool):
        self.service, self.rng, self.caches = service, random.Random(seed), caches
        self.now = 0.0
        self.request_ids: list[str] = []
        self.workers: list[str] = []
        self.steps: dict[str, int] = {}

    def int_(self, odd: float = 0.15) -> int:
        return self.rng.choice(ODD_INTS) if self.rng.random() < odd else self.rng.randrange(0, 60)

    def float_(self) -> float:
        return self.rng.choice(ODD_FLOATS) if self.rng.random() < 0.3 else self.rng.uniform(0, 50)

    def request_id(self) -> str:
        if self.request_ids and self.rng.random() < 0.8:
            return self.rng.choice(self.request_ids)
        return f"unknown{self.rng.randrange(3)}"

    def worker(self) -> str:
        return self.rng.choice(self.workers) if self.rng.random() < 0.9 else "stranger"

    def deliver(self, identity: bytes, message: wire.Message) -> None:
        try:
            message = wire.decode(wire.encode(message))
        except wire.WireError:
            return
        self.service._send(self.service._handle(identity, message, self.now))

    def address(self, peer_id: str, odd: bool) -> str | None:
        if odd:
            return self.rng.choice([None, "", "zz", "tcp://*:5", f"ipc:///nowhere/{peer_id}"])
        return f"ipc:///nowhere/{peer_id}"

    def hello(self, peer_id: str, role: str) -> None:
        odd = self.rng.random() < 0.2
        self.deliver(
            peer_id.encode(),
            wire.Hello(
                schema_version=wire.SCHEMA_VERSION,
                role=role,
                peer_id=peer_id,
                model=self.service.config.model,
                address=None if role == "prefill" else self.address(peer_id, odd),
                num_kv_blocks=0 if role == "gateway" else (self.int_() if odd else 200),
                block_size=0 if role == "gateway" else (self.int_() if odd else 16),
                max_num_seqs=0 if role == "gateway" else (self.int_() if odd else 8),
                cache_key=CACHE_KEY if self.caches and role != "gateway" else None,
            ),
        )
        if role != "gateway" and peer_id not in self.workers:
            self.workers.append(peer_id)

    def submit(self) -> None:
        request_id = f"r{len(self.request_ids)}"
        self.request_ids.append(request_id)
        length = self.rng.choice([1, 16, 17, 100, 600])
        tokens = [self.int_() if self.rng.random() < 0.05 else 7 for _ in range(length)]
        sampling = wire.SamplingSpec(
            max_tokens=self.int_(), temperature=self.float_(), top_k=self.int_(), seed=self.int_()
        )
        self.deliver(
            b"g",
            wire.Submit(
                request_id=request_id,
                prompt_token_ids=tokens,
                sampling=sampling,
                tenant=self.rng.choice(["t", "u", ""]),
                priority=self.int_(),
                gateway_peer_id=self.rng.choice(["g", "g", "g", "nobody"]),
                arrival_time=self.float_(),
                output_token_ids=[self.int_() for _ in range(self.rng.choice([0, 0, 2]))],
                resumed_from=self.rng.choice([None, None, self.request_id()]),
                bulk=self.rng.random() < 0.2,
                first_token_deadline_s=self.rng.choice([None, self.float_()]),
            ),
        )

    def reserve_reply(self) -> None:
        worker = self.worker()
        reply = wire.ReserveReply(
            request_id=self.request_id(),
            peer_id=worker,
            ok=self.rng.random() < 0.8,
            num_free_blocks=self.int_(),
            num_cached_blocks=self.rng.choice([0, self.int_()]),
        )
        self.deliver(worker.encode(), reply)

    def request_done(self) -> None:
        request_id = self.request_id()
        request = self.service.core.requests.get(request_id)
        known = [request.prefill_peer_id, request.decode_peer_id] if request else []
        peer_id = self.rng.choice([p for p in known if p] or [self.worker()])
        done = wire.RequestDone(
            request_id=request_id,
            peer_id=peer_id,
            phase=self.rng.choice(["prefill", "decode"]),
            finish_reason=self.rng.choice([None, "length", "stop", "error", "abort"]),
            num_prompt_tokens=self.int_(),
            num_output_tokens=self.int_(),
            num_cached_tokens=self.int_(),
            output_length=self.rng.choice([None, self.int_()]),
        )
        self.deliver(peer_id.encode(), done)

    def heartbeat(self) -> None:
        """Most beat soundly (free blocks, steps made), so that work is placed; some oddly."""
        peer_id = self.worker()
        self.steps[peer_id] = self.steps.get(peer_id, 0) + 1
        odd = self.rng.random() < 0.2
        beat = wire.Heartbeat(
            peer_id=peer_id,
            num_waiting=self.int_(odd=1.0) if odd else 0,
            num_running=self.int_(odd=1.0) if odd else 1,
            num_free_blocks=self.int_(odd=1.0) if odd else 180,
            num_total_blocks=200,
            steps_completed=self.int_(odd=1.0) if odd else self.steps[peer_id],
            sent_at=self.float_(),
            num_swapped=self.int_(),
            request_ids=[self.request_id() for _ in range(self.rng.randrange(4))],
            recent_batch_sizes=[self.int_() for _ in range(self.rng.randrange(3))],
            cache_events_seq=self.rng.choice([0, 1, 2, self.int_()]) if self.caches else 0,
            cache_full=self.rng.random() < 0.5,
            cache_stored=[self.int_() for _ in range(self.rng.randrange(3))],
            cache_evicted=[self.int_() for _ in range(self.rng.randrange(2))],
            step_s=self.float_(),
            prefill_tokens_per_s=self.float_(),
        )
        self.deliver(peer_id.encode(), beat)

    def play(self, num_messages: int) -> None:
        self.hello("g", "gateway")
        for index in range(self.rng.randrange(1, 4)):
            self.hello(f"prefill{index}", "prefill")
            self.hello(f"decode{index}", "decode")
        for _ in range(num_messages):
            self.now += self.rng.choice([0.0, 0.001, 0.01, 0.1, 0.5, 0.5, 30.0])
            draw = self.rng.random()
            if draw < 0.3:
                self.submit()
            elif draw < 0.45:
                self.reserve_reply()
            elif draw < 0.65:
                self.request_done()
            elif draw < 0.85:
                for _ in range(len(self.workers) if self.rng.random() < 0.5 else 1):
                    self.heartbeat()
            elif draw < 0.9:
                cancel = wire.Cancel(request_id=self.request_id(), reason="odd")
                self.deliver(b"g", cancel)
            elif draw < 0.95:
                self.service._send(self.service.core.tick(self.now))
                self.service._broadcast_status(self.now)
            else:
                role = self.rng.choice(["prefill", "decode"])
                self.hello(f"{role}{self.rng.randrange(4)}", role)


@contextlib.contextmanager
def scheduler_service(name: str, indexes: str = "auto") -> Iterator[SchedulerService]:
    """A scheduler service bound in process, its messages handed to it by the test."""
    context = zmq.Context()
    config = SchedulerConfig(address=f"inproc://odd-values-{name}", indexes=indexes)
    service = SchedulerService(config, context)
    try:
        yield service
    finally:
        service.socket.close(linger=0)
        service.security.stop()
        context.term()


@pytest.mark.parametrize("indexes", ["native", "python"])
@pytest.mark.parametrize("caches", [False, True], ids=["no-caches", "prefix-caches"])
def test_odd_values_are_refused_or_read_within_bounds_never_a_crash(indexes, caches):
    with scheduler_service(f"{indexes}-{caches}", indexes) as service:
        for seed in range(12):
            service.core = type(service.core)(service.config.limits())  # a fresh core a run
            OddPeers(service, seed, caches).play(300)


def hello_ack(service: SchedulerService, role: str, address: str | None) -> wire.HelloAck:
    block_size, num_blocks, num_seqs = (0, 0, 0) if role == "gateway" else (16, 64, 8)
    hello = wire.Hello(schema_version=wire.SCHEMA_VERSION, role=role, peer_id=f"{role}-1",
                       model=service.config.model, address=address, num_kv_blocks=num_blocks,
                       block_size=block_size, max_num_seqs=num_seqs)  # fmt: skip
    ack = service._handle(b"peer", hello, 0.0)[0].message
    assert isinstance(ack, wire.HelloAck)
    return ack


@pytest.mark.parametrize(
    "role, address, reason",
    [
        ("gateway", "zz", "cannot be connected to: Invalid argument"),
        ("gateway", "tcp://*:5", "cannot be connected to"),
        ("decode", "tcp://host:port", "cannot be connected to"),
        ("decode", "ipc:///" + "x" * 200, "'ipc:///xxx"),
        ("decode", None, "a decode must give the address others connect to"),
        ("gateway", None, "a gateway must give"),
    ],
)
def test_a_hello_whose_address_others_cannot_reach_is_refused_by_name(role, address, reason):
    """Workers connect to a gateway's address (tokens) and a decode worker's (KV): one that
    ZeroMQ refuses to connect to ended the worker that was told it, mid-step."""
    with scheduler_service(f"address-{role}-{len(address or '')}") as service:
        ack = hello_ack(service, role, address)
        assert not ack.accepted and reason in ack.error
        assert not service.core.gateways and not service.core.registry.workers


@pytest.mark.parametrize(
    "role, address", [("gateway", "tcp://127.0.0.1:5"), ("decode", "ipc:///nowhere/d"),
                      ("prefill", None), ("decode", "tcp://decode-1.cluster.local:7000")]
)  # fmt: skip
def test_a_hello_with_a_sound_address_is_accepted(role, address):
    with scheduler_service(f"sound-{role}-{len(address or '')}") as service:
        assert hello_ack(service, role, address).accepted


def worker_hello_ack(
    service: SchedulerService, role: str, peer_id: str, block_size: int, dtype: str
) -> wire.HelloAck:
    address = None if role == "prefill" else f"inproc://{peer_id}"
    hello = wire.Hello(schema_version=wire.SCHEMA_VERSION, role=role, peer_id=peer_id,
                       model=service.config.model, address=address, num_kv_blocks=64,
                       block_size=block_size, max_num_seqs=8, dtype=dtype)  # fmt: skip
    ack = service._handle(peer_id.encode(), hello, 0.0)[0].message
    assert isinstance(ack, wire.HelloAck)
    return ack


@pytest.mark.parametrize("block_size, dtype", [(32, "float32"), (16, "bfloat16")])
def test_a_worker_whose_kv_no_other_could_take_is_refused_with_caching_off(block_size, dtype):
    """Prefix caching off, no cache key compares the workers: a prefill worker of another block
    size or dtype joined, and every KV transfer to the decode workers was then refused."""
    with scheduler_service(f"layout-{block_size}-{dtype}") as service:
        assert worker_hello_ack(service, "decode", "d1", 16, "float32").accepted
        ack = worker_hello_ack(service, "prefill", "p1", block_size, dtype)
        assert not ack.accepted and "could never pass between them" in ack.error
        assert "d1" in ack.error and set(service.core.registry.workers) == {"d1"}
        assert worker_hello_ack(service, "prefill", "p2", 16, "float32").accepted
        # Alone, a worker may come back with another layout (a restart with new settings).
        solo = f"layout-solo-{block_size}-{dtype}"
        with scheduler_service(solo) as alone:
            assert worker_hello_ack(alone, "decode", "d1", 16, "float32").accepted
            assert worker_hello_ack(alone, "decode", "d1", block_size, dtype).accepted
