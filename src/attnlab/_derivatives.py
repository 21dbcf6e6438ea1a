"""First derivatives only: attnlab's kernels' backwards, and what a second derivative raises.

attnlab's kernels (the blocked CPU kernel, the weights blocks, the chunked additive scores,
the Triton kernels) compute gradients without recording a graph: their buffers are filled in
place. A second derivative through them (``torch.autograd.grad(..., create_graph=True)`` and a
backward of its result: a gradient penalty, MAML) cannot be taken, and must raise rather than
give 0. torch's ``once_differentiable`` raises "trying to differentiate twice", which names
neither the kernel nor the way out; :func:`first_derivatives_only` raises this module's
:data:`SECOND_DERIVATIVE` instead, and also when the incoming gradients need none (torch's
then returns gradients that silently carry no graph).

The way out: ``torch.nn.attention.sdpa_kernel(SDPBackend.MATH)`` (torch's math backend only)
around the call, or ``torch.func`` (``grad`` of ``grad``): attnlab then takes its readable
formulas, torch ops that autograd differentiates any number of times
(:func:`attnlab.functional._transforms.math_backend_only`).
"""

from __future__ import annotations

import functools

import torch

SECOND_DERIVATIVE = (
    "{what} computes first derivatives only (its backward fills buffers in place, with no "
    "graph), so a second derivative (create_graph=True) cannot pass through it. For one, run "
    "the attention call under `with torch.nn.attention.sdpa_kernel(SDPBackend.MATH):` or "
    "differentiate with torch.func.grad twice: attnlab then takes its readable formula, which "
    "autograd differentiates again."
)


class _NoGraph(torch.autograd.Function):
    """Identity on gradients computed without a graph; its backward raises ``message``.

    ``anchor`` (a 0-d tensor that requires grad) makes the outputs require grad whatever the
    gradients do, so that differentiating them reaches this backward."""

    @staticmethod
    def forward(ctx, message, anchor, *grads):
        ctx.message = message
        return tuple(g.view_as(g) for g in grads)

    @staticmethod
    def backward(ctx, *_):
        raise RuntimeError(ctx.message)


def first_derivatives_only(what: str):
    """Decorates an ``autograd.Function``'s ``backward``: run it without a graph (as torch's
    ``once_differentiable``), and when autograd records one (``create_graph=True``), mark its
    gradients so that differentiating them raises :data:`SECOND_DERIVATIVE` for ``what``."""

    def decorate(backward):
        @functools.wraps(backward)
        def wrapper(ctx, *grads):
            with torch.no_grad():
                out = backward(ctx, *grads)
            if not torch.is_grad_enabled():  # (create_graph=False: the common case)
                return out
            if torch._C._functorch.peek_interpreter_stack() is not None:
                return out  # torch.func records every backward; nested grads go readable
            outs = out if isinstance(out, tuple) else (out,)
            where = [i for i, g in enumerate(outs) if isinstance(g, torch.Tensor)]
            if not where:
                return out
            anchor = torch.zeros((), requires_grad=True)
            message = SECOND_DERIVATIVE.format(what=what)
            marked = _NoGraph.apply(message, anchor, *(outs[i] for i in where))
            outs = list(outs)
            for i, g in zip(where, marked, strict=True):
                outs[i] = g
            return tuple(outs) if isinstance(out, tuple) else outs[0]

        return wrapper

    return decorate
