"""Built-in workloads for `tandem bench`: short chat, long prompts, bulk batch, a mix, agents
and constrained JSON.

Each class draws long-tailed prompt and output lengths in its own ranges (see `workload`), and
prompts are exact-length windows of the corpus, so any server sees the same tokens. Each class
draws from its own random streams (keyed by its name), so the mix's classes do not start their
prompts at the same corpus places. The mix interleaves the classes in fixed proportions, in an
order drawn from the seed. Arrival times are set afterwards (`with_arrivals`), so a rate sweep
sends the same requests at each rate, but for the nonce below.

A server with a prefix cache would serve the second run of the same prompts from its cache, so
`tandem bench` puts a nonce ahead of every prompt of a run (`prompt_nonce`, `with_prompt_nonce`):
`NONCE_TOKENS` token ids drawn at random from the workload's own prompts (after the first token
every prompt starts with, a BOS, which stays first and is not drawn), or for prompts sent as
text `NONCE_WORDS` of its words. One nonce serves a whole run, so the prefixes its requests
share with each other (the agents' system prompt) stay shared; a new one for every run and
repetition makes the server see prompts it has not seen. It is drawn fresh (not from the seed:
the next command with the same seed must not find its prompts cached either) and recorded in
the result. Where EOS is not ignored (`json`), the nonce also changes what is generated, so runs
of such a workload compare as samples, not as the same work.

Two workloads of the agent hub stand apart:
- `agents`: agents re-sending a long shared context. Every prompt starts with one shared
  512-token system prompt, then its agent's own history, which grows by 64 tokens a turn (turn
  t of an agent extends turn t-1's prompt); requests go turn by turn (every agent's first turn,
  then every second turn, ...). A server with a prefix cache computes the system prompt once and
  each history once per turn's growth.
- `json`: short questions answered under a JSON schema (`response_format`), so decoding is
  constrained and ends where the structure does: EOS is not ignored and the token count is not
  checked against `max_tokens`.

Written to a JSONL file, a built-in workload is replayed by `tandem bench --workload` and by
`tandem plan` (whose simulated prefix caches find the agents' shared prefixes in the ids):

    .venv/bin/python -m loadtest.generators agents --num 32 --rate 0.5 --out agents32.jsonl
"""

from __future__ import annotations

import argparse
import dataclasses
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from loadtest.workload import (
    CORPUS_PATH,
    WorkloadRequest,
    arrival_times,
    build_workload,
    check_counts,
    corpus_window,
    load_tokenizer,
    long_tailed_lengths,
    stream,
    tokenize_corpus,
    write_workload,
)


@dataclass(frozen=True)
class RequestClass:
    prompt_range: tuple[int, int]
    output_range: tuple[int, int]
    stream: bool  # bulk jobs take one response, people watch a stream


CLASSES = {
    "chat": RequestClass(prompt_range=(16, 512), output_range=(8, 256), stream=True),
    "long": RequestClass(prompt_range=(1024, 3072), output_range=(8, 128), stream=True),
    "bulk": RequestClass(prompt_range=(32, 256), output_range=(32, 128), stream=False),
}
MIX = {"chat": 0.6, "long": 0.2, "bulk": 0.2}
GENERATORS = (*CLASSES, "mix", "agents", "json")

AGENT_TURNS = 4
AGENT_SYSTEM_TOKENS = 512  # shared by every agent
AGENT_FIRST_TOKENS = 96  # an agent's own history at its first turn
AGENT_TURN_TOKENS = 64  # what each later turn adds to it
AGENT_OUTPUT_RANGE = (16, 48)

JSON_MAX_TOKENS = 96
JSON_TASKS = (  # (question, schema): small objects a 135M model fills in a few dozen tokens
    (
        "Describe a person with a name and an age, as JSON.",
        {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                          "age": {"type": "integer"}},
         "required": ["name", "age"], "additionalProperties": False},
    ),
    (
        "Name a city and its country, as JSON.",
        {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                          "country": {"type": "string", "maxLength": 24}},
         "required": ["city", "country"], "additionalProperties": False},
    ),
    (
        "List three colours, as JSON.",
        {"type": "object", "properties": {"colours": {
            "type": "array", "items": {"type": "string", "maxLength": 12},
            "minItems": 3, "maxItems": 3}},
         "required": ["colours"], "additionalProperties": False},
    ),
    (
        "Is water wet? Answer as JSON with a yes/no field and a reason.",
        {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
                                          "reason": {"type": "string", "maxLength": 40}},
         "required": ["answer", "reason"], "additionalProperties": False},
    ),
)  # fmt: skip


def generate(tokenizer: Any, name: str, num: int, seed: int = 0) -> list[WorkloadRequest]:
    """`num` requests of class `name` (or the mix), all arriving at 0."""
    if num < 1:
        raise ValueError(f"the number of requests must be >= 1, got {num}")
    if name == "mix":
        return _mix(tokenizer, num, seed)
    if name == "agents":
        return _agents(tokenizer, num, seed)
    if name == "json":
        return _json(tokenizer, num, seed)
    if name not in CLASSES:
        raise ValueError(f"unknown workload {name!r}; built-in: {', '.join(GENERATORS)}")
    shape = CLASSES[name]
    requests = build_workload(
        tokenizer,
        num,
        seed=seed,
        prompt_range=shape.prompt_range,
        output_range=shape.output_range,
        name=name,
    )
    return [dataclasses.replace(r, label=name, stream=shape.stream) for r in requests]


def _mix(tokenizer: Any, num: int, seed: int) -> list[WorkloadRequest]:
    rng = stream(seed, "mix-order")
    names = rng.choices(list(MIX), weights=list(MIX.values()), k=num)
    pools = {
        name: iter(generate(tokenizer, name, names.count(name), seed))
        for name in MIX
        if name in names
    }
    return [next(pools[name]) for name in names]


def _agents(tokenizer: Any, num: int, seed: int) -> list[WorkloadRequest]:
    corpus = tokenize_corpus(tokenizer, CORPUS_PATH.read_text(encoding="utf-8"))
    rng = stream(seed, "agents")
    num_agents = -(-num // AGENT_TURNS)
    system = corpus_window(corpus, rng.choice(corpus.sentence_starts), AGENT_SYSTEM_TOKENS)
    longest = AGENT_FIRST_TOKENS + AGENT_TURN_TOKENS * (AGENT_TURNS - 1)
    histories = [
        corpus_window(corpus, rng.choice(corpus.sentence_starts), longest)
        for _ in range(num_agents)
    ]
    outputs = long_tailed_lengths(stream(seed, "agents-outputs"), num, *AGENT_OUTPUT_RANGE)
    requests: list[WorkloadRequest] = []
    for turn in range(AGENT_TURNS):
        for history in histories:
            if len(requests) == num:
                return requests
            ids = system + history[: AGENT_FIRST_TOKENS + AGENT_TURN_TOKENS * turn]
            max_tokens = outputs[len(requests)]
            requests.append(
                WorkloadRequest(tokenizer.decode(ids), max_tokens, 0.0, ids, label="agents")
            )
    return requests


def _json(tokenizer: Any, num: int, seed: int) -> list[WorkloadRequest]:
    rng = stream(seed, "json-tasks")
    requests = []
    for _ in range(num):
        question, schema = rng.choice(JSON_TASKS)
        ids = list(tokenizer.encode(question, add_special_tokens=False))
        schema_format = {"name": "answer", "schema": schema, "strict": True}
        request = WorkloadRequest(question, JSON_MAX_TOKENS, 0.0, ids, ignore_eos=False,
                                  label="json",
                                  response_format={"type": "json_schema",
                                                   "json_schema": schema_format})  # fmt: skip
        requests.append(request)
    return requests


def with_arrivals(
    requests: Sequence[WorkloadRequest], rate: float | None, seed: int = 0
) -> list[WorkloadRequest]:
    """The same requests, all at once (`rate` None) or as a Poisson process at `rate` per s."""
    times = arrival_times(stream(seed, f"arrivals-{rate}"), len(requests), rate)
    return [dataclasses.replace(r, arrival_time=t) for r, t in zip(requests, times, strict=True)]


NONCE_TOKENS = 4
NONCE_WORDS = 4


@dataclass(frozen=True)
class PromptNonce:
    """What goes ahead of every prompt of one run."""

    token_ids: list[int]  # ahead of prompts sent as token ids
    text: str  # ahead of prompts sent as text


def prompt_nonce(
    requests: Sequence[WorkloadRequest], rng: random.Random | None = None
) -> PromptNonce:
    """A fresh nonce (from the system's randomness unless `rng` is given), drawn from the
    workload's own token ids and words."""
    rng = rng or random.SystemRandom()
    lead = _shared_first_token(requests)
    ids = sorted({t for r in requests for t in r.prompt_token_ids or ()} - {lead})
    words = sorted({w for r in requests for w in r.prompt.split()})
    return PromptNonce(
        [rng.choice(ids) for _ in range(NONCE_TOKENS)] if ids else [],
        "".join(f"{rng.choice(words)} " for _ in range(NONCE_WORDS)) if words else "",
    )


def with_prompt_nonce(
    requests: Sequence[WorkloadRequest], nonce: PromptNonce
) -> list[WorkloadRequest]:
    """The same requests, each prompt (ids and text) after the nonce; the token ids after the
    first token every prompt starts with, if there is one (a BOS stays first)."""
    skip = 0 if _shared_first_token(requests) is None else 1
    return [
        dataclasses.replace(
            r,
            prompt=nonce.text + r.prompt,
            prompt_token_ids=(
                None
                if r.prompt_token_ids is None
                else r.prompt_token_ids[:skip] + nonce.token_ids + r.prompt_token_ids[skip:]
            ),
        )
        for r in requests
    ]


def _shared_first_token(requests: Sequence[WorkloadRequest]) -> int | None:
    """The token every prompt sent as ids starts with, if they all start with one (a BOS)."""
    firsts = {r.prompt_token_ids[0] for r in requests if r.prompt_token_ids}
    every = all(r.prompt_token_ids for r in requests if r.prompt_token_ids is not None)
    return firsts.pop() if len(firsts) == 1 and every else None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="write a built-in workload as JSONL")
    parser.add_argument("name", choices=GENERATORS)
    parser.add_argument("--out", required=True, help="the JSONL file to write")
    parser.add_argument("--num", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rate", type=float, default=None, help="Poisson rate (req/s); else burst")
    parser.add_argument("--model", default=None, help="whose tokenizer (default: smollm2)")
    args = parser.parse_args(argv)
    check_counts(parser, args.num, args.rate)
    built = generate(load_tokenizer(args.model), args.name, args.num, args.seed)
    requests = with_arrivals(built, args.rate, args.seed)
    write_workload(args.out, requests)
    print(f"wrote {len(requests)} {args.name} requests to {args.out}")


if __name__ == "__main__":
    main()
