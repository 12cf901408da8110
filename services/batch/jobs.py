"""The jobs the batch service owns: each validated (in a worker thread), then run, each as an
asyncio task.

A job's state lives in SQLite, so the task is only its engine: `resume_all` starts one for every
job a kill left unfinished (`validating` validates again from the start; `in_progress`,
`finalizing` and `cancelling` recover their answers from the files and go on). Validation and
running follow OpenAI's states: validating -> in_progress -> finalizing -> completed, or failed
(bad lines), cancelling -> cancelled, expired.
"""

from __future__ import annotations

import asyncio
import threading
import time

from services.batch.runner import JobRunner, RunLimits
from services.batch.store import Store
from services.batch.validation import ValidationStopped, error, validate
from services.gateway.rpc_client import AsyncTandemClient
from shared.logs import get_logger

UNFINISHED = ("validating", "in_progress", "finalizing", "cancelling")


class JobManager:
    def __init__(self, store: Store, client: AsyncTandemClient, limits: RunLimits):
        self.store = store
        self.client = client
        self.limits = limits
        self.runners: dict[str, JobRunner] = {}
        self._tasks: dict[str, asyncio.Task] = {}
        self._validations: dict[str, threading.Event] = {}  # each one's stop, by batch id
        self.log = get_logger()

    def start(self, batch_id: str) -> None:
        task = asyncio.create_task(self._drive(batch_id))
        self._tasks[batch_id] = task
        task.add_done_callback(lambda _: self._tasks.pop(batch_id, None))

    def resume_all(self) -> int:
        batches = self.store.batches_in(*UNFINISHED)
        for batch in batches:
            self.log.info("resuming batch", batch_id=batch["id"], status=batch["status"])
            self.start(batch["id"])
        return len(batches)

    def cancel(self, batch_id: str) -> None:
        stop = self._validations.get(batch_id)
        if stop is not None:  # the batch ends `cancelled` at once (`_refuse`), unchecked
            stop.set()
        runner = self.runners.get(batch_id)
        if runner is not None:
            runner.cancel()

    async def close(self) -> None:
        for task in list(self._tasks.values()):
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)

    def num_in_flight(self) -> int:
        return sum(len(runner.tasks) for runner in self.runners.values())

    async def _drive(self, batch_id: str) -> None:
        validating = False
        try:
            batch = self.store.get_batch(batch_id)
            validating = batch["status"] == "validating"
            if validating and not await self._validate(batch):
                return
            validating = False
            runner = self.runners[batch_id] = JobRunner(
                self.store, self.client, batch_id, self.limits
            )
            if self.store.get_batch(batch_id)["status"] == "cancelling":
                runner.cancel()
            await runner.run()
        except asyncio.CancelledError:
            raise
        except Exception as failure:  # a bug must not take the service down
            self.log.exception("batch job failed", batch_id=batch_id)
            if validating:  # it would raise again at every restart (a run resumes instead)
                message = f"the input file could not be validated: {failure!r}"
                self._refuse(batch_id, [error("validation_failed", message)])
        finally:
            self.runners.pop(batch_id, None)

    def _refuse(self, batch_id: str, errors: list[dict]) -> None:
        """Ends a batch whose validation failed (or raised: it would raise again at every
        restart, so the batch says why rather than stay `validating` for ever). A batch
        cancelled while it was validating ends `cancelled`, as OpenAI's does, whatever its
        file held."""
        self.store.drop_lines(batch_id)  # (those recorded before a raise)
        now = int(time.time())
        if self.store.get_batch(batch_id)["status"] == "cancelling":
            self.store.update_batch(batch_id, status="cancelled", cancelled_at=now)
            return
        errors_list = {"object": "list", "data": errors}
        self.store.update_batch(batch_id, status="failed", failed_at=now, errors=errors_list)

    async def _validate(self, batch: dict) -> bool:
        # In a worker thread: a 200 MB file takes seconds, during which the loop answered no
        # call. Its lines are committed page by page there; a kill leaves the batch
        # `validating`, validated again from the start at the restart.
        stop = self._validations[batch["id"]] = threading.Event()
        try:
            num_lines, errors = await asyncio.to_thread(
                self.store.run_apart, validate, batch, batch["_models"], stop
            )
        except ValidationStopped:  # cancelled: it is `cancelling`
            self._refuse(batch["id"], [])
            return False
        finally:
            stop.set()  # (the service stopping cancelled this task: the thread stops too)
            del self._validations[batch["id"]]
        if errors:
            self._refuse(batch["id"], errors)
            self.log.info("batch failed validation", batch_id=batch["id"], errors=len(errors))
            return False
        self.store.set_total(batch["id"], num_lines)
        if self.store.get_batch(batch["id"])["status"] == "cancelling":
            return True  # the runner finalizes it as cancelled at once
        self.store.update_batch(batch["id"], status="in_progress", in_progress_at=int(time.time()))
        return True
