"""PyTorch's and Hugging Face's argument names that attnlab layers spell differently.

attnlab layers read every bool mask as **True = may attend** and padding as ``key_mask``
(B, S) with **True = real token**. ``torch.nn.MultiheadAttention`` uses ``attn_mask`` and
``key_padding_mask`` with the opposite meaning (True = masked), so code ported from it would run
and be silently wrong. attnlab layers therefore do not take torch's names at all: passing one
raises a ``TypeError`` that names attnlab's spelling -- or points to
:class:`attnlab.compat.MultiheadAttention`, the drop-in that keeps torch's names *and* meanings.
"""

from __future__ import annotations

COMPAT = "attnlab.compat.MultiheadAttention (torch's signature, names and mask meanings)"

# torch / Hugging Face name -> what to write in attnlab instead
FORWARD = {
    "key_padding_mask": (
        "key_mask=: (B, S) bool, True = real token. torch's key_padding_mask means True = "
        "padding: pass key_mask=~key_padding_mask"
    ),
    "attn_mask": (
        "mask=: bool True = may attend (torch's nn.MultiheadAttention reads True = masked: pass "
        "mask=~attn_mask), or a float bias added to the scores (unchanged)"
    ),
    "attention_mask": "key_mask= ((B, S), True = real token) or mask= ((.., L, S) bool/bias)",
    "need_weights": "return_weights=True (the weights are returned only when asked)",
    "average_attn_weights": "average_weights=True (with return_weights=True)",
    "output_attentions": "return_weights=True",
    "past_key_value": "cache= (an attnlab.cache cache)",
    "past_key_values": "cache= (an attnlab.cache cache)",
}
INIT = {
    "embed_dim": "d_model=",
    "dropout": "attn_dropout= (dropout on the weights) and/or out_dropout=",
    "batch_first": "nothing: attnlab layers always take batch-first (B, L, D) inputs",
    "add_bias_kv": f"nothing: not supported by this layer; use {COMPAT}",
    "add_zero_attn": f"nothing: not supported by this layer; use {COMPAT}",
    "num_attention_heads": "num_heads=",
    "num_key_value_heads": "num_kv_heads=",
    "hidden_size": "d_model=",
}


def refuse(where: str, names: dict, table: dict[str, str]) -> None:
    """Raise TypeError for keyword arguments ``names`` that ``where`` does not take."""
    if not names:
        return
    name = next(iter(names))
    fix = table.get(name)
    if fix is None:
        raise TypeError(f"{where} got an unexpected keyword argument {name!r}.")
    raise TypeError(
        f"{where} does not take {name!r} (a PyTorch / Hugging Face name). Fix: use {fix}. "
        f"To keep torch's interface as it is, use {COMPAT}."
    )
