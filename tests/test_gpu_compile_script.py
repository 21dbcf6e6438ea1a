"""benchmarks/gpu_compile.py compiles every Triton kernel for an H100 (sm_90) with the ptxas of
Triton's wheel, no GPU needed: a kernel that would not build, would spill registers with its
tiles or would ask for more shared memory than the device has fails here, not on the
first GPU it meets. Run in a child process: it must import attnlab without TRITON_INTERPRET."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run(code: str, tmp_path: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "benchmarks"), env.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=ROOT
    )


def test_every_kernel_compiles_for_sm90_without_spills(tmp_path):
    pytest.importorskip("triton", reason="pip install triton (the kernels extra)")
    done = run("import sys, gpu_compile; sys.exit(gpu_compile.main(['--quick']))", tmp_path)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    out = done.stdout
    for kernel in ("_forward_kernel", "_weights_kernel", "_head_weights_kernel", "_dkdv_kernel",
                   "_dq_kernel", "_decode_kernel", "_fwd_kernel", "_bwd_kernel", "_kv_kernel",
                   "_rows_kernel"):  # fmt: skip
        assert kernel in out
    assert "; 0 failures" in out and "FAIL" not in out
    # the tuned bf16 tiles of the forward really were compiled (not the interpreter's 32 x 32)
    assert any(line.startswith("_forward_kernel       bfloat16 E=128") and "128x32 w8 s3" in line
               for line in out.splitlines())  # fmt: skip


def test_tiles_that_spill_or_overflow_shared_memory_fail_the_check(tmp_path):
    pytest.importorskip("triton", reason="pip install triton (the kernels extra)")
    code = """
import sys, torch, gpu_compile
from attnlab.kernels import triton_attention as ta
q = torch.zeros(1, 2, 512, 128, dtype=torch.bfloat16)
def spill():
    ta.TILES["forward"][(True, 128)] = (256, 128, 4, 1)  # far more than 255 registers hold
    ta.attention_forward(q, q, q)
def overflow():
    ta.TILES["forward"][(True, 128)] = (128, 256, 8, 4)  # 4 stages of 256 x 128 keys and values
    ta.attention_forward(q, q, q)
sys.exit(gpu_compile.main([], cases=[("spill", spill), ("overflow", overflow)]))
"""
    done = run(code, tmp_path)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert "spills registers to local memory" in done.stdout
    assert "more shared memory than the target has" in done.stdout
