"""The batch service's durability promises, checked with real processes on real SQLite files."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.integration.test_batch_service import call, dealer, wait_listening


def start_on(tmp_path, socket_name: str) -> subprocess.Popen:
    """A batch service on `--data-dir tmp_path/data`, listening on its own socket."""
    return subprocess.Popen(
        [sys.executable, "-m", "services.commands.cli", "batch-service",
         "--address", f"ipc://{tmp_path}/{socket_name}", "--data-dir", str(tmp_path / "data"),
         "--gateway-rpc-address", f"ipc://{tmp_path}/nobody.sock"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip


def test_a_second_service_on_the_same_data_dir_is_refused_and_harms_nothing(tmp_path):
    """Two services on one `--data-dir` (a second `tandem up --batch-dir` of the same folder, a
    restart while the old process still stops): the second started, deleted the first's
    uploads in progress (the first then appended to a new, empty file: the upload lost its
    start, unseen) and resumed every unfinished job beside the first, each line answered by
    both. The second is refused at start, saying why, and the first goes on unharmed."""
    first = start_on(tmp_path, "batch.sock")
    wait_listening(first)
    socket = dealer(tmp_path)
    try:
        _, begun, _ = call(socket, "file_upload_begin", {"purpose": "batch", "filename": "a"})
        call(socket, "file_upload_chunk", begun, b'{"custom_id": "a"}\n')
        second = start_on(tmp_path, "second.sock")
        try:
            output = b""
            for line in second.stdout:  # (until it exits, or says it listens: the bug)
                output += line
                if b"batch service listening" in line:
                    break
        finally:
            second.kill()
            second.wait()
        assert b"batch service listening" not in output, output.decode()[-2000:]
        assert second.returncode == 1, output.decode()[-2000:]
        assert "in use" in output.decode() and str(tmp_path / "data") in output.decode()
        call(socket, "file_upload_chunk", begun, b'{"custom_id": "b"}\n')
        status, created, _ = call(socket, "file_upload_end", begun)
        assert status == 200
        content = call(socket, "file_content", {"file_id": created["id"]})[2]
        assert content == b'{"custom_id": "a"}\n{"custom_id": "b"}\n'
    finally:
        socket.close()
        first.kill()
        first.wait()


def test_a_file_deleted_while_its_create_waits_to_count_it_is_a_404(tmp_path):
    """A create counts its file's lines in a worker thread, behind other creates' counts; a
    delete of the file meanwhile (answered at once, no batch used it yet) made the count's
    `open` raise FileNotFoundError: the create was the service's 500, not a 404."""
    import asyncio
    import threading

    from services.batch.api import COUNTING_THREADS, BatchApi, Limits
    from services.batch.store import Store

    store = Store(tmp_path)
    api = BatchApi(store, jobs=None, limits=Limits())
    store.path_of("file-in").write_bytes(b'{"custom_id": "a"}\n')
    store.add_file("file-in", "alice", "batch", "in.jsonl", 19)
    params = {"input_file_id": "file-in", "endpoint": "/v1/completions",
              "completion_window": "24h", "models": ["m"]}  # fmt: skip
    busy = threading.Event()

    async def scenario():
        for _ in range(COUNTING_THREADS):  # other creates' counts, taking every thread
            api._counting.submit(busy.wait)
        creating = asyncio.create_task(api.answer("batch_create", "alice", params, None))
        await asyncio.sleep(0.1)
        deleted = api.handle("file_delete", "alice", {"file_id": "file-in"}, None)
        busy.set()
        return deleted, await creating

    try:
        deleted, (status, body, _) = asyncio.run(scenario())
    finally:
        busy.set()
        api.close()
        store.close()
    assert deleted[0] == 200
    assert status == 404 and body["error"]["param"] == "input_file_id", body


def _gateway_answering_after(address: str, delay_s: float, stop) -> None:
    """A gateway's RPC door (in a thread) answering every line after `delay_s`, as a
    completion with usage; until `stop`."""
    import json
    import threading
    import time

    import zmq

    from shared import wire

    def serve() -> None:
        context = zmq.Context()
        router = context.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.bind(address)
        due: list[tuple[float, bytes, str]] = []
        while not stop.is_set():
            if router.poll(2):
                identity, call = wire.recv_from(router)
                if isinstance(call, wire.RpcRequest):
                    due.append((time.monotonic() + delay_s, identity, call.call_id))
            now = time.monotonic()
            for item in [item for item in due if item[0] <= now]:
                due.remove(item)
                body = json.dumps({"id": f"cmpl-{item[2]}", "object": "text_completion",
                                   "choices": [{"index": 0, "text": "ok"}],
                                   "usage": {"prompt_tokens": 3, "completion_tokens": 2,
                                             "total_tokens": 5}})  # fmt: skip
                answer = wire.RpcEvent(call_id=item[2], kind="response", body=body,
                                       status=200, done=True)  # fmt: skip
                wire.send_to(router, item[1], answer)
        router.close()
        context.term()

    threading.Thread(target=serve, daemon=True).start()


def _download(socket, file_id: str | None) -> list[dict]:
    import json

    if file_id is None:
        return []
    content, offset = b"", 0
    while offset is not None:
        status, body, chunk = call(socket, "file_content", {"file_id": file_id, "offset": offset})
        assert status == 200, body
        content, offset = content + chunk, body["next_offset"]
    return [json.loads(line) for line in content.splitlines()]


class KilledAgainAndAgain:
    """A batch service in its own process on `tmp_path/data`, killed (-9) and started again;
    its lines answered by a gateway thread after `delay_s`."""

    def __init__(self, tmp_path, delay_s: float) -> None:
        import threading

        self.tmp_path = tmp_path
        self.log_path = tmp_path / "service.log"
        self.logs = open(self.log_path, "ab")  # noqa: SIM115 - (a pipe, unread, fills up)
        self.stop_gateway = threading.Event()
        _gateway_answering_after(f"ipc://{tmp_path}/gateway.sock", delay_s, self.stop_gateway)
        self.process = self._start()
        self.socket = dealer(tmp_path)

    def _start(self) -> subprocess.Popen:
        import time

        start = self.log_path.stat().st_size
        tmp_path = self.tmp_path
        process = subprocess.Popen(
            [sys.executable, "-m", "services.commands.cli", "batch-service",
             "--address", f"ipc://{tmp_path}/batch.sock", "--data-dir", str(tmp_path / "data"),
             "--gateway-rpc-address", f"ipc://{tmp_path}/gateway.sock", "--max-in-flight", "8"],
            stdout=self.logs, stderr=subprocess.STDOUT,
        )  # fmt: skip
        while b"batch service listening" not in self.log_path.read_bytes()[start:]:
            assert process.poll() is None, self.log_path.read_text()[-3000:]
            time.sleep(0.05)
        return process

    def kill_and_restart(self) -> None:
        self.process.kill()
        self.process.wait()
        self.process = self._start()

    def call(self, op: str, params: dict, data: bytes | None = None) -> tuple:
        return call(self.socket, op, params, data)

    def create(self, num_lines: int, window: str) -> dict:
        import json

        lines = b"".join(
            json.dumps({"custom_id": f"r{n}", "method": "POST", "url": "/v1/completions",
                        "body": {"model": "m", "prompt": f"p{n}", "max_tokens": 2}}).encode()
            + b"\n"
            for n in range(num_lines)
        )  # fmt: skip
        _, begun, _ = self.call("file_upload_begin", {"purpose": "batch", "filename": "in"})
        self.call("file_upload_chunk", begun, lines)
        _, uploaded, _ = self.call("file_upload_end", begun)
        params = {"input_file_id": uploaded["id"], "endpoint": "/v1/completions",
                  "completion_window": window, "models": ["m"]}  # fmt: skip
        status, batch, _ = self.call("batch_create", params)
        assert status == 200, batch
        return batch

    def until_ended(self, batch_id: str) -> dict:
        import time

        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            _, batch, _ = self.call("batch_get", {"batch_id": batch_id})
            if batch["status"] in ("completed", "failed", "expired", "cancelled"):
                return batch
            time.sleep(0.2)
        raise AssertionError(f"the batch did not end: {batch}")

    def close(self) -> None:
        self.stop_gateway.set()
        self.socket.close()
        self.process.kill()
        self.process.wait()
        self.logs.close()


@pytest.mark.parametrize("ending", ["completed", "expired", "cancelled"])
def test_a_job_killed_again_and_again_answers_every_line_exactly_once(tmp_path, ending):
    """kill -9 of the service at arbitrary points of a running job (lines in flight, answers
    being appended, the deadline's `batch_expired` answers, a cancel, the batch ending),
    restarted on the same database each time: the batch ends as it should, no custom_id is in
    its files twice (all of them unless cancelled), and its counts are its files' lines."""
    import random
    import time

    num_lines = 3000
    service = KilledAgainAndAgain(tmp_path, delay_s=0.01)
    rng = random.Random(7)
    try:
        batch = service.create(num_lines, "4s" if ending == "expired" else "24h")
        statuses = []
        for kill in range(8):
            time.sleep(rng.uniform(0.0, 0.8))
            if ending == "cancelled" and kill == 3:
                status, cancelled, _ = service.call("batch_cancel", {"batch_id": batch["id"]})
                assert status == 200 and cancelled["status"] == "cancelling", cancelled
                time.sleep(rng.uniform(0.0, 0.05))
            service.kill_and_restart()
            _, seen, _ = service.call("batch_get", {"batch_id": batch["id"]})
            statuses.append(seen["status"])
        assert "in_progress" in statuses, statuses
        batch = service.until_ended(batch["id"])
        assert batch["status"] == ending, batch
        answered = _download(service.socket, batch["output_file_id"])
        failed = _download(service.socket, batch["error_file_id"])
        custom_ids = [line["custom_id"] for line in answered + failed]
        assert len(set(custom_ids)) == len(custom_ids)  # none twice
        if ending != "cancelled":
            assert sorted(custom_ids) == sorted(f"r{n}" for n in range(num_lines))
        counts = batch["request_counts"]
        assert counts == {"total": num_lines, "completed": len(answered), "failed": len(failed)}
        assert batch["usage"]["input_tokens"] == 3 * len(answered)
        if ending == "expired":
            assert failed and {line["error"]["code"] for line in failed} == {"batch_expired"}
    finally:
        service.close()


def test_an_upload_chunk_the_disk_refuses_is_a_507_and_frees_the_upload(tmp_path, monkeypatch):
    """A chunk the disk could not take (full) raised out of its handler: the service's 500
    (`batch call failed`), and the upload stayed in progress with its bytes, and what part of
    the chunk the disk took, for the 10 minutes of idleness, on the disk that was full (the
    running jobs' answers waiting for room meanwhile). It is a 507 saying why; the upload is
    dropped, bytes and all."""
    import errno

    from services.batch import api as api_module
    from services.batch.api import BatchApi, Limits
    from services.batch.store import Store

    store = Store(tmp_path)
    api = BatchApi(store, jobs=None, limits=Limits())
    try:
        _, begun, _ = api.handle("file_upload_begin", "t", {"purpose": "batch"}, None)
        assert api.handle("file_upload_chunk", "t", begun, b'{"custom_id": "a"}\n')[0] == 200
        path = api._uploads[begun["upload_id"]].path

        def full_disk(*_args, **_kwargs):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(api_module, "open", full_disk, raising=False)
        status, body, _ = api.handle("file_upload_chunk", "t", begun, b'{"custom_id": "b"}\n')
        assert status == 507 and "No space left" in body["error"]["message"], body
        assert not path.exists() and api._uploads == {}
        assert api.handle("file_upload_end", "t", begun, None)[0] == 503  # (upload again)
    finally:
        api.close()
        store.close()


def test_an_upload_whose_row_sqlite_refuses_leaves_no_bytes_behind(tmp_path, monkeypatch):
    """An upload's end moves its bytes into files/, then writes its row: a row SQLite refused
    (`database or disk is full`) left up to 200 MB in files/ that no row named, on the disk
    that was full, until the service restarted. They go with the refusal."""
    import sqlite3

    from services.batch.api import BatchApi, Limits
    from services.batch.store import Store

    store = Store(tmp_path)
    api = BatchApi(store, jobs=None, limits=Limits())
    try:
        _, begun, _ = api.handle("file_upload_begin", "t", {"purpose": "batch"}, None)
        api.handle("file_upload_chunk", "t", begun, b'{"custom_id": "a"}\n')

        def full(*_args):
            raise sqlite3.OperationalError("database or disk is full")

        monkeypatch.setattr(store, "add_file", full)
        with pytest.raises(sqlite3.OperationalError):
            api.handle("file_upload_end", "t", begun, None)
        assert list(store.files_dir.iterdir()) == []
        assert list((tmp_path / "uploads").iterdir()) == []
    finally:
        api.close()
        store.close()


def test_an_upload_a_restart_cut_short_is_a_503_to_upload_again(tmp_path):
    """The service restarted (killed) while a file streamed in: the upload's next chunk was a
    404 `no such upload in progress` naming `upload_id`, a parameter the client never sent, and
    one no client retries (the `openai` package retries a 5xx). It is a 503 saying to upload
    the file again."""
    from services.batch.api import BatchApi, Limits
    from services.batch.store import Store

    store = Store(tmp_path)
    api = BatchApi(store, jobs=None, limits=Limits())
    _, begun, _ = api.handle("file_upload_begin", "t", {"purpose": "batch"}, None)
    api.handle("file_upload_chunk", "t", begun, b'{"custom_id": "a"}\n')
    api.close()
    store.close()
    store = Store(tmp_path)  # the restart
    api = BatchApi(store, jobs=None, limits=Limits())
    try:
        for op in ("file_upload_chunk", "file_upload_end"):
            status, body, _ = api.handle(op, "t", begun, b'{"custom_id": "b"}\n')
            assert status == 503 and "upload the file again" in body["error"]["message"], body
    finally:
        api.close()
        store.close()
