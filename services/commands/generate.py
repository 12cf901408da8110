"""`tandem generate`: run the engine in-process on one prompt and print the result."""

from __future__ import annotations

import argparse
import json
import sys
import time

from shared.engine.engine import EngineConfig, LLMEngine
from shared.engine.loader import (
    DEFAULT_MODEL,
    DEVICE_HELP,
    device_argument,
    load_model,
    parse_device,
    parse_dtype,
)
from shared.engine.sampling_params import SamplingParams
from shared.errors import InvalidRequestError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt", required=True, help="the prompt text")
    parser.add_argument("--chat", action="store_true", help="apply the chat template to the prompt")
    parser.add_argument(
        "--model", default=DEFAULT_MODEL, help="a HF directory, a .gguf file, or 'smollm2'"
    )
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--json", action="store_true", help="print a JSON object with token ids")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cpu", type=device_argument, help=DEVICE_HELP)


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


def run(args: argparse.Namespace) -> int:
    try:
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            ignore_eos=args.ignore_eos,
        )
    except InvalidRequestError as error:
        print(f"tandem generate: error: {error}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    loaded = load_model(args.model, dtype=parse_dtype(args.dtype), device=parse_device(args.device))
    loaded_at = time.perf_counter()
    engine = LLMEngine(loaded.model, EngineConfig(kv_cache_bytes=256 << 20))
    prompt_ids = encode_prompt(loaded.tokenizer, args.prompt, args.chat)
    try:
        (result,) = engine.generate([prompt_ids], params)
    except InvalidRequestError as error:
        print(f"tandem generate: error: {error}", file=sys.stderr)
        return 2
    finished_at = time.perf_counter()
    text = loaded.tokenizer.decode(result.token_ids, skip_special_tokens=True)
    if args.json:
        print(
            json.dumps(
                {
                    "model": loaded.name,
                    "text": text,
                    "prompt_token_ids": prompt_ids,
                    "token_ids": result.token_ids,
                    "finish_reason": result.finish_reason,
                    "load_seconds": round(loaded_at - started, 3),
                    "generate_seconds": round(finished_at - loaded_at, 3),
                }
            )
        )
    else:
        print(text)
    return 0
