"""Training defaults that use a GPU: batches sized from the device's memory, bf16 autocast.

The translator's CPU defaults (1,536-2,048 tokens a batch) keep a large GPU mostly idle. On
CUDA, unless ``--max-tokens`` is given, ``attnlab train`` sizes its batches by measurement
(``--max-tokens auto``): one forward+backward of a probe batch, the peak memory it took, and
the batch scaled to a share of the device's free memory. And with ``--precision auto`` it
trains under ``torch.autocast(bfloat16)`` where the GPU supports it (weights, optimizer state
and the loss stay float32). On CPU both keep today's defaults: a fixed batch, float32 (this
machine class has no bf16 matrix units; bf16 is there on request).
"""

from __future__ import annotations

import contextlib

import torch

PRECISIONS = ("auto", "fp32", "bf16")
MEMORY_SHARE = 0.6  # of the free memory, for activations: the rest absorbs long batches
MAX_AUTO_TOKENS = 65536  # beyond this a step is long enough; more gains little


def resolve_precision(requested: str | None, device: str) -> str:
    """``"bf16"`` or ``"fp32"`` for a ``--precision`` of auto / fp32 / bf16 on ``device``."""
    requested = requested or "auto"
    if requested not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}; got {requested!r}")
    if requested != "auto":
        return requested
    cuda = str(device).startswith("cuda")
    return "bf16" if cuda and torch.cuda.is_bf16_supported() else "fp32"


def autocast(device: torch.device | str, precision: str):
    """The context a training step's forward and loss run in."""
    if precision != "bf16":
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=torch.bfloat16)


def scaled_tokens(probe_tokens: int, probe_peak: int, free: int, base: int) -> int:
    """Tokens per batch so that activations take ``MEMORY_SHARE`` of ``free`` bytes, given a
    probe batch of ``probe_tokens`` that took ``probe_peak`` bytes at its peak (activation
    memory grows about linearly in tokens at fixed sentence lengths). Never below ``base``
    (the CPU default), never above ``MAX_AUTO_TOKENS``; a multiple of 256."""
    per_token = max(1, probe_peak) / max(1, probe_tokens)
    tokens = int(MEMORY_SHARE * free / per_token) // 256 * 256
    return max(base, min(MAX_AUTO_TOKENS, tokens))


def auto_max_tokens(step, probe_tokens: int, device: str, base: int) -> tuple[int, str]:
    """``(max_tokens, how)`` for ``--max-tokens auto``.

    ``step()`` runs one forward+backward of a probe batch of ``probe_tokens`` tokens on
    ``device``. On CUDA its peak memory sizes the batch (:func:`scaled_tokens`); elsewhere the
    answer is ``base``, the model's default.
    """
    if not str(device).startswith("cuda"):
        return base, f"{base} (the CPU default)"
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    step()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    free, total = torch.cuda.mem_get_info(device)
    tokens = scaled_tokens(probe_tokens, peak, free, base)
    how = (
        f"{tokens} (a probe batch of {probe_tokens} tokens peaked at {peak / 2**20:.0f} MiB; "
        f"{free / 2**30:.1f} of {total / 2**30:.1f} GiB free)"
    )
    return tokens, how
