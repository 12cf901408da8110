"""`tandem generate`: run the engine in-process on one prompt and print the result.

It takes the API's sampling fields under the same names (`--min-tokens` is `min_tokens`), and the
fields left unset take the same defaults as the gateway gives them (the model's generation
config, then `--default-sampling`; see shared.engine.sampling_defaults). Stop strings end the
text as the gateway ends it (never within the first `min_tokens` tokens).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import torch

from services.commands.arguments import positive
from services.gateway.detokenizer import IncrementalDetokenizer, StopStringMatcher
from services.gateway.generation import ChoiceText
from shared.engine.engine import EngineConfig, GenerationResult, LLMEngine
from shared.engine.loader import (
    DEVICE_HELP,
    DTYPE_CHOICES,
    DTYPE_HELP,
    QUANTIZATION_CHOICES,
    QUANTIZATION_HELP,
    device_argument,
    dtype_name,
    linear_backend_for,
    load_model,
    parse_device,
    parse_dtype,
)
from shared.engine.model_files import DEFAULT_MODEL, resolve_model_dir
from shared.engine.sampling_defaults import sampling_defaults
from shared.engine.sampling_params import SamplingParams
from shared.errors import InvalidRequestError

# (flag, type, help) for each SamplingParams field but max_tokens and ignore_eos; unset: the
# served model's default.
SAMPLING_FLAGS = (
    ("temperature", float, "0 is greedy"),
    ("top_p", float, "nucleus sampling mass"),
    ("top_k", int, "keep the k likeliest tokens (0 or -1: all)"),
    ("min_p", float, "drop tokens below min_p times the likeliest's probability"),
    ("seed", int, "seed of this request's random generator"),
    ("presence_penalty", float, "OpenAI's presence penalty"),
    ("frequency_penalty", float, "OpenAI's frequency penalty"),
    ("repetition_penalty", float, "vLLM's repetition penalty (1: none)"),
    ("min_tokens", int, "no EOS, stop token or stop string before this many tokens"),
    ("logprobs", int, "also report the top N log-probabilities of each token (--json)"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt", required=True, help="the prompt text")
    parser.add_argument("--chat", action="store_true", help="apply the chat template to the prompt")
    parser.add_argument(
        "--model", default=DEFAULT_MODEL, help="a HF directory, a .gguf file, or 'smollm2'"
    )
    parser.add_argument("--max-tokens", type=int, default=64)
    for name, kind, help_text in SAMPLING_FLAGS:
        flag = "--" + name.replace("_", "-")
        parser.add_argument(flag, dest=name, type=kind, default=None, help=help_text)
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument(
        "--stop-token-ids", type=_token_ids, default=(), help="comma-separated token ids"
    )
    parser.add_argument(
        "--stop", type=_stop_string, action="append", default=[], help="a stop string (repeatable)"
    )
    parser.add_argument(
        "--default-sampling",
        default=None,
        help="defaults for the sampling flags left unset, over the model's (temperature=0.7,...)",
    )
    parser.add_argument(
        "--generation-config",
        default="auto",
        help="the model's own sampling defaults: auto (its generation_config.json), none, a path",
    )
    parser.add_argument("--json", action="store_true", help="print a JSON object with token ids")
    parser.add_argument(
        "--threads",
        type=positive(int),
        default=None,
        help="torch threads (default: torch's choice, one per core: on a machine other work "
        "shares, fewer can be several times faster)",
    )
    parser.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES, help=DTYPE_HELP)
    parser.add_argument("--device", default="cpu", type=device_argument, help=DEVICE_HELP)
    parser.add_argument(
        "--quantization", default="none", choices=QUANTIZATION_CHOICES, help=QUANTIZATION_HELP
    )


def _token_ids(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None


def _stop_string(text: str) -> str:
    """As the gateway takes one: an empty one would stop nowhere, or everywhere."""
    if not text:
        raise argparse.ArgumentTypeError("a stop string must not be empty")
    return text


def encode_prompt(tokenizer, prompt: str, chat: bool) -> list[int]:
    if chat:
        return list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
            )
        )
    return tokenizer(prompt, add_special_tokens=True).input_ids


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    """The request's parameters: the flags given, the served defaults for the others.
    Raises InvalidRequestError (a bad flag value) or ValueError (a bad default)."""
    directory, name = resolve_model_dir(args.model)
    defaults = sampling_defaults(
        directory, name == DEFAULT_MODEL, args.generation_config, args.default_sampling
    )
    given = {n: getattr(args, n) for n, _, _ in SAMPLING_FLAGS if getattr(args, n) is not None}
    return SamplingParams(
        max_tokens=args.max_tokens,
        ignore_eos=args.ignore_eos,
        stop_token_ids=args.stop_token_ids,
        **{**defaults, **given},
    )


def engine_config(model, num_prompt_tokens: int, params: SamplingParams) -> EngineConfig:
    """A KV pool for this one request: its prompt and max_tokens, up to the model's context (a
    longer one the engine refuses by the context). A fixed 256 MiB held about 5,800 tokens of
    the default model in float32, 1,000 of an 8B model, and refused requests within the context
    ("can never fit the KV cache") that the cluster serves."""
    tokens = min(num_prompt_tokens + params.max_tokens, model.config.context_len)
    return EngineConfig(num_blocks=max(1, math.ceil(tokens / EngineConfig.block_size)))


def apply_stop_strings(
    tokenizer, result: GenerationResult, stops: list[str], params: SamplingParams
) -> tuple[str, list[int], str]:
    """(text, token ids, finish reason) as the gateway would stream them: the text the output
    adds to the prompt's, cut at the first stop string to end after the first `min_tokens`
    tokens, without the text of a `stop_token_ids` token that ended it."""
    choice = ChoiceText(
        IncrementalDetokenizer(tokenizer, prompt_token_ids=result.prompt_token_ids),
        StopStringMatcher(stops),
        params.min_tokens,
        stop_token_ids=frozenset(params.stop_token_ids),
    )
    text = ""
    for count, token in enumerate(result.token_ids, start=1):
        last = count == len(result.token_ids)
        new, stopped = choice.push([token], result.finish_reason if last else None)
        text += new
        if stopped:
            return text, result.token_ids[:count], "stop"
    tail, stopped = choice.flush()
    return text + tail, result.token_ids, "stop" if stopped else result.finish_reason


def run(args: argparse.Namespace) -> int:
    try:
        params = sampling_params(args)
    except (InvalidRequestError, ValueError) as error:
        print(f"tandem generate: error: {error}", file=sys.stderr)
        return 2
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    device = parse_device(args.device)
    dtype = parse_dtype(args.dtype, device)
    try:
        backend = linear_backend_for(args.quantization, dtype, device)
    except ValueError as error:
        print(f"tandem generate: error: {error}", file=sys.stderr)
        return 2
    try:
        loaded = load_model(args.model, dtype=dtype, device=device, linear_backend=backend)
    except (ValueError, OSError) as error:  # its config.json unreadable, a type not served
        print(f"tandem generate: error: --model {args.model}: {error}", file=sys.stderr)
        return 2
    loaded_at = time.perf_counter()
    if args.chat and getattr(loaded.tokenizer, "chat_template", None) is None:
        # (transformers' ValueError was a traceback; the gateway answers such a chat 400)
        print("tandem generate: error: --chat: this model has no chat template", file=sys.stderr)
        return 2
    prompt_ids = encode_prompt(loaded.tokenizer, args.prompt, args.chat)
    engine = LLMEngine(loaded.model, engine_config(loaded.model, len(prompt_ids), params))
    try:
        (result,) = engine.generate([prompt_ids], params)
    except InvalidRequestError as error:
        print(f"tandem generate: error: {error}", file=sys.stderr)
        return 2
    finished_at = time.perf_counter()
    text, token_ids, finish_reason = apply_stop_strings(loaded.tokenizer, result, args.stop, params)
    if not args.json:
        print(text)
        return 0
    output = {
        "model": loaded.name,
        "dtype": dtype_name(loaded.model.dtype),
        "quantization": args.quantization,
        "text": text,
        "prompt_token_ids": prompt_ids,
        "token_ids": token_ids,
        "finish_reason": finish_reason,
        "sampling": {k: v for k, v in vars(params).items() if k != "stop_token_ids"},
        "load_seconds": round(loaded_at - started, 3),
        "generate_seconds": round(finished_at - loaded_at, 3),
    }
    if params.logprobs is not None:
        output["logprobs"] = [
            {"logprob": lp.logprob, "top": lp.top} for lp in result.logprobs[: len(token_ids)]
        ]
    print(json.dumps(output))
    return 0
