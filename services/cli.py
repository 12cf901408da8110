"""The `tandem` command: one subcommand per role, plus tools (`generate`)."""

from __future__ import annotations

import argparse
import sys

from services import generate

SUBCOMMANDS = {
    "generate": generate,
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module in SUBCOMMANDS.items():
        module.add_arguments(sub.add_parser(name, help=module.HELP, description=module.__doc__))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return SUBCOMMANDS[args.command].run(args) or 0


if __name__ == "__main__":
    sys.exit(main())
