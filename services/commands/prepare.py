"""`tandem prepare`: resolves the model once, converting a GGUF into the cache, and exits.

Services that share a cache volume (docker-compose, Kubernetes) run it first, so that the
conversion (about a minute for the default model) happens once instead of in every worker.
Prints the model's directory.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from shared.config import ConfigError
from shared.engine.model_files import DEFAULT_MODEL, resolve_model_dir


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=os.environ.get("TANDEM_MODEL") or DEFAULT_MODEL,
        help="a HF directory, .gguf, or name (env TANDEM_MODEL)",
    )


def resolve_model(model: str) -> tuple[Path, str]:
    """`resolve_model_dir`, a model it cannot read (a .gguf that is none, one transformers
    cannot convert) a ConfigError naming --model: transformers' ValueError or OSError was a
    traceback."""
    try:
        return resolve_model_dir(model)
    except ConfigError:
        raise
    except (ValueError, OSError) as error:
        raise ConfigError(f"--model {model}: {error}") from None


def run(args: argparse.Namespace) -> int:
    directory, name = resolve_model(args.model)
    print(f"{name}: {directory}")
    return 0
