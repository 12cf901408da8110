"""How long the wire takes to decode and to encode the messages sent most: the scheduler's SUBMIT
(prompts of 32 to 1,500 tokens, and an agent's 32,768-token context), the PREFILL_JOB it forwards a
prompt in (built from the SUBMIT as received), a worker's HEARTBEAT (quiet, and with a prefix
cache's events), a RESERVE reply and a REQUEST_DONE, and the TOKENS a decode worker sends its
gateway every step (8 and 64 deltas). Each figure is the median of `--repeats` timings of `--number`
calls, in microseconds per message, of the process's CPU time (a 32,768-token message is timed
`--number` / 64 times); decoding starts from the frames as a socket hands them over.

    .venv/bin/python -m loadtest.wire_speed [--number 20000] [--repeats 7]

Run it against another checkout (`PYTHONPATH=<checkout>`) to compare side by side.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable

from shared import wire


def submit(num_tokens: int) -> wire.Submit:
    return wire.Submit(
        request_id="req-000123",
        prompt_token_ids=[(i * 7919) % 49152 for i in range(num_tokens)],
        sampling=wire.SamplingSpec(max_tokens=256, temperature=0.7, top_p=0.9),
        tenant="tenant-42",
        priority=0,
        gateway_peer_id="gateway-0",
        arrival_time=1764892800.25,
        first_token_deadline_s=30.0,
    )


def prefill_job(num_tokens: int) -> wire.PrefillJob:
    """What the scheduler sends a prefill worker: the prompt as its SUBMIT arrived."""
    received = wire.decode([bytes(frame) for frame in wire.encode(submit(num_tokens))])
    assert isinstance(received, wire.Submit)
    return wire.PrefillJob(
        request_id=received.request_id,
        prompt_token_ids=received.prompt_token_ids,
        sampling=received.sampling,
        gateway_address="tcp://10.0.0.7:5560",
        decode_peer_id="decode-17",
        decode_address="tcp://10.0.0.9:5570",
    )


def heartbeat(cache_events: int) -> wire.Heartbeat:
    return wire.Heartbeat(
        peer_id="decode-17",
        num_waiting=2,
        num_running=31,
        num_free_blocks=1204,
        num_total_blocks=4096,
        steps_completed=918273,
        sent_at=1764892800.5,
        request_ids=[f"req-{i:06d}" for i in range(33)],
        recent_batch_sizes=[31, 31, 32, 31],
        cache_events_seq=5 if cache_events else 0,
        cache_stored=list(range(10**12, 10**12 + cache_events)),
        num_prefix_query_tokens=10**6,
        num_prefix_hit_tokens=6 * 10**5,
        prefill_tokens_per_s=5123.5,
        step_s=0.031,
    )


def tokens(num_deltas: int) -> wire.Tokens:
    """A decode step's tokens for one gateway: one delta per sequence of that gateway's."""
    return wire.Tokens(
        deltas=[
            wire.TokenDelta(request_id=f"req-{i:06d}", token_ids=[1000 + i], index=57 + i)
            for i in range(num_deltas)
        ]
    )


MESSAGES: dict[str, Callable[[], wire.Message]] = {
    "submit_32": lambda: submit(32),
    "submit_415": lambda: submit(415),
    "submit_1500": lambda: submit(1500),
    "submit_32768": lambda: submit(32768),
    "prefill_job_1500": lambda: prefill_job(1500),
    "heartbeat": lambda: heartbeat(0),
    "heartbeat_cache_events": lambda: heartbeat(16),
    "tokens_8": lambda: tokens(8),
    "tokens_64": lambda: tokens(64),
    "reserve_reply": lambda: wire.ReserveReply(
        request_id="req-000123",
        peer_id="decode-17",
        ok=True,
        num_free_blocks=1200,
        num_cached_blocks=3,
    ),
    "request_done": lambda: wire.RequestDone(
        request_id="req-000123",
        peer_id="decode-17",
        phase="decode",
        finish_reason="stop",
        num_prompt_tokens=415,
        num_output_tokens=211,
        output_length=211,
    ),  # fmt: skip
}


def median_time(call: Callable[[], object], number: int, repeats: int) -> float:
    """The median over `repeats` of the CPU time per call, microseconds."""
    runs = []
    for _ in range(repeats):
        started = time.process_time()
        for _ in range(number):
            call()
        runs.append((time.process_time() - started) / number * 1e6)
    return statistics.median(runs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--number", type=int, default=20000, help="calls per timing")
    parser.add_argument("--repeats", type=int, default=7, help="timings per message")
    args = parser.parse_args(argv)
    if args.number < 1 or args.repeats < 1:
        parser.error("--number and --repeats must be at least 1")
    for name, build in MESSAGES.items():
        message = build()
        frames = [bytes(frame) for frame in wire.encode(message)]  # as a socket hands them over
        assert wire.decode(frames) == message
        number = max(1, args.number // 64) if name.endswith("32768") else args.number
        decode_us = median_time(functools.partial(wire.decode, frames), number, args.repeats)
        encode_us = median_time(functools.partial(wire.encode, message), number, args.repeats)
        print(f"{name:>24}: decode {decode_us:7.2f} us, encode {encode_us:7.2f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
