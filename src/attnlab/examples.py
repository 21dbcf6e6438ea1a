"""The worked examples of the tutorials attnlab grew from, reproduced through its public API.

``attnlab examples`` prints them; the tests check every printed number against the tutorials.
Each example returns its results (so they can be checked) and a text report.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from attnlab import functional as AF
from attnlab import masks, reference

# "Write your first Attention mechanism": five tokens, six features each (the tutorial's text
# says five dimensions, but its tensor has six columns).
FIVE_TOKENS = ["Write", "your", "first", "Attention", "mechanism"]
FIVE_TOKEN_EMBEDDINGS = [
    [0.172, 0.295, 0.618, 0.459, 0.818, 0.071],
    [0.265, 0.563, 0.718, 0.323, 0.126, 0.235],
    [0.206, 0.333, 0.044, 0.862, 0.152, 0.594],
    [0.300, 0.505, 0.727, 0.495, 0.898, 0.954],
    [0.095, 0.809, 0.596, 0.110, 0.447, 0.418],
]


def _fmt(x) -> str:
    return np.array2string(np.asarray(x, dtype=np.float64), precision=4, suppress_small=True)


def five_tokens() -> tuple[dict, str]:
    """Unscaled dot-product self-attention of five tokens with themselves (no projections)."""
    x = torch.tensor(FIVE_TOKEN_EMBEDDINGS)  # (L, E) = (5, 6)
    scores = AF.dot_product_scores(x, x)  # (5, 5): s_ij = x_i . x_j
    weights = AF.masked_softmax(scores)  # rows sum to 1
    context = AF.attention(scores, x)  # (5, 6): c_i = sum_j w_ij x_j
    assert context.shape == x.shape
    # what the tutorial printed as context vectors (see the note below)
    transposed = weights.T @ x  # (5, 6): columns of the weights as mixing coefficients
    result = {"scores": scores, "weights": weights, "context": context, "transposed": transposed}
    text = "\n".join(
        [
            "Tokens: " + " ".join(FIVE_TOKENS) + f"  -> embeddings {tuple(x.shape)}",
            "attention scores  x x^T:",
            _fmt(scores),
            "attention weights softmax(scores) (rows sum to 1):",
            _fmt(weights),
            "row sums: " + _fmt(weights.sum(-1)),
            "context vectors  weights @ x  (shape (5, 6), like the inputs):",
            _fmt(context),
            "(The tutorial prints other context vectors, e.g. 0.1780 for the first entry: its",
            " cell ran before the weights' cell shown (In [66] < In [100]) and they are",
            " weights.T @ inputs, each query mixing by a *column* of weights, normalised over",
            " the queries (softmax(dim=0), the scores being symmetric): "
            f"{float(result['transposed'][0, 0]):.4f}.",
            " Its own formula, c_i = sum_j w_ij x_j with rows that sum to 1, gives "
            f"0.2368*0.172 + 0.1495*0.265 + ... = {float(context[0, 0]):.4f}.)",
        ]
    )
    return result, text


def four_words() -> tuple[dict, str]:
    """Scaled dot-product attention of four one-hot-ish words, seeded integer projections."""
    words = np.array([[1, 0, 0], [0, 1, 0], [1, 1, 0], [0, 0, 1]], dtype=np.float64)  # (4, 3)
    rng = np.random.RandomState(42)  # same stream as np.random.seed(42); np.random.randint
    W_Q, W_K, W_V = (rng.randint(3, size=(3, 3)).astype(np.float64) for _ in range(3))
    Q, K, V = words @ W_Q, words @ W_K, words @ W_V  # (4, 3) each
    scores = reference.dot_product_scores(Q, K)  # (4, 4)
    out_np, weights_np = reference.scaled_dot_product_attention(Q, K, V, return_weights=True)
    out_t, weights_t = AF.scaled_dot_product_attention(
        *(torch.from_numpy(a) for a in (Q, K, V)), return_weights=True
    )
    result = {
        "scores": scores,
        "weights": weights_np,
        "attention": out_np,
        "attention_torch": out_t.numpy(),
        "weights_torch": weights_t.numpy(),
    }
    text = "\n".join(
        [
            "W_Q, W_K, W_V drawn with NumPy seed 42 (integers 0..2)",
            "scores of word 1 against all keys: " + str(scores[0].astype(int)),
            "weights of word 1 (scaled by 1/sqrt(3)): "
            + np.array2string(weights_np[0], precision=8),
            "attention output of all four words (NumPy oracle):",
            np.array2string(out_np, precision=8),
            "same through attnlab.functional (torch, float64): max difference "
            + f"{np.abs(out_t.numpy() - out_np).max():.1e}",
        ]
    )
    return result, text


def seed002_shapes() -> tuple[dict, str]:
    """The shape walkthrough of scaled dot-product, additive and multi-head self-attention."""
    g = torch.Generator().manual_seed(0)
    B, L, S, d_k, d_v, d_attn = 2, 3, 4, 5, 6, 10
    Q, K, V = (torch.randn(B, n, d, generator=g) for n, d in ((L, d_k), (S, d_k), (S, d_v)))
    out, w = AF.scaled_dot_product_attention(Q, K, V, return_weights=True)
    w_q, w_k = torch.randn(d_attn, d_k, generator=g), torch.randn(d_attn, d_k, generator=g)
    w_s = torch.randn(d_attn, generator=g)
    add_out, add_w = AF.additive_attention(Q, K, V, w_q, w_k, w_s, return_weights=True)
    # Multi-head self-attention: (B, L, D) -> (B, H, L, D/H) heads -> (B, L, D)
    D, H, L2 = 16, 4, 5
    x = torch.randn(B, L2, D, generator=g)
    heads = x.view(B, L2, H, D // H).transpose(1, 2)  # (B, L, D) -> (B, H, L, D/H)
    mh_out, mh_w = AF.scaled_dot_product_attention(heads, heads, heads, return_weights=True)
    merged = mh_out.transpose(1, 2).reshape(B, L2, D)  # (B, H, L, D/H) -> (B, L, D)
    result = {
        "sdpa": (tuple(out.shape), tuple(w.shape)),
        "additive": (tuple(add_out.shape), tuple(add_w.shape)),
        "self_attention": (tuple(merged.shape), tuple(mh_w.shape)),
    }
    text = "\n".join(
        [
            f"scaled dot-product: Q {tuple(Q.shape)} K {tuple(K.shape)} V {tuple(V.shape)} -> "
            f"output {result['sdpa'][0]}, weights {result['sdpa'][1]}",
            f"additive (d_attn={d_attn}): output {result['additive'][0]}, weights "
            f"{result['additive'][1]}",
            f"multi-head self-attention, {H} heads: x {tuple(x.shape)} -> heads "
            f"{tuple(heads.shape)} -> output {result['self_attention'][0]}, weights "
            f"{result['self_attention'][1]}",
        ]
    )
    return result, text


def seed004_shapes() -> tuple[dict, str]:
    """Multi-head, multi-query and grouped-query attention on a (1, 10, 512) input."""
    torch.manual_seed(0)
    x = torch.rand(1, 10, 512)  # (B, L, D)
    B, L, D, H = 1, 10, 512, 8
    E = D // H
    lines = [f"input {tuple(x.shape)} (B, L, D); {H} query heads of width {E}"]
    result = {}
    for name, hkv in (("multi-head", 8), ("grouped-query", 2), ("multi-query", 1)):
        g = torch.Generator().manual_seed(1)
        w_q = torch.randn(D, H * E, generator=g) / D**0.5
        w_kv = torch.randn(2, D, hkv * E, generator=g) / D**0.5
        q = (x @ w_q).view(B, L, H, E).transpose(1, 2)  # (B, L, H*E) -> (B, H, L, E)
        k = (x @ w_kv[0]).view(B, L, hkv, E).transpose(1, 2)  # -> (B, Hkv, L, E)
        v = (x @ w_kv[1]).view(B, L, hkv, E).transpose(1, 2)
        out = AF.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, L, E)
        merged = out.transpose(1, 2).reshape(B, L, H * E)  # -> (B, L, D)
        result[name] = (tuple(q.shape), tuple(k.shape), tuple(merged.shape))
        lines.append(
            f"{name:>13}: Hkv={hkv} q {tuple(q.shape)} k/v {tuple(k.shape)} "
            f"(KV cache per token: {2 * hkv * E} numbers) -> output {tuple(merged.shape)}"
        )
    x3 = torch.rand(1, 3, 512)  # "I love programming"
    split = x3.view(1, 3, H, E).transpose(1, 2)
    result["split"] = tuple(split.shape)
    lines.append(f'"I love programming" {tuple(x3.shape)} -> heads {tuple(split.shape)}')
    lines.append("decoding mask, 3 new tokens after 5 cached ones (bottom-right causal):")
    lines.append(str(masks.causal_mask(3, 8, alignment="bottom_right")))
    lines += [
        "(Where this differs from the tutorial's classes: its multi-query class gives each query",
        " head a full-width (512) query, one full-width key and value, scales by 1/sqrt(512)",
        " and averages 8 output projections -- multi-query attention (Shazeer, 2019) splits the",
        " query into heads of width 64 that share one key/value head of width 64, scales by",
        " 1/sqrt(64) and has one output projection, as above; its grouped-query class does not",
        " run, and its KV-cache classes are unfinished: attnlab.cache, the kv-cache example.)",
    ]
    return result, "\n".join(lines)


SLOTS = {  # what a cache's slots are, after its 12 tokens
    "dynamic": " (its storage doubles as it fills)",
    "static": " (max_length, allocated once)",
    "sliding-window": " (the window: the last 4 tokens)",
}


def cache_decoding() -> tuple[dict, str]:
    """A grouped-query layer decoding token by token with each kind of KV cache."""
    from attnlab.cache import DynamicCache, SlidingWindowCache, StaticCache
    from attnlab.nn import MultiHeadAttention

    torch.manual_seed(0)
    x = torch.randn(1, 12, 64)  # (B, L, D): a 4-token prompt, then 8 tokens one at a time
    lines = ["GQA layer: d_model=64, 8 query heads sharing 2 kv heads, RoPE, causal"]
    result = {}
    for kind, window in (("dynamic", None), ("static", None), ("sliding-window", 4)):
        layer = MultiHeadAttention(
            64, 8, num_kv_heads=2, is_causal=True, rope=True, sliding_window=window, layer_idx=0
        ).eval()
        cache = {"dynamic": DynamicCache(), "static": StaticCache(16)}.get(kind)
        cache = cache or SlidingWindowCache(4)
        with torch.no_grad():
            full = layer(x)  # recompute everything at once
            steps = [layer(x[:, :4], cache=cache)]
            steps += [layer(x[:, t : t + 1], cache=cache) for t in range(4, 12)]
        err = float((torch.cat(steps, 1) - full).abs().max())
        tokens, stored = cache.get_seq_length(0), cache.capacity  # seen, and slots allocated
        result[kind] = {"max_error": err, "slots": stored, "tokens": tokens}
        lines.append(
            f"  {kind:>14} cache: {tokens} tokens seen, {stored:2d} slots of (Hkv=2, E=8) "
            f"per layer{SLOTS[kind]}; decode vs recompute max |diff| = {err:.1e}"
        )
    lines.append("  the same layer as plain MHA would cache 8 kv heads: 4x the memory of GQA's 2")
    return result, "\n".join(lines)


def rope_relative() -> tuple[dict, str]:
    """Rotary embeddings: attention scores depend on relative positions only."""
    from attnlab.functional import apply_rotary

    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 1, 1, 16, generator=g), torch.randn(1, 1, 1, 16, generator=g)

    def score(m: int, n: int) -> float:
        qm = apply_rotary(q, torch.tensor([m]))
        kn = apply_rotary(k, torch.tensor([n]))
        return float((qm * kn).sum())

    pairs = [(3, 1), (10, 8), (100, 98), (3, 0)]
    scores = {p: score(*p) for p in pairs}
    lines = ["score(query at m, key at n) after rotary embedding:"]
    lines += [f"  m={m:3d}, n={n:3d}, m-n={m - n}: {scores[(m, n)]: .6f}" for m, n in pairs]
    lines.append("  equal whenever m - n is equal: positions enter as distances")
    return {"scores": scores}, "\n".join(lines)


def real_model_weights() -> tuple[dict, str]:
    """Attention weights of a real pretrained model (MiniLM) computed by attnlab's kernels.

    Every head gets a head-pattern label; the head shown for "bank" -> "river" is a content head
    whose weight follows "river" when it moves (or the report says the head is positional).
    """
    from attnlab.integrations.hf_examples import weights_from_real_model

    return weights_from_real_model()


EXAMPLES: dict[str, tuple[str, Callable[[], tuple[dict, str]]]] = {
    "five-tokens": ("Dot-product attention of five tokens with themselves", five_tokens),
    "four-words": ("Scaled dot-product attention, NumPy and torch", four_words),
    "attention-shapes": ("Shapes of scaled dot-product, additive and multi-head", seed002_shapes),
    "head-sharing": ("Multi-head, grouped-query and multi-query attention", seed004_shapes),
    "kv-cache": ("A grouped-query layer decoding with each KV cache", cache_decoding),
    "rope": ("Rotary position embedding sees relative positions", rope_relative),
    "real-model": (
        "Attention weights of MiniLM (BERT), run on attnlab: which heads read meaning",
        real_model_weights,
    ),
}


def run(names: list[str] | None = None, echo: Callable[[str], None] = print) -> dict:
    """Run the named examples (all by default), printing each; returns their results."""
    unknown = sorted(set(names or []) - set(EXAMPLES))
    if unknown:
        raise ValueError(f"unknown example(s) {unknown}; choose from {sorted(EXAMPLES)}.")
    results = {}
    for name, (title, fn) in EXAMPLES.items():
        if names and name not in names:
            continue
        try:
            result, text = fn()
        except ImportError as e:  # an optional part (transformers, a model wheel) is missing
            echo(f"== {name}: {title} ==\nskipped: {e}\n")
            continue
        echo(f"== {name}: {title} ==\n{text}\n")
        results[name] = result
    return results
