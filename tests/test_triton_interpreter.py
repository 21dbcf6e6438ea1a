"""attnlab's Triton kernels, tested through Triton's interpreter in a child process.

The kernels are decorated (``@triton.jit``) when their modules are imported, and Triton decides
then whether they are compiled or interpreted; the dispatch reads ``TRITON_INTERPRET`` when
attnlab is imported. So the tests in ``tests/triton/`` run in a fresh pytest with
``TRITON_INTERPRET=1`` set, on CPU tensors, through the very kernel code that runs on a GPU.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent


SHARDS = 2  # child processes sharing the folder's tests (the interpreter runs one core each)


def test_triton_kernels_pass_under_the_interpreter(tmp_path):
    pytest.importorskip("triton", reason="pip install triton (the kernels extra)")
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    logs = [tmp_path / f"shard-{i}.log" for i in range(SHARDS)]
    children = []
    for i, log in enumerate(logs):  # (output to files: a full pipe would stall a child)
        with log.open("w") as out:
            children.append(subprocess.Popen(
                [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                 f"--shard={i}/{SHARDS}", str(HERE / "triton")],
                env=env, stdout=out, stderr=subprocess.STDOUT, cwd=HERE.parent,
            ))  # fmt: skip
    try:
        for child in children:
            child.wait()
    finally:  # (interrupted: no child runs on)
        for child in children:
            child.kill()
    passed, collected = 0, set()
    for child, log in zip(children, logs, strict=True):
        output = log.read_text()
        print(output[-3000:])
        assert child.returncode == 0, output[-25000:]
        assert " skipped" not in output, output[-3000:]
        counts = re.search(r"(\d+) passed, (\d+) deselected", output)
        assert counts, output[-3000:]
        passed += int(counts[1])
        collected.add(int(counts[1]) + int(counts[2]))
    assert len(collected) == 1 and passed == collected.pop()  # the shards ran every test


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
