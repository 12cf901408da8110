"""The gateway's cluster link when a scheduler restart, a crowd of pending submits or a late
loss meets a resumption: no attempt may run for nobody, and no healthy stream may fail. The
scheduler is played by the test on a real ROUTER socket (`test_gateway_resume.FakeScheduler`)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator

import pytest
import zmq.asyncio

from services.gateway.cluster import ClusterClient, SubmitRefused
from shared import wire
from shared.lifecycle import GatewayEvents
from shared.logs import get_logger
from tests.integration.test_gateway_resume import FakeScheduler, delta, submit


def status(epoch: str) -> wire.ClusterStatus:
    return wire.ClusterStatus(num_prefill=1, num_decode=1, num_queued=0, num_in_flight=0,
                              scheduler_epoch=epoch)  # fmt: skip


def unknown_gateway(request_id: str) -> wire.SubmitReply:
    """A restarted scheduler's answer before this gateway's HELLO reached it."""
    message = "gateway 'g' has not said HELLO"  # services/scheduler/core.py's words
    return wire.SubmitReply(request_id=request_id, accepted=False, status_code=400,
                            message=message, retry_after_s=None)  # fmt: skip


@contextlib.asynccontextmanager
async def played(tmp_path, **client_args) -> AsyncIterator[tuple[ClusterClient, FakeScheduler]]:
    """A gateway's cluster link to a scheduler (epoch "e1") the test plays. Its status never
    goes quiet here, so the only HELLOs after the first are those the link says on purpose."""
    context = zmq.asyncio.Context()
    scheduler = FakeScheduler(context, f"ipc://{tmp_path}/scheduler")
    client = ClusterClient(f"ipc://{tmp_path}/scheduler", f"ipc://{tmp_path}/stream",
                           f"ipc://{tmp_path}/stream", "g", "m", GatewayEvents(get_logger()),
                           status_timeout_s=60.0, **client_args)  # fmt: skip
    await client.start()
    try:
        await scheduler.expect(wire.Hello)
        await scheduler.send(status("e1"))
        yield client, scheduler
    finally:
        await client.close()
        scheduler.socket.close(linger=0)
        context.term()


async def admitted(client: ClusterClient, scheduler: FakeScheduler, request_id: str):
    caller = asyncio.create_task(client.submit(submit(request_id)))
    assert (await scheduler.expect(wire.Submit)).request_id == request_id
    await scheduler.reply(request_id)
    return await caller


async def serve(scheduler: FakeScheduler, seconds: float) -> list[wire.Message]:
    """Every message the scheduler gets for `seconds`, each SUBMIT accepted."""
    got: list[wire.Message] = []
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds):
            while True:
                got.append(message := await scheduler.expect(wire.Message))
                if isinstance(message, wire.Submit):
                    await scheduler.reply(message.request_id)
    return got


def ids(messages: list[wire.Message], kind: type) -> set[str]:
    return {m.request_id for m in messages if isinstance(m, kind)}


# -- a scheduler restart while a request's first SUBMIT awaits its answer -----------------------


async def restarted_before_the_first_answer(tmp_path, client_leaves: bool):
    async with played(tmp_path) as (client, scheduler):
        caller = asyncio.create_task(client.submit(submit("r"), timeout_s=1.0))
        assert (await scheduler.expect(wire.Submit)).request_id == "r"  # then the scheduler dies
        await scheduler.send(status("e2"))  # its successor, which takes whatever comes
        served = asyncio.create_task(serve(scheduler, 2.0))
        if client_leaves:
            await asyncio.sleep(0.3)
            caller.cancel()
        outcome = (await asyncio.gather(caller, return_exceptions=True))[0]
        return outcome, await served


@pytest.mark.parametrize("client_leaves", [False, True])
def test_a_restart_before_the_first_answer_leaves_nothing_running(tmp_path, client_leaves):
    """The request was resumed as `r~1` by the restart and accepted, while its handler still
    waited for `r`'s answer: the 503 (or the client gone) called off `r` only, and `r~1` ran to
    its max_tokens for nobody. Now the answer alone settles it."""
    outcome, messages = asyncio.run(restarted_before_the_first_answer(tmp_path, client_leaves))
    if client_leaves:
        assert isinstance(outcome, asyncio.CancelledError)
    else:
        assert isinstance(outcome, SubmitRefused) and outcome.status_code == 503
    assert "r" in ids(messages, wire.Cancel)
    assert ids(messages, wire.Submit) == set()  # no attempt its handler would not hear of


async def resumed_before_the_first_answer(tmp_path):
    async with played(tmp_path) as (client, scheduler):
        caller = asyncio.create_task(client.submit(submit("r"), timeout_s=1.0))
        assert (await scheduler.expect(wire.Submit)).request_id == "r"
        await scheduler.send(delta("r", [], finish="lost"))  # its answer is late, or lost
        messages = await serve(scheduler, 2.0)
        outcome = (await asyncio.gather(caller, return_exceptions=True))[0]
        return outcome, messages


def test_a_request_ended_by_its_submit_failing_calls_off_its_resumed_attempt(tmp_path):
    """However a later attempt came to be, the handler's 503 must not leave it running."""
    outcome, messages = asyncio.run(resumed_before_the_first_answer(tmp_path))
    assert isinstance(outcome, SubmitRefused) and outcome.status_code == 503
    assert ids(messages, wire.Submit) == {"r~1"}
    assert ids(messages, wire.Cancel) == {"r", "r~1"}


# -- an older resumption overtaken by a newer one (the scheduler restarted meanwhile) -----------


async def restart_while_resuming_waits_out_a_503(tmp_path):
    async with played(tmp_path) as (client, scheduler):
        queue = await admitted(client, scheduler, "r")
        await scheduler.send(delta("r", [], finish="lost"))
        assert (await scheduler.expect(wire.Submit)).request_id == "r~1"
        await scheduler.reply("r~1", 503)  # it waits a second to ask again
        await scheduler.send(status("e2"))  # meanwhile the scheduler restarts: r~2 takes over
        assert (await scheduler.expect(wire.Submit)).request_id == "r~2"
        await scheduler.reply("r~2")
        messages = await serve(scheduler, 1.5)
        await scheduler.send(delta("r~2", [5], finish="length"))
        got = await asyncio.wait_for(queue.get(), 5)
        return messages, got


def test_an_overtaken_resumption_does_not_submit_again(tmp_path):
    messages, got = asyncio.run(restart_while_resuming_waits_out_a_503(tmp_path))
    assert ids(messages, wire.Submit) == set()  # r~1 again would run beside r~2
    assert (got.token_ids, got.finish_reason) == ([5], "length")


async def restart_while_resuming_awaits_its_answer(tmp_path, late_answer: int):
    async with played(tmp_path) as (client, scheduler):
        queue = await admitted(client, scheduler, "r")
        await scheduler.send(delta("r", [], finish="lost"))
        assert (await scheduler.expect(wire.Submit)).request_id == "r~1"  # not answered yet
        await scheduler.send(status("e2"))
        assert (await scheduler.expect(wire.Submit)).request_id == "r~2"
        await scheduler.reply("r~2")
        await scheduler.reply("r~1", late_answer)  # r~1 reached the new scheduler after all
        messages = await serve(scheduler, 0.5)
        await scheduler.send(delta("r~2", [5], finish="length"))
        got = await asyncio.wait_for(queue.get(), 5)
        return messages, got


@pytest.mark.parametrize("late_answer", [200, 400])
def test_an_overtaken_resumption_calls_off_its_attempt_and_fails_nothing(tmp_path, late_answer):
    """Its answer came after r~2 took over: accepted, r~1 ran for nobody; refused, the
    request failed (an error delta) while r~2 streamed."""
    messages, got = asyncio.run(restart_while_resuming_awaits_its_answer(tmp_path, late_answer))
    assert (got.token_ids, got.finish_reason, got.error) == ([5], "length", None)
    assert ids(messages, wire.Cancel) == ({"r~1"} if late_answer == 200 else set())


# -- a resumption behind a crowd of new submits --------------------------------------------------


async def resumed_past_the_pending_bound(tmp_path):
    async with played(tmp_path, max_pending_submits=1) as (client, scheduler):
        queue = await admitted(client, scheduler, "r")
        crowd = asyncio.create_task(client.submit(submit("x")))  # awaits its answer: the bound
        assert (await scheduler.expect(wire.Submit)).request_id == "x"
        await scheduler.send(delta("r", [7]))
        await scheduler.send(delta("r", [], finish="lost"))
        resubmit = await asyncio.wait_for(scheduler.expect(wire.Submit), 5)
        await scheduler.reply(resubmit.request_id)
        await scheduler.send(delta(resubmit.request_id, [8], finish="length"))
        got = [await asyncio.wait_for(queue.get(), 5) for _ in range(2)]
        crowd.cancel()
        await asyncio.gather(crowd, return_exceptions=True)
        return resubmit, got


def test_a_resumption_is_not_refused_for_the_submits_awaiting_admission(tmp_path):
    """The scheduler never refuses a resumed request for load; the gateway's own bound on
    pending submits answered it 429, and the stream failed mid-way."""
    resubmit, got = asyncio.run(resumed_past_the_pending_bound(tmp_path))
    assert resubmit.request_id == "r~1" and resubmit.output_token_ids == [7]
    assert [(d.token_ids, d.finish_reason) for d in got] == [([7], None), ([8], "length")]


# -- a restarted scheduler that has not heard this gateway's HELLO yet ----------------------------


async def refused_as_a_stranger(tmp_path):
    async with played(tmp_path) as (client, scheduler):
        caller = asyncio.create_task(client.submit(submit("r")))
        assert (await scheduler.expect(wire.Submit)).request_id == "r"
        await scheduler.send(unknown_gateway("r"))
        outcome = (await asyncio.gather(caller, return_exceptions=True))[0]
        hello = await asyncio.wait_for(scheduler.expect(wire.Hello), 1.0)
        return outcome, hello


def test_a_submit_refused_as_from_a_stranger_is_a_503_and_the_gateway_says_hello(tmp_path):
    """It was a 400 invalid_request_error with no Retry-After, until the gateway noticed the
    quiet (3 s) and said HELLO again."""
    outcome, hello = asyncio.run(refused_as_a_stranger(tmp_path))
    assert isinstance(outcome, SubmitRefused)
    assert (outcome.status_code, outcome.retry_after_s) == (503, 1.0)
    assert hello.peer_id == "g" and hello.role == "gateway"


async def resumption_refused_as_from_a_stranger(tmp_path):
    async with played(tmp_path) as (client, scheduler):
        queue = await admitted(client, scheduler, "r")
        await scheduler.send(delta("r", [], finish="lost"))
        assert (await scheduler.expect(wire.Submit)).request_id == "r~1"
        await scheduler.send(unknown_gateway("r~1"))
        await asyncio.wait_for(scheduler.expect(wire.Hello), 1.0)
        again = await asyncio.wait_for(scheduler.expect(wire.Submit), 5)  # asked again
        await scheduler.reply(again.request_id)
        await scheduler.send(delta(again.request_id, [5], finish="length"))
        return again, await asyncio.wait_for(queue.get(), 5)


def test_a_resumption_refused_as_from_a_stranger_says_hello_and_asks_again(tmp_path):
    again, got = asyncio.run(resumption_refused_as_from_a_stranger(tmp_path))
    assert again.request_id == "r~1"
    assert (got.token_ids, got.finish_reason, got.error) == ([5], "length", None)


# -- a loss told after the stream's end ----------------------------------------------------------


async def lost_after_its_end(tmp_path):
    async with played(tmp_path) as (client, scheduler):
        queue = await admitted(client, scheduler, "r")
        await scheduler.send(delta("r", [7], finish="length"))
        await scheduler.send(delta("r", [], finish="lost"))  # the handler has not read the end
        messages = await serve(scheduler, 0.5)
        return messages, await asyncio.wait_for(queue.get(), 5)


def test_a_loss_after_the_streams_end_resumes_nothing(tmp_path):
    messages, got = asyncio.run(lost_after_its_end(tmp_path))
    assert ids(messages, wire.Submit) == set()
    assert (got.token_ids, got.finish_reason) == ([7], "length")


# -- a scheduler restart while a resumed attempt waits in its queue ------------------------------


async def restarted_with_a_resumption_queued(tmp_path):
    async with played(tmp_path) as (client, scheduler):
        queue = await admitted(client, scheduler, "r")
        await scheduler.send(delta("r", [7]))
        await scheduler.send(delta("r", [], finish="preempted"))  # handed back to recompute
        assert (await scheduler.expect(wire.Submit)).request_id == "r~1"
        await scheduler.reply("r~1")  # queued there, waiting for a prefill worker
        await scheduler.send(status("e2"))  # and lost with the scheduler
        resubmit = await asyncio.wait_for(scheduler.expect(wire.Submit), 5)
        await scheduler.reply(resubmit.request_id)
        await scheduler.send(delta(resubmit.request_id, [8]))
        await scheduler.send(status("e3"))  # r~2 brought a token: it is decoding on a worker
        messages = await serve(scheduler, 0.5)
        await scheduler.send(delta(resubmit.request_id, [9], finish="length"))
        got = [await asyncio.wait_for(queue.get(), 5) for _ in range(3)]
        return resubmit, messages, got


def test_a_restart_resumes_an_attempt_that_had_brought_no_token_yet(tmp_path):
    """Only requests with no token at all were resumed: one resumed from its tokens (after a
    preemption or a lost worker) and still in the old scheduler's queue was lost with it, and
    its client waited out the request's time limit for tokens that would never come."""
    resubmit, messages, got = asyncio.run(restarted_with_a_resumption_queued(tmp_path))
    assert resubmit.request_id == "r~2" and resubmit.output_token_ids == [7]
    assert ids(messages, wire.Submit) == set()
    assert [(d.token_ids, d.finish_reason) for d in got] == [([7], None), ([8], None),
                                                              ([9], "length")]  # fmt: skip


async def restarted_after_an_end_without_tokens(tmp_path):
    async with played(tmp_path) as (client, scheduler):
        queue = await admitted(client, scheduler, "r")
        # The scheduler failed it before its first token; its handler has not read that yet.
        failed = wire.TokenDelta(request_id="r", token_ids=[], finish_reason="timeout",
                                 error="no first token within its deadline")  # fmt: skip
        await scheduler.send(wire.Tokens(deltas=[failed]))
        await scheduler.send(status("e2"))
        messages = await serve(scheduler, 0.5)
        got = await asyncio.wait_for(queue.get(), 5)
        await client.cancel("r", "failed")  # what the handler does on the error
        messages += await serve(scheduler, 0.3)
        return messages, got, queue.empty()


def test_a_restart_does_not_resume_a_request_whose_stream_ended(tmp_path):
    """An ended request without tokens was resumed as r~1, which then ran for nobody: the
    handler's cancel calls off an attempt only while its stream has not ended."""
    messages, got, nothing_else = asyncio.run(restarted_after_an_end_without_tokens(tmp_path))
    assert ids(messages, wire.Submit) == set()
    assert (got.finish_reason, got.error) == ("timeout", "no first token within its deadline")
    assert nothing_else


# -- a request decoding when the scheduler restarted, whose worker then goes silent -------------


async def orphaned_then_silent(tmp_path, num_restarts: int):
    async with played(tmp_path, orphan_silence_s=0.3) as (client, scheduler):
        queue = await admitted(client, scheduler, "r")
        await scheduler.send(delta("r", [7]))
        for epoch in range(2, 2 + num_restarts):  # its worker died unseen: no token, no "lost"
            await scheduler.send(status(f"e{epoch}"))
        await asyncio.sleep(0.1)
        num_chores = len(client._chores)
        messages = [await asyncio.wait_for(scheduler.expect(wire.Message), 5)]
        while not isinstance(resubmit := messages[-1], wire.Submit):
            messages.append(await asyncio.wait_for(scheduler.expect(wire.Message), 5))
        await scheduler.reply(resubmit.request_id)
        await scheduler.send(delta("r", [99]))  # late, from the abandoned attempt: dropped
        await scheduler.send(delta(resubmit.request_id, [8], finish="length"))
        after = await serve(scheduler, 0.8)
        got = [await asyncio.wait_for(queue.get(), 5) for _ in range(2)]
        return resubmit, num_chores, messages, after, got


@pytest.mark.parametrize("num_restarts", [1, 2])
def test_an_orphan_that_goes_silent_is_resumed_from_its_tokens(tmp_path, num_restarts):
    """A request decoding when the scheduler restarted was left to its worker; had that worker
    died before the new scheduler adopted it (or the loss been told before this gateway's
    HELLO), its client waited out the request timeout. One watchdog an attempt, restarts or
    not; the abandoned attempt is called off."""
    outcome = asyncio.run(orphaned_then_silent(tmp_path, num_restarts))
    resubmit, num_chores, messages, after, got = outcome
    assert (resubmit.request_id, resubmit.output_token_ids) == ("r~1", [7])
    assert resubmit.resumed_from == "r" and num_chores == 1
    assert ids(messages, wire.Cancel) == {"r"}  # called off ahead of its successor
    assert after == []  # once: no second watchdog, nor one for r~1
    assert [(d.token_ids, d.finish_reason) for d in got] == [([7], None), ([8], "length")]


async def orphan_streaming_on(tmp_path, ends: bool):
    async with played(tmp_path, orphan_silence_s=0.4) as (client, scheduler):
        queue = await admitted(client, scheduler, "r")
        await scheduler.send(delta("r", [7]))
        await scheduler.send(status("e2"))
        served = asyncio.create_task(serve(scheduler, 1.3))
        for token in range(8, 16):  # one every 0.1 s: 0.8 s, two silences' worth
            await asyncio.sleep(0.1)
            finish = "length" if ends and token == 15 else None
            await scheduler.send(delta("r", [token], finish))
        while_streaming = await served  # and 0.5 s after, silent unless it ended
        after = await serve(scheduler, 0.8)
        num_chores = len(client._chores)
        got = [await asyncio.wait_for(queue.get(), 5) for _ in range(9)]
        return while_streaming, after, num_chores, got


def test_an_orphan_that_streams_on_is_resumed_only_once_silent(tmp_path):
    """Streaming on past two silences' worth it is left alone; once its tokens stop it is
    resumed with them all (the orphan's worker died after streaming on a while)."""
    while_streaming, after, num_chores, got = asyncio.run(orphan_streaming_on(tmp_path, False))
    resumed = [m for m in while_streaming + after if isinstance(m, wire.Submit)]
    assert [(m.request_id, m.output_token_ids) for m in resumed] == [("r~1", list(range(7, 16)))]
    assert [d.token_ids for d in got] == [[t] for t in range(7, 16)]


def test_an_orphan_that_streams_to_its_end_is_left_alone(tmp_path):
    while_streaming, after, num_chores, got = asyncio.run(orphan_streaming_on(tmp_path, True))
    assert while_streaming + after == [] and num_chores == 0  # its watchdog ended with it
    assert got[-1].finish_reason == "length"


async def orphan_cancelled(tmp_path):
    async with played(tmp_path, orphan_silence_s=0.3) as (client, scheduler):
        await admitted(client, scheduler, "r")
        await scheduler.send(delta("r", [7]))
        await scheduler.send(status("e2"))
        await asyncio.sleep(0.1)
        await client.cancel("r", "client gone")
        messages = await serve(scheduler, 0.8)
        return messages, len(client._chores)


def test_an_orphan_cancelled_by_its_client_is_not_resumed(tmp_path):
    messages, num_chores = asyncio.run(orphan_cancelled(tmp_path))
    assert ids(messages, wire.Submit) == set() and ids(messages, wire.Cancel) == {"r"}
    assert num_chores == 0  # its watchdog ended with the request


async def resumption_told_to_wait_an_hour(tmp_path):
    async with played(tmp_path) as (client, scheduler):
        queue = await admitted(client, scheduler, "r")
        await scheduler.send(delta("r", [], finish="lost"))
        assert (await scheduler.expect(wire.Submit)).request_id == "r~1"
        refused = wire.SubmitReply(request_id="r~1", accepted=False, status_code=503,
                                   message="full", retry_after_s=3600.0)  # fmt: skip
        await scheduler.send(refused)
        started = asyncio.get_running_loop().time()
        again = await asyncio.wait_for(scheduler.expect(wire.Submit), 5)  # once patience ends
        await scheduler.send(dataclasses.replace(refused, request_id=again.request_id))
        got = await asyncio.wait_for(queue.get(), 5)
        return got, asyncio.get_running_loop().time() - started


def test_a_resumptions_wait_for_room_is_bounded_by_its_patience(tmp_path, monkeypatch):
    """A 503 asking for an hour's wait (the scheduler takes up to 3,600 s) kept a resumption
    asleep that long past its patience: its client waited the hour for an error."""
    monkeypatch.setattr("services.gateway.cluster.RESUME_PATIENCE_S", 0.5)
    got, waited_s = asyncio.run(resumption_told_to_wait_an_hour(tmp_path))
    assert got.finish_reason == "error" and "could not resume" in got.error
    assert waited_s < 5
