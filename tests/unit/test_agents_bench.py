"""The agents scenario's pure parts: its prompts, its per-turn figures, its arguments."""

import asyncio
import json

import httpx
import pytest

from loadtest.agents_bench import (
    Turn,
    one_turn,
    parse_args,
    system_prompt,
    up_arguments,
    user_message,
    verdicts,
)


def test_the_system_prompt_is_shared_and_the_messages_differ():
    assert system_prompt(400) == system_prompt(400)
    assert len(system_prompt(400).split()) >= 400
    assert user_message(0, 1) != user_message(1, 1) != user_message(0, 2)


def test_a_turn_reports_computed_tokens_and_hit_rate():
    turn = Turn(ttfts=[0.5, 1.5], num_sent=1000, num_cached=800, kv_bytes=2048.0)
    row = turn.summary()
    assert row["prompt_tokens_computed"] == 200 and row["hit_rate"] == 0.8
    assert row["ttft_p50_s"] == pytest.approx(1.0) and row["kv_bytes"] == 2048.0
    assert Turn().summary()["ttft_p50_s"] is None
    assert Turn(num_host_hits=64.0).summary()["host_hit_tokens"] == 64.0


def test_modes_and_a_small_pool_reach_the_cluster():
    args = parse_args(["--modes", "no-tier,on", "--kv-cache-bytes", "1000", "--max-num-seqs", "2"])
    assert args.modes == ["no-tier", "on"]
    assert up_arguments(args) == ["--kv-cache-bytes", "1000", "--max-num-seqs", "2"]
    assert parse_args([]).modes == ["off", "on"] and up_arguments(parse_args([])) == []


@pytest.mark.parametrize(
    "argv",
    [
        ["--agents", "0"],
        ["--turns", "-1"],
        ["--reply-tokens", "0"],
        ["--modes", "on,tiered"],
        ["--modes", "on,on"],
        ["--kv-cache-bytes", "0"],
        ["--max-num-seqs", "-2"],
        ["--llama-server", "llama-server"],
        ["--llama-gguf", "model.gguf"],
        ["--slots", "0", "--llama-server", "b", "--llama-gguf", "m"],
    ],
)
def test_wrong_arguments_exit_naming_the_flag(argv, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert argv[0] in capsys.readouterr().err


def _rows(ttfts_per_turn, sent, computed, kv_bytes=0.0):
    return [
        Turn(
            ttfts=list(ttfts), num_sent=sent, num_cached=sent - computed, kv_bytes=kv_bytes
        ).summary()
        for ttfts in ttfts_per_turn
    ]


def test_verdicts_judge_the_later_turns_against_each_target():
    results = {
        "on": _rows([[9.0], [1.0, 1.0], [1.0]], sent=1000, computed=200, kv_bytes=200 * 1024.0),
        "off": _rows([[9.0], [4.0, 4.0], [4.0]], sent=1000, computed=1000),
        "llama.cpp": _rows([[0.1], [2.0, 2.0], [2.0]], sent=1000, computed=300),
    }
    lines = verdicts(results)
    assert "20.0% (target <= 25%): met" in lines[0]
    assert "ratio 0.25 (target <= 0.33): met" in lines[1]  # turn 1 (9 s) left out
    assert "turn 2 KV bytes per computed token (on): 1,024" in lines[2]
    assert lines[-1].endswith("(target: both below): met")
    results["llama.cpp"] = _rows([[5.0], [0.5], [0.5]], sent=1000, computed=300)
    assert verdicts(results)[-1].endswith("NOT met")
    assert verdicts({"off": results["off"]}) == []


def test_verdicts_say_what_is_missing_when_no_later_turn_succeeded():
    # One turn (--turns 1), or every later turn failed: no TTFT to judge, said so, no crash
    # (main printed the verdicts before writing --json: a crash lost the whole run's results).
    one_turn = {
        "on": _rows([[1.0]], sent=1000, computed=200),
        "off": _rows([[4.0]], sent=1000, computed=1000),
        "llama.cpp": _rows([[2.0]], sent=1000, computed=300),
    }
    lines = verdicts(one_turn)
    assert "20.0% (target <= 25%): met" in lines[0]
    assert any("TTFT p50 turns>=2" in line and "no TTFT" in line for line in lines)
    assert any("TTFT turns>=2 p50/p99" in line and "no TTFT" in line for line in lines)
    failed_later = {
        "on": _rows([[1.0], []], sent=1000, computed=200),
        "off": _rows([[4.0], [4.0]], sent=1000, computed=1000),
    }
    assert "no TTFT" in verdicts(failed_later)[1]


class _Replies(httpx.AsyncBaseTransport):
    """Answers every chat turn with `stream`'s SSE lines, or raises `error`."""

    def __init__(self, lines=(), error=None):
        self.lines, self.error = lines, error

    async def handle_async_request(self, request):
        if self.error is not None:
            raise self.error
        body = "".join(f"data: {line}\n\n" for line in self.lines).encode()
        return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})


def _turn_with(transport) -> Turn:
    async def go():
        turn = Turn()
        async with httpx.AsyncClient(base_url="http://test", transport=transport) as client:
            await one_turn(client, [{"role": "user", "content": "hi"}], 4, turn)
        return turn

    return asyncio.run(go())


def test_a_turn_the_transport_fails_counts_as_an_error_and_the_run_goes_on():
    turn = _turn_with(_Replies(error=httpx.RemoteProtocolError("peer closed")))
    assert turn.num_errors == 1 and turn.ttfts == []
    turn = _turn_with(_Replies(error=httpx.ReadTimeout("read timed out")))
    assert turn.num_errors == 1


def test_a_turn_whose_usage_has_no_cache_details_counts_none_cached():
    chunk = json.dumps({"choices": [{"delta": {"content": "ok"}}]})
    usage = {"prompt_tokens": 10, "completion_tokens": 1, "prompt_tokens_details": None}
    turn = _turn_with(_Replies([chunk, json.dumps({"choices": [], "usage": usage}), "[DONE]"]))
    assert (turn.num_errors, turn.num_sent, turn.num_cached, len(turn.ttfts)) == (0, 10, 0, 1)
