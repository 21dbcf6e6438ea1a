"""``attnlab translate RUN_DIR``: translate text with a trained run.

Text comes from the arguments (one sentence each), from ``--input FILE`` (one per line), or from
standard input. Translations go to standard output, one per line, in order.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

EPILOG = """\
examples:
  attnlab translate runs/bible-rnn-luong-general "In the beginning God created the heaven."
  attnlab translate runs/dates-rnn-bahdanau "mardi 1 février 2005" --show-attention
  attnlab translate runs/bible-rnn-luong-general --input verses.txt --beam-size 5 > out.txt
  attnlab translate runs/dates-rnn-luong-general --beam-size 1 "3 mars 1999"   # any order
  echo "And God said, Let there be light" | attnlab translate runs/bible-rnn-luong-general
"""


def add_run_arguments(parser) -> None:
    """The options of the commands that use a trained run: RUN_DIR, beam, device, threads."""
    from attnlab.cli import device_name, positive_int, thread_count

    parser.add_argument(
        "run_dir", type=Path, metavar="RUN_DIR", help="a folder written by attnlab train"
    )
    parser.add_argument(
        "--beam-size",
        "-b",
        type=positive_int,
        default=None,
        help="beam width (1 = greedy; default: the run's, 4)",
    )
    parser.add_argument(
        "--device", type=device_name, default="cpu", help="cpu (default), cuda or cuda:N"
    )
    parser.add_argument(
        "--threads",
        type=thread_count,
        default=None,
        help="CPU threads, at most 4 per core (default: the idle cores, >= 1)",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="Transformer runs: compile the decoder step once and replay it (CUDA graphs on a "
        "GPU; same translations; on CPU it is slower, and compiling costs ~20 s)",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from attnlab.cli import positive_int

    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EPILOG
    add_run_arguments(parser)
    parser.add_argument(
        "text", nargs="*", help="sentences to translate (default: --input or stdin)"
    )
    parser.add_argument(
        "--input",
        "-i",
        type=Path,
        default=None,
        metavar="FILE",
        help="read sentences from FILE, one per line",
    )
    parser.add_argument(
        "--batch-size", type=positive_int, default=32, help="sentences decoded together"
    )
    parser.add_argument(
        "--show-attention",
        action="store_true",
        help="also print each target token's most attended source token",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object per sentence (source, translation, source_tokens, "
        "target_tokens, score, complete)",
    )


def _read_input(args) -> list[str]:
    """The sentences, stripped: one per argument, or one per line of the file or of stdin."""
    if args.text and args.input:
        raise ValueError("give sentences as arguments or with --input FILE, not both")
    if args.text:
        return [text.strip() for text in args.text]
    if args.input:
        if args.input.is_dir():
            raise IsADirectoryError(f"--input {args.input}: a folder; pass a text file")
        if not args.input.is_file():
            raise FileNotFoundError(f"--input {args.input}: no such file")
        return split_lines(args.input.read_bytes(), f"--input {args.input}")
    if sys.stdin.isatty():
        print(
            "reading sentences from standard input, one per line (Ctrl-D to finish)",
            file=sys.stderr,
        )
    stdin = getattr(sys.stdin, "buffer", None)  # bytes, decoded strictly below
    raw = sys.stdin.read() if stdin is None else stdin.read()  # (None: a text stream instead)
    return split_lines(raw, "standard input")


def split_lines(raw: bytes | str, name: str) -> list[str]:
    """UTF-8 text -> its lines, stripped, as ``wc -l`` and ``paste`` count them: split at
    ``\\n`` only (CRLF's ``\\r`` is stripped). ``str.splitlines`` also splits at U+2028,
    U+0085, form feeds and lone carriage returns, and then every translation after such a
    character stood next to another sentence's line."""
    text = raw
    if isinstance(raw, bytes):
        try:
            text = raw.decode("utf-8-sig")  # (a byte-order mark is not part of the first line)
        except UnicodeDecodeError as e:
            line = raw[: e.start].count(b"\n") + 1
            raise ValueError(
                f"{name} is not UTF-8 text: byte {raw[e.start]:#04x} on line {line} cannot be "
                f"read as UTF-8. Fix: convert it first, e.g. iconv -f latin1 -t utf-8"
            ) from None
    lines = text.split("\n")
    if lines[-1] == "":  # the newline that ends the last line starts no new one
        lines.pop()
    return [line.strip() for line in lines]


def main(args: argparse.Namespace) -> int:
    from attnlab.translate.pipeline import open_run

    translator = open_run(args)
    lines = _read_input(args)
    wanted = [i for i, line in enumerate(lines) if line]
    outputs = translator.translate(
        [lines[i] for i in wanted],
        beam_size=args.beam_size,
        return_attention=args.show_attention,
        batch_size=args.batch_size,
        progress=len(wanted) > args.batch_size,
    )
    by_line = dict(zip(wanted, outputs, strict=True))
    for i in range(len(lines)):
        out = by_line.get(i)
        if out is None and args.json:  # keep line numbers aligned, one JSON object a line
            print(json.dumps({"source": "", "translation": "", "source_tokens": [],
                              "target_tokens": [], "score": None, "complete": None}))  # fmt: skip
            continue
        if out is None:  # keep line numbers aligned: an empty line stays empty
            print()
            continue
        if args.json:
            print(
                json.dumps(
                    {
                        "source": out.source,
                        "translation": out.text,
                        "source_tokens": out.source_tokens,
                        "target_tokens": out.target_tokens,
                        "score": round(out.score, 4),
                        "complete": out.complete,
                    },
                    ensure_ascii=False,
                )
            )
        else:
            print(out.text)
        if not out.complete:  # (the text is cut: said on stderr, the lines stay aligned)
            n = len(out.target_tokens)
            print(
                f"note: line {i + 1}'s translation stopped at the length limit ({n} tokens) "
                "before the model ended it",
                file=sys.stderr,
            )
        if args.show_attention and out.attention is not None:
            A = out.attention if out.attention.ndim == 2 else out.attention.mean(axis=(0, 1))
            pairs = [
                f"{t}<-{out.source_tokens[int(A[r].argmax())]}"
                for r, t in enumerate(out.target_tokens)
            ]
            print("  attention: " + "  ".join(pairs), file=sys.stderr)
    return 0
