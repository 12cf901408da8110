"""Bulk decode rows (batch jobs' lines) join a step beside interactive rows only while the step
stays within its slack of the interactive rows' own time; alone, they all run. Left out, they
keep their blocks and seats, the oldest run first, and no sequence's tokens change."""

from __future__ import annotations

import argparse
import math

import pytest
import torch

from services.worker.config import WorkerConfig
from shared.config import ConfigError, add_config_arguments, config_from_args
from shared.engine.block_manager import BlockManager
from shared.engine.engine import EngineConfig, LLMEngine
from shared.engine.sampling_params import SamplingParams
from shared.engine.scheduler import StepScheduler
from shared.engine.sequence import Sequence, SequenceStatus
from tests.helpers import our_model_from_hf, tiny_hf_model
from tests.unit.test_step_scheduler import run_step

# -- the step scheduler ------------------------------------------------------------------------


def make_scheduler(limit, num_blocks: int = 1000) -> tuple[StepScheduler, list]:
    """A scheduler whose bulk decode rows are limited to `limit(rows, prompt_tokens)`, what the
    rest of the step runs; the list collects what it was asked with."""
    asked: list[tuple[int, int]] = []

    def max_bulk_decode_rows(num_rows: int, num_prompt_tokens: int) -> int | None:
        asked.append((num_rows, num_prompt_tokens))
        return limit(num_rows, num_prompt_tokens)

    scheduler = StepScheduler(
        BlockManager(num_blocks, 16),
        max_num_seqs=64,
        max_num_batched_tokens=512,
        max_bulk_decode_rows=max_bulk_decode_rows,
    )
    return scheduler, asked


def seq(name: str, prompt_len: int = 8, bulk: bool = False, max_tokens: int = 50) -> Sequence:
    return Sequence(name, [1] * prompt_len, SamplingParams(max_tokens=max_tokens), bulk=bulk)


def decoding_bulk(scheduler: StepScheduler, count: int) -> list[Sequence]:
    lines = [seq(f"bulk{i}", bulk=True) for i in range(count)]
    for line in lines:
        scheduler.add(line)
    run_step(scheduler)  # their prompts: every one decodes from now on
    return lines


def test_without_interactive_rows_every_bulk_row_runs():
    scheduler, asked = make_scheduler(lambda rows, tokens: 0)
    decoding_bulk(scheduler, 5)
    assert run_step(scheduler) == {f"bulk{i}": 1 for i in range(5)}
    assert asked == []  # nothing to protect: the machine stays busy


def test_beside_interactive_rows_only_the_oldest_bulk_rows_within_the_limit_run():
    scheduler, asked = make_scheduler(lambda rows, tokens: 2)
    lines = decoding_bulk(scheduler, 5)
    scheduler.add(seq("chat"))
    # The chat's prompt step: no other decode row, its 8 prompt tokens.
    assert run_step(scheduler) == {"bulk0": 1, "bulk1": 1, "chat": 8}
    assert asked == [(0, 8)]
    assert run_step(scheduler) == {"chat": 1, "bulk0": 1, "bulk1": 1}
    assert asked == [(0, 8), (1, 0)]
    # The rest keep their blocks and seats: nothing preempted, nothing swapped.
    assert all(line.status == SequenceStatus.RUNNING and line.block_ids for line in lines)
    assert scheduler.num_preemptions == 0 and len(scheduler.running) == 6


def test_held_bulk_rows_run_again_once_the_interactive_ones_end():
    scheduler, _ = make_scheduler(lambda rows, tokens: 0)
    decoding_bulk(scheduler, 3)
    chat = seq("chat", max_tokens=2)
    scheduler.add(chat)
    assert run_step(scheduler) == {"chat": 8}
    assert run_step(scheduler) == {"chat": 1}
    scheduler.finish(chat, SequenceStatus.FINISHED_LENGTH)
    assert run_step(scheduler) == {"bulk0": 1, "bulk1": 1, "bulk2": 1}


def test_the_oldest_bulk_rows_finish_and_the_next_ones_take_their_place():
    """Oldest first starves none: each line's tokens are bounded, so the oldest ones finish and
    free their places (and their KV, sooner than if every line advanced a little)."""
    scheduler, _ = make_scheduler(lambda rows, tokens: 1)
    lines = decoding_bulk(scheduler, 3)
    scheduler.add(seq("chat", max_tokens=1000))
    run_step(scheduler)
    for line in lines:
        assert run_step(scheduler) == {"chat": 1, line.request_id: 1}
        scheduler.finish(line, SequenceStatus.FINISHED_LENGTH)


def test_no_limit_lets_every_bulk_row_join():
    scheduler, asked = make_scheduler(lambda rows, tokens: None)
    decoding_bulk(scheduler, 4)
    scheduler.add(seq("chat"))
    run_step(scheduler)
    assert run_step(scheduler) == {"chat": 1, **{f"bulk{i}": 1 for i in range(4)}}
    assert asked == [(0, 8), (1, 0)]


def test_a_step_without_a_limit_function_runs_every_bulk_row():
    scheduler = StepScheduler(BlockManager(100, 16), max_num_seqs=8, max_num_batched_tokens=64)
    for item in (seq("chat"), seq("bulk", bulk=True)):
        scheduler.add(item)
    assert run_step(scheduler) == {"chat": 8}  # (a bulk prompt waits out a first token)
    assert run_step(scheduler) == {"chat": 1, "bulk": 8}
    assert run_step(scheduler) == {"chat": 1, "bulk": 1}


# -- the engine --------------------------------------------------------------------------------

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model(device):
    return our_model_from_hf(tiny_hf_model("llama", seed=11, device=device))


def prompts(count: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 30, (count,), generator=gen).tolist()
    return [torch.randint(3, 256, (n,), generator=gen).tolist() for n in lengths]


def run_mixed(model, slack: float | None, params: SamplingParams) -> tuple[dict, list[int]]:
    """Eight bulk lines decoding, then two chats arriving: every sequence's tokens, and the
    bulk rows in each step that ran a chat's decode row."""
    engine = LLMEngine(model, EngineConfig(num_blocks=256, bulk_step_slack=slack))
    for index, prompt in enumerate(prompts(8, seed=1)):
        engine.add_request(prompt, params, request_id=f"bulk{index}", bulk=True)
    results: dict[str, list[int]] = {}
    bulk_rows_beside_chat: list[int] = []
    chats = list(enumerate(prompts(2, seed=2)))
    step = 0
    while engine.has_unfinished or chats:
        if chats and step in (3, 5):
            index, prompt = chats.pop(0)
            engine.add_request(prompt, params, request_id=f"chat{index}")
        running = engine.scheduler.running
        chat_decodes = any(not s.bulk and s.num_uncomputed_tokens == 1 for s in running)
        outputs = engine.step()
        if chat_decodes:
            bulk_rows_beside_chat.append(engine.last_step_num_seqs - 2)
        for out in outputs:
            results.setdefault(out.request_id, []).extend(out.new_token_ids)
        step += 1
    return results, bulk_rows_beside_chat


@pytest.mark.parametrize(
    "params",
    [GREEDY, SamplingParams(max_tokens=10, temperature=1.0, seed=5, ignore_eos=True)],
    ids=["greedy", "seeded"],
)
def test_holding_bulk_rows_back_changes_when_tokens_come_not_which(model, params):
    unbounded, all_rows = run_mixed(model, None, params)
    bounded, few_rows = run_mixed(model, 0.0, params)
    assert bounded == unbounded
    assert len(unbounded) == 10 and all(len(t) == 10 for t in unbounded.values())
    assert max(all_rows) > 0 and max(few_rows) <= 0  # (<0: one chat decoding, not two)


def test_the_engine_learns_the_decode_step_cost_from_its_decode_steps(model):
    engine = LLMEngine(model, EngineConfig(num_blocks=256, bulk_step_slack=0.25))
    for index, prompt in enumerate(prompts(6, seed=3)):
        engine.add_request(prompt, GREEDY, request_id=f"bulk{index}", bulk=True)
    engine.step()  # the prompts: no decode-only step
    for _ in range(3):  # six bulk rows alone, a size the model counts from its third step
        assert engine.decode_cost.predict(1) is None
        engine.step()
        assert engine.last_step_num_seqs == 6
    engine.add_request([5, 6, 7], GREEDY, request_id="chat")
    engine.step()  # the chat's prompt, beside no bulk row (no line yet to time a prompt by)
    assert engine.last_step_num_seqs == 1
    for _ in range(3):  # the chat's decode, still the prior: no bulk row beside one row
        engine.step()
        assert engine.last_step_num_seqs == 1
    assert engine.decode_cost.predict(1) is not None  # 1 and 6 rows: a line


@pytest.mark.parametrize("slack", [-0.1, math.nan, math.inf])
def test_the_engine_refuses_a_slack_below_zero_or_not_finite(slack):
    with pytest.raises(ValueError, match="bulk_step_slack must be >= 0 and finite"):
        EngineConfig(bulk_step_slack=slack)


# -- the worker's setting ----------------------------------------------------------------------


def parse_worker(argv: list[str], environ: dict[str, str] | None = None) -> WorkerConfig:
    parser = argparse.ArgumentParser()
    add_config_arguments(parser, WorkerConfig)
    return config_from_args(WorkerConfig, parser.parse_args(argv), environ or {})


def test_the_worker_passes_its_slack_to_the_engine():
    assert parse_worker([]).engine_config().bulk_step_slack == 0.25
    config = parse_worker([], {"TANDEM_BULK_STEP_SLACK": "0"})
    assert config.engine_config().bulk_step_slack == 0.0
    assert parse_worker(["--bulk-step-slack", "1e9"]).engine_config().bulk_step_slack == 1e9


@pytest.mark.parametrize(
    ("argv", "environ", "message"),
    [
        (["--bulk-step-slack", "-0.5"], {}, "bulk_step_slack (--bulk-step-slack / TANDEM_BULK"),
        ([], {"TANDEM_BULK_STEP_SLACK": "inf"}, "expected a finite number"),
        ([], {"TANDEM_BULK_STEP_SLACK": "nan"}, "expected a finite number"),
        ([], {"TANDEM_BULK_STEP_SLACK": "some"}, "expected a number"),
    ],
)
def test_the_worker_refuses_a_wrong_slack(argv, environ, message):
    with pytest.raises(ConfigError) as caught:
        parse_worker(argv, environ)
    assert message in str(caught.value)


def test_a_worker_built_directly_refuses_a_slack_not_finite():
    with pytest.raises(ConfigError, match="must be >= 0 and finite"):
        WorkerConfig(bulk_step_slack=math.inf)
