"""How far ahead of its step's KV transfers a prefill worker's first tokens leave.

One real prefill worker (a thread of this process) with this script playing its scheduler, its
gateway and its decode worker on ipc sockets. Each round sends `--prompts` jobs of `--tokens`
tokens at once (one step, given the budget), records when the step's first tokens and each
transfer reach their sockets, acknowledges the transfers, and prints per round the last first
token's arrival minus the last transfer's (negative: the tokens came first), then the median.

    .venv/bin/python -m loadtest.first_token_lead [--prompts 8 --tokens 256 --rounds 7]
        [--dtype float32] [--model smollm2]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time

import zmq

from services.prefill.service import PrefillWorker
from services.worker.config import WorkerConfig
from shared import wire


def accept_hello(scheduler: zmq.Socket) -> bytes:
    """The scheduler's part: accept the worker's HELLO; returns its identity."""
    while True:
        if not scheduler.poll(60_000):
            raise TimeoutError("the prefill worker never said HELLO")
        identity, message = wire.recv_from(scheduler)
        if isinstance(message, wire.Hello):
            ack = wire.HelloAck(schema_version=wire.SCHEMA_VERSION, accepted=True, error=None,
                                heartbeat_interval_s=0.5)  # fmt: skip
            wire.send_to(scheduler, identity, ack)
            return identity


def run_worker(worker: PrefillWorker, stop: threading.Event) -> None:
    worker.link.handshake(timeout_s=60)
    while not stop.is_set():
        worker.run_once()


def one_round(args, jobs_to, gateway, decode, round_index: int, folder: str) -> float:
    for i in range(args.prompts):
        tokens = [(7 * i + round_index + j) % 5000 + 10 for j in range(args.tokens)]
        jobs_to(wire.PrefillJob(
            request_id=f"r{round_index}-{i}", prompt_token_ids=tokens,
            sampling=wire.SamplingSpec(max_tokens=8, temperature=0.0, ignore_eos=True),
            gateway_address=f"ipc://{folder}/g", decode_peer_id="d",
            decode_address=f"ipc://{folder}/d",
        ))  # fmt: skip
    token_at: list[float] = []
    kv_at: list[float] = []
    poller = zmq.Poller()
    poller.register(gateway, zmq.POLLIN)
    poller.register(decode, zmq.POLLIN)
    while len(token_at) < args.prompts or len(kv_at) < args.prompts:
        ready = dict(poller.poll(120_000))
        if not ready:
            raise TimeoutError("the prefill worker went quiet")
        now = time.perf_counter()
        if gateway in ready:
            token_at += [now] * len(wire.recv(gateway).deltas)
        if decode in ready:
            identity, transfer = wire.recv_from(decode)
            kv_at.append(now)
            ack = wire.KvAck(request_id=transfer.request_id, ok=True, error=None)
            wire.send_to(decode, identity, ack)
    return (max(token_at) - max(kv_at)) * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=7, help="the first is a warm-up")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--model", default="smollm2", help="as the workers' --model")
    args = parser.parse_args(argv)
    if args.prompts < 1 or args.tokens < 1 or args.rounds < 2:
        parser.error("--prompts and --tokens must be >= 1, --rounds >= 2")
    folder = tempfile.mkdtemp()
    context = zmq.Context()
    scheduler, gateway, decode = (context.socket(k) for k in (zmq.ROUTER, zmq.PULL, zmq.ROUTER))
    scheduler.bind(f"ipc://{folder}/s")
    gateway.bind(f"ipc://{folder}/g")
    decode.bind(f"ipc://{folder}/d")
    config = WorkerConfig(
        scheduler_address=f"ipc://{folder}/s", peer_id="p", dtype=args.dtype, model=args.model,
        kv_cache_bytes=1 << 30, max_num_batched_tokens=args.prompts * args.tokens,
        step_time_target_s=None, transfer_timeout_s=60,
    )  # fmt: skip
    worker = PrefillWorker(config, context)
    stop = threading.Event()
    runner = threading.Thread(target=run_worker, args=(worker, stop))
    runner.start()
    identity = accept_hello(scheduler)  # the worker's heartbeats then queue unread

    def jobs_to(job: wire.PrefillJob) -> None:
        wire.send_to(scheduler, identity, job)

    try:
        rounds = [one_round(args, jobs_to, gateway, decode, r, folder) for r in range(args.rounds)]
    finally:
        stop.set()
        runner.join(timeout=30)
        worker.close()
    leads = rounds[1:]  # the first warms up
    print(f"{args.prompts} prompts of {args.tokens} tokens per step, {args.dtype}")
    print("last first token minus last transfer, ms:", ", ".join(f"{v:.1f}" for v in leads))
    print(f"median: {statistics.median(leads):.1f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
