"""The in-process engine on a tiny random model (on the test device): batching, chunking,
preemption, handoff, errors."""

import dataclasses
import itertools
import time

import pytest
import torch

from shared.engine.engine import EngineConfig, LLMEngine
from shared.engine.kv_cache import bytes_per_block
from shared.engine.sampling_params import SamplingParams
from shared.engine.scheduler import MIN_CHUNK
from shared.errors import InvalidRequestError
from tests.helpers import FailingModel, our_model_from_hf, tiny_hf_model, writes_into

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model(device):
    """On the test device: on CUDA, swaps and KV exports cross between GPU and host memory."""
    return our_model_from_hf(tiny_hf_model("llama", seed=11, device=device))


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 60, (count,), generator=gen).tolist()
    return [torch.randint(3, 256, (n,), generator=gen).tolist() for n in lengths]


def one_by_one(model, batch, params) -> list[list[int]]:
    outputs = []
    for prompt in batch:
        engine = LLMEngine(model, EngineConfig(num_blocks=64, max_num_batched_tokens=4096))
        outputs.append(engine.generate([prompt], params)[0].token_ids)
    return outputs


def test_continuous_batching_with_staggered_arrivals_equals_one_by_one(model):
    batch = prompts(10)
    expected = one_by_one(model, batch, GREEDY)
    engine = LLMEngine(
        model, EngineConfig(num_blocks=128, max_num_batched_tokens=40, max_num_seqs=4)
    )
    results: dict[str, list[int]] = {}
    pending = list(enumerate(batch))
    while pending or engine.has_unfinished:
        if pending:  # one new arrival per step, joining a running batch
            index, prompt = pending.pop(0)
            engine.add_request(prompt, GREEDY, request_id=str(index))
        for out in engine.step():
            results.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert [results[str(i)] for i in range(len(batch))] == expected
    assert engine.block_manager.num_free_blocks == 128


def test_a_step_time_target_caps_prompt_tokens_and_changes_no_token(model):
    batch = prompts(10, seed=3)
    expected = one_by_one(model, batch, GREEDY)
    engine = LLMEngine(model, EngineConfig(num_blocks=128, step_time_target_s=0.25))
    engine.preemption.prefill_tokens_per_s = 400.0
    assert engine.prompt_token_cap() == 100  # 0.25 s at 400 tokens/s
    engine.preemption.prefill_tokens_per_s = 10.0
    assert engine.prompt_token_cap() == MIN_CHUNK  # never below one chunk: prompts advance
    engine.preemption.prefill_tokens_per_s = 400.0
    results: dict[str, list[int]] = {}
    for index, prompt in enumerate(batch):  # one arrival per step: light and capped steps mix
        engine.add_request(prompt, GREEDY, request_id=str(index))
        for out in engine.step():
            results.setdefault(out.request_id, []).extend(out.new_token_ids)
    while engine.has_unfinished:
        for out in engine.step():
            results.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert [results[str(i)] for i in range(len(batch))] == expected
    assert engine.block_manager.num_free_blocks == 128
    assert LLMEngine(model, EngineConfig(num_blocks=8)).prompt_token_cap() is None


@pytest.mark.parametrize("target", [0.0, -1.0, float("nan")])
def test_a_step_time_target_must_be_positive(target):
    with pytest.raises(ValueError, match="step_time_target_s must be > 0"):
        EngineConfig(step_time_target_s=target)


@pytest.mark.parametrize("mode", ["recompute", "swap", "auto"])
def test_preemption_loses_no_token_and_no_block(model, mode):
    batch = prompts(6, seed=1)
    params = dataclasses.replace(GREEDY, max_tokens=30)
    expected = one_by_one(model, batch, params)
    # 12 blocks of 16 cannot hold six sequences of up to 90 tokens: some must be preempted.
    config = EngineConfig(
        num_blocks=12, max_num_batched_tokens=64, swap_bytes=1 << 24, preemption_mode=mode
    )
    engine = LLMEngine(model, config)
    if mode == "auto":  # both kinds in one run, whatever this machine's rates say
        choices = itertools.cycle(["swap", "recompute"])
        engine.preemption.choose = lambda num_bytes, num_tokens, space: next(choices)
    results = engine.generate(batch, params)
    by_mode = engine.scheduler.num_preemptions_by_mode
    if mode == "auto":
        assert by_mode["swap"] > 0 and by_mode["recompute"] > 0, by_mode
    else:
        assert by_mode[mode] > 0 and sum(by_mode.values()) == by_mode[mode], by_mode
    assert [r.token_ids for r in results] == expected
    assert engine.block_manager.num_free_blocks == 12
    assert engine.swap_space.used_bytes == engine.swap_space.reserved_bytes == 0


def test_a_full_swap_space_falls_back_to_recompute(model):
    config = EngineConfig(
        num_blocks=12, max_num_batched_tokens=64, swap_bytes=1, preemption_mode="swap"
    )
    engine = LLMEngine(model, config)
    engine.generate(prompts(6, seed=1), dataclasses.replace(GREEDY, max_tokens=30))
    assert engine.scheduler.num_preemptions_by_mode == {
        "swap": 0,
        "recompute": engine.scheduler.num_preemptions,
    }


def test_aborting_a_swapped_sequence_frees_its_host_copy(model):
    config = EngineConfig(
        num_blocks=12, max_num_batched_tokens=64, swap_bytes=1 << 24, preemption_mode="swap"
    )
    engine = LLMEngine(model, config)
    for i, prompt in enumerate(prompts(6, seed=1)):
        engine.add_request(prompt, dataclasses.replace(GREEDY, max_tokens=30), request_id=str(i))
    while not engine.scheduler.swapped:
        engine.step()
    for seq in list(engine.scheduler.swapped):
        assert engine.abort(seq.request_id)
    assert not engine.scheduler.swapped and engine.swap_space.used_bytes == 0


def test_a_swap_outs_time_includes_its_copy_to_host_memory(model):
    """The read of the blocks was timed, not their copy to host memory: on a GPU the read only
    queues work, and the copy rate (which decides swap against recompute) came out far too
    high. Here the copy is made slow on purpose: the rate must see it."""
    config = EngineConfig(
        num_blocks=12, max_num_batched_tokens=64, swap_bytes=1 << 24, preemption_mode="swap"
    )
    engine = LLMEngine(model, config)
    real_put = engine.swap_space.put

    def slow_put(*args):
        time.sleep(0.2)
        real_put(*args)

    engine.swap_space.put = slow_put
    for i, prompt in enumerate(prompts(6, seed=1)):
        engine.add_request(prompt, dataclasses.replace(GREEDY, max_tokens=30), request_id=str(i))
    engine.preemption.copy_bytes_per_s = 1.0  # so that every sample moves the rate up to it
    while not engine.scheduler.swapped:
        engine.step()
    num_bytes = engine.swap_space.used_bytes
    assert 1.0 < engine.preemption.copy_bytes_per_s <= num_bytes / 0.2


def test_a_sequence_swapped_out_mid_prompt_is_not_dropped_for_recompute(model):
    """B, swapped out mid-prompt, came back to room for one token and went straight out again
    in the same step; its host copy, taken only when the step runs, was still counted in the
    swap space, so the second copy did not fit and B was dropped for recompute."""
    batch = [list(range(3, 20)), list(range(40, 73))]
    params = [dataclasses.replace(GREEDY, max_tokens=n) for n in (31, 8)]
    expected = [one_by_one(model, [p], q)[0] for p, q in zip(batch, params, strict=True)]
    config = EngineConfig(
        num_blocks=12,
        block_size=4,
        max_num_batched_tokens=16,
        swap_bytes=6 * bytes_per_block(model.config, 4, model.dtype),  # one copy of B
        preemption_mode="swap",
        enable_prefix_caching=False,
    )
    engine = LLMEngine(model, config)
    results = engine.generate(batch, params)
    assert engine.scheduler.num_preemptions_by_mode == {"swap": 1, "recompute": 0}
    assert [r.token_ids for r in results] == expected


def test_seeded_sampling_is_reproducible_across_batches(model):
    params = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    alone = LLMEngine(model, EngineConfig(num_blocks=64)).generate([[5, 6, 7]], params)[0]
    others = prompts(5, seed=2)
    mixed = LLMEngine(model, EngineConfig(num_blocks=128)).generate(
        others[:2] + [[5, 6, 7]] + others[2:],
        [SamplingParams(max_tokens=8, temperature=1.0)] * 2 + [params] + [GREEDY] * 3,
    )[2]
    assert mixed.token_ids == alone.token_ids


def test_a_seeded_request_resumed_from_its_tokens_goes_on_as_it_would_have(model):
    """A decode worker hands a sequence back under memory pressure; its gateway resumes it from
    the tokens its client has, with a fresh generator. Its seed must still give the tokens the
    undisturbed run gave: whether a request is preempted depends on what else runs."""
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=99, ignore_eos=True)
    prompt = prompts(1, seed=5)[0]
    undisturbed = LLMEngine(model, EngineConfig(num_blocks=64)).generate([prompt], params)[0]
    had = undisturbed.token_ids[:4]
    engine = LLMEngine(model, EngineConfig(num_blocks=64))
    rest = dataclasses.replace(params, max_tokens=6)
    engine.add_request(prompt + had, rest, request_id="resumed", num_generated=len(had))
    tokens = [t for out in engine.run_until_done() for t in out.new_token_ids]
    assert had + tokens == undisturbed.token_ids


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(max_tokens=9, temperature=0.8, seed=7)])
def test_prefill_export_then_decode_equals_colocated(model, params):
    prompt = prompts(1, seed=3)[0]
    expected = LLMEngine(model, EngineConfig(num_blocks=64)).generate([prompt], params)[0].token_ids

    prefill = LLMEngine(model, EngineConfig(num_blocks=64, retain_finished=True))
    first_only = dataclasses.replace(params, max_tokens=1, min_tokens=0)
    (result,) = prefill.generate([prompt], first_only)
    keys, values = prefill.export_kv(result.request_id)
    state = prefill.retained(result.request_id).generator
    prefill.release(result.request_id)
    assert prefill.block_manager.num_free_blocks == 64

    decode = LLMEngine(model, EngineConfig(num_blocks=64))
    block_ids = decode.block_manager.allocate(keys.shape[1])
    decode.kv_cache.write_blocks(block_ids, keys, values)
    decode.add_prefilled(
        "r", prompt, result.token_ids, params, block_ids, state.get_state() if state else None
    )
    tokens = list(result.token_ids)
    for out in decode.run_until_done():
        tokens.extend(out.new_token_ids)
    assert tokens == expected
    assert decode.block_manager.num_free_blocks == 64


def test_abort_returns_blocks(model):
    engine = LLMEngine(model, EngineConfig(num_blocks=32))
    engine.add_request(list(range(3, 40)), GREEDY, request_id="a")
    engine.step()
    assert engine.block_manager.num_free_blocks < 32
    assert engine.abort("a") and not engine.abort("a")
    assert engine.block_manager.num_free_blocks == 32 and not engine.has_unfinished


def test_stop_token_and_eos(model):
    engine = LLMEngine(model, EngineConfig(num_blocks=64))
    free_run = engine.generate([[9, 10, 11]], GREEDY)[0].token_ids
    stop_at = free_run[3]
    params = dataclasses.replace(GREEDY, stop_token_ids=(stop_at,))
    result = engine.generate([[9, 10, 11]], params)[0]
    assert result.token_ids == free_run[: free_run.index(stop_at) + 1]
    assert result.finish_reason == "stop"
    min_params = dataclasses.replace(params, min_tokens=12)
    assert stop_at not in engine.generate([[9, 10, 11]], min_params)[0].token_ids


def engine_whose_eos_is(model, token: int) -> LLMEngine:
    """An engine that takes `token` for the model's EOS (the tiny model's own EOS never wins)."""
    engine = LLMEngine(model, EngineConfig(num_blocks=64))
    engine.eos_token_ids = frozenset({token})
    return engine


def test_eos_semantics_follow_vllm(model):
    """ignore_eos alone: a drawn EOS does not end the sequence. min_tokens: EOS cannot be drawn
    before it, with or without ignore_eos (vLLM's meaning; it used to slip through with both)."""
    prompt = [9, 10, 11]
    free_run = LLMEngine(model, EngineConfig(num_blocks=64)).generate([prompt], GREEDY)[0]
    eos = free_run.token_ids[3]
    first = free_run.token_ids.index(eos)
    engine = engine_whose_eos_is(model, eos)
    stops = dataclasses.replace(GREEDY, ignore_eos=False)

    stopped = engine.generate([prompt], stops)[0]
    assert stopped.token_ids == free_run.token_ids[: first + 1]
    assert stopped.finish_reason == "stop"
    ignored = engine.generate([prompt], GREEDY)[0]
    assert ignored.token_ids == free_run.token_ids and ignored.finish_reason == "length"
    for params in (
        dataclasses.replace(GREEDY, min_tokens=12),
        dataclasses.replace(stops, min_tokens=12),
    ):
        held = engine.generate([prompt], params)[0]
        assert held.token_ids[:first] == free_run.token_ids[:first]
        assert eos not in held.token_ids and len(held.token_ids) == 12
        assert held.finish_reason == "length"
    # Past min_tokens, EOS may end the sequence again (without ignore_eos).
    late = engine.generate([prompt], dataclasses.replace(stops, min_tokens=first + 1))[0]
    assert eos not in late.token_ids[: first + 1]


@pytest.mark.parametrize(
    "prompt,params,field",
    [
        ([], GREEDY, "prompt"),
        ([5] * 600, GREEDY, "prompt"),  # longer than the tiny model's 512-token context
        ([5] * 500, dataclasses.replace(GREEDY, max_tokens=20), "max_tokens"),
        ([5, 300], GREEDY, "prompt"),  # token id outside the vocabulary
        # The sampler indexes the logits by a stop id until min_tokens: one past the
        # vocabulary raised in the middle of the step, ending the worker and its batch.
        ([5], dataclasses.replace(GREEDY, stop_token_ids=(10**9,), min_tokens=1), "stop_token_ids"),
        ([5], SamplingParams(temperature=0, logit_bias={300: 5.0}), "logit_bias"),  # likewise
    ],
)
def test_wrong_input_names_the_field(model, prompt, params, field):
    engine = LLMEngine(model, EngineConfig(num_blocks=64))
    with pytest.raises(InvalidRequestError) as error:
        engine.add_request(prompt, params)
    assert error.value.param == field


def run_to_the_end(engine, request_ids) -> tuple[dict, dict]:
    """Every request's tokens, and how each finished (finish reason, error)."""
    tokens: dict[str, list[int]] = {request_id: [] for request_id in request_ids}
    finished = {}
    for out in engine.run_until_done():
        tokens[out.request_id] += out.new_token_ids
        if out.finished:
            finished[out.request_id] = (out.finish_reason, out.error)
    return tokens, finished


def test_a_row_the_sampler_fails_on_ends_alone_and_its_batch_goes_on(model):
    """A bug one request's parameters hit in the sampler (here the stop id past the vocabulary
    that validation once let through, put back past it) used to raise out of the step: the
    worker exited with every sequence. Now that row aborts with the error, and the others
    decode as they would have without it."""
    prompts = {"a": [5, 6, 7], "poison": [1, 2, 3, 4], "b": [8, 9]}
    alone = LLMEngine(model, EngineConfig(num_blocks=64))
    expected = dict(zip("ab", alone.generate([prompts["a"], prompts["b"]], GREEDY), strict=True))
    engine = LLMEngine(model, EngineConfig(num_blocks=64))
    for request_id, prompt in prompts.items():
        engine.add_request(prompt, GREEDY, request_id)
    poisoned = dataclasses.replace(GREEDY, stop_token_ids=(10**9,), min_tokens=3)
    engine._sequences["poison"].params = poisoned  # past the engine's own check
    tokens, finished = run_to_the_end(engine, prompts)
    assert finished["poison"] == (
        "abort",
        "the sampler failed on this request (IndexError)",
    )
    assert tokens["poison"] == [] and engine.num_sampler_failures == 1
    for request_id in "ab":
        assert finished[request_id] == ("length", None)
        assert tokens[request_id] == expected[request_id].token_ids
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("at_output", [0, 3], ids=["in-its-prefill", "mid-decode"])
def test_a_sequence_the_model_fails_on_ends_alone_and_its_batch_goes_on(model, at_output):
    """A forward that raises used to end the worker with its whole batch (resumed elsewhere,
    where the request at fault did it again). Now the batch runs again chunk by chunk: the
    sequence whose chunk raises alone ends with the error, the others decode exactly as they
    would have (their spoiled KV slots written again)."""
    prompts = {"a": [5, 6, 7], "poison": [1, 2, 3, 4], "b": [8, 9]}
    alone = LLMEngine(model, EngineConfig(num_blocks=64))
    expected = dict(zip("ab", alone.generate([prompts["a"], prompts["b"]], GREEDY), strict=True))
    engine = LLMEngine(model, EngineConfig(num_blocks=64, block_size=4))
    poison_writes = writes_into(engine, "poison")

    def fails(batch, block_size):
        seq = engine._sequences.get("poison")
        ready = seq is not None and len(seq.output_token_ids) >= at_output
        return ready and poison_writes(batch, block_size)

    engine.model = failing = FailingModel(model, fails)
    for request_id, prompt in prompts.items():
        engine.add_request(prompt, GREEDY, request_id)
    tokens, finished = run_to_the_end(engine, prompts)
    assert finished["poison"] == ("abort", "the model failed on this request (RuntimeError)")
    assert len(tokens["poison"]) == at_output
    assert engine.num_model_failures == 1 and engine.num_sampler_failures == 0
    assert failing.num_raised == 2  # the batch, then the poison alone
    for request_id in "ab":
        assert finished[request_id] == ("length", None)
        assert tokens[request_id] == expected[request_id].token_ids
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("num_requests", [1, 3])
def test_requests_the_model_fails_on_alone_end_when_it_runs_a_forward_of_its_own(
    model, num_requests
):
    """No chunk of the step runs, alone either (a request by itself, or every one of the
    batch's): the model runs one token of its own in a free block, and since that works the
    requests are to blame: they end with the error, and the engine serves the next."""
    poisons = [f"poison{index}" for index in range(num_requests)]
    engine = LLMEngine(model, EngineConfig(num_blocks=64, block_size=4))
    engine.model = failing = FailingModel(model, writes_into(engine, *poisons))
    for index, request_id in enumerate(poisons):
        engine.add_request([5, 6, index + 7], GREEDY, request_id)
    outputs = engine.step()
    assert sorted((o.request_id, o.finish_reason, o.error) for o in outputs) == [
        (request_id, "abort", "the model failed on this request (RuntimeError)")
        for request_id in poisons
    ]
    assert failing.num_raised == (1 if num_requests == 1 else 1 + num_requests)
    assert engine.num_model_failures == num_requests and not engine.has_unfinished
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    alone = LLMEngine(model, EngineConfig(num_blocks=64)).generate([[8, 9]], GREEDY)
    assert engine.generate([[8, 9]], GREEDY)[0].token_ids == alone[0].token_ids


@pytest.mark.parametrize("num_requests", [1, 3])
def test_a_model_that_fails_a_forward_of_its_own_too_is_the_workers_fault_and_raises(
    model, num_requests
):
    """A broken device: no request is to blame. The step raises as before, the worker ends,
    and the scheduler resumes its requests elsewhere."""
    engine = LLMEngine(model, EngineConfig(num_blocks=64))
    engine.model = failing = FailingModel(model, lambda batch, block_size: True)
    for index in range(num_requests):
        engine.add_request([5, 6, index + 7], GREEDY, str(index))
    with pytest.raises(RuntimeError, match="injected"):
        engine.step()
    assert failing.num_raised == (2 if num_requests == 1 else 2 + num_requests)
    assert engine.num_model_failures == 0
    assert engine.block_manager.num_free_blocks == 64 - num_requests  # its own block back


def test_with_no_block_free_for_a_forward_of_its_own_the_step_raises(model):
    """It cannot tell a request's fault from its own: it raises, as before."""
    engine = LLMEngine(model, EngineConfig(num_blocks=1, block_size=16))
    engine.model = failing = FailingModel(model, writes_into(engine, "poison"))
    engine.add_request([5, 6, 7], GREEDY, "poison")
    with pytest.raises(RuntimeError, match="injected"):
        engine.step()
    assert failing.num_raised == 1 and engine.num_model_failures == 0


def test_a_prefilled_sequence_outside_the_vocabulary_is_refused(model):
    """A decode worker admits what a KV transfer says: its ids are checked like a prompt's."""
    engine = LLMEngine(model, EngineConfig(num_blocks=64))
    blocks = engine.block_manager.allocate(1)
    for prompt, output, params, field in (
        ([5, 6], [2**63], GREEDY, "token_ids"),
        ([5, -1], [7], GREEDY, "token_ids"),
        ([5, 6], [7], dataclasses.replace(GREEDY, stop_token_ids=(300,)), "stop_token_ids"),
        ([5, 6], [7], dataclasses.replace(GREEDY, logit_bias=((300, 1.0),)), "logit_bias"),
    ):
        with pytest.raises(InvalidRequestError) as error:
            engine.add_prefilled("r", prompt, output, params, blocks)
        assert error.value.param == field
    engine.add_prefilled("r", [5, 6], [7], GREEDY, blocks)  # in range: admitted


def test_a_prefilled_sequence_that_could_outgrow_the_pool_is_refused(model):
    """A decode worker smaller than the one the cluster sized the request for: the sequence
    would fill the pool, swap itself out at its last block and never fit again (every arrival
    held back behind it). It is refused like a prompt that can never fit."""
    config = EngineConfig(num_blocks=4, block_size=16, swap_bytes=1 << 24, preemption_mode="swap")
    engine = LLMEngine(model, config)
    params = dataclasses.replace(GREEDY, max_tokens=40)  # 40 + 40 tokens: five blocks
    blocks = engine.block_manager.allocate(3)
    with pytest.raises(InvalidRequestError) as error:
        engine.add_prefilled("r", list(range(3, 43)), [7], params, blocks)
    assert error.value.param == "max_tokens"
    fitting = dataclasses.replace(params, max_tokens=24)  # 64 tokens: the whole pool
    engine.add_prefilled("r", list(range(3, 43)), [7], fitting, blocks)
    results = [out for _ in range(40) for out in engine.step()]
    assert results[-1].finish_reason == "length" and not engine.has_unfinished


@pytest.mark.parametrize(
    "field,value", [("max_tokens", -1), ("temperature", -0.5), ("top_k", 2**31), ("top_k", 2**63)]
)
def test_wrong_sampling_values_name_the_field(field, value):
    with pytest.raises(InvalidRequestError) as error:
        SamplingParams(**{field: value})
    assert error.value.param == field


def test_prompt_that_can_never_fit_the_pool_is_refused(model):
    engine = LLMEngine(model, EngineConfig(num_blocks=2, block_size=16))
    with pytest.raises(InvalidRequestError, match="never"):
        engine.add_request([5] * 30, GREEDY)


def test_a_handed_back_sequence_resumed_elsewhere_loses_and_repeats_no_token(model):
    """The decode role: a sequence preempted for recompute leaves the engine; resumed as a new
    request from its prompt and the tokens it had (what a prefill worker would be sent), every
    request's tokens equal an undisturbed run's."""
    batch = prompts(6, seed=1)
    params = dataclasses.replace(GREEDY, max_tokens=30)
    expected = one_by_one(model, batch, params)
    config = EngineConfig(num_blocks=12, max_num_batched_tokens=64, preemption_mode="recompute",
                          hand_back_recomputed=True)  # fmt: skip
    engine = LLMEngine(model, config)
    tokens: dict[int, list[int]] = {i: [] for i in range(len(batch))}
    owner: dict[str, int] = {}
    for i, prompt in enumerate(batch):
        owner[engine.add_request(prompt, params, request_id=f"{i}")] = i
    handed_back = 0
    while engine.has_unfinished:
        for out in engine.step():
            tokens[owner[out.request_id]].extend(out.new_token_ids)
        for seq in engine.take_evicted():
            i = owner[seq.request_id]
            assert seq.request_id not in engine._sequences and not seq.block_ids
            handed_back += 1
            left = dataclasses.replace(params, max_tokens=params.max_tokens - len(tokens[i]))
            owner[engine.add_request(batch[i] + tokens[i], left, f"{i}~{handed_back}")] = i
    assert handed_back > 0 and not engine.scheduler.waiting
    assert [tokens[i] for i in range(len(batch))] == expected
    assert engine.block_manager.num_free_blocks == 12


def test_a_resumed_requests_penalties_count_its_earlier_output(model):
    """A request resumed from its client's tokens has them at the end of its prompt
    (`num_generated`): presence and frequency penalties count output only, so they must count
    those too; its first token then is the one the uninterrupted run drew."""
    prompt = [9, 10, 11]
    plain = dataclasses.replace(GREEDY, max_tokens=12)
    params = dataclasses.replace(plain, presence_penalty=-2.0, frequency_penalty=-2.0)
    engine = LLMEngine(model, EngineConfig(num_blocks=64))
    whole = engine.generate([prompt], params)[0].token_ids
    assert engine.generate([prompt], plain)[0].token_ids != whole  # (the penalties matter)
    one = dataclasses.replace(params, max_tokens=1)
    for done in range(1, 8):
        request_id = engine.add_request(prompt + whole[:done], one, num_generated=done)
        while engine.has_unfinished:
            outputs = {o.request_id: o for o in engine.step()}
        assert outputs[request_id].new_token_ids == [whole[done]], done
