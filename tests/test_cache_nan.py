"""The NaN policy through a KV cache, at the cost of the new tokens only.

attnlab's rule (docs/conventions.md): a NaN or inf in a key or value makes every output row of
the heads that read it NaN, masked or not. A cache checks each slot once, when it is written
(``Cache.kv_finite``), and attention takes that verdict instead of reading the whole cache again
at every decode step. These tests check that the verdict is the one a full screen of the
returned storage gives, for every cache kind, through reorders, resets and ring overwrites, and
that decoding keeps the rule of full recomputation.
"""

from __future__ import annotations

import pytest
import torch

from attnlab.cache import DynamicCache, SlidingWindowCache, StaticCache, finite_slots
from attnlab.functional.nonfinite import propagate_nonfinite
from attnlab.models import DecodeStep, LlamaConfig, LlamaModel
from attnlab.nn import MultiHeadAttention

nan, inf = float("nan"), float("inf")
CACHES = {
    "dynamic": lambda: DynamicCache(),
    "static": lambda: StaticCache(16),
    "sliding": lambda: SlidingWindowCache(3),
}


def screen(keys, values):
    """What attention would conclude from reading the returned storage: (B, Hkv)."""
    return torch.isfinite(keys).flatten(-2).all(-1) & torch.isfinite(values).flatten(-2).all(-1)


def test_finite_slots():
    k = torch.randn(2, 3, 4, 5)
    v = torch.randn(2, 3, 4, 6)
    k[0, 1, 2, 3], v[1, 2, 0, 5] = nan, float("-inf")
    want = torch.ones(2, 3, 4, dtype=torch.bool)
    want[0, 1, 2] = want[1, 2, 0] = False
    assert torch.equal(finite_slots(k, v), want)
    assert finite_slots(k[..., :0], v[..., :0]).all()  # E = Ev = 0: nothing to hold a NaN
    assert torch.equal(finite_slots(k, v[..., :0]), torch.isfinite(k).all(-1))  # Ev = 0


@pytest.mark.parametrize("kind", list(CACHES))
def test_kv_finite_is_the_screen_of_what_update_returns(kind):
    g = torch.Generator().manual_seed(0)
    cache = CACHES[kind]()
    for step, (L, bad) in enumerate([(4, (1, 0, 2)), (1, None), (1, (0, 1, 0)), (1, None)] * 2):
        k, v = torch.randn(2, 2, L, 8, generator=g), torch.randn(2, 2, L, 8, generator=g)
        if bad is not None:
            b, h, t = bad
            (k if step % 2 else v)[b, h, t, 3] = nan if step < 4 else float("inf")
        keys, values = cache.update(k, v, 0)
        assert torch.equal(cache.kv_finite(0), screen(keys, values)), step
        if step == 4:
            cache.reorder(torch.tensor([1, 1]))  # beams: both rows follow row 1
            keys, values = cache.update(k[:, :, :1] * 0, v[:, :, :1] * 0, 0)
            assert torch.equal(cache.kv_finite(0), screen(keys, values))
    if kind == "sliding":  # the ring forgets: once every bad slot is overwritten, finite again
        for _ in range(3):
            keys, values = cache.update(torch.zeros(2, 2, 1, 8), torch.zeros(2, 2, 1, 8), 0)
        assert cache.kv_finite(0).all() and bool(screen(keys, values).all())
    cache.reset()
    keys, values = cache.update(torch.zeros(2, 2, 2, 8), torch.zeros(2, 2, 2, 8), 0)
    assert cache.kv_finite(0).all()  # reset storage holds no stale verdict


def test_a_given_verdict_replaces_reading_key_and_value():
    q = torch.randn(2, 4, 1, 8)
    k, v = torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    k[1, 0, 3, 0] = nan  # not read: the verdict below says otherwise
    out = torch.randn(2, 4, 1, 8)
    same, _ = propagate_nonfinite(q, k, v, out.clone(), kv_finite=torch.ones(2, 2, dtype=bool))
    assert torch.equal(same, out)
    verdict = torch.tensor([[True, False], [True, True]])
    got, _ = propagate_nonfinite(q, k, v, out.clone(), kv_finite=verdict)
    # kv head 1 of batch 0 is read by query heads 2 and 3 (G = 2): their rows are NaN
    assert got[0, 2:].isnan().all() and torch.equal(got[0, :2], out[0, :2])
    assert torch.equal(got[1], out[1])
    q[1, 0, 0, 0] = nan  # the query is still screened
    got, _ = propagate_nonfinite(q, k, v, out.clone(), kv_finite=torch.ones(2, 2, dtype=bool))
    assert got[1, 0].isnan().all() and torch.isfinite(got[1, 1:]).all()


@pytest.mark.parametrize("kind", ["dynamic", "static"])
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_cached_decoding_keeps_the_rule_of_full_recomputation(kind, kv_heads):
    """A NaN in one token of row 1 poisons every output of row 1, before and after it (masked
    or not), and nothing of row 0: as the whole sequence computed at once."""
    torch.manual_seed(0)
    layer = MultiHeadAttention(32, 4, num_kv_heads=kv_heads, is_causal=True, layer_idx=0).eval()
    x = torch.randn(2, 8, 32)
    x[1, 5, 7] = nan  # a decode step's token: its key and value are NaN
    with torch.no_grad():
        full = layer(x)
        cache = CACHES[kind]()
        parts = [layer(x[:, :3], cache=cache)]
        parts += [layer(x[:, t : t + 1], cache=cache) for t in range(3, 8)]
    cached = torch.cat(parts, 1)
    assert torch.isfinite(full[0]).all() and full[1].isnan().all()[None]  # the rule
    assert torch.equal(cached[:, 5:].isnan(), full[:, 5:].isnan())  # from the NaN on: the same
    assert torch.isfinite(cached[:, :5]).all()  # earlier steps could not see the future
    torch.testing.assert_close(cached[0], full[0], rtol=0, atol=1e-6)


def test_the_decode_step_flags_what_it_writes():
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=16,
        d_model=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        d_ff=64,
        tie_embeddings=False,  # (tied, the NaN row would reach every row's logits)
    )
    model = LlamaModel(cfg).eval()
    with torch.no_grad():
        model.embed.weight[7, 0] = nan  # token 7: its keys and values are NaN in every layer
        cache = StaticCache(10)
        model(torch.tensor([[1, 2, 3], [4, 5, 6]]), cache=cache)
        step = DecodeStep(model, compile=False)  # the compiled step's own code, run eagerly
        first = step(torch.tensor([[2], [7]]), cache)
        assert torch.isfinite(first[0]).all() and first[1].isnan().all()
        assert torch.equal(cache.buffers(0)[4][:, :, 3], torch.tensor([[True] * 2, [False] * 2]))
        after = step(torch.tensor([[3], [3]]), cache)  # row 1's cache still holds the NaN
        assert torch.isfinite(after[0]).all() and after[1].isnan().all()
        want = model(torch.tensor([[1, 2, 3, 2, 3]]))[:, -1:]  # row 0 untouched by row 1
    torch.testing.assert_close(after[0:1], want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "shapes",
    [
        ((2, 6, 5, 4), (2, 2, 7, 4), (2, 2, 7, 3)),  # GQA, G = 3
        ((2, 3, 5, 4), (2, 3, 7, 4), (2, 3, 7, 4)),  # MHA
        ((3, 5, 4), (3, 7, 4), (3, 7, 6)),  # (B, L, E), as additive attention gives them
        ((2, 2, 5, 0), (2, 1, 7, 0), (2, 1, 7, 3)),  # E = 0: empty rows are finite
    ],
)
def test_the_row_check_equals_the_oracle(dtype, shapes):
    # the traced and GPU path: max |x| per row / kv head, then one finiteness test; values at
    # the dtype's largest must not overflow into a false NaN (max, never a sum)
    from attnlab.functional.nonfinite import nonfinite_rows
    from attnlab.reference.attention import _nonfinite_rows

    g = torch.Generator().manual_seed(3)
    big = torch.finfo(dtype).max
    for trial in range(12):
        q, k, v = (torch.randn(*s, generator=g).to(dtype) for s in shapes)
        for t in (q, k, v):
            if t.numel() and torch.rand((), generator=g) < 0.5:
                flat = t.view(-1)
                i = int(torch.randint(flat.numel(), (), generator=g))
                flat[i] = (nan, inf, -inf, big, -big)[trial % 5]
        want = _nonfinite_rows(q.float().numpy(), k.float().numpy(), v.float().numpy())
        got = nonfinite_rows(q, k, v)
        assert got.shape == want.shape and (got.numpy() == want).all()
        if q.dim() == 4:  # the caches' verdict for K and V instead of reading them
            kv_finite = torch.isfinite(k.float()).flatten(-2).all(-1) & torch.isfinite(
                v.float()
            ).flatten(-2).all(-1)
            assert (nonfinite_rows(q, k, v, kv_finite).numpy() == want).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dim", [-1, (-2, -1)])
def test_max_abs_is_the_inf_norm_nan_and_inf_included(dtype, dim):
    """max_abs (abs then amax on the CPU, the screen of every cache write) equals the inf-norm
    it replaces there, NaN where a NaN sits (also beside an inf), inf where an inf does, and
    the largest finite value of the dtype stays finite (no overflow)."""
    from attnlab.functional.nonfinite import max_abs

    x = torch.randn(3, 4, 5, 6, generator=torch.Generator().manual_seed(0)).to(dtype)
    x[0, 1, 2, 3] = nan
    x[0, 1, 2, 4] = -inf  # the NaN's row holds an inf too
    x[1, 2, 3, 0] = inf
    x[2, 0, 1, 5] = -inf
    x[2, 3, 4, 1] = torch.finfo(dtype).max
    got = max_abs(x, dim)
    want = torch.linalg.vector_norm(x.double(), inf, dim=dim).to(dtype)
    assert got.dtype == dtype
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    assert got.isnan().sum() == 1 and got.isinf().sum() == 2


@pytest.mark.parametrize("average", [False, True])
def test_static_cache_weights_span_every_slot_nan_rows_whole(average):
    """Eagerly a static cache's layer reads its filled slots alone; the weights it returns still
    span every slot: 0 on the empty ones, and a NaN row (a NaN token in batch row 0) NaN over
    all of them, as when every slot was read under a mask."""
    torch.manual_seed(0)
    layer = MultiHeadAttention(16, 4, num_kv_heads=2, is_causal=True, layer_idx=0).eval()
    x = torch.randn(2, 5, 16)
    x[0, 2] = nan
    cache = StaticCache(12)
    with torch.no_grad():
        layer(x, cache=cache)
        _, w = layer(x[:, :1], cache=cache, return_weights=True, average_weights=average)
    assert w.shape == ((2, 1, 12) if average else (2, 4, 1, 12))
    assert w[0].isnan().all()
    assert not w[1].isnan().any() and w[1][..., 6:].abs().max() == 0
    torch.testing.assert_close(w[1].sum(-1), torch.ones_like(w[1].sum(-1)))
