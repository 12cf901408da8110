"""The gateway's cluster link resuming a request whose worker was lost, against a scheduler
played by the test on a real ROUTER socket."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
import zmq
import zmq.asyncio

from services.gateway.cluster import MAX_RESUMES, ClusterClient
from shared import wire
from shared.lifecycle import GatewayEvents
from shared.logs import get_logger


def submit(request_id: str, **sampling) -> wire.Submit:
    return wire.Submit(
        request_id=request_id, prompt_token_ids=[1, 2, 3],
        sampling=wire.SamplingSpec(max_tokens=10, **sampling), tenant="t", priority=0,
        gateway_peer_id="g", arrival_time=0.0,
    )  # fmt: skip


def delta(request_id: str, tokens: list[int], finish: str | None = None) -> wire.Tokens:
    error = "worker d0 stopped responding" if finish == "lost" else None
    return wire.Tokens(
        deltas=[wire.TokenDelta(request_id=request_id, token_ids=tokens, finish_reason=finish,
                                error=error)]
    )  # fmt: skip


class FakeScheduler:
    def __init__(self, context: zmq.asyncio.Context, address: str):
        self.socket = context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)  # a failed test must not hang at teardown
        self.socket.bind(address)
        self.gateway = b""

    async def expect(self, kind: type) -> wire.Message:
        while True:
            identity, message = await wire.async_recv_from(self.socket)
            self.gateway = identity
            if isinstance(message, kind):
                return message

    async def reply(self, request_id: str, status: int = 200) -> None:
        reply = wire.SubmitReply(request_id=request_id, accepted=status == 200, status_code=status,
                                 message=None if status == 200 else f"refused ({status})",
                                 retry_after_s=None)  # fmt: skip
        await wire.async_send_to(self.socket, self.gateway, reply)

    async def send(self, message: wire.Message) -> None:
        await wire.async_send_to(self.socket, self.gateway, message)


@dataclass
class Link:
    """A gateway's cluster link to the played scheduler, with request "r" submitted."""

    context: zmq.asyncio.Context
    scheduler: FakeScheduler
    client: ClusterClient
    queue: asyncio.Queue

    @classmethod
    async def open(cls, tmp_path, stream_end_grace_s: float = 5.0, **sampling) -> Link:
        context = zmq.asyncio.Context()
        scheduler = FakeScheduler(context, f"ipc://{tmp_path}/scheduler")
        client = ClusterClient(f"ipc://{tmp_path}/scheduler", f"ipc://{tmp_path}/stream",
                               f"ipc://{tmp_path}/stream", "g", "m",
                               GatewayEvents(get_logger()),
                               stream_end_grace_s=stream_end_grace_s)  # fmt: skip
        await client.start()
        await scheduler.expect(wire.Hello)
        submitted = asyncio.create_task(client.submit(submit("r", **sampling)))
        await scheduler.expect(wire.Submit)
        await scheduler.reply("r")
        return cls(context, scheduler, client, await submitted)

    async def close(self) -> None:
        await self.client.close()
        self.scheduler.socket.close(linger=0)
        self.context.term()


@contextlib.asynccontextmanager
async def opened(tmp_path, stream_end_grace_s: float = 5.0, **sampling) -> AsyncIterator[Link]:
    """`Link.open`, closed however the scenario ends (a failure must not hang the session)."""
    link = await Link.open(tmp_path, stream_end_grace_s, **sampling)
    try:
        yield link
    finally:
        await link.close()


async def scenario(tmp_path, refuse_resume: bool) -> tuple[list[wire.TokenDelta], list]:
    async with opened(tmp_path) as link:
        scheduler, queue = link.scheduler, link.queue
        await scheduler.send(delta("r", [7]))
        await scheduler.send(delta("r", [8]))
        await scheduler.send(delta("r", [], finish="lost"))
        await scheduler.send(delta("r", [99]))  # late, from the lost attempt: dropped
        resubmit = await scheduler.expect(wire.Submit)
        await scheduler.reply(resubmit.request_id, 400 if refuse_resume else 200)
        if not refuse_resume:
            await scheduler.send(delta(resubmit.request_id, [9], finish="length"))
        got = [await asyncio.wait_for(queue.get(), 5) for _ in range(3)]
    return got, [resubmit]


def test_a_lost_request_resumes_with_the_tokens_its_handler_got(tmp_path):
    got, (resubmit,) = asyncio.run(scenario(tmp_path, refuse_resume=False))
    assert [d.token_ids for d in got] == [[7], [8], [9]] and got[-1].finish_reason == "length"
    assert resubmit.request_id == "r~1" and resubmit.resumed_from == "r"
    assert resubmit.output_token_ids == [7, 8] and resubmit.prompt_token_ids == [1, 2, 3]


def test_a_lost_request_that_cannot_resume_ends_with_a_clear_error(tmp_path):
    got, _ = asyncio.run(scenario(tmp_path, refuse_resume=True))
    assert [d.token_ids for d in got[:2]] == [[7], [8]]
    assert got[2].finish_reason == "error"
    assert "d0 stopped responding" in got[2].error and "refused (400)" in got[2].error


async def resubmitted_after(tmp_path, tokens: list[int]) -> wire.Submit:
    async with opened(tmp_path, prompt_logprobs=2) as link:
        if tokens:
            await link.scheduler.send(delta("r", tokens))
        await link.scheduler.send(delta("r", [], finish="lost"))
        return await link.scheduler.expect(wire.Submit)


@pytest.mark.parametrize(("tokens", "expected"), [([], 2), ([7, 8], None)])
def test_prompt_logprobs_are_asked_again_only_if_they_never_came(tmp_path, tokens, expected):
    """They come with the first token: a resumption after it does not compute them again."""
    resubmit = asyncio.run(resubmitted_after(tmp_path, tokens))
    assert resubmit.sampling.prompt_logprobs == expected
    assert resubmit.output_token_ids == tokens


async def lost_every_time(tmp_path) -> wire.TokenDelta:
    async with opened(tmp_path) as link:
        scheduler, queue = link.scheduler, link.queue
        attempt = "r"
        for _ in range(MAX_RESUMES):
            await scheduler.send(delta(attempt, [], finish="lost"))
            attempt = (await scheduler.expect(wire.Submit)).request_id
            await scheduler.reply(attempt)
        await scheduler.send(delta(attempt, [], finish="lost"))
        last = await asyncio.wait_for(queue.get(), 5)
    return last


async def preempted_often(tmp_path, times: int) -> tuple[wire.TokenDelta, list[str]]:
    async with opened(tmp_path) as link:
        scheduler, queue = link.scheduler, link.queue
        attempt, attempts = "r", []
        for token in range(times):  # each attempt brings a token, then is handed back
            await scheduler.send(delta(attempt, [token]))
            await scheduler.send(delta(attempt, [], finish="preempted"))
            attempt = (await scheduler.expect(wire.Submit)).request_id
            attempts.append(attempt)
            await scheduler.reply(attempt)
        await scheduler.send(delta(attempt, [99], finish="length"))
        got = [await asyncio.wait_for(queue.get(), 5) for _ in range(times + 1)]
    return got, attempts


def test_preemptions_resume_without_counting_toward_the_bound(tmp_path):
    times = MAX_RESUMES + 2
    got, attempts = asyncio.run(preempted_often(tmp_path, times))
    assert [d.token_ids for d in got] == [[t] for t in range(times)] + [[99]]
    assert got[-1].finish_reason == "length"
    assert attempts == [f"r~{n}" for n in range(1, times + 1)]


def test_resumptions_are_bounded(tmp_path):
    last = asyncio.run(lost_every_time(tmp_path))
    assert last.finish_reason == "error" and f"after {MAX_RESUMES} resumptions" in last.error


async def refused_once(tmp_path) -> tuple[list[wire.TokenDelta], list[str]]:
    async with opened(tmp_path) as link:
        scheduler, queue = link.scheduler, link.queue
        await scheduler.send(delta("r", [], finish="lost"))
        attempts = []
        for status in (503, 200):  # no worker just now, then one is back
            attempt = await scheduler.expect(wire.Submit)
            attempts.append(attempt.request_id)
            await scheduler.reply(attempt.request_id, status)
        await scheduler.send(delta(attempts[-1], [5], finish="length"))
        got = [await asyncio.wait_for(queue.get(), 5)]
    return got, attempts


def test_a_resumption_waits_out_a_moment_with_no_worker(tmp_path):
    got, attempts = asyncio.run(refused_once(tmp_path))
    assert attempts == ["r~1", "r~1"]  # the same attempt, asked again
    assert got[0].token_ids == [5] and got[0].finish_reason == "length"


async def cancelled_while_resuming(tmp_path) -> tuple[wire.Message, ...]:
    async with opened(tmp_path) as link:
        scheduler = link.scheduler
        await scheduler.send(delta("r", [], finish="lost"))
        resubmit = await scheduler.expect(wire.Submit)  # the resumption waits for its answer
        await link.client.cancel("r", "client gone")  # the client leaves meanwhile
        first_cancel = await scheduler.expect(wire.Cancel)
        await scheduler.reply(resubmit.request_id)
        second_cancel = await asyncio.wait_for(scheduler.expect(wire.Cancel), 5)
    return resubmit, first_cancel, second_cancel


def test_a_request_cancelled_while_resuming_leaves_nothing_running(tmp_path):
    resubmit, first, second = asyncio.run(cancelled_while_resuming(tmp_path))
    assert resubmit.request_id == "r~1"
    assert {first.request_id, second.request_id} == {"r~1"}  # the new attempt is called off


# -- one attempt streamed by two workers: tokens by position ----------------------------------


def at(request_id: str, tokens: list[int], index: int, finish: str | None = None) -> wire.Tokens:
    return wire.Tokens(
        deltas=[wire.TokenDelta(request_id=request_id, token_ids=tokens, index=index,
                                finish_reason=finish)]
    )  # fmt: skip


async def streamed(tmp_path, messages: list[wire.Tokens], num_deltas: int) -> list:
    """What the handler gets when a worker pushes `messages` to the gateway's stream socket."""
    async with opened(tmp_path) as link:
        worker = link.context.socket(zmq.PUSH)
        try:
            worker.connect(f"ipc://{tmp_path}/stream")
            for message in messages:
                await wire.async_send(worker, message)
            got = [await asyncio.wait_for(link.queue.get(), 5) for _ in range(num_deltas)]
        finally:
            worker.close(linger=0)  # an open socket would hang the context's term
    return [(d.token_ids, d.finish_reason) for d in got]


def test_a_first_token_that_never_came_is_taken_from_the_decode_workers_repeat(tmp_path):
    # The prefill worker's first token [7] was lost with its connection; the decode worker
    # streams it again ahead of its own.
    messages = [at("r", [7, 8], 0), at("r", [9], 2, "length")]
    got = asyncio.run(streamed(tmp_path, messages, 2))
    assert got == [([7, 8], None), ([9], "length")]


def test_a_first_token_late_or_early_reaches_the_handler_once(tmp_path):
    late = [at("r", [7, 8], 0), at("r", [7], 0), at("r", [9], 2, "length")]
    assert asyncio.run(streamed(tmp_path, late, 2)) == [([7, 8], None), ([9], "length")]
    early = [at("r", [7], 0), at("r", [7, 8], 0), at("r", [9], 2, "length")]
    (tmp_path / "early").mkdir()
    got = asyncio.run(streamed(tmp_path / "early", early, 3))
    assert got == [([7], None), ([8], None), ([9], "length")]


async def stream_with_a_hole(tmp_path) -> tuple[wire.Cancel, wire.Submit, list]:
    async with opened(tmp_path) as link:
        scheduler, queue = link.scheduler, link.queue
        await scheduler.send(at("r", [7], 0))
        await scheduler.send(at("r", [9], 2))  # token 1 never comes
        cancel = await scheduler.expect(wire.Cancel)
        resubmit = await scheduler.expect(wire.Submit)
        await scheduler.reply(resubmit.request_id)
        await scheduler.send(at("r", [10], 2))  # the abandoned attempt's: dropped
        await scheduler.send(at(resubmit.request_id, [8, 9], 1, "length"))
        got = [await asyncio.wait_for(queue.get(), 5) for _ in range(2)]
    return cancel, resubmit, [(d.token_ids, d.finish_reason) for d in got]


def test_a_stream_with_a_hole_is_abandoned_and_resumed_from_what_arrived(tmp_path):
    cancel, resubmit, got = asyncio.run(stream_with_a_hole(tmp_path))
    assert cancel.request_id == "r" and "tokens missing" in cancel.reason
    assert resubmit.request_id == "r~1" and resubmit.output_token_ids == [7]
    assert got == [([7], None), ([8, 9], "length")]


# -- a stream whose last delta was lost: the scheduler says where it ended --------------------

GRACE_S = 0.3


def ended(request_id: str, finish: str, length: int) -> wire.StreamEnded:
    return wire.StreamEnded(request_id=request_id, finish_reason=finish, output_length=length)


async def last_tokens_lost(tmp_path) -> tuple[wire.Submit, list]:
    async with opened(tmp_path, GRACE_S) as link:
        scheduler, queue = link.scheduler, link.queue
        await scheduler.send(at("r", [7], 0))
        await scheduler.send(at("r", [8], 1))
        # The worker's last delta, [9] with the finish, never comes.
        await scheduler.send(ended("r", "length", 3))
        resubmit = await asyncio.wait_for(scheduler.expect(wire.Submit), 5)
        await scheduler.reply(resubmit.request_id)
        await scheduler.send(at("r", [9], 2, "length"))  # far too late, from the ended attempt
        await scheduler.send(at(resubmit.request_id, [9], 2, "length"))
        got = [await asyncio.wait_for(queue.get(), 5) for _ in range(3)]
    return resubmit, [(d.token_ids, d.finish_reason) for d in got]


def test_a_stream_whose_last_tokens_were_lost_resumes_from_what_came(tmp_path):
    resubmit, got = asyncio.run(last_tokens_lost(tmp_path))
    assert resubmit.request_id == "r~1" and resubmit.output_token_ids == [7, 8]
    assert got == [([7], None), ([8], None), ([9], "length")]


async def finish_lost(tmp_path, finish: str, **sampling) -> tuple[wire.TokenDelta, bool]:
    async with opened(tmp_path, GRACE_S, **sampling) as link:
        scheduler, queue = link.scheduler, link.queue
        num_tokens = 0 if finish == "rejected" else 2
        if num_tokens:
            await scheduler.send(at("r", [7, 8], 0))
            await asyncio.wait_for(queue.get(), 5)
        await scheduler.send(ended("r", finish, num_tokens))  # every token came, not the end
        last = await asyncio.wait_for(queue.get(), 5)
        resubmitted = await quiet_for(scheduler, wire.Submit, 3 * GRACE_S)
    return last, resubmitted


async def quiet_for(scheduler: FakeScheduler, kind: type, seconds: float) -> bool:
    """Whether a message of `kind` came within `seconds`."""
    try:
        await asyncio.wait_for(scheduler.expect(kind), seconds)
    except TimeoutError:
        return False
    return True


def test_a_stream_whose_finish_alone_was_lost_ends_as_its_worker_ended_it(tmp_path):
    last, resubmitted = asyncio.run(finish_lost(tmp_path, "stop", logprobs=0))
    assert (last.token_ids, last.finish_reason, last.index, last.logprobs) == ([], "stop", 2, [])
    assert not resubmitted


def test_a_refusal_whose_message_was_lost_fails_with_a_clear_error(tmp_path):
    last, resubmitted = asyncio.run(finish_lost(tmp_path, "rejected"))
    assert last.finish_reason == "error" and "rejected" in last.error and not resubmitted


async def end_told_ahead_of_a_slow_stream(tmp_path) -> tuple[list, bool]:
    """The scheduler's word comes first (the gateway reads its stream behind a backlog), and
    the tokens trickle in for longer than the grace, each well within it: nothing is resumed."""
    grace_s = 1.0
    async with opened(tmp_path, grace_s) as link:
        scheduler, queue = link.scheduler, link.queue
        await scheduler.send(ended("r", "length", 6))
        for index in range(6):
            await asyncio.sleep(grace_s / 4)
            await scheduler.send(at("r", [index], index, "length" if index == 5 else None))
        got = [await asyncio.wait_for(queue.get(), 5) for _ in range(6)]
        resubmitted = await quiet_for(scheduler, wire.Submit, 2 * grace_s)
    return [(d.token_ids, d.finish_reason) for d in got], resubmitted


def test_a_stream_still_coming_after_its_end_was_told_is_waited_for(tmp_path):
    got, resubmitted = asyncio.run(end_told_ahead_of_a_slow_stream(tmp_path))
    assert got == [([i], None) for i in range(5)] + [([5], "length")]
    assert not resubmitted


async def wrong_stream_ends(tmp_path) -> tuple[list, bool]:
    """A stream end for an attempt this gateway does not run, and one with a negative length:
    both dropped, and the request's own stream goes on untouched."""
    async with opened(tmp_path, GRACE_S) as link:
        scheduler, queue = link.scheduler, link.queue
        await scheduler.send(at("r", [7], 0))
        await scheduler.send(ended("someone-else", "length", 3))
        await scheduler.send(ended("r", "length", -1))
        resubmitted = await quiet_for(scheduler, wire.Submit, 3 * GRACE_S)
        await scheduler.send(at("r", [8], 1, "length"))
        got = [await asyncio.wait_for(queue.get(), 5) for _ in range(2)]
    return [(d.token_ids, d.finish_reason) for d in got], resubmitted


def test_a_wrong_stream_end_is_dropped_and_loses_nothing(tmp_path):
    got, resubmitted = asyncio.run(wrong_stream_ends(tmp_path))
    assert got == [([7], None), ([8], "length")] and not resubmitted
