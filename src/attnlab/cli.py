"""The ``attnlab`` command line.

Each subcommand lives in its own module, which exposes ``add_arguments(parser)`` and
``main(args) -> int``; it is imported only when used, so ``attnlab --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# name -> (module, one-line help)
COMMANDS = {
    "train": (
        "attnlab.translate.cmd_train",
        "train a translator with attention (default: Bible en->es, 15 minutes on CPU)",
    ),
    "translate": ("attnlab.translate.cmd_translate", "translate text with a trained run"),
    "evaluate": (
        "attnlab.translate.cmd_evaluate",
        "score a trained run: BLEU, chrF and the alignment error rate of its attention",
    ),
    "compare": (
        "attnlab.translate.cmd_compare",
        "train every attention variant on equal terms; write a table and a plot",
    ),
    "examples": ("attnlab.cli_examples", "print the worked examples of the tutorials"),
    "explain": (
        "attnlab.viz.cmd_explain",
        "draw a real model's attention: heatmaps, embedding movement, an offline HTML explorer",
    ),
}


class UserError(Exception):
    """A problem with the user's input: printed as one line, exit status 2, no traceback."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="attnlab", description="Attention mechanisms: run, train, compare and look."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in COMMANDS:
        # Build only the parser of the command used: importing every command is slow.
        parser = argparse.ArgumentParser(prog=f"attnlab {argv[0]}")
        module = importlib.import_module(COMMANDS[argv[0]][0])
        parser.description = COMMANDS[argv[0]][1]
        module.add_arguments(parser)
        args = parser.parse_args(argv[1:])
        try:
            return module.main(args) or 0
        except (UserError, ValueError, TypeError, FileNotFoundError) as e:
            # attnlab's errors name the argument, the expected and received values and the
            # fix: one line says it all. ATTNLAB_DEBUG=1 shows the traceback.
            if os.environ.get("ATTNLAB_DEBUG"):
                raise
            print(f"attnlab {argv[0]}: error: {e}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print(f"attnlab {argv[0]}: interrupted", file=sys.stderr)
            return 130
    build_parser().print_help()
    return 0 if not argv or argv[0] in ("-h", "--help") else 2


if __name__ == "__main__":
    raise SystemExit(main())
