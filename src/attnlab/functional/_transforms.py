"""Which ``torch.func`` transforms (vmap, grad, jvp, functionalize) are running this call.

attnlab's own paths write results into fresh tensors in place, read values on the host (the
NaN rule's screen) and define only a backward. Under ``vmap`` none of that can be batched, and
forward-mode AD (``jvp``, or ``torch.autograd.forward_ad``) needs a rule they do not have (nor
does torch's fused CPU kernel); under ``grad`` the in-place writes of the weights path cannot
take the transform's wrapped tensors. The dispatch asks here and takes torch's ops there (the
readable formulas, or torch's fused kernel where it serves), which every transform takes. When
no transform is active the question costs ~0.1 us.
"""

from __future__ import annotations

import torch
import torch.autograd.forward_ad as _forward_ad
from torch._C._functorch import peek_interpreter_stack as _peek

_NONE: frozenset[str] = frozenset()
_NAMES = {
    torch._C._functorch.TransformType.Vmap: "vmap",
    torch._C._functorch.TransformType.Grad: "grad",
    torch._C._functorch.TransformType.Jvp: "jvp",
    torch._C._functorch.TransformType.Functionalize: "functionalize",
}


def active() -> frozenset[str]:
    """The transforms around this call: names of ``torch.func``'s, ``"jvp"`` inside a
    ``torch.autograd.forward_ad.dual_level``, and ``"grad of grad"`` when two or more ``grad``
    levels nest (empty outside them, and in traced graphs)."""
    if _peek() is None and _forward_ad._current_level < 0:  # (the common case first: ~0.1 us)
        return _NONE
    if torch.compiler.is_compiling():  # (dynamo cannot read the interpreter stack)
        return _NONE
    names = {"jvp"} if _forward_ad._current_level >= 0 else set()
    if _peek() is not None:
        kinds = [_NAMES.get(i.key(), "other") for i in torch._C._functorch.get_interpreter_stack()]
        names |= set(kinds)
        if kinds.count("grad") > 1:
            names.add("grad of grad")
    return frozenset(names)


def readable_only(names: frozenset[str] | None = None) -> str | None:
    """The transform under which only torch's ops give the right answer, else None: ``"vmap"``
    (attnlab's kernels cannot be batched, and torch's fused CPU kernel has no batching rule:
    vmap would loop over it), ``"jvp"`` (forward-mode AD) or ``"grad of grad"`` (the kernels'
    backward is once-differentiable, and a nested ``grad`` would give 0, not an error).
    ``names``: :func:`active`'s answer, when the caller has it already."""
    names = active() if names is None else names
    for name in ("vmap", "jvp", "grad of grad"):
        if name in names:
            return name
    return None


def math_backend_only() -> bool:
    """Whether torch's ``sdpa_kernel`` context allows its math backend only (its flash,
    memory-efficient and cuDNN backends off): the way to ask torch for the readable,
    twice-differentiable formula, which attnlab's dispatch then takes too, for
    ``scaled_dot_product_attention`` and the additive scores (:mod:`attnlab._derivatives`).
    Not read in traced graphs (dynamo cannot read the flags): there, as without the context.
    ~0.4 us outside it."""
    b = torch.backends.cuda  # (the flags are global: torch's CPU kernels read them too)
    return (
        not torch.compiler.is_compiling()
        and not b.flash_sdp_enabled()
        and not b.mem_efficient_sdp_enabled()
        and not b.cudnn_sdp_enabled()
        and b.math_sdp_enabled()
    )
