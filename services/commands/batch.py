"""`tandem batch`: bulk jobs from the command line, through the OpenAI Files and Batches APIs.

    tandem batch submit FILE.jsonl [--endpoint /v1/chat/completions] [--wait]
    tandem batch status BATCH_ID        tandem batch list [--limit N]
    tandem batch cancel BATCH_ID        tandem batch download BATCH_ID [--out FILE] [--errors]

`submit` uploads the file, creates the batch and prints its id; with `--wait` it follows the job
with a progress line (done/total, output tokens per second, ETA) until it ends, and exits 0
only if it completed (a failed batch's errors, its input's offending lines, go to stderr);
Ctrl-C stops following (status 130), not the batch.
While it follows, a 429 or 503 (a busy server, a batch service that restarts: the job goes on)
is waited out as its Retry-After asks, for up to MAX_REFUSED_S in a row. Works against any
server with these APIs (`--url`, `--api-key` or `OPENAI_API_KEY`).
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from services.commands.top import gateway_url

ENDED = ("completed", "failed", "cancelled", "expired")
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
RETRY_STATUSES = (429, 503)  # the job goes on: a follower waits and asks again
MAX_REFUSED_S = 300.0  # how long refusals in a row may last before a follower gives up
MAX_BACKOFF_S = 30.0  # between tries, when the server names no Retry-After


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--url", type=gateway_url, default="http://127.0.0.1:8000", help="the server"
    )
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    sub = parser.add_subparsers(dest="action", required=True)
    submit = sub.add_parser("submit", help="upload a JSONL file and start a batch")
    submit.add_argument("file", type=Path)
    submit.add_argument("--endpoint", default=None, choices=ENDPOINTS,
                        help="default: the first line's url")  # fmt: skip
    submit.add_argument("--completion-window", default="24h")
    submit.add_argument("--wait", action="store_true", help="follow the job until it ends")
    for name, text in (("status", "show a batch"), ("cancel", "cancel a batch")):
        sub.add_parser(name, help=text).add_argument("batch_id")
    listing = sub.add_parser("list", help="list batches, newest first")
    listing.add_argument("--limit", type=int, default=20)
    download = sub.add_parser("download", help="write a batch's output (or error) file")
    download.add_argument("batch_id")
    download.add_argument("--out", type=Path, default=None, help="default: stdout")
    download.add_argument("--errors", action="store_true", help="the error file instead")


class Api:
    def __init__(self, url: str, api_key: str | None):
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(
            base_url=url.rstrip("/") + "/v1",
            headers=headers,
            timeout=60,
            trust_env=not is_loopback(url),
        )

    def call(self, method: str, path: str, **kwargs: Any) -> Any:
        response = self._request(method, path, **kwargs)
        _check(method, response)
        return response

    def get_patiently(self, path: str, max_refused_s: float = MAX_REFUSED_S) -> Any:
        """GET `path`, waiting out 429 and 503 (each wait the Retry-After, else 1 s doubling
        up to MAX_BACKOFF_S) while they last at most `max_refused_s`; any other failure, or
        refusals past that, exits as `call` does."""
        backoff_s, deadline = 1.0, None
        while True:
            response = self._request("GET", path)
            if response.status_code not in RETRY_STATUSES:
                break
            now = time.monotonic()
            deadline = now + max_refused_s if deadline is None else deadline
            wait_s = _retry_after_s(response) or backoff_s
            if now + wait_s > deadline:
                break
            time.sleep(wait_s)
            backoff_s = min(MAX_BACKOFF_S, backoff_s * 2)
        _check("GET", response)
        return response

    def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            return self.http.request(method, path, **kwargs)
        except httpx.HTTPError as error:  # the server is not there, or went away
            raise SystemExit(f"tandem batch: {method} {self.sent_path(path)}: {error}") from None

    def sent_path(self, path: str) -> str:
        """`path` as the request goes: under the base URL's `/v1`."""
        return self.http.base_url.path.rstrip("/") + path


def is_loopback(url: str) -> bool:
    """Whether the server is on this machine: asked directly, as `tandem top` asks it (through
    `http_proxy`, as httpx goes by default, a proxy that cannot reach our loopback was asked);
    another server through the proxy the environment names."""
    host = httpx.URL(url).host
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name
        return False


def run(args: argparse.Namespace) -> int:
    api = Api(args.url, args.api_key)
    if args.action == "submit":
        return submit(api, args)
    if args.action == "status":
        print(json.dumps(api.call("GET", f"/batches/{args.batch_id}").json(), indent=2))
    elif args.action == "cancel":
        batch = api.call("POST", f"/batches/{args.batch_id}/cancel").json()
        print(f"{batch['id']} {batch['status']}")
    elif args.action == "list":
        for batch in api.call("GET", "/batches", params={"limit": args.limit}).json()["data"]:
            counts = batch["request_counts"]
            print(f"{batch['id']}  {batch['status']:<11} {counts['completed']}/{counts['total']}"
                  f" done, {counts['failed']} failed")  # fmt: skip
    elif args.action == "download":
        return download(api, args)
    return 0


def submit(api: Api, args: argparse.Namespace) -> int:
    if not args.file.is_file():
        raise SystemExit(f"tandem batch: no such file {args.file}")
    endpoint = args.endpoint or _first_url(args.file)
    with open(args.file, "rb") as file:
        uploaded = api.call("POST", "/files", files={"file": (args.file.name, file)},
                            data={"purpose": "batch"}).json()  # fmt: skip
    body = {"input_file_id": uploaded["id"], "endpoint": endpoint,
            "completion_window": args.completion_window}  # fmt: skip
    batch = api.call("POST", "/batches", json=body).json()
    print(batch["id"], flush=True)
    if not args.wait:
        return 0
    try:
        batch = follow(api, batch["id"])
    except KeyboardInterrupt:  # (a traceback, as if the batch had crashed or been cancelled)
        print(f"\ntandem batch: stopped following; {batch['id']} goes on (tandem batch status "
              f"{batch['id']}, tandem batch cancel {batch['id']})", file=sys.stderr)  # fmt: skip
        return 130
    _print_errors(batch)
    return 0 if batch["status"] == "completed" else 1


def _print_errors(batch: dict[str, Any]) -> None:
    """Why a batch failed (its input's offending lines, as `errors.data` gives them), on
    stderr: the progress line alone said 0/0 done."""
    for error in (batch.get("errors") or {}).get("data") or []:
        where = f"line {error['line']}: " if error.get("line") is not None else ""
        print(f"{where}{error.get('message')} ({error.get('code')})", file=sys.stderr)


def follow(api: Api, batch_id: str, interval_s: float = 1.0) -> dict[str, Any]:
    """Polls until the batch ends, redrawing one progress line on stderr. Its rates count from
    the first poll that saw lines (or tokens) done: a batch followed midway did work before."""
    first_done = first_tokens = None
    while True:
        batch = api.get_patiently(f"/batches/{batch_id}").json()
        counts = batch["request_counts"]
        done = counts["completed"] + counts["failed"]
        output_tokens = (batch.get("usage") or {}).get("output_tokens") or 0
        now = time.monotonic()
        if first_done is None and done:
            first_done = (now, done)
        if first_tokens is None and output_tokens:
            first_tokens = (now, output_tokens)
        rate, token_rate = _rate(first_done, done, now), _rate(first_tokens, output_tokens, now)
        ended = batch["status"] in ENDED
        if ended:  # the batch's own rate, when it says when it ran: no ETA, nor a 0.0 lines/s
            rate, eta = _run_rate(batch, done) or rate, ""
        else:
            eta = f"  ETA {(counts['total'] - done) / rate:.0f} s" if rate else "  ETA ?"
        tokens = f"  {token_rate:.0f} tokens/s" if token_rate else ""
        sys.stderr.write(
            f"\r{batch['status']:<11} {done}/{counts['total']} done ({counts['failed']} failed)"
            f"  {rate:.1f} lines/s{tokens}{eta}   "
        )
        sys.stderr.flush()
        if ended:
            sys.stderr.write("\n")
            return batch
        time.sleep(interval_s)


def _run_rate(batch: dict[str, Any], done: int) -> float | None:
    """Lines per second over the ended batch's run (`in_progress_at` to its end's stamp, whole
    seconds), if it took one or more: a short job ends before a second poll measures one."""
    start, end = batch.get("in_progress_at"), batch.get(f"{batch['status']}_at")
    if not isinstance(start, int) or not isinstance(end, int) or end <= start:
        return None
    return done / (end - start)


def _rate(first: tuple[float, int] | None, count: int, now: float) -> float:
    """Per second since `first` (when, and the count then), or 0 before there is a second."""
    if first is None:
        return 0.0
    elapsed = now - first[0]
    return (count - first[1]) / elapsed if elapsed > 0 else 0.0


def download(api: Api, args: argparse.Namespace) -> int:
    batch = api.call("GET", f"/batches/{args.batch_id}").json()
    file_id = batch["error_file_id" if args.errors else "output_file_id"]
    if file_id is None:
        print(f"tandem batch: {args.batch_id} has no {'error' if args.errors else 'output'} "
              f"file (status {batch['status']})", file=sys.stderr)  # fmt: skip
        return 1
    path = f"/files/{file_id}/content"
    try:
        with api.http.stream("GET", path) as response:
            if response.status_code != 200:
                response.read()
                _check("GET", response)  # an error body is no batch's output
            out = open(args.out, "wb") if args.out else sys.stdout.buffer  # noqa: SIM115
            try:
                for chunk in response.iter_bytes():
                    out.write(chunk)
            finally:
                if args.out:
                    out.close()
    except httpx.HTTPError as error:
        raise SystemExit(f"tandem batch: GET {api.sent_path(path)}: {error}") from None
    return 0


def _check(method: str, response: httpx.Response) -> None:
    """Exits with the server's message when it did not answer 200."""
    if response.status_code == 200:
        return
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = response.text
    where = response.request.url.path  # (as sent: /v1/...)
    raise SystemExit(f"tandem batch: {method} {where}: {response.status_code} {message}")


def _retry_after_s(response: httpx.Response) -> float | None:
    """The seconds a Retry-After header asks for (its HTTP-date form is taken as absent)."""
    try:
        seconds = float(response.headers.get("retry-after", ""))
    except ValueError:
        return None
    return seconds if 0 < seconds < float("inf") else None


def _first_url(path: Path) -> str:
    with open(path, "rb") as file:
        for raw in file:
            if raw.strip():
                try:
                    url = json.loads(raw).get("url")
                except (ValueError, AttributeError):
                    break
                if url in ENDPOINTS:
                    return url
                break
    raise SystemExit(f"tandem batch: give --endpoint: the first line of {path} names none of "
                     f"{', '.join(ENDPOINTS)}")  # fmt: skip
