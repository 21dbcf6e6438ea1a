"""benchmarks/gpu_check.py, the first thing to run on a GPU machine, runs and passes here too
(tiny shapes through the interpreter), so that it has not rotted when a GPU is lent."""

from __future__ import annotations

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def test_the_gpu_check_script_passes_under_the_interpreter(capsys):
    sys.path.insert(0, str(BENCH))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(BENCH))
    assert gpu_check.main(["--smoke"]) == 0
    printed = capsys.readouterr().out
    assert "0 failure(s)" in printed and printed.count("  ok   ") >= 60
    assert "FAIL" not in printed
