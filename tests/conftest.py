"""Shared test settings and helpers.

Tolerances: float64 results are compared with the float64 NumPy oracle at 1e-12 (rounding of a
few dozen operations is ~1e-15). 16-bit results are held to a *control*: the same computation
done naively in the same dtype; the implementation's error against the oracle may be at most
twice the control's (the FlashAttention test rule).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile(
    "default", deadline=None, max_examples=40, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("ci", parent=settings.get_profile("default"), derandomize=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

F64_ATOL = 1e-12

# tests/triton/ runs attnlab's Triton kernels through Triton's interpreter, which must be switched
# on (TRITON_INTERPRET=1) before attnlab is imported: tests/test_triton_interpreter.py runs that
# folder in a child pytest with the variable set; this process leaves it alone.
if os.environ.get("TRITON_INTERPRET") != "1":
    collect_ignore = ["triton"]


def pytest_addoption(parser):
    parser.addoption(
        "--shard",
        default=None,
        help="I/N: run every N-th collected test from the I-th (0-based), so that N processes "
        "share a folder's tests (tests/test_triton_interpreter.py runs tests/triton/ so)",
    )


def pytest_collection_modifyitems(config, items):
    shard = config.getoption("--shard")
    if shard is None:
        return
    index, _, count = shard.partition("/")
    if not (index.isdigit() and count.isdigit() and int(index) < int(count)):
        raise pytest.UsageError(f"--shard: expected I/N with 0 <= I < N, got {shard!r}")
    index, count = int(index), int(count)
    left = [item for i, item in enumerate(items) if i % count != index]
    config.hook.pytest_deselected(items=left)
    items[:] = items[index::count]


def check_under_cpu_autocast(layer, *inputs) -> None:
    """``layer(*inputs)`` under bf16 CPU autocast trains (finite gradients for every
    parameter) and stays within bf16 rounding of the float32 call (3e-2 at unit scale)."""
    want = layer(*inputs)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(*inputs)
    out.float().sum().backward()
    assert all(p.grad is not None and p.grad.isfinite().all() for p in layer.parameters())
    torch.testing.assert_close(out.float(), want, atol=3e-2, rtol=0)


def np64(t):
    """A tensor (or None) as a float64/bool NumPy array for the oracle."""
    if t is None:
        return None
    t = t.detach().as_subclass(torch.Tensor)
    return t.numpy() if t.dtype == torch.bool else t.double().numpy()


def assert_close_to_oracle(actual: torch.Tensor, expected: np.ndarray, atol=F64_ATOL) -> None:
    got = actual.detach().double().numpy()
    assert got.shape == expected.shape, (got.shape, expected.shape)
    np.testing.assert_allclose(got, expected, rtol=0, atol=atol)


def naive_sdpa(q, k, v, mask=None, scale=None):
    """The control: the textbook formula in the inputs' own dtype, GQA by repeating heads."""
    if q.dim() == 4 and k.shape[1] != q.shape[1]:
        g = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    s = (q @ k.transpose(-2, -1)) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask
    w = torch.softmax(s, -1).nan_to_num(0.0)
    return w @ v


def qkv(B=2, H=4, Hkv=2, L=5, S=7, E=8, Ev=8, dtype=torch.float32, seed=0):
    """Random (B, H, L, E) query, (B, Hkv, S, E) key, (B, Hkv, S, Ev) value."""
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(B, H, L, E, generator=g, dtype=dtype),
        torch.randn(B, Hkv, S, E, generator=g, dtype=dtype),
        torch.randn(B, Hkv, S, Ev, generator=g, dtype=dtype),
    )


def copy_of_run(run_dir, tmp_path):
    """A copy of a trained run folder, for a test that changes or damages it (the module's
    trained run stays as it was for the next test)."""
    import shutil

    out = tmp_path / "run"
    shutil.copytree(run_dir, out)
    return out


def run_command(module, argv: list[str]) -> int:
    """Parse and run one command module (``attnlab.translate.cmd_*``) the way ``attnlab.cli``
    does."""
    import argparse

    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    return module.main(parser.parse_args(argv))


class Graphs:
    """A torch.compile backend that keeps the graphs it is given (then runs aot_eager)."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        from torch._dynamo.backends.registry import lookup_backend

        self.graphs.append(gm)
        return lookup_backend("aot_eager")(gm, example_inputs)

    def targets(self):
        return {str(n.target) for gm in self.graphs for n in gm.graph.nodes}


# The reason of a skip for a CPU feature this machine lacks (oneDNN's brgemm, native bfloat16
# products): the code such a test covers cannot run here. Only these skips pass under
# ATTNLAB_NO_SKIPS; CI machines with and without AVX-512 both run the suite.
CPU_LACKS = "this CPU lacks it: "


def skip_on_this_cpu(reason: str) -> None:
    """Skip the test: this CPU lacks a feature it needs (``reason`` says which)."""
    pytest.skip(CPU_LACKS + reason)


def skip_if_this_cpu_lacks(condition: bool, reason: str):
    """A skipif mark for a CPU feature (see :data:`CPU_LACKS`)."""
    return pytest.mark.skipif(condition, reason=CPU_LACKS + reason)


def pytest_sessionfinish(session, exitstatus):
    """With ATTNLAB_NO_SKIPS=1 (set by CI) a skipped test fails the run: in CI every optional
    dependency is installed, so a skip can only mean something is missing; except a skip for a
    CPU feature the machine lacks (:data:`CPU_LACKS`), which is counted and said."""
    if os.environ.get("ATTNLAB_NO_SKIPS") != "1":
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = reporter.stats.get("skipped", []) if reporter else []
    missing = [r for r in skipped if CPU_LACKS not in _skip_reason(r)]
    if len(missing) < len(skipped):
        reporter.write_line(
            f"ATTNLAB_NO_SKIPS=1: {len(skipped) - len(missing)} test(s) skipped for CPU features "
            "this machine lacks (allowed)"
        )
    if missing:
        reporter.write_line(f"ATTNLAB_NO_SKIPS=1: {len(missing)} test(s) skipped", red=True)
        session.exitstatus = 1


def _skip_reason(report) -> str:
    """A skip report's reason (its longrepr is (path, line, "Skipped: reason"))."""
    longrepr = report.longrepr
    return longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)


@pytest.fixture
def rng():
    return torch.Generator().manual_seed(1234)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models: one thread is faster, and immune to a busy machine's stalls."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def make_mask(kind, B, H, L, S, seed=1):
    """None, a bool mask (B, 1, L, S) with a dead row, or a float bias (1, H, L, S) with -inf."""
    g = torch.Generator().manual_seed(seed)
    if kind == "bool":
        m = torch.rand(B, 1, L, S, generator=g) > 0.3
        m[0, 0, L // 2] = False  # a row with no attendable key
        return m
    if kind == "float":
        bias = torch.randn(1, H, L, S, generator=g, dtype=torch.float64)
        return bias.masked_fill(torch.rand(1, H, L, S, generator=g) > 0.7, float("-inf"))
    return None
