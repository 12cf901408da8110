"""Benchmark workloads: long-tailed prompt and output lengths, burst or Poisson arrivals, as JSONL.

Each length is drawn from a log-normal whose median sits at the geometric middle of its range and
whose 99th percentile sits at the top of the range; the rare draws outside are clipped. So most
requests are short and a few are long, the shape of real traffic (the default: prompts of 8 to
1,024 tokens with a median near 90, outputs of 1 to 256 tokens with a median of 16).

A prompt is a window of exactly the target number of tokens cut from `corpus.txt` (natural
English prose, read round and round), starting at a sentence start chosen by the seed. Its token
ids are stored with it and are what `tandem bench` sends (the completions API takes a list of ids as
`prompt`), so the server sees exactly the target length; the decoded text is kept for people and
for text-only clients, and a generator check keeps its re-tokenized length within one token.

Arrival times are all 0 (a burst) or a Poisson process at `rate` requests per second. Every
random choice comes from its own stream seeded by (seed, the workload's name, purpose), so a
different rate leaves the prompts and lengths unchanged, and two named workloads of one seed (the
mix's classes) do not start their i-th prompts at the same place.

    .venv/bin/python -m loadtest.workload --out loadtest/workloads/mixed64.jsonl [--rate 2]
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import random
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.planner.workload import MAX_ARRIVAL_TIME_S, whole_number

CORPUS_PATH = Path(__file__).with_name("corpus.txt")
DEFAULT_PROMPT_RANGE = (8, 1024)
DEFAULT_OUTPUT_RANGE = (1, 256)
Z_99 = 2.326  # the standard normal's 99th percentile
# A sentence starts at the text's start, after a line break, or after ". " (and "!", "?").
_SENTENCE_START = re.compile(r"(?:\A|\n|(?<=[.!?]) )([A-Z])")


@dataclass(frozen=True)
class WorkloadRequest:
    prompt: str
    max_tokens: int
    arrival_time: float  # seconds after the run starts
    prompt_token_ids: list[int] | None = None  # exact; sent instead of `prompt` when present
    ignore_eos: bool = True  # every request generates exactly max_tokens
    label: str = ""  # its class in reports (chat, long, bulk, ...)
    stream: bool = True  # streamed (latencies per token) or one response
    response_format: dict[str, Any] | None = None  # OpenAI's, sent as given (constrained output)

    @property
    def num_prompt_tokens(self) -> int | None:
        return len(self.prompt_token_ids) if self.prompt_token_ids is not None else None

    def to_json(self) -> str:
        fields: dict[str, Any] = {
            "prompt": self.prompt,
            "max_tokens": self.max_tokens,
            "ignore_eos": self.ignore_eos,
            "arrival_time": self.arrival_time,
        }
        if self.prompt_token_ids is not None:
            fields["prompt_token_ids"] = self.prompt_token_ids
        if self.label:
            fields["label"] = self.label
        if not self.stream:
            fields["stream"] = False
        if self.response_format is not None:
            fields["response_format"] = self.response_format
        return json.dumps(fields, ensure_ascii=False)

    @classmethod
    def from_json(cls, line: str) -> WorkloadRequest:
        data = json.loads(line)
        if not isinstance(data, dict):
            raise TypeError(f"a request is a JSON object, got {type(data).__name__}")
        if not isinstance(data["prompt"], str):
            raise TypeError(f"prompt must be a string, got {type(data['prompt']).__name__}")
        return cls(
            prompt=data["prompt"],
            max_tokens=whole_number(data["max_tokens"], "max_tokens"),
            arrival_time=float(data.get("arrival_time", 0.0)),
            prompt_token_ids=_token_ids(data.get("prompt_token_ids")),
            ignore_eos=_flag(data, "ignore_eos"),
            label=str(data.get("label", "")),
            stream=_flag(data, "stream"),
            response_format=_response_format(data.get("response_format")),
        )


def _flag(data: dict[str, Any], name: str) -> bool:
    """A true/false field, true when left out; `"false"` (a string, true to `bool`) was read as
    true: a request meant to be sent whole was streamed."""
    value = data.get(name, True)
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be true or false, got {value!r}")
    return value


def _token_ids(value: Any) -> list[int] | None:
    """A non-empty list of token ids (integers >= 0), or None; a string was taken as its
    digits."""
    if value is None:
        return None
    if not isinstance(value, list) or not value:
        raise TypeError(f"prompt_token_ids must be a non-empty list, got {value!r:.80}")
    ids = [whole_number(t, "each of prompt_token_ids") for t in value]
    if min(ids) < 0:
        raise ValueError(f"prompt_token_ids must be >= 0, got {min(ids)}")
    return ids


def _response_format(value: Any) -> dict[str, Any] | None:
    if value is not None and not isinstance(value, dict):
        raise TypeError(f"response_format must be an object, got {type(value).__name__}")
    return value


def write_workload(path: str | Path, requests: Iterable[WorkloadRequest]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for request in requests:
            f.write(request.to_json() + "\n")


class WorkloadError(ValueError):
    """A workload file that cannot be read; the message names the line."""


def read_workload(path: str | Path) -> list[WorkloadRequest]:
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise WorkloadError(f"cannot read workload {path}: {error}") from None
    requests = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            request = WorkloadRequest.from_json(line)
        except (ValueError, KeyError, TypeError, OverflowError) as error:
            raise WorkloadError(f"{path}:{number}: {type(error).__name__}: {error}") from None
        # (The planner's bound: a replay of an arrival at 1e300 s waited for ever.)
        if request.max_tokens < 1 or not 0 <= request.arrival_time <= MAX_ARRIVAL_TIME_S:
            raise WorkloadError(
                f"{path}:{number}: max_tokens must be >= 1, arrival_time seconds in "
                f"[0, {MAX_ARRIVAL_TIME_S:.0e}]"
            )
        requests.append(request)
    if not requests:
        raise WorkloadError(f"{path}: no requests")
    return requests


# --- random draws ------------------------------------------------------------------------------


def stream(seed: int, purpose: str) -> random.Random:
    # String seeds are hashed with SHA-512 by `random`, so they are stable across runs/platforms.
    return random.Random(f"tandem-workload:{seed}:{purpose}")


def long_tailed_lengths(rng: random.Random, num: int, low: int, high: int) -> list[int]:
    """Log-normal draws: median sqrt(low * high), 99th percentile at `high`, clipped to range."""
    if not 1 <= low <= high:
        raise ValueError(f"need 1 <= low <= high, got {low}, {high}")
    median = math.sqrt(low * high)
    sigma = math.log(high / median) / Z_99
    draws = (rng.lognormvariate(math.log(median), sigma) for _ in range(num))
    return [min(high, max(low, round(x))) for x in draws]


def arrival_times(rng: random.Random, num: int, rate: float | None) -> list[float]:
    """All 0 for a burst; otherwise a Poisson process (exponential gaps) at `rate` per second."""
    if rate is None:
        return [0.0] * num
    if not 0 < rate < math.inf:  # (a NaN compares false: it made every arrival NaN)
        raise ValueError(f"rate must be a positive number of requests/s, got {rate}")
    times, clock = [], 0.0
    for _ in range(num):
        clock += rng.expovariate(rate)
        times.append(round(clock, 6))
    return times


# --- prompts from the corpus -------------------------------------------------------------------


@dataclass(frozen=True)
class Corpus:
    token_ids: list[int]
    sentence_starts: list[int]  # indices into token_ids of tokens that begin a sentence


def tokenize_corpus(tokenizer: Any, text: str) -> Corpus:
    """Tokenizes the whole text once; sentence starts are found through the offset mapping."""
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(encoded["input_ids"]), encoded["offset_mapping"]
    token_char_starts = [start for start, _ in offsets]
    starts = []
    for match in _SENTENCE_START.finditer(text):
        # The token holding the capital letter; a byte-level BPE token such as " The" also
        # spans the space before it.
        index = bisect.bisect_right(token_char_starts, match.start(1)) - 1
        if index >= 0 and match.start(1) < offsets[index][1] and index not in starts[-1:]:
            starts.append(index)
    if not starts:
        raise ValueError("the corpus has no sentence starts")
    return Corpus(ids, starts)


def corpus_window(corpus: Corpus, start: int, num_tokens: int) -> list[int]:
    """`num_tokens` ids from `start`, wrapping around the end of the corpus."""
    size = len(corpus.token_ids)
    return [corpus.token_ids[(start + i) % size] for i in range(num_tokens)]


def build_prompt(
    tokenizer: Any, corpus: Corpus, rng: random.Random, num_tokens: int, attempts: int = 20
) -> tuple[str, list[int]]:
    """A prompt of exactly `num_tokens` ids whose text re-tokenizes to within one token of it."""
    for _ in range(attempts):
        ids = corpus_window(corpus, rng.choice(corpus.sentence_starts), num_tokens)
        text = tokenizer.decode(ids)
        if abs(len(tokenizer.encode(text, add_special_tokens=False)) - num_tokens) <= 1:
            return text, ids
    raise ValueError(f"no window of {num_tokens} tokens round-trips through the text")


def build_workload(
    tokenizer: Any,
    num: int = 64,
    seed: int = 0,
    rate: float | None = None,
    prompt_range: tuple[int, int] = DEFAULT_PROMPT_RANGE,
    output_range: tuple[int, int] = DEFAULT_OUTPUT_RANGE,
    corpus_text: str | None = None,
    name: str = "",
) -> list[WorkloadRequest]:
    """`num` requests; `name` keys the random streams, so that workloads drawn with one seed
    under different names (the mix's classes) start their prompts at different places."""
    corpus = tokenize_corpus(tokenizer, corpus_text or CORPUS_PATH.read_text(encoding="utf-8"))
    key = f"{name}:" if name else ""
    prompt_lens = long_tailed_lengths(stream(seed, f"{key}prompt-lengths"), num, *prompt_range)
    output_lens = long_tailed_lengths(stream(seed, f"{key}output-lengths"), num, *output_range)
    arrivals = arrival_times(stream(seed, f"{key}arrivals"), num, rate)
    starts = stream(seed, f"{key}prompt-starts")
    requests = []
    for prompt_len, max_tokens, arrival in zip(prompt_lens, output_lens, arrivals, strict=True):
        text, ids = build_prompt(tokenizer, corpus, starts, prompt_len)
        requests.append(WorkloadRequest(text, max_tokens, arrival, ids))
    return requests


# --- command line ------------------------------------------------------------------------------


def parse_range(value: str) -> tuple[int, int]:
    low, high = (int(part) for part in value.split(","))
    return low, high


def check_counts(parser: argparse.ArgumentParser, num: int, rate: float | None) -> None:
    """`--num` and `--rate` refused as flags (exit 2), before a tokenizer loads."""
    if num < 1:
        parser.error(f"--num must be at least 1, got {num}")
    if rate is not None and not 0 < rate < math.inf:
        parser.error(f"--rate must be a positive number of requests/s, got {rate}")


def load_tokenizer(model: str | None = None) -> Any:
    """The model's tokenizer (default: smollm2), whose tokens a written workload holds."""
    from transformers import AutoTokenizer

    from shared.engine.model_files import resolve_model_dir

    return AutoTokenizer.from_pretrained(resolve_model_dir(model)[0])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="the JSONL file to write")
    parser.add_argument("--num", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rate", type=float, default=None, help="Poisson rate (req/s); else burst")
    parser.add_argument(
        "--prompt-range",
        type=parse_range,
        default=DEFAULT_PROMPT_RANGE,
        help="LOW,HIGH prompt tokens (default 8,1024)",
    )
    parser.add_argument(
        "--output-range",
        type=parse_range,
        default=DEFAULT_OUTPUT_RANGE,
        help="LOW,HIGH output tokens (default 1,256)",
    )
    parser.add_argument("--model", default=None, help="whose tokenizer (default: smollm2)")
    args = parser.parse_args(argv)
    check_counts(parser, args.num, args.rate)

    requests = build_workload(
        load_tokenizer(args.model),
        args.num,
        args.seed,
        args.rate,
        args.prompt_range,
        args.output_range,
    )
    write_workload(args.out, requests)
    prompt_lens = sorted(r.num_prompt_tokens or 0 for r in requests)
    output_lens = sorted(r.max_tokens for r in requests)
    print(
        f"wrote {len(requests)} requests to {args.out}: prompt tokens median "
        f"{prompt_lens[len(prompt_lens) // 2]} max {prompt_lens[-1]} total {sum(prompt_lens)}; "
        f"output tokens median {output_lens[len(output_lens) // 2]} max {output_lens[-1]} "
        f"total {sum(output_lens)}"
    )


if __name__ == "__main__":
    main()
