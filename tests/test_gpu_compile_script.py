"""benchmarks/gpu_compile.py compiles every Triton kernel for an H100 (sm_90) with the ptxas of
Triton's wheel, no GPU needed: a kernel that would not build, would spill registers with its
tiles or would ask for more shared memory than the device has fails here, not on the
first GPU it meets. Run in a child process: it must import attnlab without TRITON_INTERPRET."""

from __future__ import annotations

import ast
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
    code = "import sys, gpu_compile; sys.exit(gpu_compile.main(['--quick', '--jobs', '2']))"
    done = run(code, tmp_path)
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
    ta.TILES["forward"][(True, 128)] = (64, 16, 1, 1)  # 64 x 128 fp32 sums: 256 regs a thread
    ta.attention_forward(q, q, q)
def overflow():
    ta.TILES["forward"][(True, 128)] = (16, 64, 1, 10)  # 10 stages of 64 x 128 keys and values
    ta.attention_forward(q, q, q)
sys.exit(gpu_compile.main([], cases=[("spill", spill), ("overflow", overflow)]))
"""
    done = run(code, tmp_path)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert "spills registers to local memory" in done.stdout
    assert "more shared memory than the target has" in done.stdout


def test_bfloat16_additive_kernels_compile_to_the_hardware_tanh_and_float32_ones_do_not(tmp_path):
    """The interpreter cannot run PTX, so the SFU's tanh.approx.f32 is checked where it is
    compiled: bfloat16's kernels carry it (HARDWARE_TANH_ON), float32's keep exp2 and the
    reciprocal, and the setting turned off takes it out again."""
    pytest.importorskip("triton", reason="pip install triton (the kernels extra)")
    code = """
import torch, gpu_compile
from attnlab.kernels import triton_additive as K
def compiled(dtype, **settings):
    a, b = torch.zeros(1, 64, 32, requires_grad=True), torch.zeros(1, 64, 32, requires_grad=True)
    w = torch.zeros(32, requires_grad=True)
    v = torch.zeros(1, 64, 64, dtype=dtype, requires_grad=True)
    with gpu_compile.CompileEveryLaunch(90) as launches:
        with K.settings(**settings):
            out = K.additive_attention(a, b, w, v)
        out.float().sum().backward()
    return {name: k.asm["ptx"].count("tanh.approx.f32") for name, k, _ in launches.records}
print("bf16", compiled(torch.bfloat16))
print("fp32", compiled(torch.float32))
print("bf16-off", compiled(torch.bfloat16, HARDWARE_TANH_ON=()))
"""
    done = run(code, tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines() if " {" in line)
    bf16, fp32, off = (ast.literal_eval(lines[k]) for k in ("bf16", "fp32", "bf16-off"))
    assert set(bf16) == {"_fwd_kernel", "_bwd_kernel"} and all(n > 0 for n in bf16.values())
    assert set(fp32) == set(off) == set(bf16)
    assert not any(fp32.values()) and not any(off.values())
