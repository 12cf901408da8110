"""`tandem batch-service`: the durable owner of the OpenAI Files and Batches state.

One process holds an SQLite database (WAL) and the uploaded and produced files in `--data-dir`.
Gateways forward the Files and Batches calls to its ROUTER (`shared.wire_batch`); any number of
gateways share it. It runs each job's lines through a gateway's RPC door as bulk requests
(`runner`), and on start resumes every job a kill left unfinished (`jobs`). Metrics: lines by
state, jobs by status and the lines still queued, on `--metrics-port` and to a gateway that asks
(its /metrics federates them, as a `batch` peer).
"""

from __future__ import annotations

import argparse
import asyncio
import fcntl
import json
import os
import signal
import sqlite3
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry, Gauge, generate_latest

from services.batch.api import BatchApi, Limits
from services.batch.jobs import JobManager
from services.batch.runner import RunLimits
from services.batch.store import Store
from services.gateway.rpc_client import AsyncTandemClient
from shared import wire_batch
from shared.binding import bind
from shared.config import (
    CurveSettings,
    add_config_arguments,
    config_from_args,
    require_address,
    require_distinct_addresses,
    require_port,
    require_positive,
    setting,
)
from shared.curve import ClientKeys, Security
from shared.errors import StartUpError
from shared.logs import configure_logging, get_logger
from shared.metrics import name, serve_metrics
from shared.wire import WireError

METRICS_INTERVAL_S = 2.0
STATUSES = ("validating", "in_progress", "finalizing", "completed", "failed", "expired",
            "cancelling", "cancelled")  # fmt: skip
# Calls answered after a worker thread's work (`BatchApi.answer`): a create counts its file's
# lines, an upload's end syncs its bytes (a 200 MB upload: 0.4 s and more). Each is a task of
# its own, so the calls after it are answered meanwhile (in order, the others held them all).
WAITING_FOR_A_THREAD = frozenset({"batch_create", "file_upload_end"})


@dataclass(frozen=True)
class BatchServiceConfig(CurveSettings):
    address: str = setting("ipc:///tmp/tandem/batch.sock", "the ROUTER gateways connect to")
    gateway_rpc_address: str = setting(
        "ipc:///tmp/tandem/gateway-rpc.sock", "a gateway's RPC door, where lines are sent"
    )
    data_dir: str = setting("./tandem-batch", "where the SQLite database and the files live")
    api_key: str | None = setting(
        None, "the API key the service presents to the gateway (a bare one: lines name their owner)"
    )
    max_file_bytes: int = setting(200 << 20, "largest uploaded file (413 past it)")
    max_lines: int = setting(50_000, "most requests in one batch's input file (400 past it)")
    max_in_flight: int = setting(
        128,
        "most lines of one job in the cluster at once (the scheduler queues those it cannot "
        "place yet; keep it above the decode workers' seats for batch lines plus a prefill "
        "window of lines, or the job runs below the cluster's pace)",
    )
    line_timeout_s: float = setting(600.0, "a line unanswered this long is tried again")
    max_attempts: int = setting(5, "tries per line when the cluster fails (5xx, no answer)")
    metrics_host: str = setting("127.0.0.1", "host of the Prometheus /metrics server")
    metrics_port: int | None = setting(None, "port of /metrics (0: any free; none: off)")

    def __post_init__(self) -> None:
        require_address(self, "address", "gateway_rpc_address")
        require_distinct_addresses(self, "address", "gateway_rpc_address")
        require_positive(
            self, "max_file_bytes", "max_lines", "max_in_flight", "line_timeout_s", "max_attempts"
        )
        require_port(self, "metrics_port")
        self.curve_keys()
        if self.max_in_flight > 256:
            raise ValueError(
                "max_in_flight (--max-in-flight / TANDEM_MAX_IN_FLIGHT) must be at most 256 "
                f"(the RPC door's calls per client), got {self.max_in_flight}"
            )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, BatchServiceConfig)


class BatchMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.lines = Gauge(
            name("batch_lines"),
            "lines of unfinished jobs, by state",
            ["state"],
            registry=self.registry,
        )
        self.jobs = Gauge(
            name("batch_jobs"), "batch jobs by status", ["status"], registry=self.registry
        )
        self.queue_depth = Gauge(
            name("batch_queue_depth"), "lines not yet answered", registry=self.registry
        )

    def update(self, store: Store, jobs: JobManager) -> None:
        # Every status, those no job is in set to 0 (set only when some job was, a status kept
        # its last count for good once its last job moved on).
        counts_by_state = store.count_by_state()
        for status in STATUSES:
            self.jobs.labels(status).set(counts_by_state.get(status, 0))
        counts = store.db.execute(
            "SELECT COALESCE(SUM(total - completed - failed), 0), COALESCE(SUM(completed), 0), "
            "COALESCE(SUM(failed), 0) FROM batches WHERE status IN "
            "('validating', 'in_progress', 'finalizing', 'cancelling')"
        ).fetchone()
        in_flight = jobs.num_in_flight()
        self.queue_depth.set(counts[0])
        self.lines.labels("pending").set(max(0, counts[0] - in_flight))
        self.lines.labels("in_flight").set(in_flight)
        self.lines.labels("completed").set(counts[1])
        self.lines.labels("failed").set(counts[2])


class BatchService:
    def __init__(self, config: BatchServiceConfig):
        self.config = config
        self.log = get_logger(role="batch")
        self._data_dir_lock = _lock_data_dir(config.data_dir)  # (before anything is touched)
        try:
            self.store = _open_store(config.data_dir)
        except StartUpError:
            os.close(self._data_dir_lock)
            raise
        # Under CurveZMQ the gateways' batch link must hold the cluster's key to reach us, and we
        # present it to their RPC door (which lets the cluster's own key in).
        keys = config.curve_keys()
        self.security = Security(keys, self.log)
        self.client = AsyncTandemClient(
            config.gateway_rpc_address,
            timeout_s=config.line_timeout_s,
            api_key=config.api_key,
            bulk=True,
            curve=None if keys is None else ClientKeys(keys.public, keys.secret, keys.public),
        )
        limits = RunLimits(config.max_in_flight, config.line_timeout_s, config.max_attempts)
        self.jobs = JobManager(self.store, self.client, limits)
        self.api = BatchApi(self.store, self.jobs, Limits(config.max_file_bytes, config.max_lines))
        self.metrics = BatchMetrics()
        self._stopping = asyncio.Event()
        self._in_threads: set[asyncio.Task] = set()  # calls waiting for a worker thread

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stopping.set)
        context = zmq.asyncio.Context.instance()
        self.security.start(context)
        socket = self.security.server(context.socket(zmq.ROUTER))
        socket.setsockopt(zmq.MAXMSGSIZE, wire_batch.MAX_FRAME_BYTES)
        socket.setsockopt(zmq.LINGER, 0)
        bind(socket, self.config.address, "address")
        metrics_address = None
        if self.config.metrics_port is not None:
            metrics_address = serve_metrics(
                self.metrics.registry, self.config.metrics_host, self.config.metrics_port
            )
        resumed = self.jobs.resume_all()
        self.log.info(
            "batch service listening",
            address=self.config.address,
            curve=self.security.enabled,
            data_dir=self.config.data_dir,
            resumed=resumed,
            metrics=metrics_address,
        )
        tasks = [asyncio.create_task(self._receive(socket)), asyncio.create_task(self._periodic())]
        await self._stopping.wait()
        for task in [*tasks, *self._in_threads]:
            task.cancel()
        await asyncio.gather(*tasks, *self._in_threads, return_exceptions=True)
        self.api.close()
        await self.jobs.close()
        await self.client.close()
        socket.close()
        self.security.stop()
        self.store.close()
        os.close(self._data_dir_lock)

    async def _receive(self, socket: zmq.asyncio.Socket) -> None:
        while True:
            identity, *frames = await socket.recv_multipart()
            try:
                call, data = wire_batch.decode(frames)
                if not isinstance(call, wire_batch.BatchCall):
                    raise WireError(f"expected a BatchCall, got {type(call).__name__}")
                params = json.loads(call.params)
                if not isinstance(params, dict):
                    raise WireError("BatchCall.params must be a JSON object")
            # (ValueError: JSON's errors, an int past 4,300 digits; RecursionError: nesting.
            # Raised past here, either ended this task and the service answered no one.)
            except (WireError, ValueError, RecursionError) as error:
                self.log.warning("dropped malformed message", error=str(error), peer=identity.hex())
                continue
            answering = self._serve_call(socket, identity, call, params, data)
            if call.op in WAITING_FOR_A_THREAD:  # the calls after it do not wait for it
                task = asyncio.create_task(answering)
                self._in_threads.add(task)
                task.add_done_callback(self._in_threads.discard)
            else:  # one at a time, in order (what comes meanwhile waits in ZeroMQ's queue)
                await answering

    async def _serve_call(
        self,
        socket: zmq.asyncio.Socket,
        identity: bytes,
        call: wire_batch.BatchCall,
        params: dict,
        data: bytes | None,
    ) -> None:
        try:
            status, body, chunk = await self._answer(call, params, data)
        except Exception as error:  # a bug in one call must not take the service down
            self.log.exception("batch call failed", op=call.op)
            status, body, chunk = 500, _server_error(str(error)), None
        await socket.send_multipart([identity, *self._reply(call, status, body, chunk)])

    async def _answer(
        self, call: wire_batch.BatchCall, params: dict, data: bytes | None
    ) -> tuple[int, dict, bytes | None]:
        if call.op == "metrics":  # the gateway's, for its /metrics: no tenant's, no file's
            return 200, {"object": "metrics"}, generate_latest(self.metrics.registry)
        return await self.api.answer(call.op, call.tenant, params, data)

    def _reply(
        self, call: wire_batch.BatchCall, status: int, body: dict, chunk: bytes | None
    ) -> list[bytes]:
        """The frames of the answer; a 500 saying why when it cannot be sent (too big for the
        gateway to receive, say): raised here, it ended the receive task, and the service
        stopped answering anyone."""
        try:
            reply = wire_batch.BatchReply(
                call_id=call.call_id, status=status, body=json.dumps(body)
            )
            return wire_batch.encode(reply, chunk)
        except (ValueError, TypeError) as error:  # (WireError is a ValueError)
            self.log.error("batch answer not sendable", op=call.op, error=str(error))
            message = f"the answer to {call.op} could not be sent: {error}"
            reply = wire_batch.BatchReply(
                call_id=call.call_id, status=500, body=json.dumps(_server_error(message))
            )
            return wire_batch.encode(reply)

    async def _periodic(self) -> None:
        while True:
            self.metrics.update(self.store, self.jobs)
            self.api.drop_idle_uploads()
            for file_id in self.api.drop_expired_files():
                self.log.info("file expired", file_id=file_id)
            await asyncio.sleep(METRICS_INTERVAL_S)


def _lock_data_dir(data_dir: str) -> int:
    """Takes the data dir for this process (an exclusive lock on `batch.lock` in it, held while
    the returned descriptor is open: the kernel drops it when the process dies, a kill -9
    too); a StartUpError if another process holds it. A second service on the same folder
    deleted the first's uploads in progress (the first then wrote the rest of each to a new,
    empty file) and resumed every unfinished job beside the first: each line answered twice."""
    lock_path = Path(data_dir) / "batch.lock"
    try:
        lock_path.parent.mkdir(parents=True, exist_ok=True)
        descriptor = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as error:
        reason = error.strerror or str(error)
        raise StartUpError(f"the batch data dir {data_dir} cannot be used: {reason}") from None
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(descriptor)
        raise StartUpError(
            f"the batch data dir {data_dir} is in use by another batch service (it holds "
            f"{lock_path}): stop it first, or give this one another --data-dir"
        ) from None
    except OSError as error:  # (a file system without locks: said as it is)
        os.close(descriptor)
        reason = error.strerror or str(error)
        raise StartUpError(f"the batch data dir {data_dir} cannot be locked: {reason}") from None
    return descriptor


def _open_store(data_dir: str) -> Store:
    """The service's store; a StartUpError saying why when SQLite cannot open its database (a
    folder in its place, a file that is no database, a disk it may not write): a traceback
    said it before."""
    try:
        return Store(data_dir)
    except sqlite3.Error as error:
        database = Path(data_dir) / "batch.sqlite3"
        raise StartUpError(f"the batch database {database} cannot be used: {error}") from None


def _server_error(message: str) -> dict:
    return {"error": {"message": message, "type": "server_error", "param": None, "code": None}}


def run(args: argparse.Namespace) -> int:
    configure_logging("batch")
    config = config_from_args(BatchServiceConfig, args)

    async def main() -> None:
        await BatchService(config).serve()

    asyncio.run(main())
    return 0
