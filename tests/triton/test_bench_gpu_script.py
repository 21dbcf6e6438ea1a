"""benchmarks/bench_gpu.py runs here on tiny shapes through the interpreter (its times mean
nothing), so that a section has not rotted when a GPU is lent: each prints its target line."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.mark.parametrize(
    "section, target",
    [
        ("weights", r"targets: averaged x[\d.]+ of fused \(<= 2\); per head x[\d.]+ of the bound"),
        ("overhead", r"\+[\d.-]+ us per call; under assume_finite \+[\d.-]+ us"),
        ("decode", r"targets: weights per head x[\d.]+, averaged x[\d.]+ of the call without"),
    ],
)
def test_a_bench_gpu_section_runs_under_the_interpreter(section, target, capsys):
    sys.path.insert(0, str(BENCH))
    try:
        import bench_gpu
    finally:
        sys.path.remove(str(BENCH))
    assert bench_gpu.main(["--smoke", "--only", section, "--rounds", "1"]) == 0
    printed = capsys.readouterr().out
    assert re.search(target, printed), printed
    if section == "decode":  # the weights come from the decode kernel, not a fallback
        assert "weights per head (triton)" in printed and "weights averaged (triton)" in printed
