"""attnlab's own kernels, each behind one Python entry point that the dispatch can call.

* :mod:`attnlab.kernels.cpu_flash` -- blocked ("flash") attention on CPU, forward and backward,
  with dropout inside the blocks, in C++ (``cpu_flash.cpp``, built at first use by
  :mod:`~attnlab.kernels.cpu_flash_native`) or, for float64 and where that does not build, in
  torch ops: ``flash_attention(q, k, v, mask, alignment,
  scale, dropout_p, generator=None)``, ``supports(q, k, v, mask, dropout_p)`` (None, or why
  not) and ``describe(q, k, v, alignment)`` (the tiling in one line, for ``explain()``);
  ``forward_with_weights`` / ``backward_with_weights`` (``weights_unfit``: None, or why not)
  serve weights on demand, the blocks writing each block's weights as they make them.
  :mod:`attnlab.kernels.choice` -- ``training(dtype, E, Ev, L, S)``: whether it or torch's
  kernel trains attention faster on this CPU at this length (16-bit: measured once per process
  and length class, or set by ``ATTNLAB_CPU_TRAINING_KERNEL``, which also sends float32 there:
  ``chooses(dtype)``).

* :mod:`attnlab.kernels.few_rows` -- ``linear(module, x)``: a linear layer over a few rows on
  CPU (a decode step) as ``(W x^T)^T`` where that is measured faster than ``F.linear``.

* Triton kernels (GPU; on CPU tensors through Triton's interpreter under ``TRITON_INTERPRET=1``,
  see :mod:`attnlab.kernels._triton`), imported only when they run:
  :mod:`~attnlab.kernels.triton_attention` (forward with the row log-sum-exp; weights from it),
  :mod:`~attnlab.kernels.triton_backward` (its backward), :mod:`~attnlab.kernels.triton_decode`
  (split-key decoding with weights), :mod:`~attnlab.kernels.triton_additive` (fused additive
  attention, forward and backward). The dispatch picks them in
  :mod:`attnlab.functional._triton` and :mod:`attnlab.functional.additive`.

* :mod:`attnlab.kernels.flex_padding` -- key padding on CUDA through torch's FlexAttention,
  with a block mask built on the device from each batch row's key range (measured faster than
  the Triton kernels and SDPA with the dense mask there).

The kernels depend on nothing above them (no ``attnlab.functional`` import): the dispatch in
:mod:`attnlab.functional.sdpa` checks inputs and applies the NaN policy around them.
"""

from attnlab.kernels.choice import training
from attnlab.kernels.cpu_flash import describe, flash_attention, supports

__all__ = ["describe", "flash_attention", "supports", "training"]
