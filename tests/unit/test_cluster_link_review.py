"""The gateway's cluster link over a long run of requests that end every way a request ends
(success, an error, its client gone mid-stream or mid-resumption, a lost worker, a scheduler
restart, a lost finish, a refusal, resumptions exhausted): no per-request state stays behind,
against a scheduler played by the test on a real ROUTER socket."""

from __future__ import annotations

import asyncio
import contextlib

import zmq
import zmq.asyncio

from services.gateway.cluster import MAX_RESUMES, ClusterClient, SubmitRefused
from shared import wire
from shared.lifecycle import GatewayEvents
from shared.logs import get_logger
from tests.integration.test_gateway_resume import FakeScheduler, delta, submit


def per_request_state(client: ClusterClient) -> dict[str, object]:
    state = {
        "requests": dict(client._requests),
        "attempts": dict(client._attempts),
        "replies": dict(client._replies),
        "watched_orphans": set(client._watched_orphans),
    }
    return {name: held for name, held in state.items() if held}


async def next_delta(queue: asyncio.Queue) -> wire.TokenDelta:
    return await asyncio.wait_for(queue.get(), 5)


async def submitted(client: ClusterClient, scheduler: FakeScheduler, request_id: str):
    task = asyncio.create_task(client.submit(submit(request_id)))
    await scheduler.expect(wire.Submit)
    await scheduler.reply(request_id)
    return await task


async def resubmitted(scheduler: FakeScheduler) -> str:
    resubmit = await scheduler.expect(wire.Submit)
    await scheduler.reply(resubmit.request_id)
    return resubmit.request_id


async def status(scheduler: FakeScheduler, epoch: str) -> None:
    await scheduler.send(wire.ClusterStatus(num_prefill=1, num_decode=1, num_queued=0,
                                            num_in_flight=0, scheduler_epoch=epoch))  # fmt: skip


async def every_end(client: ClusterClient, scheduler: FakeScheduler) -> None:
    """One request ended each way, its handler doing what the gateway's handlers do: `finished`
    after a finish, `cancel` after an error or when its client leaves."""
    await status(scheduler, "e1")
    # Success.
    queue = await submitted(client, scheduler, "ok")
    await scheduler.send(delta("ok", [5], finish="stop"))
    assert (await next_delta(queue)).finish_reason == "stop"
    client.finished("ok")
    # An error the scheduler sends.
    queue = await submitted(client, scheduler, "err")
    await scheduler.send(delta("err", [], finish="error"))
    assert (await next_delta(queue)).finish_reason == "error"
    await client.cancel("err", "client gone")
    # The client gone mid-stream.
    queue = await submitted(client, scheduler, "gone")
    await scheduler.send(delta("gone", [5]))
    await next_delta(queue)
    await client.cancel("gone", "client gone")
    # Lost, resumed, finished.
    queue = await submitted(client, scheduler, "lost")
    await scheduler.send(delta("lost", [5]))
    await scheduler.send(delta("lost", [], finish="lost"))
    attempt = await resubmitted(scheduler)
    await scheduler.send(delta(attempt, [6], finish="stop"))
    assert [(await next_delta(queue)).token_ids for _ in range(2)] == [[5], [6]]
    client.finished("lost")
    # Lost, and the client gone while its resumption awaits its answer.
    queue = await submitted(client, scheduler, "lost-gone")
    await scheduler.send(delta("lost-gone", [], finish="lost"))
    attempt = (await scheduler.expect(wire.Submit)).request_id
    await client.cancel("lost-gone", "client gone")
    await scheduler.reply(attempt)  # (its cancel follows, which a scheduler reads after it)
    # Resumptions exhausted.
    queue = await submitted(client, scheduler, "exhausted")
    attempt = "exhausted"
    for _ in range(MAX_RESUMES):
        await scheduler.send(delta(attempt, [], finish="lost"))
        attempt = await resubmitted(scheduler)
    await scheduler.send(delta(attempt, [], finish="lost"))
    assert (await next_delta(queue)).finish_reason == "error"
    await client.cancel("exhausted", "client gone")
    # Refused, and cancelled while awaiting its answer.
    with contextlib.suppress(SubmitRefused):
        refused = asyncio.create_task(client.submit(submit("refused")))
        await scheduler.expect(wire.Submit)
        await scheduler.reply("refused", 429)
        await refused
    waiting = asyncio.create_task(client.submit(submit("waiting")))
    await scheduler.expect(wire.Submit)
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)
    # A finish lost, the stream's end told.
    queue = await submitted(client, scheduler, "finish-lost")
    await scheduler.send(delta("finish-lost", [5]))
    await next_delta(queue)
    await scheduler.send(wire.StreamEnded(request_id="finish-lost", finish_reason="stop",
                                          output_length=1))  # fmt: skip
    assert (await next_delta(queue)).finish_reason == "stop"
    client.finished("finish-lost")
    # A scheduler restart: one queued (resumed), one decoding (an orphan, then finished).
    queued = await submitted(client, scheduler, "queued")
    decoding = await submitted(client, scheduler, "decoding")
    await scheduler.send(delta("decoding", [5]))
    await next_delta(decoding)
    await status(scheduler, "e2")
    attempt = await resubmitted(scheduler)
    await scheduler.send(delta(attempt, [7], finish="stop"))
    await scheduler.send(delta("decoding", [6], finish="stop"))
    assert (await next_delta(queued)).token_ids == [7]
    client.finished("queued")
    assert (await next_delta(decoding)).token_ids == [6]
    client.finished("decoding")


async def long_run(tmp_path) -> dict[str, object]:
    context = zmq.asyncio.Context()
    scheduler = FakeScheduler(context, f"ipc://{tmp_path}/scheduler")
    stream = f"ipc://{tmp_path}/stream"
    client = ClusterClient(f"ipc://{tmp_path}/scheduler", stream, stream, "g", "m",
                           GatewayEvents(get_logger()), status_timeout_s=60.0,
                           stream_end_grace_s=0.05, orphan_silence_s=0.05)  # fmt: skip
    try:
        await client.start()
        await scheduler.expect(wire.Hello)
        await every_end(client, scheduler)
        await asyncio.sleep(0.3)  # the chores' watches (a stream's end, orphans) run out
        return per_request_state(client)
    finally:
        await client.close()
        scheduler.socket.close(linger=0)
        context.term()


def test_no_request_state_is_left_behind_whichever_way_requests_end(tmp_path):
    assert asyncio.run(long_run(tmp_path)) == {}


async def odd_delta_after_the_finish(tmp_path, odd: wire.TokenDelta) -> list[wire.Message]:
    """A finish, then (before the handler read it) a delta no worker sends after it: the
    request is over, and nothing may start running for it after its handler is done."""
    context = zmq.asyncio.Context()
    scheduler = FakeScheduler(context, f"ipc://{tmp_path}/scheduler")
    stream = f"ipc://{tmp_path}/stream"
    client = ClusterClient(f"ipc://{tmp_path}/scheduler", stream, stream, "g", "m",
                           GatewayEvents(get_logger()), status_timeout_s=60.0)  # fmt: skip
    try:
        await client.start()
        await scheduler.expect(wire.Hello)
        queue = await submitted(client, scheduler, "r")
        finish = wire.TokenDelta(request_id="r", token_ids=[5], finish_reason="stop", index=0)
        await scheduler.send(wire.Tokens(deltas=[finish, odd]))
        got = [await next_delta(queue)]
        client.finished("r")
        await asyncio.sleep(0.2)
        while not queue.empty():
            got.append(queue.get_nowait())
        assert [d.finish_reason for d in got] == ["stop"]
        sent = []
        with contextlib.suppress(TimeoutError):
            while True:
                sent.append(await asyncio.wait_for(scheduler.expect(wire.Message), 0.3))
        return sent
    finally:
        await client.close()
        scheduler.socket.close(linger=0)
        context.term()


def test_a_delta_with_a_hole_after_the_finish_starts_no_attempt(tmp_path):
    odd = wire.TokenDelta(request_id="r", token_ids=[9], index=4)
    sent = asyncio.run(odd_delta_after_the_finish(tmp_path, odd))
    submits = [m for m in sent if isinstance(m, wire.Submit)]
    cancels = {m.request_id for m in sent if isinstance(m, wire.Cancel)}
    assert all(s.request_id in cancels for s in submits), (submits, cancels)


async def restarted_amid_requests(tmp_path) -> list[wire.Message]:
    """Three requests across a scheduler restart whose new status comes again and again: one
    queued, one decoding, one whose first SUBMIT awaits its answer."""
    context = zmq.asyncio.Context()
    scheduler = FakeScheduler(context, f"ipc://{tmp_path}/scheduler")
    stream = f"ipc://{tmp_path}/stream"
    client = ClusterClient(f"ipc://{tmp_path}/scheduler", stream, stream, "g", "m",
                           GatewayEvents(get_logger()), status_timeout_s=60.0)  # fmt: skip
    try:
        await client.start()
        await scheduler.expect(wire.Hello)
        await status(scheduler, "e1")
        await submitted(client, scheduler, "queued")
        decoding = await submitted(client, scheduler, "decoding")
        await scheduler.send(delta("decoding", [5]))
        await next_delta(decoding)
        pending = asyncio.create_task(client.submit(submit("pending")))
        await scheduler.expect(wire.Submit)
        for _ in range(3):
            await status(scheduler, "e2")
        sent = []
        with contextlib.suppress(TimeoutError):
            while True:
                sent.append(await asyncio.wait_for(scheduler.expect(wire.Message), 0.3))
        pending.cancel()
        return sent
    finally:
        await client.close()
        scheduler.socket.close(linger=0)
        context.term()


def test_a_restart_resumes_each_queued_request_once_and_no_other(tmp_path):
    sent = asyncio.run(restarted_amid_requests(tmp_path))
    assert [(type(m).__name__, m.request_id) for m in sent] == [
        ("Cancel", "queued"),
        ("Submit", "queued~1"),
    ]
