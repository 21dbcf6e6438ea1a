"""attnlab's Triton kernels, tested through Triton's interpreter in a child process.

The kernels are decorated (``@triton.jit``) when their modules are imported, and Triton decides
then whether they are compiled or interpreted; the dispatch reads ``TRITON_INTERPRET`` when
attnlab is imported. So the tests in ``tests/triton/`` run in a fresh pytest with
``TRITON_INTERPRET=1`` set, on CPU tensors, through the very kernel code that runs on a GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent


def test_triton_kernels_pass_under_the_interpreter():
    pytest.importorskip("triton", reason="pip install triton (the kernels extra)")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(HERE / "triton")],
        env=env,
        capture_output=True,
        text=True,
        cwd=HERE.parent,
    )
    print(run.stdout[-3000:])
    assert run.returncode == 0, run.stdout[-20000:] + run.stderr[-5000:]
    assert " passed" in run.stdout and " skipped" not in run.stdout, run.stdout[-3000:]


def test_without_the_interpreter_cpu_tensors_keep_the_existing_paths():
    import torch

    from attnlab.kernels import _triton

    assert not _triton.INTERPRET
    reason = _triton.unfit(torch.zeros(1))
    assert reason is not None and "TRITON_INTERPRET" in reason


def test_without_the_interpreter_additive_products_are_tf32x3_and_cuda_tiles():
    """Compiled (no TRITON_INTERPRET), the additive kernels multiply float32 in TF32x3 and take
    the CUDA tiles, whatever device a tensor reports: the interpreter's settings are its own."""
    pytest.importorskip("triton", reason="pip install triton (the kernels extra)")
    import torch

    from attnlab.kernels import triton_additive as tadd

    assert tadd.products(torch.bfloat16) == {"PRECISION": "tf32x3", "WIDEN": False}
    assert tadd.tiling_for(64) == tadd.TILINGS["cuda"]
    assert tadd.tiling_for(256) == tadd.TILINGS["cuda, wide values"]
