"""The gateway's cluster link calling off the attempts it replaces: those a scheduler restart
resumed (their prefill job or decode reservation, held on, ran for nobody), and a resumption's
SUBMIT that went unanswered (asked again under its own id, a late answer to the first settled
the second); and a restart read together with a first SUBMIT's acceptance. The scheduler is
played by the test (`test_gateway_resume.FakeScheduler`), or is the real service turned over
by the test (`test_scheduler_restart_adoption.turn`)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses

import zmq
import zmq.asyncio

from services.gateway import cluster
from services.gateway.cluster import ClusterClient
from services.scheduler.service import SchedulerConfig, SchedulerService
from shared import wire
from shared.lifecycle import GatewayEvents
from shared.logs import get_logger
from tests.integration.test_gateway_cluster_resume import admitted, ids, played, serve, status
from tests.integration.test_gateway_resume import FakeScheduler, delta, submit
from tests.integration.test_scheduler_restart_adoption import (
    STATUS_TIMEOUT_S,
    decode_heartbeat,
    decode_hello,
    reply_to,
    turn,
)

# -- a restart resumes the requests that waited: their old attempts are called off --------------


async def restarted_with_requests_waiting(tmp_path) -> list[wire.Message]:
    async with played(tmp_path) as (client, scheduler):
        await admitted(client, scheduler, "queued")  # no token yet
        await admitted(client, scheduler, "decoding")
        await scheduler.send(delta("decoding", [7]))  # decoding on a worker: adopted
        await admitted(client, scheduler, "requeued")
        await scheduler.send(delta("requeued", [7]))
        await scheduler.send(delta("requeued", [], finish="preempted"))
        assert (await scheduler.expect(wire.Submit)).request_id == "requeued~1"
        await scheduler.reply("requeued~1")  # back in the queue, no token of its own yet
        await asyncio.sleep(0.1)
        await scheduler.send(status("e2"))
        return await serve(scheduler, 0.5)


def test_a_restart_calls_off_each_attempt_it_resumes(tmp_path):
    """An attempt with no token may be prefilling, or hold a decode reservation, rather than be
    lost in the old queue; resumed under a new id, it was left to run for nobody (its tokens
    dropped). The new scheduler keeps a cancel until a worker lists the id. The request that was
    decoding goes on: it is not resumed, nor called off."""
    messages = asyncio.run(restarted_with_requests_waiting(tmp_path))
    assert ids(messages, wire.Submit) == {"queued~1", "requeued~2"}
    assert ids(messages, wire.Cancel) == {"queued", "requeued~1"}


async def prefilling_across_a_restart(tmp_path, workers_first: bool) -> dict[str, wire.Cancel]:
    """Request "r" prefills on "p", its decode reservation on "d", as the scheduler restarts; both
    workers register with the new one and list "r" (before or after the gateway hears of the
    restart). The CANCEL each worker then gets for "r"."""
    context = zmq.asyncio.Context()
    address = f"ipc://{tmp_path}/scheduler"
    first = FakeScheduler(context, address)
    client = ClusterClient(address, f"ipc://{tmp_path}/stream", f"ipc://{tmp_path}/stream",
                           "g", "m", GatewayEvents(get_logger()),
                           status_timeout_s=STATUS_TIMEOUT_S)  # fmt: skip
    await client.start()
    service = loop = beating = None
    workers = {name: context.socket(zmq.DEALER) for name in ("p", "d")}
    try:
        await first.expect(wire.Hello)
        await first.send(status("first"))
        caller = asyncio.create_task(client.submit(submit("r")))
        await first.expect(wire.Submit)
        await first.reply("r")
        await caller  # then the scheduler stops, "r" prefilling: no token has come
        first.socket.close(linger=0)
        config = SchedulerConfig(address=address, model="m", heartbeat_interval_s=0.2)
        service = SchedulerService(config, context=zmq.Context())
        loop = asyncio.create_task(turn(service))
        if not workers_first:
            await resumed(client)
        for name, worker in workers.items():
            worker.setsockopt(zmq.LINGER, 0)
            worker.connect(address)
            role = "prefill" if name == "p" else "decode"
            hello = decode_hello(tmp_path)
            await wire.async_send(worker, dataclasses.replace(hello, peer_id=name, role=role))
            assert (await reply_to(worker, wire.HelloAck)).accepted
        beating = asyncio.create_task(heartbeats(workers))
        if workers_first:
            await asyncio.sleep(0.3)  # listed, and "d"'s reservation adopted
            await resumed(client)
        async with asyncio.timeout(5):
            return {name: await cancel_of("r", worker) for name, worker in workers.items()}
    finally:
        for task in (loop, beating):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await client.close()
        for worker in workers.values():
            worker.close(linger=0)
        if service is not None:
            service.socket.close(linger=0)
            service.security.stop()
            service.context.destroy(linger=0)
        first.socket.close(linger=0)
        context.term()


async def resumed(client: ClusterClient) -> None:
    """Until the gateway has heard the new scheduler's status and resumed "r"."""
    async with asyncio.timeout(5):
        while client._requests["r"].attempt_id == "r":
            await asyncio.sleep(0.01)


async def heartbeats(workers: dict[str, zmq.asyncio.Socket]) -> None:
    """Each worker lists "r" every 0.1 s (a prefill worker's job, a decode worker's reservation)."""
    while True:
        for name, worker in workers.items():
            beat = dataclasses.replace(decode_heartbeat(["r"]), peer_id=name, num_running=0)
            await wire.async_send(worker, beat)
        await asyncio.sleep(0.1)


async def cancel_of(request_id: str, worker: zmq.asyncio.Socket) -> wire.Cancel:
    while True:
        message = await wire.async_recv(worker)
        if isinstance(message, wire.Cancel) and message.request_id == request_id:
            return message


def test_the_workers_holding_a_resumed_attempt_are_told_to_let_it_go(tmp_path):
    """The gateway heard the restart first: its cancel of "r" waited at the new scheduler for
    the workers' listings. "r"'s prefill ran on, its KV went to the reserved decode worker,
    which decoded it to max_tokens for nobody (the gateway runs "r~1")."""
    cancels = asyncio.run(prefilling_across_a_restart(tmp_path, workers_first=False))
    assert set(cancels) == {"p", "d"}


def test_the_workers_that_listed_a_resumed_attempt_first_are_told_to_let_it_go(tmp_path):
    """The workers listed "r" before the gateway heard the restart: the decode worker's
    reservation was adopted (let go on the cancel), the prefill worker's job is given up on
    (cancelled at its next listing)."""
    cancels = asyncio.run(prefilling_across_a_restart(tmp_path, workers_first=True))
    assert set(cancels) == {"p", "d"}


# -- a resumption's SUBMIT that went unanswered, then answered late ------------------------------


async def resubmitted_after_a_late_answer(tmp_path, monkeypatch):
    monkeypatch.setattr(cluster, "RESUBMIT_ANSWER_S", 1.0)
    async with played(tmp_path) as (client, scheduler):
        queue = await admitted(client, scheduler, "r")
        await scheduler.send(delta("r", [7]))
        await scheduler.send(delta("r", [], finish="lost"))
        unanswered = await scheduler.expect(wire.Submit)  # the scheduler is slow: no answer
        cancel = await asyncio.wait_for(scheduler.expect(wire.Cancel), 5)
        again = await asyncio.wait_for(scheduler.expect(wire.Submit), 5)
        await scheduler.reply(unanswered.request_id)  # the late answer: it ran, then cancelled
        await scheduler.reply(again.request_id, 503)  # no worker just now: ask again shortly
        third = await asyncio.wait_for(scheduler.expect(wire.Submit), 5)
        await scheduler.reply(third.request_id)
        await scheduler.send(delta(third.request_id, [8], finish="length"))
        await scheduler.send(delta(unanswered.request_id, [99]))  # it ran a moment: dropped
        got = [await asyncio.wait_for(queue.get(), 5) for _ in range(2)]
        return unanswered, cancel, again, third, got


def test_a_late_answer_to_an_unanswered_resubmit_settles_only_its_own(tmp_path, monkeypatch):
    """The resumption asked again under the same id: the late answer to the first (which the
    gateway had called off) was taken for the second's, the second's refusal dropped, and the
    request waited out its time limit for an attempt nobody ran. Each SUBMIT after one that
    went unanswered is a new attempt: its own answer settles it, and a token of the first
    cannot mix into its stream."""
    unanswered, cancel, again, third, got = asyncio.run(
        resubmitted_after_a_late_answer(tmp_path, monkeypatch)
    )
    assert (unanswered.request_id, cancel.request_id) == ("r~1", "r~1")
    assert again.request_id == third.request_id == "r~2"
    assert again.output_token_ids == [7] and again.resumed_from == "r~1"
    assert [(d.token_ids, d.finish_reason) for d in got] == [([7], None), ([8], "length")]


# -- a restart told right behind the first SUBMIT's acceptance -----------------------------------


async def accepted_then_restarted(tmp_path) -> list[wire.Message]:
    async with played(tmp_path) as (client, scheduler):
        caller = asyncio.create_task(client.submit(submit("r")))
        assert (await scheduler.expect(wire.Submit)).request_id == "r"
        await scheduler.reply("r")  # queued there; and the scheduler dies at once
        await scheduler.send(status("e2"))  # read with the answer, before its handler ran
        await caller
        return await serve(scheduler, 0.5)


def test_a_restart_read_with_the_first_answer_resumes_the_request(tmp_path):
    """The answer and the new epoch's status were read in one go: the request still counted as
    awaiting its answer (its handler had not run), was not resumed, and waited out its time
    limit for the old scheduler's lost queue. An answer that came settles the request."""
    messages = asyncio.run(accepted_then_restarted(tmp_path))
    assert ids(messages, wire.Submit) == {"r~1"}
