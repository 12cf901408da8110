"""The `tandem` command: one subcommand per role, plus tools (`generate`)."""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import textwrap
from types import FrameType

from shared.config import ConfigError
from shared.env_names import unread_names, unread_warning
from shared.errors import StartUpError

# Subcommand name -> module with HELP, add_arguments(parser) and run(args). Imported lazily so that
# `tandem scheduler` does not pay for torch and `tandem --help` stays quick.
SUBCOMMANDS = {
    "up": "services.commands.up",
    "gateway": "services.gateway.service",
    "scheduler": "services.scheduler.service",
    "prefill": "services.prefill.service",
    "decode": "services.decode.service",
    "batch-service": "services.batch.service",
    "generate": "services.commands.generate",
    "prepare": "services.commands.prepare",
    "keys": "services.commands.keys",
    "top": "services.commands.top",
    "bench": "loadtest.bench",
    "profile": "loadtest.worker_profile",
    "plan": "loadtest.plan",
    "batch": "services.commands.batch",
}
HELPS = {
    "up": "start a whole local cluster (gateway, scheduler, prefill and decode workers)",
    "gateway": "run the gateway (OpenAI HTTP API and RPC front door)",
    "scheduler": "run the scheduler",
    "prefill": "run a prefill worker",
    "decode": "run a decode worker",
    "batch-service": "run the batch service (OpenAI Files and Batches, durable bulk jobs)",
    "generate": "generate text for one prompt with the in-process engine",
    "prepare": "convert and cache the model once (for containers sharing a cache volume)",
    "keys": "generate CurveZMQ keys for a cluster and its RPC clients",
    "top": "a live terminal view of a running cluster",
    "bench": "benchmark any OpenAI-compatible server: latency percentiles, goodput, plots",
    "profile": "measure a worker profile (step and transfer times) for `tandem plan`",
    "plan": "how many prefill and decode workers meet your SLOs: simulate the real scheduler",
    "batch": "bulk jobs: submit a JSONL file (--wait: follow it), status, list, cancel, download",
}


class DocstringFormatter(argparse.HelpFormatter):
    """A subcommand's description is its module's docstring: paragraphs are filled to the
    terminal as argparse fills them, but an indented block (the example command lines) keeps
    its lines. (argparse's default ran the examples together into one paragraph.)"""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        fill = super()._fill_text
        paragraphs = textwrap.dedent(text).strip().split("\n\n")
        return "\n\n".join(
            textwrap.indent(p, indent) if p.startswith(" ") else fill(p, width, indent)
            for p in paragraphs
        )


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module_name in SUBCOMMANDS.items():
        subparser = sub.add_parser(name, help=HELPS[name], formatter_class=DocstringFormatter)
        if name in argv:  # only the chosen subcommand's module is imported
            module = importlib.import_module(module_name)
            subparser.description = module.__doc__
            module.add_arguments(subparser)
    return parser


def exit_on_sigterm(signum: int, frame: FrameType | None) -> None:
    """Until a role puts its own handler in place (once it serves: a GOODBYE, a drain), SIGTERM
    ends the command as the default action would. As a container's process 1 the default is to
    ignore it (the kernel's rule for a namespace's init): a stop during the model's load or
    conversion waited out the grace period for its SIGKILL."""
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    signal.signal(signal.SIGTERM, exit_on_sigterm)
    args = build_parser(argv).parse_args(argv)
    for name in unread_names(os.environ):
        print(f"tandem {args.command}: warning: {unread_warning(name)}", file=sys.stderr)
    module = importlib.import_module(SUBCOMMANDS[args.command])
    try:
        return module.run(args) or 0
    except ConfigError as error:
        print(f"tandem {args.command}: configuration error: {error}", file=sys.stderr)
        return 2
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError) as error:
        # A path given (a model, a file) that cannot be read: its reason, not a traceback.
        print(f"tandem {args.command}: {error}", file=sys.stderr)
        return 2
    except StartUpError as error:
        print(f"tandem {args.command}: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C (in `generate`, `prepare`, ...): not a traceback
        print(f"\ntandem {args.command}: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT
    except BrokenPipeError:  # its reader left (`tandem batch download ID | head`)
        # Python's advice: the interpreter's last flush of stdout at exit would raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
