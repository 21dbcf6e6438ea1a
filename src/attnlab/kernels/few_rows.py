"""A linear layer applied to a few rows on CPU (decoding): ``(W x^T)^T`` where it is faster.

A decode step multiplies a few rows (one new token per sequence) by every weight matrix of the
model, so its speed is the rate at which the weights stream from memory. ``F.linear`` computes
``x W^T``; with a few rows the BLAS may pack all of ``W`` for each call and stream it more than
once. The same product taken weight-major, ``W x^T`` (each weight row meets the few columns of
``x^T``), reads it once. The weight-major time over ``F.linear``'s, each matrix read from
memory (as :func:`measure` times them), on an AVX2 AMD EPYC (MKL 2024.2, 2 threads, float32):

==========================  ==========  ==========  ==========
W (out, in) of SmolLM2      1 row       2-4 rows    8 rows
==========================  ==========  ==========  ==========
lm_head (49152, 576)        x0.98-1.10  x0.30-0.33  x0.56
MLP (1536, 576), (576, ..)  x1.02-1.11  x0.51-0.70  x0.96-1.09
q, o (576, 576)             x0.97-1.00  x0.52-0.60  x1.01
k, v (192, 576)             x1.08-1.11  x0.54-0.69  x1.15
==========================  ==========  ==========  ==========

and a SmolLM2-shaped model (random weights) decoded greedily at batch 4 with a static cache,
eager, 1.5x faster (17.6 -> 26.5 tokens/s, Hugging Face's generate 17.6; the same tokens).
The two orders add the same products in another order: results differ in rounding only (in
float32 with 4,096 inputs per output, up to ~3x ``F.linear``'s error against float64; 16-bit
results were the same).

Which is faster depends on the CPU, its BLAS, the shape, the row count, the threads and whether
the matrix is in cache (there the k and v projections were 1.3x slower weight-major), so it is
measured, not guessed: once per
process for each (dtype, out, in, row class, threads) (rows rounded up to a power of two: 2, 4,
8, 16), both orders over copies of a matrix of that shape read from memory (:func:`measure`),
round-robin, best of :data:`ROUNDS`; weight-major serves only where it took at most
:data:`MARGIN` of ``F.linear``'s time (so that noise does not flip it between processes). A
probe reads 1 GiB with at most :data:`COLD_BYTES` of memory (0.2-0.5 s on 2 cores), once per
shape and row class. Not measured, ``F.linear``: one row (both orders are then a matrix-vector
product: x0.97-1.11 above) and matrices under :data:`SMALL_BYTES` (the call, not the bytes,
costs).

It applies only where nothing else could notice: plain CPU tensors (no subclass) with 2 to
:data:`FEW_ROWS` rows, of the sizes the layer takes; no autograd recording (training, bias-only
too, keeps ``F.linear``, so a resumed run repeats an uninterrupted one bit for bit), no
``torch.func`` transform or forward-mode AD; no autocast, no torch function or dispatch mode
(FakeTensorMode, make_fx, a default device), no ``torch.jit.trace``; a module that is exactly
``nn.Linear``, with no hooks and its own ``forward``: a replaced or wrapped one (LoRA,
quantized, parametrized, accelerate's hooks) is called as itself; and, inside torch.compile, a
graph of fixed sizes (:func:`fixed_sizes`: the compiled decode step,
:class:`attnlab.models.DecodeStep`, with ``dynamic=False``, its default).

``ATTNLAB_CPU_FEW_ROWS_PRODUCT``: ``measure`` (the default), ``linear`` (always ``F.linear``:
results that repeat bit for bit across processes and machines with the same BLAS) or
``weight-major``.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import threading
import time

import torch
import torch.autograd.forward_ad as _forward_ad
import torch.nn.functional as F
from torch import nn
from torch._C._functorch import peek_interpreter_stack as _peek_transform
from torch.overrides import _get_current_function_mode_stack
from torch.utils._python_dispatch import _get_current_dispatch_mode

from attnlab.kernels.choice import env_setting

ENV = "ATTNLAB_CPU_FEW_ROWS_PRODUCT"
SETTINGS = ("measure", "linear", "weight-major")
FEW_ROWS = 16  # at most this many rows (tokens x sequences) take the choice (one does not)
MARGIN = 0.9  # weight-major serves where it took at most this fraction of F.linear's time
ROUNDS = 3  # timed rounds of each order after one warm-up round; the best of each is compared
COLD_BYTES = 128 * 2**20  # each round of the probe reads this much matrix (past the caches)
SMALL_BYTES = 2**18  # matrices under this take F.linear unmeasured (calls, not bytes, cost)


def linear(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``module(x)`` for a linear layer ``module`` and x (..., in) -> (..., out), weight-major
    where that is measured faster (see the module's docstring), else as the module computes it.
    """
    if type(module) is not nn.Linear:
        return module(x)
    if torch.compiler.is_compiling() and not traced_with_fixed_sizes():
        return module(x)  # (before the row count: a traced branch on it would specialise it)
    if x.dim() < 1 or not x.shape[-1]:
        return module(x)
    rows = x.numel() // x.shape[-1]
    if not 1 < rows <= FEW_ROWS:  # (one row: both orders are a matrix-vector product)
        return module(x)  # (first, cheap: a prefill's or training's call checks nothing more)
    if not _plain(module, x):
        return module(x)
    out_features, in_features = module.weight.shape
    if not weight_major(x.dtype, out_features, in_features, rows):
        return module(x)
    y = _weight_major_product(x.reshape(rows, in_features), module.weight, module.bias)
    return y.view(*x.shape[:-1], out_features)


def _plain(module: nn.Module, x: torch.Tensor) -> bool:
    """Whether ``module(x)`` is ``F.linear`` of plain CPU tensors of matching sizes, and nothing
    would see how it is computed. (For an ``nn.Linear`` and x of 1+ dims, as :func:`linear`
    has checked.)"""
    if "forward" in module.__dict__:  # (replaced on the instance: accelerate's hooks)
        return False
    if torch.jit.is_tracing():  # (a trace keeps the ranks and sizes it saw)
        return False
    if not torch.compiler.is_compiling() and (
        _peek_transform() is not None or _forward_ad._current_level >= 0
    ):  # (dynamo cannot read the interpreter stack: a graph's sizes decide there, below)
        return False  # (torch.func transforms, forward-mode AD: autograd that no flag shows)
    if any(getattr(module, name) for name in _HOOKS):
        return False
    if any(getattr(nn.modules.module, name, None) for name in _GLOBAL_HOOKS):
        return False
    weight, bias = module.weight, module.bias
    if not all(_plain_tensor(t) for t in (x, weight, bias) if t is not None):
        return False  # (a subclass may override F.linear: torchao's, a __torch_function__'s)
    if x.dtype != weight.dtype or weight.dim() != 2 or weight.numel() == 0:
        return False  # (nn.Linear's own error, or its answer)
    if x.shape[-1] != weight.shape[1] or (bias is not None and bias.shape != weight.shape[:1]):
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x, weight, bias) if t is not None):
        return False
    if torch.is_autocast_enabled("cpu"):  # (the layer's dtype is not the product's there)
        return False
    if torch.compiler.is_compiling():  # (the choice is a constant of the graph: plain sizes)
        return traced_with_fixed_sizes()
    return not _modes_active()


def _plain_tensor(t: torch.Tensor) -> bool:
    return type(t) in (torch.Tensor, nn.Parameter) and t.device.type == "cpu"


def _modes_active() -> bool:
    """Whether a torch function or dispatch mode is on (FakeTensorMode, make_fx, a default
    device, a FLOP counter): it would see the order, and a probe run there would time nothing
    real."""
    return bool(_get_current_function_mode_stack()) or _get_current_dispatch_mode() is not None


_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_GLOBAL_HOOKS = (
    "_global_forward_hooks",
    "_global_forward_pre_hooks",
    "_global_backward_hooks",
    "_global_backward_pre_hooks",
    "_global_forward_hooks_always_called",
)


def _weight_major_product(x2, weight, bias):
    """(rows, in) -> (rows, out): ``(W x^T)^T + b``, contiguous."""
    if bias is None:
        return torch.mm(weight, x2.t()).t().contiguous()
    return torch.addmm(bias.unsqueeze(1), weight, x2.t()).t().contiguous()


_FIXED_SIZES = contextvars.ContextVar("attnlab_few_rows_fixed_sizes", default=False)


@contextlib.contextmanager
def fixed_sizes():
    """Around a call of a function compiled with ``dynamic=False``: its traced calls take the
    measured choice (a constant of the graph, for the sizes the graph is specialised to).

    Elsewhere a traced call keeps ``F.linear``: with symbolic sizes the choice cannot be a
    constant, and a traced branch on the row count would specialise the graph to it (dynamo
    shows a symbolic size to Python as a plain int, so the code cannot tell by itself)."""
    token = _FIXED_SIZES.set(True)
    try:
        yield
    finally:
        _FIXED_SIZES.reset(token)


def traced_with_fixed_sizes() -> bool:
    """Whether a call traced now is inside :func:`fixed_sizes` (read when traced, a constant)."""
    return _FIXED_SIZES.get()


# torch.compiler.assume_constant_result(traced_with_fixed_sizes), without importing torch._dynamo
traced_with_fixed_sizes._dynamo_marked_constant = True


def weight_major(dtype: torch.dtype, out_features: int, in_features: int, rows: int) -> bool:
    """Whether a linear layer of this shape takes the weight-major product for ``rows`` rows:
    set by ``ATTNLAB_CPU_FEW_ROWS_PRODUCT``, or measured once per process and thread count for
    the row count's class (rounded up to a power of two; the probe runs when torch.compile
    traces a call too, and the answer is a constant of the graph)."""
    setting = env_setting(ENV, SETTINGS)
    if setting != "measure":
        return setting == "weight-major"
    if out_features * in_features * dtype.itemsize < SMALL_BYTES or _modes_active():
        return False
    rows_class = 1 << max(0, rows - 1).bit_length()
    with _probe_lock:  # (two threads' first calls would time each other)
        ratio = measure(dtype, out_features, in_features, rows_class, torch.get_num_threads())
    return ratio <= MARGIN


_probe_lock = threading.Lock()


# torch.compiler.assume_constant_result(weight_major), without importing torch._dynamo
weight_major._dynamo_marked_constant = True


@functools.cache
def measure(dtype: torch.dtype, out_features: int, in_features: int, rows: int,
            threads: int, rounds: int = ROUNDS) -> float:  # fmt: skip
    """The weight-major product's time over ``F.linear``'s, best of ``rounds`` each, for an
    (out, in) matrix read from memory, as a decode step reads each layer's (``threads``: the
    caller's count, in the key).

    One matrix multiplied again and again would sit in the CPU's caches, where the BLAS ranks
    the two orders otherwise: each round runs over copies of it that fill
    :data:`COLD_BYTES`, so that each product finds its matrix in memory. A matrix larger than
    that is probed by its first rows that fit: memory and time stay bounded."""
    row_bytes = in_features * dtype.itemsize
    out_probed = max(1, min(out_features, COLD_BYTES // max(row_bytes, 1)))
    copies = max(1, COLD_BYTES // max(out_probed * row_bytes, 1))
    # (plain CPU tensors, whatever the default device; the values do not change the time, and
    # a constant fill is cheaper than random numbers)
    weights = torch.full((copies, out_probed, in_features), 0.01, dtype=dtype, device="cpu")
    x = torch.full((rows, in_features), 0.5, dtype=dtype, device="cpu")
    orders = {
        "linear": lambda w: F.linear(x, w),
        "weight-major": lambda w: _weight_major_product(x, w, None),
    }
    best = dict.fromkeys(orders, float("inf"))
    with torch.no_grad():
        for r in range(rounds + 1):  # round 0 warms both up and is not counted
            for name, product in orders.items():
                start = time.perf_counter()
                for w in weights:
                    product(w)
                if r:
                    best[name] = min(best[name], time.perf_counter() - start)
    return best["weight-major"] / best["linear"]
