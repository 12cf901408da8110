"""Agents: many conversations sharing one long system prompt, each turn re-sending the history.

    .venv/bin/python -m loadtest.agents_bench [--agents 8] [--turns 6] [--modes off,on]
        [--kv-cache-bytes N] [--max-num-seqs N] [--json OUT]

A agents share a system prompt of about `--system-words` words (~600 tokens at the default) and
run T turns each, in lockstep: every agent sends its turn (system prompt, the whole history, a
new user message; a short streamed reply), and the next turn starts when all have answered, as
an orchestrator waiting on its agents does. The same scenario runs on a `tandem up` per mode,
in one run: the prefix cache `off`, `on` (with its host tier), and `no-tier` (on, the host tier
off). Per turn it reports TTFT p50/p99, the prompt tokens sent against those computed (sent less
`usage.prompt_tokens_details.cached_tokens`), the KV bytes the prefill workers sent (their
`kv_transfer_bytes_total`, before and after the turn), the turns prefilled on a decode worker,
the hit rate, and the prompt tokens copied back from the host tier. A KV pool too small for all
the agents' histories (`--kv-cache-bytes`, with `--max-num-seqs` keeping the running turns
within it) is where the host tier shows. Given `--llama-server BIN --llama-gguf MODEL.gguf`, the
same scenario then runs on llama.cpp's server (`--slots` slots, 16 by default; its hit rate from
the same `cached_tokens`, which it reports). The verdict lines check the issue's targets: tokens
computed at most a quarter of those sent, TTFT p50 of turns 2 and on at most a third of the
cache-off run's, KV bytes per turn against the new tokens, and TTFT p50 and p99 of turns 2 and on
below llama.cpp's. All traffic goes to 127.0.0.1.

    .venv/bin/python -m loadtest.agents_bench --llama-server BIN --llama-gguf MODEL.gguf
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from loadtest.metrics import percentile
from loadtest.race import llama_server
from loadtest.served import environment, tandem_up
from services.commands.top_data import parse_counters

MODEL = "smollm2"
LLAMA = "llama.cpp"
KV_BYTES = "tandem:kv_transfer_bytes_total"
LOCAL_PREFILLS = "tandem:local_prefills_total"
HOST_HITS = "tandem:prefix_cache_host_hits_total"
# A verdict on turns 2 and on with nothing to judge: one turn only, or none of them succeeded.
NO_LATER_TTFT = "no TTFT of turns 2 and on to compare (one turn, or every later one failed)"
# Each mode's worker settings (TANDEM_* environment variables).
MODES = {
    "off": {"TANDEM_ENABLE_PREFIX_CACHING": "false"},
    "on": {"TANDEM_ENABLE_PREFIX_CACHING": "true"},
    "no-tier": {"TANDEM_ENABLE_PREFIX_CACHING": "true", "TANDEM_HOST_CACHE_BYTES": "0"},
}
WORDS = [
    "agent",
    "tool",
    "search",
    "fetch",
    "parse",
    "summarize",
    "plan",
    "verify",
    "report",
    "file",
    "query",
    "table",
    "index",
]


@dataclass
class Turn:
    ttfts: list[float] = field(default_factory=list)
    num_sent: int = 0  # prompt tokens sent
    num_cached: int = 0  # of them, not computed
    kv_bytes: float = 0.0
    num_local_prefills: float = 0.0
    num_host_hits: float = 0.0  # prompt tokens copied back from the host tier (workers' counter)
    num_errors: int = 0

    def summary(self) -> dict[str, Any]:
        return {
            "ttfts_s": self.ttfts,
            "ttft_p50_s": percentile(self.ttfts, 50) if self.ttfts else None,
            "ttft_p99_s": percentile(self.ttfts, 99) if self.ttfts else None,
            "prompt_tokens_sent": self.num_sent,
            "prompt_tokens_computed": self.num_sent - self.num_cached,
            "hit_rate": self.num_cached / self.num_sent if self.num_sent else 0.0,
            "kv_bytes": self.kv_bytes,
            "local_prefills": self.num_local_prefills,
            "host_hit_tokens": self.num_host_hits,
            "errors": self.num_errors,
        }


def system_prompt(num_words: int) -> str:
    rng = random.Random(0)
    lines = ["You are one of several agents. Use the tools below and answer in one line."]
    while sum(len(line.split()) for line in lines) < num_words:
        name = "_".join(rng.sample(WORDS, 2))
        lines.append(f"Tool {name}: takes {rng.choice(WORDS)} and {rng.choice(WORDS)}.")
    return "\n".join(lines)


def user_message(agent: int, turn: int) -> str:
    rng = random.Random(agent * 1000 + turn)
    return f"Agent {agent}, step {turn}: " + " ".join(rng.choices(WORDS, k=20))


async def one_turn(
    client: httpx.AsyncClient, messages: list[dict], max_tokens: int, turn: Turn
) -> str:
    """One agent's turn: its reply's text ("" or what came, when it failed). A failure (an HTTP
    error, a broken or malformed stream, a timeout) counts in the turn's errors, never raises:
    the other agents' turns, and the run, go on."""
    try:
        return await _stream_turn(client, messages, max_tokens, turn)
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        turn.num_errors += 1
        return ""


async def _stream_turn(
    client: httpx.AsyncClient, messages: list[dict], max_tokens: int, turn: Turn
) -> str:
    body = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "user": "agents",
    }
    sent_at, first_at, text, usage = time.monotonic(), None, "", None
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            turn.num_errors += 1
            return ""
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                content = choice.get("delta", {}).get("content")
                if content:
                    first_at = first_at or time.monotonic()
                    text += content
    if first_at is None or usage is None:
        turn.num_errors += 1
        return text
    sent = int(usage["prompt_tokens"])  # (read first: a malformed usage counts nothing)
    # OpenAI may send the details as null, or a null count: none cached, as far as it says.
    cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    turn.ttfts.append(first_at - sent_at)
    turn.num_sent += sent
    turn.num_cached += cached
    return text


def counters(client: httpx.Client) -> dict[str, float]:
    """tandem's cluster-wide counters; none where the server has no such metrics (llama.cpp)."""
    response = client.get("/metrics")
    if response.status_code != 200:
        return {}
    parsed = parse_counters(response.text, (KV_BYTES, LOCAL_PREFILLS, HOST_HITS))
    totals: dict[str, float] = {}
    for (name, _), value in parsed.items():
        totals[name] = totals.get(name, 0.0) + value
    return totals


async def run_agents(url: str, args: argparse.Namespace) -> list[Turn]:
    system = system_prompt(args.system_words)
    histories = [[{"role": "system", "content": system}] for _ in range(args.agents)]
    turns = []
    async with httpx.AsyncClient(base_url=url, timeout=600, trust_env=False) as client:
        with httpx.Client(base_url=url, timeout=30, trust_env=False) as sync:
            for t in range(args.turns):
                turn = Turn()
                before = counters(sync)
                for agent, history in enumerate(histories):
                    history.append({"role": "user", "content": user_message(agent, t)})
                replies = await asyncio.gather(
                    *(one_turn(client, h, args.reply_tokens, turn) for h in histories)
                )
                for history, reply in zip(histories, replies, strict=True):
                    history.append({"role": "assistant", "content": reply})
                await asyncio.sleep(1.0)  # think time; the counters ride on heartbeats
                after = counters(sync)
                turn.kv_bytes = after.get(KV_BYTES, 0.0) - before.get(KV_BYTES, 0.0)
                turn.num_local_prefills = after.get(LOCAL_PREFILLS, 0.0) - before.get(
                    LOCAL_PREFILLS, 0.0
                )
                turn.num_host_hits = after.get(HOST_HITS, 0.0) - before.get(HOST_HITS, 0.0)
                turns.append(turn)
    return turns


def up_arguments(args: argparse.Namespace) -> list[str]:
    extra = []
    if args.kv_cache_bytes is not None:
        extra += ["--kv-cache-bytes", str(args.kv_cache_bytes)]
    if args.max_num_seqs is not None:
        extra += ["--max-num-seqs", str(args.max_num_seqs)]
    return extra


def run_one(mode: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    # A worker starved of CPU by a long prefill on a busy machine must not be taken for dead.
    settings = {**MODES[mode], "TANDEM_HEARTBEAT_TIMEOUT_S": str(args.heartbeat_timeout_s)}
    with environment(settings), tandem_up(args.prefill, args.decode, up_arguments(args)) as served:
        turns = asyncio.run(run_agents(served.url, args))
    return [turn.summary() for turn in turns]


def run_llama(args: argparse.Namespace) -> list[dict[str, Any]]:
    with llama_server(args.llama_server, args.llama_gguf, args.slots, args.context_per_slot) as url:
        turns = asyncio.run(run_agents(url, args))
    return [turn.summary() for turn in turns]


def later_turns_ttfts(rows: list[dict[str, Any]]) -> list[float]:
    return [ttft for row in rows[1:] for ttft in row["ttfts_s"]]


def verdicts(results: dict[str, Any]) -> list[str]:
    """The issue's targets, each as a line that says the figures and whether it is met."""
    lines = []
    on = results.get("on")
    if on is None:
        return lines
    sent = sum(row["prompt_tokens_sent"] for row in on)
    computed = sum(row["prompt_tokens_computed"] for row in on)
    share = computed / sent if sent else 1.0
    lines.append(f"computed/sent (on): {share:.1%} (target <= 25%): {_met(share <= 0.25)}")
    on_p50 = percentile(later_turns_ttfts(on), 50)
    if "off" in results:
        off_p50 = percentile(later_turns_ttfts(results["off"]), 50)
        if on_p50 is None or off_p50 is None:
            lines.append(f"TTFT p50 turns>=2: {NO_LATER_TTFT} (on and off): NOT met")
        else:
            lines.append(
                f"TTFT p50 turns>=2: on {on_p50:.2f} s, off {off_p50:.2f} s, ratio "
                f"{on_p50 / off_p50:.2f} (target <= 0.33): {_met(on_p50 <= off_p50 / 3)}"
            )
    for row_index, row in enumerate(on[1:], start=2):
        new = row["prompt_tokens_computed"]
        per_token = row["kv_bytes"] / new if new else 0.0
        lines.append(f"turn {row_index} KV bytes per computed token (on): {per_token:,.0f}")
    if LLAMA in results:
        on_p99 = percentile(later_turns_ttfts(on), 99)
        llama = later_turns_ttfts(results[LLAMA])
        llama_p50, llama_p99 = percentile(llama, 50), percentile(llama, 99)
        if on_p50 is None or on_p99 is None or llama_p50 is None or llama_p99 is None:
            lines.append(f"TTFT turns>=2 p50/p99: {NO_LATER_TTFT} (tandem and llama.cpp): NOT met")
        else:
            lines.append(
                f"TTFT turns>=2 p50/p99: tandem {on_p50:.2f}/{on_p99:.2f} s, llama.cpp "
                f"{llama_p50:.2f}/{llama_p99:.2f} s (target: both below): "
                f"{_met(on_p50 < llama_p50 and on_p99 < llama_p99)}"
            )
    return lines


def _met(condition: bool) -> str:
    return "met" if condition else "NOT met"


def parse_modes(text: str) -> list[str]:
    modes = [mode.strip() for mode in text.split(",") if mode.strip()]
    unknown = [mode for mode in modes if mode not in MODES]
    if unknown or not modes or len(set(modes)) != len(modes):
        raise argparse.ArgumentTypeError(
            f"expected distinct modes among {', '.join(MODES)}, comma-separated; got {text!r}"
        )
    return modes


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agents", type=int, default=8)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--system-words", type=int, default=400, help="~1.5 tokens per word")
    parser.add_argument("--reply-tokens", type=int, default=16)
    parser.add_argument("--prefill", type=int, default=1)
    parser.add_argument("--decode", type=int, default=1)
    parser.add_argument("--heartbeat-timeout-s", type=float, default=60.0)
    parser.add_argument(
        "--modes", type=parse_modes, default=["off", "on"], help=f"among {', '.join(MODES)}"
    )
    parser.add_argument("--kv-cache-bytes", type=int, help="per worker (default: tandem up's)")
    parser.add_argument("--max-num-seqs", type=int, help="per decode worker (default: up's)")
    parser.add_argument("--llama-server", help="llama.cpp's llama-server binary, run after tandem")
    parser.add_argument("--llama-gguf", type=Path, help="the GGUF llama-server loads")
    parser.add_argument("--slots", type=int, default=16, help="llama-server --parallel")
    parser.add_argument("--context-per-slot", type=int, default=4096)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    if bool(args.llama_server) != bool(args.llama_gguf):
        parser.error("--llama-server and --llama-gguf go together")
    if args.slots < 1 or args.context_per_slot < 64:
        parser.error("--slots must be >= 1 and --context-per-slot >= 64")
    names = ("agents", "turns", "system_words", "reply_tokens", "prefill", "decode")
    for name in (*names, "heartbeat_timeout_s", "kv_cache_bytes", "max_num_seqs"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results: dict[str, Any] = {"args": vars(args)}
    for mode in args.modes:
        results[mode] = run_one(mode, args)
    shown = list(args.modes)
    if args.llama_server:
        results[LLAMA] = run_llama(args)
        shown.append(LLAMA)
    print("turn      cache  TTFT p50  TTFT p99  sent  computed  hit   KV MiB  local  host  errors")
    for mode in shown:
        for t, row in enumerate(results[mode]):
            p50, p99 = row["ttft_p50_s"] or float("nan"), row["ttft_p99_s"] or float("nan")
            print(
                f"{t + 1:>4}  {mode:>9}  {p50:8.2f}  {p99:8.2f}  {row['prompt_tokens_sent']:>4}  "
                f"{row['prompt_tokens_computed']:>8}  {row['hit_rate']:4.0%}  "
                f"{row['kv_bytes'] / 2**20:7.1f}  {row['local_prefills']:5.0f}  "
                f"{row['host_hit_tokens']:4.0f}  {row['errors']:6d}"
            )
    for line in verdicts(results):
        print(line)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(results, out, indent=2, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
