#!/usr/bin/env python3
"""Rule-based baseline: translate the Bible test split with Apertium and score it with sacrebleu.

Needs Debian's Apertium English -> Spanish pair and sacrebleu::

    apt-get install -y --no-install-recommends apertium-eng-spa
    pip install sacrebleu

Usage::

    python scripts/apertium_baseline.py                  # test split, BLEU and chrF
    python scripts/apertium_baseline.py --split validation --output hyps.txt
    python scripts/apertium_baseline.py --twice          # also check the output is reproducible

All verses go through one Apertium process in line mode (``-f line``: each input line is one
segment, translated on its own, output line n = input line n); ``-u`` leaves unknown words
unmarked (no ``*``). The references are the RV1909 verses of the same split.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from attnlab.data import load_bible  # noqa: E402


def apertium(lines: list[str], direction: str = "eng-spa") -> list[str]:
    """Translate lines (no newlines inside) with one Apertium run; one output line per line."""
    if shutil.which("apertium") is None:
        raise SystemExit(
            "apertium not found; install it with: "
            "apt-get install -y --no-install-recommends apertium-eng-spa"
        )
    command = ["apertium", "-u", "-f", "line", direction]
    result = subprocess.run(
        command, input="".join(line + "\n" for line in lines), capture_output=True, text=True
    )
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed ({result.returncode}): {result.stderr}")
    out = result.stdout.split("\n")
    if out and out[-1] == "":
        out.pop()
    if len(out) != len(lines):
        raise SystemExit(f"apertium returned {len(out)} lines for {len(lines)} input lines")
    return [" ".join(line.split()) for line in out]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--split", default="test", choices=["train", "validation", "test"])
    parser.add_argument("--limit", type=int, default=None, help="only the first N verses")
    parser.add_argument("--output", type=Path, help="write the translations here, one per line")
    parser.add_argument("--twice", action="store_true", help="translate twice and compare")
    args = parser.parse_args(argv)

    import sacrebleu  # optional dependency, only for this script

    pairs = load_bible(args.split)[: args.limit]
    sources = [p.source for p in pairs]
    references = [p.target for p in pairs]
    start = time.perf_counter()
    hypotheses = apertium(sources)
    seconds = time.perf_counter() - start
    if args.twice and apertium(sources) != hypotheses:
        print("NOT reproducible: a second run gave different translations", file=sys.stderr)
        return 1
    if args.output:
        args.output.write_text("".join(h + "\n" for h in hypotheses), encoding="utf-8")

    print(f"Apertium eng-spa, Bible {args.split} split: {len(pairs)} verses in {seconds:.1f} s")
    for metric in (sacrebleu.BLEU(), sacrebleu.CHRF()):
        print(f"  {metric.corpus_score(hypotheses, [references])}   [{metric.get_signature()}]")
    if args.twice:
        print("  reproducible: a second run gave identical translations")
    return 0


if __name__ == "__main__":
    sys.exit(main())
