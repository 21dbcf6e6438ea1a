"""``attnlab examples``: print the tutorials' worked examples, computed by attnlab."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from attnlab.examples import EXAMPLES

    parser.add_argument(
        "names",
        nargs="*",
        metavar="NAME",
        help="examples to run (default: all): " + ", ".join(EXAMPLES),
    )


def main(args: argparse.Namespace) -> int:
    from attnlab.examples import run

    run(args.names or None)
    return 0
