"""`tandem keys`: CurveZMQ keys for a cluster, and for RPC clients.

    tandem keys --dir keys/                 # the cluster's keypair (kept if it exists)
    tandem keys --dir keys/ --client agent  # plus a keypair for an RPC client named agent

Services take the directory (`--curve-keys-dir keys/`, `TANDEM_CURVE_KEYS_DIR`) or, without
files, the secret key this prints (`TANDEM_CURVE_SECRET_KEY`). An RPC client loads its keys with
`ClientKeys.from_dir("keys/", "agent")`; its public key is in `keys/authorized/`, which every
service started afterwards accepts. Secret key files are written readable by their owner only.
"""

from __future__ import annotations

import argparse
import sys

from shared.curve import CurveError, CurveKeys, generate


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--dir", required=True, type=_directory, help="the keys directory (created if missing)"
    )
    parser.add_argument(
        "--client", action="append", default=[], help="an RPC client to make a keypair for"
    )


def _directory(text: str) -> str:
    """An empty one (an unset shell variable) was the working directory, which got the
    cluster's secret key; services refuse `--curve-keys-dir ""` as given empty."""
    if not text.strip():
        raise argparse.ArgumentTypeError("a keys directory must not be empty")
    return text


def run(args: argparse.Namespace) -> int:
    try:
        written = generate(args.dir, tuple(args.client))
        keys = CurveKeys.from_dir(args.dir)  # as the services will load them
    except CurveError as error:
        print(f"tandem keys: {error}", file=sys.stderr)
        return 2
    for path in written:
        print(f"wrote {path}")
    print(f"cluster public key: {keys.public.decode()}")
    print(f"for services without the files: TANDEM_CURVE_SECRET_KEY={keys.secret.decode()}")
    return 0
