"""What watching for disconnects costs the gateway: N requests held waiting (as they wait in the
scheduler's queue) in a uvicorn server whose handler waits through the gateway's own
`_unless_gone`, and the server process's CPU over a quiet interval, as a share of one core.

    .venv/bin/python -m loadtest.disconnect_watch [--requests 1000] [--seconds 10]

The server runs in its own process (`--serve PORT`), so its CPU is its own.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import Response

from loadtest.served import free_port
from services.gateway import app as gateway
from services.gateway.drain import Drain


def build_app() -> FastAPI:
    app = FastAPI()
    app.state.drain = Drain()  # (as the gateway's: `_unless_gone` waits under its shutdown)
    never = asyncio.Event()

    @app.post("/wait")
    async def wait(request: Request) -> Response:
        await request.body()
        try:
            await gateway._unless_gone(request, never.wait())
        except gateway.ClientGone:
            return Response(status_code=499)
        return Response(status_code=200)

    return app


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def hold_waiting(port: int, pid: int, num_requests: int, seconds: float) -> float:
    limits = httpx.Limits(max_connections=num_requests)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=None,
                                 limits=limits) as client:  # fmt: skip
        waiting = [
            asyncio.create_task(client.post("/wait", content=b"x")) for _ in range(num_requests)
        ]
        await asyncio.sleep(3.0)  # all connected and waiting
        before, start = cpu_seconds(pid), time.monotonic()
        await asyncio.sleep(seconds)
        share = (cpu_seconds(pid) - before) / (time.monotonic() - start)
        answered = sum(request.done() for request in waiting)
        assert answered == 0, f"{answered} requests were answered: they should all be waiting"
        for request in waiting:
            request.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
    return share


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve is not None:
        import uvicorn

        uvicorn.run(build_app(), host="127.0.0.1", port=args.serve, log_level="warning")
        return
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "loadtest.disconnect_watch", "--serve", str(port)]
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(f"http://127.0.0.1:{port}/docs", timeout=1)
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        share = asyncio.run(hold_waiting(port, server.pid, args.requests, args.seconds))
        print(f"{args.requests} requests waiting: the server used {100 * share:.1f}% of a core")
    finally:
        server.terminate()
        server.wait(timeout=30)


if __name__ == "__main__":
    main()
