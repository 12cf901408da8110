"""A worker killed with SIGKILL leaves the scheduler's rotation as soon as its connection closes
(within the grace of three heartbeat intervals), not after the heartbeat timeout: the streams
of the requests it held stood still for the whole timeout (10 s by default) while `tandem up`
saw the death in half a second. A live worker whose connection only blipped (closed, and
opened again under its routing id) stays in rotation: its next heartbeat clears the mark."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time

import zmq
import zmq.asyncio

from shared import wire
from tests.helpers import scheduler_process, wait_for_line
from tests.integration.test_scheduler_restart_adoption import reply_to
from tests.unit.test_scheduler_core import heartbeat, hello

INTERVAL_S = 0.3
TIMEOUT_S = 60.0  # silence alone takes no worker out within the test
GRACE_S = 3 * INTERVAL_S  # what the scheduler derives from the two

DOOMED_WORKER = """
import sys, time, zmq
from shared import wire
from tests.unit.test_scheduler_core import heartbeat, hello
address, interval_s = sys.argv[1], float(sys.argv[2])
socket = zmq.Context().socket(zmq.DEALER)
socket.connect(address)
wire.send(socket, hello("doomed", "decode", address=address + "-doomed"))
assert wire.recv(socket).accepted
print("registered", flush=True)
while True:
    wire.send(socket, heartbeat("doomed"))
    time.sleep(interval_s)
"""


async def beat_through_a_blip_and_a_kill(address: str, doomed: subprocess.Popen) -> float:
    """Beats as worker "steady", cuts its own connection once and carries on, kills "doomed",
    and beats on for the heartbeat grace's worth and more. When the kill was sent."""
    context = zmq.asyncio.Context()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.ROUTING_ID, b"steady-worker")
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(address)
    try:
        await wire.async_send(socket, hello("steady", "decode", address=f"{address}-steady"))
        assert (await reply_to(socket, wire.HelloAck, seconds=30)).accepted
        killed_at = 0.0
        for beat in range(int(6 * GRACE_S / INTERVAL_S)):
            if beat == 3:  # the blip: the same routing id on a new connection
                socket.close(linger=0)
                socket = context.socket(zmq.DEALER)
                socket.setsockopt(zmq.ROUTING_ID, b"steady-worker")
                socket.setsockopt(zmq.LINGER, 0)
                socket.connect(address)
            if beat == 6:
                doomed.send_signal(signal.SIGKILL)
                killed_at = time.monotonic()
            await wire.async_send(socket, heartbeat("steady"))
            while await socket.poll(0):  # a worker taken for gone is told to HELLO again
                message = await wire.async_recv(socket)
                assert not isinstance(message, wire.HelloAck), message
            await asyncio.sleep(INTERVAL_S)
        return killed_at
    finally:
        socket.close(linger=0)
        context.term()


def test_a_killed_worker_leaves_rotation_at_once_and_a_blipped_one_stays(tmp_path):
    address = f"ipc://{tmp_path}/scheduler"
    scheduler = scheduler_process(
        address, "--heartbeat-interval-s", str(INTERVAL_S), "--heartbeat-timeout-s", str(TIMEOUT_S)
    )
    doomed = None
    try:
        wait_for_line(scheduler, b"scheduler listening", "the scheduler")
        doomed = subprocess.Popen(
            [sys.executable, "-c", DOOMED_WORKER, address, str(INTERVAL_S)],
            stdout=subprocess.PIPE,
        )
        wait_for_line(doomed, b"registered", "the doomed worker")
        asyncio.run(beat_through_a_blip_and_a_kill(address, doomed))
    finally:
        if doomed is not None:
            doomed.kill()
            doomed.wait()
        scheduler.terminate()
        output = scheduler.communicate(timeout=30)[0].decode()
    events = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
    left = [e for e in events if e.get("event") == "worker left rotation"]
    closed = [e["peer_id"] for e in events if e.get("event") == "worker connection closed"]
    assert [e["peer_id"] for e in left] == ["doomed"], output[-3000:]
    assert left[0]["connection_closed"] is True
    # Silent since its last beat before the kill: the grace and a tick, not the timeout.
    assert left[0]["silent_s"] < GRACE_S + 2.0, left
    assert "steady" in closed and "doomed" in closed, closed  # the blip was seen, and forgiven
