"""A scheduler whose own loop stalled (its process stopped, or starved of the CPU) reads the
heartbeats that came meanwhile before it judges any worker silent. After a 20 s SIGSTOP it
dropped every healthy worker ("worker left rotation", silent 20 s) at its first tick, their
heartbeats unread in its own socket, and the requests they held were resumed for nothing."""

from __future__ import annotations

import asyncio
import signal
import time

import zmq
import zmq.asyncio

from shared import wire
from tests.helpers import scheduler_process, wait_for_line
from tests.integration.test_scheduler_restart_adoption import reply_to
from tests.unit.test_scheduler_core import heartbeat, hello

# (A 1 s timeout failed once on a loaded machine: this test's own beats came late, a true
# silence the scheduler was right to judge. Five intervals of slack became ten.)
INTERVAL_S, TIMEOUT_S = 0.2, 2.0
STALL_S = 2 * TIMEOUT_S


def test_a_stalled_scheduler_reads_its_heartbeats_before_judging_silence(tmp_path):
    address = f"ipc://{tmp_path}/scheduler"
    process = scheduler_process(
        address, "--heartbeat-interval-s", str(INTERVAL_S), "--heartbeat-timeout-s", str(TIMEOUT_S)
    )

    async def beat_through_a_stall() -> list[wire.HelloAck]:
        context = zmq.asyncio.Context()
        workers = {name: context.socket(zmq.DEALER) for name in ("p", "d")}
        refusals: list[wire.HelloAck] = []
        try:
            for name, role in (("p", "prefill"), ("d", "decode")):
                workers[name].setsockopt(zmq.LINGER, 0)
                workers[name].connect(address)
                await wire.async_send(workers[name], hello(name, role, address=f"{address}-{name}"))
                assert (await reply_to(workers[name], wire.HelloAck, seconds=30)).accepted
            stop_at = time.monotonic() + 2 * TIMEOUT_S
            resume_at = stop_at + STALL_S
            end_at = resume_at + 2 * TIMEOUT_S
            stopped = resumed = False
            while time.monotonic() < end_at:
                if not stopped and time.monotonic() >= stop_at:
                    process.send_signal(signal.SIGSTOP)
                    stopped = True
                if not resumed and time.monotonic() >= resume_at:
                    process.send_signal(signal.SIGCONT)
                    resumed = True
                for name, worker in workers.items():
                    await wire.async_send(worker, heartbeat(name))
                    while await worker.poll(0):  # a worker taken for gone is told to HELLO again
                        message = await wire.async_recv(worker)
                        if isinstance(message, wire.HelloAck) and not message.accepted:
                            refusals.append(message)
                await asyncio.sleep(INTERVAL_S)
            return refusals
        finally:
            for worker in workers.values():
                worker.close(linger=0)
            context.term()

    try:
        wait_for_line(process, b"scheduler listening", "the scheduler")
        refusals = asyncio.run(beat_through_a_stall())
    finally:
        process.send_signal(signal.SIGCONT)
        process.terminate()
        output = process.communicate(timeout=30)[0].decode()
    assert not refusals, refusals
    assert "worker left rotation" not in output, output[-3000:]
