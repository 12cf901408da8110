"""What the simulator replays: requests with an arrival time, a prompt and an output length.

Either the JSONL files `tandem bench` replays (one request a line: `arrival_time`, `max_tokens`,
and the prompt as `prompt_token_ids`, else `num_prompt_tokens`, else `prompt`: token ids, or
text counted at four characters a token; `"stream": false` marks one sent for one response,
which has an e2e latency and no TTFT or TPOT, as the bench records it), or a generated process
described in one string:

    poisson:rate=2,n=1000,prompt=8-1024,output=1-256[,tenants=10][,prefix=512][,seed=0]

Poisson arrivals at `rate` requests/s; lengths log-normal with the median at the geometric middle
of the range and the 99th percentile at its top (clipped to the range), as the bench's generator
draws them. Every request generates exactly `max_tokens` tokens (the bench's `ignore_eos`).

The tokens matter only to simulated prefix caches (`SimConfig.prefix_cache`): a JSONL file's
`prompt_token_ids` are kept (`python -m loadtest.generators agents` writes the agent
hub's conversations so); a generated prompt starts with `prefix` tokens its tenant's prompts all
share (a system prompt, at most the prompt's length) and goes on with tokens no other prompt has.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

Z_99 = 2.326  # the standard normal's 99th percentile
CHARS_PER_TOKEN = 4  # for a JSONL line that has only the prompt text
# Arrival times are seconds from any origin (Unix seconds: 1.7e9); past 1e11 they are no log's
# seconds (milliseconds, or a float past any calendar), and far past it the simulated clock, a
# float, steps by more than its ticks (1e300: a run that never ended) or its origin overflows
# (1e308).
MAX_ARRIVAL_TIME_S = 1e11
MAX_SPAN_S = 366 * 86_400.0  # first arrival to last: a year of traffic is simulated in days
MAX_GENERATED_REQUESTS = 10_000_000  # a generated process's `n` (some 300 bytes each)


class WorkloadError(ValueError):
    """A workload that cannot be read, with the reason."""


@dataclass(frozen=True)
class SimRequest:
    arrival_time: float  # seconds, from any origin (a log's Unix timestamps: see Simulator.run)
    num_prompt_tokens: int
    max_tokens: int  # generated tokens, exactly
    tenant: str = "default"
    label: str = ""
    priority: int = 0
    prompt_token_ids: tuple[int, ...] | None = None  # the prompt itself, when the workload has it
    num_shared_tokens: int = 0  # else: the leading tokens every prompt of its tenant shares
    # Streamed (a first token, TTFT and TPOT) or one response (e2e only), as the bench sends it.
    stream: bool = True
    # A batch job's line (the bulk class: spare capacity only). Set by programs that build
    # workloads (`loadtest/bulk_beside_agents.py`), not read from a file: a plan's objectives
    # would judge batch lines by the interactive targets.
    bulk: bool = False

    @property
    def shares_tokens(self) -> bool:
        """Whether its prompt can share tokens with others' (a cache has something to find)."""
        return self.prompt_token_ids is not None or self.num_shared_tokens > 0

    def prompt(self, index: int) -> list[int]:
        """Its prompt's tokens: its own, or a shared prefix and then tokens only the request
        numbered `index` has."""
        if self.prompt_token_ids is not None:
            return list(self.prompt_token_ids)
        num_shared = min(self.num_shared_tokens, self.num_prompt_tokens)
        return [0] * num_shared + [index + 1] * (self.num_prompt_tokens - num_shared)


def load_workload(spec: str) -> list[SimRequest]:
    """A generated process (`poisson:...`) or a JSONL file, sorted by arrival."""
    requests = _generate(spec) if spec.startswith("poisson:") else _read_jsonl(Path(spec))
    if not requests:
        raise WorkloadError(f"workload {spec!r} has no requests")
    requests.sort(key=lambda r: r.arrival_time)
    span_s = requests[-1].arrival_time - requests[0].arrival_time
    if span_s > MAX_SPAN_S:
        raise WorkloadError(
            f"workload {spec!r} spans {span_s:.3g} s from its first arrival to its last, more "
            f"than a year ({MAX_SPAN_S:.0f} s): are its arrival times seconds?"
        )
    return requests


def _read_jsonl(path: Path) -> list[SimRequest]:
    try:
        # (utf-8-sig: a file an editor saved with a byte-order mark reads as the same lines)
        lines = path.read_text(encoding="utf-8-sig").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise WorkloadError(f"cannot read workload {path}: {error}") from None
    requests = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            requests.append(_from_line(json.loads(line)))
        except KeyError as error:
            raise WorkloadError(f"{path}:{number}: missing field {error}") from None
        # (RecursionError: a line nested past the JSON parser's depth.)
        except (TypeError, ValueError, OverflowError, RecursionError) as error:
            raise WorkloadError(f"{path}:{number}: {error}") from None
    return requests


def _from_line(data: object) -> SimRequest:
    if not isinstance(data, dict):
        raise TypeError(f"a request is a JSON object, got {type(data).__name__}")
    token_ids = None
    if "prompt_token_ids" in data:
        token_ids = tuple(whole_number(t, "a token id") for t in data["prompt_token_ids"])
        num_prompt_tokens = len(token_ids)
    elif "num_prompt_tokens" in data:
        num_prompt_tokens = whole_number(data["num_prompt_tokens"], "num_prompt_tokens")
    elif isinstance(data["prompt"], list):  # token ids, as the completions API (and the bench)
        token_ids = tuple(whole_number(t, "a token id") for t in data["prompt"])
        num_prompt_tokens = len(token_ids)
    elif isinstance(data["prompt"], str):
        num_prompt_tokens = max(1, len(data["prompt"]) // CHARS_PER_TOKEN)
    else:
        raise TypeError(f"prompt is text or token ids, got {type(data['prompt']).__name__}")
    request = SimRequest(
        arrival_time=float(data.get("arrival_time", 0.0)),
        num_prompt_tokens=num_prompt_tokens,
        max_tokens=whole_number(data["max_tokens"], "max_tokens"),
        tenant=str(data.get("tenant", "default")),
        label=str(data.get("label", "")),
        prompt_token_ids=token_ids,
        stream=_stream(data),
    )
    if (
        request.num_prompt_tokens < 1
        or request.max_tokens < 1
        or not 0 <= request.arrival_time <= MAX_ARRIVAL_TIME_S  # (NaN compares false)
    ):
        raise ValueError(
            "prompt and max_tokens must be >= 1, and arrival_time seconds in "
            f"[0, {MAX_ARRIVAL_TIME_S:.0e}] (Unix seconds are 1.7e9; milliseconds are not read)"
        )
    return request


def whole_number(value: object, name: str) -> int:
    """A count or token id of a workload line (this reader's and `tandem bench`'s): a JSON
    integer, or a number with no fraction (3.0). `int` read 2.7 as 2, true as 1 and "16" as 16,
    each a value the server refuses."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a whole number, got {value!r}")
    if isinstance(value, float) and not value.is_integer():  # (NaN and infinities too)
        raise ValueError(f"{name} must be a whole number, got {value!r}")
    return int(value)


def _stream(data: dict) -> bool:
    """`stream`, true when left out; `"false"` (a string, true to `bool`) was read as true."""
    value = data.get("stream", True)
    if not isinstance(value, bool):
        raise TypeError(f"stream must be true or false, got {value!r}")
    return value


def _parse_range(name: str, text: str) -> tuple[int, int]:
    low, _, high = text.partition("-")
    try:
        bounds = int(low), int(high or low)
    except ValueError:
        raise WorkloadError(f"{name} must be LOW-HIGH token counts, got {text!r}") from None
    if not 1 <= bounds[0] <= bounds[1]:
        raise WorkloadError(f"{name} must satisfy 1 <= LOW <= HIGH, got {text!r}")
    return bounds


def _generate(spec: str) -> list[SimRequest]:
    fields = {"rate": "1", "n": "100", "prompt": "8-1024", "output": "1-256", "tenants": "1"}
    fields.update(prefix="0", seed="0")
    given: set[str] = set()
    for part in spec.removeprefix("poisson:").split(","):
        key, sep, value = part.partition("=")
        if not sep or key not in fields:
            known = ", ".join(fields)
            raise WorkloadError(f"workload field {part!r} is not key=value with a key of {known}")
        if key in given:  # (the last one won, unsaid)
            raise WorkloadError(f"workload field {key!r} is given twice")
        given.add(key)
        fields[key] = value
    try:
        rate, num_requests = float(fields["rate"]), int(fields["n"])
        num_tenants, seed = int(fields["tenants"]), int(fields["seed"])
        num_shared = int(fields["prefix"])
    except ValueError as error:
        raise WorkloadError(f"workload {spec!r}: {error}") from None
    if not (rate > 0 and num_requests > 0 and num_tenants > 0):
        raise WorkloadError("rate, n and tenants must be positive")
    if num_requests > MAX_GENERATED_REQUESTS:  # (it ran until the memory ran out)
        raise WorkloadError(f"n must be at most {MAX_GENERATED_REQUESTS:,}, got {num_requests:,}")
    if num_shared < 0:
        raise WorkloadError(f"prefix must be >= 0 tokens, got {num_shared}")
    prompts = _parse_range("prompt", fields["prompt"])
    outputs = _parse_range("output", fields["output"])
    rng = random.Random(seed)
    requests, now = [], 0.0
    for index in range(num_requests):
        now += rng.expovariate(rate)
        if now > MAX_SPAN_S:  # (past it the simulation ticked towards 1e300 forever)
            raise WorkloadError(
                f"rate={fields['rate']} is too low: the arrivals would span more than a year"
            )
        requests.append(
            SimRequest(
                arrival_time=now,
                num_prompt_tokens=_long_tailed(rng, *prompts),
                max_tokens=_long_tailed(rng, *outputs),
                tenant=f"tenant{index % num_tenants}",
                num_shared_tokens=num_shared,
            )
        )
    return requests


def _long_tailed(rng: random.Random, low: int, high: int) -> int:
    """Log-normal: median at sqrt(low * high), 99th percentile at high, clipped to the range."""
    if low == high:
        return low
    mu = math.log(math.sqrt(low * high))
    sigma = (math.log(high) - mu) / Z_99
    return min(high, max(low, round(rng.lognormvariate(mu, sigma))))
