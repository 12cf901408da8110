"""What a scheduler core costs in Python before it decides anything: the floor under
`scheduler_scale.py`'s figures for any core that keeps the service's message-level interface.

A request's life in the core is four handler calls (its SUBMIT, its reservation's answer, the
prefill's report, the decode's report) and two messages built (the RESERVE, the PREFILL_JOB),
as the real core's are, with the real wire types. Here the policy between them is the least a
core can do: first come, first served, workers taken in turn, no fair share, no indexes, no
placement, no heartbeats. Whatever a core's policy costs comes on top of this floor; so a core
whose policy runs in native code behind the same interface can go no faster than this, and one
whose policy is Python pays this plus the policy.

    .venv/bin/python -m loadtest.core_floor [--requests 100000]
"""

from __future__ import annotations

import argparse
import time
from collections import deque

from services.scheduler.core import Outgoing
from shared import wire

PROMPT_TOKENS = 200
NUM_DECODE = 1000
# One request's messages to the core: its SUBMIT, its reservation's answer, its two reports.
Life = tuple[wire.Submit, wire.ReserveReply, wire.RequestDone, wire.RequestDone]


class FifoCore:
    """The handlers a core has, with first come, first served for a policy."""

    def __init__(self) -> None:
        self.requests: dict[str, tuple[wire.Submit, str]] = {}
        self.queue: deque[wire.Submit] = deque()
        self.num_dispatched = 0

    def on_submit(self, submit: wire.Submit, now: float) -> list[Outgoing]:
        self.queue.append(submit)
        return self.dispatch(now)

    def dispatch(self, now: float) -> list[Outgoing]:
        out = []
        while self.queue:
            submit = self.queue.popleft()
            decode = f"decode{self.num_dispatched % NUM_DECODE}"
            self.num_dispatched += 1
            self.requests[submit.request_id] = (submit, decode)
            reserve = wire.Reserve(
                request_id=submit.request_id,
                num_tokens=len(submit.prompt_token_ids) + 1,
                lease_s=30.0,
                token_ids=submit.prompt_token_ids,
            )
            out.append(Outgoing(decode.encode(), reserve))
        return out

    def on_reserve_reply(self, reply: wire.ReserveReply, now: float) -> list[Outgoing]:
        submit, decode = self.requests[reply.request_id]
        job = wire.PrefillJob(
            request_id=submit.request_id,
            prompt_token_ids=submit.prompt_token_ids,
            sampling=submit.sampling,
            gateway_address="gateway",
            decode_peer_id=decode,
            decode_address=f"sim://{decode}",
        )
        return [Outgoing(b"prefill0", job)]

    def on_request_done(self, done: wire.RequestDone, now: float) -> list[Outgoing]:
        if done.phase == "decode":
            del self.requests[done.request_id]
        return self.dispatch(now)


def lives(
    num: int,
) -> list[tuple[wire.Submit, wire.ReserveReply, wire.RequestDone, wire.RequestDone]]:
    """Each request's messages to the core, built before the clock starts (as the bench's)."""
    sampling = wire.SamplingSpec(max_tokens=16)
    messages = []
    for i in range(num):
        request_id = f"r{i}"
        submit = wire.Submit(
            request_id=request_id,
            prompt_token_ids=list(range(PROMPT_TOKENS)),
            sampling=sampling,
            tenant=f"tenant{i % 10_000}",
            priority=0,
            gateway_peer_id="gateway",
            arrival_time=0.0,
        )
        reply = wire.ReserveReply(
            request_id=request_id, peer_id="decode0", ok=True, num_free_blocks=1000
        )
        prefilled, decoded = (
            wire.RequestDone(
                request_id=request_id,
                peer_id=peer,
                phase=phase,
                finish_reason=reason,
                num_prompt_tokens=PROMPT_TOKENS,
                num_output_tokens=tokens,
            )
            for peer, phase, reason, tokens in (
                ("prefill0", "prefill", None, 1),
                ("decode0", "decode", "length", 16),
            )
        )
        messages.append((submit, reply, prefilled, decoded))
    return messages


def measure(num: int) -> float:
    """Thread CPU seconds per request life through the FIFO core."""
    core, messages = FifoCore(), lives(num)
    started = time.thread_time()
    for submit, reply, prefilled, decoded in messages:
        core.on_submit(submit, 0.0)
        core.on_reserve_reply(reply, 0.0)
        core.on_request_done(prefilled, 0.0)
        core.on_request_done(decoded, 0.0)
    assert not core.requests and core.num_dispatched == num
    return (time.thread_time() - started) / num


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=100_000)
    args = parser.parse_args(argv)
    if args.requests < 1:
        parser.error(f"--requests must be at least 1, got {args.requests}")
    seconds = measure(args.requests)
    print(f"{seconds * 1e6:.1f} us per request life: {1 / seconds:,.0f} lives/s at most")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
