"""``attnlab examples``: print the tutorials' worked examples, computed by attnlab."""

from __future__ import annotations

import argparse

# The names of :data:`attnlab.examples.EXAMPLES`, in order, written out so that
# ``attnlab examples --help`` need not import torch (tests/test_cli_front.py checks they agree).
NAMES = (
    "five-tokens",
    "four-words",
    "attention-shapes",
    "head-sharing",
    "kv-cache",
    "rope",
    "real-model",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "names",
        nargs="*",
        metavar="NAME",
        help="examples to run (default: all): " + ", ".join(NAMES),
    )


def main(args: argparse.Namespace) -> int:
    from attnlab.examples import run

    run(args.names or None)
    return 0
