"""The ``attnlab`` command line.

Each subcommand lives in its own module, which exposes ``add_arguments(parser)`` and
``main(args) -> int``; it is imported only when used, so ``attnlab --help`` stays fast (it
imports no command module, hence no torch).

Every failure a user can cause ends in one line that names the problem and the fix, with exit
status 2: options are checked by the argparse ``type=`` helpers below before anything runs, and
the errors the commands raise are printed without a traceback. ``attnlab --debug COMMAND ...``
(or ``--debug`` anywhere before ``--``, or ``ATTNLAB_DEBUG=1``) shows the traceback instead.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import math
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
    "show": (
        "attnlab.viz.cmd_explain",
        "draw a real model's attention: heatmaps, embedding movement, an offline HTML explorer",
    ),
}
# old name -> new name. `attnlab explain` was `attnlab show`'s name until 0.1.0; it still works,
# with a note, and is not listed in --help: `attnlab.explain(q, k, v)` (which kernel a call
# runs) keeps the name "explain".
ALIASES = {"explain": "show"}
DEBUG_HELP = "on an error, show the traceback instead of one line (also: ATTNLAB_DEBUG=1)"


class UserError(Exception):
    """A problem with the user's input: printed as one line, exit status 2, no traceback."""


# ------------------------------------------------------------------------------ option types
# argparse calls these on the option's text; an ArgumentTypeError becomes the one line
# "attnlab train: error: argument --max-steps: must be an integer >= 1; got '0' ...".


def _parse_number(text: str, kind: type) -> int | float:
    try:
        value = kind(text)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if kind is float and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """An integer >= 1 (counts, sizes, steps)."""
    value = _parse_number(text, int)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1; got {text!r}: pass 1 or more")
    return value


THREADS_PER_CORE = 4  # --threads allows up to this many threads per core of the machine


def max_threads() -> int:
    """The largest ``--threads``: 4 per core of this machine (``os.cpu_count()``).

    More threads than cores only slows torch down (its OpenMP threads wait for each other), and
    tens of thousands crash the process inside libgomp (an abort, or a segfault) before
    Python can say anything: 30000 aborted, 100000 segfaulted.
    """
    return THREADS_PER_CORE * (os.cpu_count() or 1)


def thread_count(text: str) -> int:
    """A number of CPU threads: an integer in [1, :func:`max_threads`]."""
    value = positive_int(text)
    limit = max_threads()
    if value > limit:
        raise argparse.ArgumentTypeError(
            f"must be an integer in [1, {limit}] ({THREADS_PER_CORE} per core of this "
            f"machine's {os.cpu_count() or 1}); got {text!r}: pass {os.cpu_count() or 1} "
            "(one per core) or leave --threads out (the idle cores)"
        )
    return value


def tokens_or_auto(text: str) -> int | str:
    """``auto`` (measured on the device) or an integer >= 1."""
    return "auto" if text == "auto" else positive_int(text)


def non_negative_int(text: str) -> int:
    """An integer >= 0 (warm-up steps, seeds)."""
    value = _parse_number(text, int)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0; got {text!r}: pass 0 or more")
    return value


def seed_int(text: str) -> int:
    """A random seed: an integer in [0, 2**32) (what NumPy accepts)."""
    value = non_negative_int(text)
    if value >= 2**32:
        raise argparse.ArgumentTypeError(f"must be below 2**32; got {text!r}: pass a smaller seed")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0 (minutes, epochs, learning rates)."""
    value = _parse_number(text, float)
    if value <= 0:
        raise argparse.ArgumentTypeError(
            f"must be a number > 0; got {text!r}: pass a positive number"
        )
    return value


def non_negative_float(text: str) -> float:
    """A finite number >= 0 (a gradient-norm clip, where 0 turns it off)."""
    value = _parse_number(text, float)
    if value < 0:
        raise argparse.ArgumentTypeError(
            f"must be a number >= 0; got {text!r}: pass 0 or more (0 turns it off)"
        )
    return value


def fraction(text: str) -> float:
    """A number in [0, 1) (dropout)."""
    value = _parse_number(text, float)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(
            f"must be in [0, 1); got {text!r}: pass e.g. 0.1 (0 turns it off)"
        )
    return value


def device_name(text: str) -> str:
    """``auto``, ``cpu``, ``cuda`` or ``cuda:N`` (whether CUDA is there is checked when used)."""
    name = text.strip().lower()
    if name in ("auto", "cpu", "cuda"):
        return name
    if name.startswith("cuda:") and name[5:].isdigit():
        return name
    if name in ("gpu", "nvidia"):
        raise argparse.ArgumentTypeError(f"unknown device {text!r}; for an NVIDIA GPU pass cuda")
    if name == "mps":
        raise argparse.ArgumentTypeError(
            "mps (Apple GPUs) is not supported; pass cpu, cuda, cuda:N or auto"
        )
    raise argparse.ArgumentTypeError(
        f"unknown device {text!r}; pass cpu, cuda, cuda:N (N = GPU index) or auto"
    )


# ------------------------------------------------------------------------------ parsers
class Parser(argparse.ArgumentParser):
    """An argparse parser whose errors are one line (no usage block) that points at --help."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see: {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser: the commands and their one-line help (imports no command)."""
    parser = Parser(
        prog="attnlab",
        description="Attention mechanisms: run, train, compare and look.",
        epilog="Options of a command: attnlab COMMAND --help",
    )
    parser.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    parser.add_argument("--version", action="store_true", help="print attnlab's version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, description=help_text)
    return parser


def command_parser(name: str) -> tuple[argparse.ArgumentParser, object]:
    """The parser of one command (or of an old name in :data:`ALIASES`), and its module.

    Command modules import nothing heavy at module level and in ``add_arguments`` (torch is
    imported by ``main``), so ``attnlab COMMAND --help`` answers at once."""
    module_name, help_text = COMMANDS[ALIASES.get(name, name)]
    module = importlib.import_module(module_name)
    parser = Parser(prog=f"attnlab {name}", description=help_text)
    module.add_arguments(parser)
    parser.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    return parser, module


def one_line(error: BaseException) -> str:
    """An exception's message on one line (a multi-line message's lines joined by '; ')."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return "; ".join(lines) or type(error).__name__


def _take_debug(argv: list[str]) -> tuple[list[str], bool]:
    """Remove ``--debug`` wherever it stands before ``--``; whether it was there."""
    end = argv.index("--") if "--" in argv else len(argv)
    found = "--debug" in argv[:end]
    return [a for a in argv[:end] if a != "--debug"] + argv[end:], found


def deprecation_note(name: str) -> str:
    """The one line printed to stderr when an old command name is used."""
    return (
        f"attnlab {name}: note: this command is now 'attnlab {ALIASES[name]}'; "
        f"'attnlab {name}' still works but will be removed"
    )


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    argv, debug = _take_debug(argv)
    debug = debug or bool(os.environ.get("ATTNLAB_DEBUG"))
    if not argv or argv[0] in ("-h", "--help"):
        build_parser().print_help()
        return 0
    if argv[0] == "--version":
        from attnlab import __version__

        print(f"attnlab {__version__}")
        return 0
    name = argv[0]
    if name in ALIASES and name not in COMMANDS:
        code = _run(name, argv, debug)
        if code == 0:  # after the output; an error stays the one line it is
            print(deprecation_note(name), file=sys.stderr)
        return code
    if name not in COMMANDS:
        if name.startswith("-"):
            problem = f"unknown option {name!r} before the command"
        else:
            problem = f"unknown command {name!r}"
        close = difflib.get_close_matches(name.lstrip("-"), [*COMMANDS, *ALIASES], n=1)
        fix = f"did you mean {close[0]!r}?" if close else "commands: " + ", ".join(COMMANDS)
        print(f"attnlab: {problem}; {fix} (see: attnlab --help)", file=sys.stderr)
        return 2
    return _run(name, argv, debug)


def _run(name: str, argv: list[str], debug: bool) -> int:
    """Parse ``argv`` (``[name, options...]``) for command ``name`` and run it."""
    try:
        parser, module = command_parser(name)
        # intermixed: options may stand before, between or after positional text
        # (attnlab translate RUN --beam-size 5 "text")
        args = parser.parse_intermixed_args(argv[1:])
        args.debug = debug
        args.command = f"attnlab {name}"  # as typed (an old name in ALIASES included)
        return module.main(args) or 0
    except SystemExit as e:  # argparse: --help (0) or a bad option (2, one line printed)
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    except (UserError, ValueError, TypeError, OSError) as e:
        # attnlab's errors name the argument, the expected and received values and the fix:
        # one line says it all (OSError: a file that cannot be read or written).
        if debug:
            raise
        print(f"attnlab {name}: error: {one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if debug:
            raise
        print(f"attnlab {name}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
