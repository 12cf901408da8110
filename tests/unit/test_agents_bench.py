"""The agents scenario's pure parts: its prompts, its per-turn figures, its arguments."""

import pytest

from loadtest.agents_bench import Turn, parse_args, system_prompt, up_arguments, user_message


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
    ],
)
def test_wrong_arguments_exit_naming_the_flag(argv, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert argv[0] in capsys.readouterr().err
