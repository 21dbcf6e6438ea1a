"""How fast the command line answers: ``attnlab --help``, ``attnlab CMD --help`` and
``import attnlab``, each the median of N fresh processes; the target is <= 0.3 s for every help.

A fresh process is what a user waits for (interpreter start-up included), so each timing runs
the installed ``attnlab`` script (or ``python -m attnlab.cli`` when it is not on PATH) in a new
subprocess. For reference it also times ``python -c pass`` and ``python -c "import torch"``:
a help that imported torch would cost about the latter.

Usage: ``python benchmarks/bench_cli.py [--runs 5]``
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

TARGET_SECONDS = 0.3


def attnlab_command() -> list[str]:
    """The installed script next to this interpreter, else ``python -m attnlab.cli``."""
    script = Path(sys.executable).with_name("attnlab")
    if script.exists():
        return [str(script)]
    found = shutil.which("attnlab")
    return [found] if found else [sys.executable, "-m", "attnlab.cli"]


def median_seconds(argv: list[str], runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="processes per timing (median)")
    args = parser.parse_args()

    from attnlab.cli import COMMANDS

    attnlab = attnlab_command()
    rows = [
        ("python -c pass", [sys.executable, "-c", "pass"], None),
        ("python -c 'import attnlab'", [sys.executable, "-c", "import attnlab"], None),
        ("python -c 'import torch'", [sys.executable, "-c", "import torch"], None),
        ("attnlab --help", [*attnlab, "--help"], TARGET_SECONDS),
        ("attnlab --version", [*attnlab, "--version"], TARGET_SECONDS),
    ]
    rows += [(f"attnlab {c} --help", [*attnlab, c, "--help"], TARGET_SECONDS) for c in COMMANDS]
    print(f"median of {args.runs} fresh processes; target <= {TARGET_SECONDS} s for the CLI")
    slow = 0
    for label, argv, target in rows:
        seconds = median_seconds(argv, args.runs)
        verdict = "" if target is None else ("  ok" if seconds <= target else "  SLOW")
        slow += verdict == "  SLOW"
        print(f"  {label:<34} {seconds:7.3f} s{verdict}")
    print("all within target" if not slow else f"{slow} over target (a busy machine? rerun)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
