"""How long a server keeps its other clients waiting while it works through heavy requests.

A probe asks `GET /v1/models` every `--probe-every-ms` on a connection of its own (in a thread of
its own, so the sender's work never delays it) while heavy requests go out one at a time on
another; the probe's latency is reported per phase: idle first, then each heavy kind. A server
that does a heavy request's work on its event loop (parsing, tokenizing, detokenizing) answers
the probe only when that work is done: the probe's worst latency is the loop's longest stall.

Heavy kinds (each `--repeat` times, bodies built before the phase starts):
- `long-prompt`: a completion whose prompt is `--mib` MiB of text (UTF-8; tandem takes bodies up to
  8 MiB by default), far past the model's context,
  so the server tokenizes it and refuses it (400) without spending the cluster's time on it;
- `tokenize-strs`: `POST /tokenize` of the same text with each token's string (`return_token_strs`,
  vLLM's shape; a server without the route answers 404 and the phase says so);
- `many-messages`: a chat body of `--mib` MiB in 1,000 messages (the chat template rendered, then
  tokenized, then refused).

    .venv/bin/python -m loadtest.loop_stalls [--url http://127.0.0.1:8000] [--mib 7] [--repeat 3]
        [--kinds long-prompt,tokenize-strs,many-messages] [--json out.json]

Without `--url` it starts `tandem up --no-batch` on a free port (`loadtest.served`) and stops it
after. Figures are wall-clock milliseconds on a shared machine: compare servers or commits in
runs side by side, and read the medians over `--repeat`.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import httpx

from loadtest.served import tandem_up

PROBE_PATH = "/v1/models"
KINDS = ("long-prompt", "tokenize-strs", "many-messages")
# Text of mixed scripts and widths (the tokenizer's work per byte differs by script).
WORDS = (
    "hello",
    "world",
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "Ω",
    "日本",
    "émoji😀",
    "\n",
    "  ",
)
NUM_MESSAGES = 1000
IDLE_S = 2.0  # the probe alone, before any heavy request: the server's floor
SETTLE_S = 0.5  # between heavy requests: the probe sees the server recover


@dataclass
class Probe:
    """Asks the probe path every `every_s` until stopped; each latency is kept under the phase
    current when its request was sent."""

    url: str
    every_s: float
    phase: str = "idle"
    latencies: dict[str, list[float]] = field(default_factory=dict)
    failures: dict[str, int] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=60.0, trust_env=False) as client:
            while not self._stop.is_set():
                phase, started = self.phase, time.perf_counter()
                try:
                    ok = client.get(PROBE_PATH).status_code == 200
                except httpx.HTTPError:
                    ok = False
                elapsed = time.perf_counter() - started
                if ok:
                    self.latencies.setdefault(phase, []).append(elapsed)
                else:
                    self.failures[phase] = self.failures.get(phase, 0) + 1
                self._stop.wait(max(0.0, self.every_s - elapsed))

    def stop(self) -> None:
        self._stop.set()


@contextmanager
def probing(url: str, every_s: float) -> Iterator[Probe]:
    probe = Probe(url, every_s)
    thread = threading.Thread(target=probe.run, name="probe", daemon=True)
    thread.start()
    try:
        yield probe
    finally:
        probe.stop()
        thread.join()


def long_text(num_bytes: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    parts, size = [], 0
    while size < num_bytes:
        word = rng.choice(WORDS) + " "
        parts.append(word)
        size += len(word.encode())
    return "".join(parts)


def heavy_request(kind: str, model: str, text: str) -> tuple[str, bytes]:
    """The path and the JSON body of one heavy request of `kind`."""
    if kind == "long-prompt":
        path, body = "/v1/completions", {"model": model, "prompt": text, "max_tokens": 1}
    elif kind == "tokenize-strs":
        path, body = "/tokenize", {"model": model, "prompt": text, "return_token_strs": True}
    elif kind == "many-messages":
        step = max(1, len(text) // NUM_MESSAGES)
        messages = [
            {"role": "user" if i % 2 == 0 else "assistant", "content": text[start : start + step]}
            for i, start in enumerate(range(0, len(text), step))
        ]
        path, body = "/v1/chat/completions", {"model": model, "messages": messages, "max_tokens": 1}
    else:
        raise ValueError(f"unknown kind {kind!r}; expected one of {', '.join(KINDS)}")
    return path, json.dumps(body, ensure_ascii=False).encode()


def served_model(url: str) -> str:
    with httpx.Client(base_url=url, timeout=30.0, trust_env=False) as client:
        response = client.get(PROBE_PATH)
        response.raise_for_status()
        return response.json()["data"][0]["id"]


def run_phases(url: str, kinds: list[str], mib: float, repeat: int, every_s: float) -> dict:
    model = served_model(url)
    text = long_text(int(mib * (1 << 20)))
    heavy: dict[str, list[tuple[int, float]]] = {}
    with (
        probing(url, every_s) as probe,
        httpx.Client(base_url=url, timeout=600.0, trust_env=False) as client,
    ):
        time.sleep(IDLE_S)
        for kind in kinds:
            path, body = heavy_request(kind, model, text)
            probe.phase = kind
            for _ in range(repeat):
                started = time.perf_counter()
                status = client.post(
                    path, content=body, headers={"content-type": "application/json"}
                ).status_code
                heavy.setdefault(kind, []).append((status, time.perf_counter() - started))
                time.sleep(SETTLE_S)
        probe.phase = "done"
    return summary(probe, heavy, mib)


def summary(probe: Probe, heavy: dict[str, list[tuple[int, float]]], mib: float) -> dict:
    phases = {}
    for phase in ["idle", *heavy]:
        latencies = sorted(probe.latencies.get(phase, []))
        row: dict[str, object] = {
            "probes": len(latencies),
            "probe_failures": probe.failures.get(phase, 0),
            "probe_p50_ms": ms(percentile(latencies, 0.50)),
            "probe_p99_ms": ms(percentile(latencies, 0.99)),
            "probe_max_ms": ms(latencies[-1] if latencies else None),
        }
        if phase in heavy:
            runs = heavy[phase]
            row["statuses"] = sorted({status for status, _ in runs})
            row["heavy_median_ms"] = ms(statistics.median(s for _, s in runs))
        phases[phase] = row
    return {"mib": mib, "phases": phases}


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    return values[min(len(values) - 1, int(q * len(values)))]


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


def print_table(result: dict, write: Callable[[str], None] = print) -> None:
    write(f"heavy bodies of {result['mib']} MiB; the probe's latency while each kind is served")
    header = f"{'phase':<15}{'probes':>7}{'p50 ms':>9}{'p99 ms':>9}{'max ms':>9}"
    write(header + f"{'heavy ms':>10}  statuses")
    for phase, row in result["phases"].items():
        cells = [row["probes"], row["probe_p50_ms"], row["probe_p99_ms"], row["probe_max_ms"]]
        line = f"{phase:<15}{cells[0]:>7}" + "".join(f"{str(c):>9}" for c in cells[1:])
        if "heavy_median_ms" in row:
            line += f"{row['heavy_median_ms']:>10}  {row['statuses']}"
        write(line)


def parse_kinds(value: str) -> list[str]:
    kinds = [kind.strip() for kind in value.split(",") if kind.strip()]
    unknown = [kind for kind in kinds if kind not in KINDS]
    if unknown or not kinds:
        raise argparse.ArgumentTypeError(
            f"unknown kind(s) {', '.join(unknown) or '(none)'}; expected some of {', '.join(KINDS)}"
        )
    return kinds


def positive(kind: type) -> Callable[[str], float]:
    def parse(value: str):
        number = kind(value)
        if not number > 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {value}")
        return number

    return parse


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a running server; without it, `tandem up` is started")
    parser.add_argument("--mib", type=positive(float), default=7.0)
    parser.add_argument("--repeat", type=positive(int), default=3)
    parser.add_argument("--probe-every-ms", type=positive(float), default=10.0)
    parser.add_argument("--kinds", type=parse_kinds, default=list(KINDS))
    parser.add_argument("--json", help="also write the result here")
    args = parser.parse_args(argv)
    every_s = args.probe_every_ms / 1000
    if args.url:
        result = run_phases(args.url.rstrip("/"), args.kinds, args.mib, args.repeat, every_s)
    else:
        with tandem_up(extra_args=["--no-batch"]) as cluster:
            result = run_phases(cluster.url, args.kinds, args.mib, args.repeat, every_s)
    print_table(result)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(result, out, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
