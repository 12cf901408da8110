"""The gateway's shutdown as its handlers see it: a grace for what is running, then a clean end.

On SIGTERM uvicorn closes its listening socket (new connections are refused) and its idle
keep-alive connections, then waits for every request under way: without a bound, a stream that
never ends kept the gateway up until the orchestrator's SIGKILL tore every connection (docker's
and `tandem up`'s 10 s, Kubernetes' 30 s). With a `Drain` begun, a request has `grace_s` to
finish; then each wait on the cluster still under way (`within`) ends as a 503 (a stream's error
event and its end, as OpenAI's clients read one), the work it waited on cancelled with its
cluster requests, and the process exits before the kill.

The bound costs a stream's token nothing but a set's add and discard: the waits are cancelled
once, at the deadline, not each put under a timer.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

from services.gateway.openai_protocol import ApiError

T = TypeVar("T")
DRAINED_MESSAGE = "the server is shutting down: the request ran past its grace"


class Drain:
    def __init__(self) -> None:
        self.deadline: float | None = None  # the event loop's time; None: not begun
        self.expired = False
        self._waiting: set[asyncio.Task] = set()  # the tasks inside `within` now
        self._cut: set[asyncio.Task] = set()  # those the deadline cancelled

    def begin(self, grace_s: float) -> None:
        if self.deadline is not None:
            return  # (a second signal: the first deadline stands)
        loop = asyncio.get_running_loop()
        self.deadline = loop.time() + grace_s
        loop.call_at(self.deadline, self._expire)

    def _expire(self) -> None:
        self.expired = True
        for task in self._waiting:
            self._cut.add(task)
            task.cancel()

    async def within(self, work: Awaitable[T]) -> T:
        """`work`'s result; past the drain's deadline, ApiError 503, `work` cancelled (it runs
        in this task: a coroutine, or an `anext` of a stream's events)."""
        task = asyncio.current_task()
        assert task is not None, "within a task"
        if self.expired:
            asyncio.ensure_future(work).cancel()  # (never started: closed, not left pending)
            raise drained()
        self._waiting.add(task)
        try:
            return await work
        except asyncio.CancelledError:
            if task not in self._cut:
                raise
            self._cut.discard(task)
            if task.uncancel() > 0:  # cancelled by someone else too: theirs goes on
                raise
            raise drained() from None
        finally:
            self._waiting.discard(task)


def drained() -> ApiError:
    return ApiError(503, DRAINED_MESSAGE, "server_error")


async def until_drained(events: AsyncIterator[T], drain: Drain) -> AsyncIterator[T]:
    """`events` until the drain's deadline (then ApiError 503); closed with this iterator."""
    try:
        while True:
            try:
                event = await drain.within(anext(events))
            except StopAsyncIteration:
                return
            yield event
    finally:
        await events.aclose()  # type: ignore[attr-defined]
