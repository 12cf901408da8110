"""Closing the gateway's cluster link (the gateway's shutdown) with chores of its own still
under way: a resumption awaiting its answer, a stream end awaiting its grace. None may outlive
the link, to fail later on its closed sockets ("Task exception was never retrieved")."""

from __future__ import annotations

import asyncio

from shared import wire
from tests.integration.test_gateway_resume import GRACE_S, at, delta, ended, opened, submit


async def closed_mid_chores(tmp_path) -> tuple[list[asyncio.Task], list[dict]]:
    loop = asyncio.get_running_loop()
    unhandled: list[dict] = []
    loop.set_exception_handler(lambda _loop, context: unhandled.append(context))
    async with opened(tmp_path, GRACE_S) as link:
        scheduler, client = link.scheduler, link.client
        await scheduler.send(at("r", [7], 0))
        await asyncio.wait_for(link.queue.get(), 5)
        await scheduler.send(ended("r", "length", 3))  # its last tokens lost: resumed at grace
        # A second request, lost: its resumption's SUBMIT is never answered.
        submitted = asyncio.create_task(client.submit(submit("s")))
        await scheduler.expect(wire.Submit)
        await scheduler.reply("s")
        await submitted
        await scheduler.send(delta("s", [], finish="lost"))
        assert (await asyncio.wait_for(scheduler.expect(wire.Submit), 5)).request_id == "s~1"
        chores = list(client._chores)
    await asyncio.sleep(3 * GRACE_S)  # the stream end's grace runs out after the close
    return chores, unhandled


def test_closing_the_link_ends_its_chores(tmp_path):
    chores, unhandled = asyncio.run(closed_mid_chores(tmp_path))
    assert chores and all(chore.done() for chore in chores)
    assert not [chore.exception() for chore in chores if not chore.cancelled()]
    assert unhandled == []
