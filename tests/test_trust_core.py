"""Issue 12, the core: habits ported from PyTorch, NaN policy, degenerate shapes, compile/export.

Every case here gave a silent wrong answer or an unclear error before (see each test's comment).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import attnlab.functional as AF
import attnlab.reference as R
from attnlab import masks
from attnlab.cache import DynamicCache, StaticCache
from attnlab.nn import DotProductAttention, MultiHeadAttention
from conftest import np64, qkv

nan, inf = float("nan"), float("inf")


# --- torch's names keep torch's meanings -------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,fix",
    [
        ({"key_padding_mask": torch.zeros(2, 5, dtype=torch.bool)}, "key_mask="),
        ({"attn_mask": torch.ones(5, 5, dtype=torch.bool)}, "mask="),
        ({"need_weights": True}, "return_weights=True"),
        ({"average_attn_weights": True}, "average_weights=True"),
    ],
)
def test_layer_refuses_torch_names_and_names_the_attnlab_spelling(kwargs, fix):
    # before: key_padding_mask/attn_mask were read with the opposite polarity to torch's module
    layer = MultiHeadAttention(16, 4)
    with pytest.raises(TypeError) as info:
        layer(torch.randn(2, 5, 16), **kwargs)
    assert fix in str(info.value) and "attnlab.compat.MultiheadAttention" in str(info.value)
    with pytest.raises(TypeError, match=fix.rstrip("=")):
        DotProductAttention()(
            torch.randn(2, 5, 16), torch.randn(2, 5, 16), torch.randn(2, 5, 16), **kwargs
        )


def test_torch_style_call_cannot_split_the_batch():
    # before: `out, w = mha(x, x, x)` with B = 2 unpacked the batch into out and w
    layer = MultiHeadAttention(16, 4)
    x = torch.randn(2, 3, 16)
    with pytest.raises(TypeError, match=r"key= and value= by keyword.*attnlab.compat"):
        out, w = layer(x, x, x)
    torch.testing.assert_close(layer(x, key=x, value=x), layer(x))


def test_constructor_refuses_torch_positional_dropout_and_embed_dim():
    # before: MultiHeadAttention(512, 8, 0.1) -> "num_kv_heads must be a positive int; got 0.1"
    with pytest.raises(TypeError, match=r"attn_dropout=0.1.*torch's third positional"):
        MultiHeadAttention(512, 8, 0.1)
    with pytest.raises(TypeError, match="d_model="):
        MultiHeadAttention(embed_dim=512, num_heads=8)
    with pytest.raises(TypeError, match="batch-first"):
        MultiHeadAttention(16, 4, batch_first=False)
    with pytest.raises(TypeError, match="unexpected keyword argument 'nonsense'"):
        MultiHeadAttention(16, 4, nonsense=1)


def test_from_torch_refuses_sequence_first_modules():
    # before: accepted, then (L, B, E) inputs were misread as (B, L, E): difference 1.20
    with pytest.raises(ValueError, match=r"batch_first=False.*attnlab.compat.MultiheadAttention"):
        MultiHeadAttention.from_torch(nn.MultiheadAttention(16, 4))


def test_a_foreign_cache_object_is_refused():
    class DynamicCacheFromElsewhere:  # e.g. transformers.DynamicCache
        pass

    layer = MultiHeadAttention(16, 4, is_causal=True, layer_idx=0)
    with pytest.raises(TypeError, match=r"attnlab.cache cache.*DynamicCacheFromElsewhere"):
        layer(torch.randn(1, 3, 16), cache=DynamicCacheFromElsewhere())


def test_key_mask_true_means_real_token_and_matches_torch_module():
    # torch's all-False key_padding_mask ("no padding") gave an output of exactly 0 when passed
    # as is; with attnlab's own name and meaning, all-True means no padding.
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(16, 4, batch_first=True).eval()
    ours = MultiHeadAttention.from_torch(ref)
    x = torch.randn(2, 5, 16)
    torch_kpm = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])  # torch: True = padding
    want = ref(x, x, x, key_padding_mask=torch_kpm, need_weights=False)[0]
    got = ours(x, key_mask=~torch_kpm)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert got.abs().amax() > 0.1


# --- NaN is never turned into a number ---------------------------------------------------------

PATHS = ["fused", "weights", "eager"]


def run_path(path, q, k, v, mask=None, is_causal=False):
    if path == "fused":
        return AF.scaled_dot_product_attention(q, k, v, mask, is_causal=is_causal)
    if path == "weights":
        with torch.no_grad():
            return AF.scaled_dot_product_attention(
                q, k, v, mask, is_causal=is_causal, return_weights=True
            )[0]
    q = q.clone().requires_grad_()
    out, _ = AF.scaled_dot_product_attention(
        q, k, v, mask, is_causal=is_causal, return_weights=True
    )
    return out.detach()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("bad", [nan, inf, -inf])
def test_nonfinite_query_row_gives_nan_row_on_every_path(path, bad):
    # before: a NaN query row gave 0 on the fused and eager paths, NaN on the weights path
    q, k, v = qkv()
    q[0, 1, 2, 3] = bad
    out = run_path(
        path, q, k, v, torch.rand(5, 7, generator=torch.Generator().manual_seed(1)) > 0.2
    )
    assert out[0, 1, 2].isnan().all()
    out[0, 1, 2] = 0
    assert torch.isfinite(out).all()  # nothing else is touched


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("where", ["key", "value"])
def test_nonfinite_key_or_value_reaches_the_heads_that_read_it_even_if_masked(path, where):
    q, k, v = qkv()
    (k if where == "key" else v)[1, 0, 6, 0] = nan  # kv head 0 serves query heads 0 and 1
    mask = torch.ones(5, 7, dtype=torch.bool)
    mask[:, 6] = False  # the NaN key is masked for every query: a mask does not clean a NaN
    out = run_path(path, q, k, v, mask)
    assert out[1, :2].isnan().all()
    assert torch.isfinite(out[1, 2:]).all() and torch.isfinite(out[0]).all()


@pytest.mark.parametrize("path", PATHS)
def test_only_masks_make_rows_dead(path):
    q, k, v = qkv()
    mask = torch.ones(5, 7, dtype=torch.bool)
    mask[3] = False
    out = run_path(path, q, k, v, mask)
    assert (out[:, :, 3] == 0).all() and torch.isfinite(out).all()
    q[0, 0, 3, 0] = nan  # a dead row whose query is NaN is NaN, not 0
    assert run_path(path, q, k, v, mask)[0, 0, 3].isnan().all()


def test_the_screen_tells_an_overflowing_sum_from_a_nan_or_an_inf():
    # the eager screen sums each input in its own dtype: finite values may overflow the sum
    # (float16 from 65,504), which must not read as a NaN; a min and max decide then
    from attnlab.functional.nonfinite import all_finite

    big = torch.full((100,), 1000.0, dtype=torch.float16)
    assert big.sum().isinf() and all_finite(big)
    assert all_finite(torch.full((10,), 3e38, dtype=torch.bfloat16))
    for bad in (nan, inf, -inf):
        x = big.clone()
        x[7] = bad
        assert not all_finite(x) and not all_finite(torch.ones(3), x, torch.ones(2))
    pair = torch.tensor([inf, -inf])  # a sum of NaN, a min and max of infinities
    assert not all_finite(pair) and not all_finite(torch.empty(0), pair)
    assert all_finite(torch.empty(0), torch.zeros(2, 3))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_large_finite_16bit_inputs_are_not_taken_for_nan(dtype):
    q, k, v = qkv(dtype=torch.float32)
    v = v + 400  # its float16 sum overflows (224 values of ~400)
    want = AF.scaled_dot_product_attention(q.double(), k.double(), v.double())
    q16, k16, v16 = (t.to(dtype) for t in (q, k, v))
    assert math.isinf(v16.half().sum().item())
    got = AF.scaled_dot_product_attention(q16, k16, v16)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), want, rtol=0.01, atol=0)
    k16[1, 1, 3, 0] = nan  # and a NaN among them is still found: kv head 1 -> heads 2, 3
    got = AF.scaled_dot_product_attention(q16, k16, v16)
    assert got[1, 2:].isnan().all() and torch.isfinite(got[0]).all()


def test_masked_softmax_additive_and_hard_follow_the_policy():
    # before: masked_softmax of an all-NaN row gave [0, 0, 0]
    assert AF.masked_softmax(torch.tensor([[nan, nan, nan]])).isnan().all()
    w = AF.masked_softmax(torch.tensor([[1.0, nan, 2.0], [1.0, 2.0, 3.0]]))
    assert w[0].isnan().all() and torch.isfinite(w[1]).all()
    dead = AF.masked_softmax(torch.randn(2, 3), torch.tensor([[False] * 3, [True] * 3]))
    assert (dead[0] == 0).all() and torch.isclose(dead[1].sum(), torch.tensor(1.0))
    g = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(2, 3, 4, generator=g),
        torch.randn(2, 5, 4, generator=g),
        torch.randn(2, 5, 6, generator=g),
    )
    q[0, 1, 0] = nan
    w_q, w_k, w_s = torch.randn(8, 4, generator=g), torch.randn(8, 4, generator=g), torch.randn(8)
    out, w = AF.additive_attention(q, k, v, w_q, w_k, w_s, return_weights=True)
    assert out[0, 1].isnan().all() and w[0, 1].isnan().all()
    assert torch.isfinite(out[1]).all() and torch.isfinite(out[0, [0, 2]]).all()
    out = AF.hard_attention(q, k, v)
    assert out[0, 1].isnan().all() and torch.isfinite(out[1]).all()


def test_nonfinite_scale_and_out_of_range_bias_are_refused():
    # before: scale=nan was accepted (output all 0); a float32 finfo.min mask with fp16 inputs
    # gave weights 0 where float32 gives uniform weights
    q, k, v = qkv()
    for scale in (nan, inf):
        with pytest.raises(ValueError, match="scale must be a finite number"):
            AF.scaled_dot_product_attention(q, k, v, scale=scale)
        with pytest.raises(ValueError, match="scale must be a finite number"):
            AF.hard_attention(q, k, v, scale=scale)
    bias = torch.zeros(5, 7)
    bias[2] = torch.finfo(torch.float32).min
    with pytest.raises(ValueError, match=r"outside torch.float16's range.*-inf"):
        AF.scaled_dot_product_attention(q.half(), k.half(), v.half(), bias)
    bias[2] = -inf  # the fix the message names
    out = AF.scaled_dot_product_attention(q.half(), k.half(), v.half(), bias)
    assert (out[:, :, 2] == 0).all()


@pytest.mark.parametrize(
    "number", [np.float32(0.25), np.float64(0.25), np.int64(2), torch.tensor(0.25), 0.25]
)
def test_numpy_scalars_and_0d_tensors_are_taken_as_torch_takes_them(number):
    # before: np.float32, np.int64 and 0-d tensors were refused ("must be a finite number",
    # "must be a probability") where torch's SDPA takes them
    q, k, v = qkv(Hkv=4)
    value = float(number)
    expected = F.scaled_dot_product_attention(q, k, v, scale=value)
    got = AF.scaled_dot_product_attention(q, k, v, scale=number)
    torch.testing.assert_close(got, expected)
    assert AF.explain(q, k, v, scale=number).path == AF.explain(q, k, v, scale=value).path
    torch.testing.assert_close(AF.hard_attention(q, k, v, scale=number),
                               AF.hard_attention(q, k, v, scale=value))  # fmt: skip
    if value < 1:  # the same draws as the Python float: the same keep mask and scaling
        p = number
        torch.manual_seed(0)
        expected = AF.scaled_dot_product_attention(q, k, v, dropout_p=value)
        torch.manual_seed(0)
        torch.testing.assert_close(AF.scaled_dot_product_attention(q, k, v, dropout_p=p), expected)
        scores = torch.randn(2, 4, 5, 7)
        torch.manual_seed(0)
        expected = AF.attention(scores, v, dropout_p=value)
        torch.manual_seed(0)
        got = AF.attention(scores, v, dropout_p=p)
        torch.testing.assert_close(got, expected)
    for bad in (np.bool_(True), torch.tensor([0.25]), torch.tensor(True), "0.1"):
        with pytest.raises(ValueError, match="scale must be a finite number"):
            AF.scaled_dot_product_attention(q, k, v, scale=bad)
        with pytest.raises(ValueError, match="dropout_p must be a probability"):
            AF.scaled_dot_product_attention(q, k, v, dropout_p=bad)


@pytest.mark.parametrize("where", ["sdpa", "masked_softmax", "additive"])
def test_a_bias_that_overflows_the_inputs_dtype_either_way_is_refused(where):
    # before: +1e39 (float64) with float32 inputs became +inf: its row NaN where the oracle is
    # finite; -1e39 in masked_softmax / additive attention became -inf: a dead row
    q, k, v = qkv(Hkv=4)
    w = torch.randn(6, 8), torch.randn(6, 8), torch.randn(6)
    calls = {
        "sdpa": lambda b: AF.scaled_dot_product_attention(q, k, v, b),
        "masked_softmax": lambda b: AF.masked_softmax(q @ k.transpose(-1, -2), b),
        "additive": lambda b: AF.additive_attention(q, k, v, *w, attn_mask=b),
    }
    for big in (1e39, -1e39):
        bias = torch.zeros(5, 7, dtype=torch.float64)
        bias[2, :3] = big
        with pytest.raises(ValueError, match=r"outside torch.float32's range"):
            calls[where](bias)
    bias[2, :3] = 1e30  # within float32: accepted, and as the float64 oracle reads it
    out = calls[where](bias)
    assert torch.isfinite(out).all()


# --- degenerate shapes give torch's results ----------------------------------------------------


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("empty", ["B", "H", "L", "S", "E"])
def test_empty_dimensions_give_torchs_result(path, empty):
    # before: H = 0 raised ValueError, E = 0 ZeroDivisionError
    d = {"B": 2, "H": 2, "L": 3, "S": 4, "E": 5}
    d[empty] = 0
    g = torch.Generator().manual_seed(0)
    q = torch.randn(d["B"], d["H"], d["L"], d["E"], generator=g)
    k = torch.randn(d["B"], d["H"], d["S"], d["E"], generator=g)
    v = torch.randn(d["B"], d["H"], d["S"], 6, generator=g)
    want = F.scaled_dot_product_attention(q, k, v)
    got = run_path(path, q, k, v)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("empty", ["L", "S", "E"])
def test_empty_dimensions_beyond_four_dims_and_an_empty_key_mask(path, empty):
    # before: RuntimeError "cannot reshape tensor of 0 elements" for a 5-D query with an empty
    # L, S or E, and for a (S,) mask with S = 0
    d = {"L": 3, "S": 4, "E": 5}
    d[empty] = 0
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 1, 2, d["L"], d["E"], generator=g)
    k = torch.randn(2, 1, 2, d["S"], d["E"], generator=g)
    v = torch.randn(2, 1, 2, d["S"], 6, generator=g)
    want = F.scaled_dot_product_attention(q, k, v)
    got = run_path(path, q, k, v)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want)
    mask = torch.ones(d["S"], dtype=torch.bool)  # (S,): one row of keys for every query
    got = run_path(path, q[0, 0], k[0, 0], v[0, 0], mask)
    assert got.shape == want[0, 0].shape
    torch.testing.assert_close(got, want[0, 0])


def test_hard_and_additive_attention_with_no_keys():
    # before: IndexError (hard) and RuntimeError (additive) for S = 0
    q, k, v = torch.randn(2, 3, 4), torch.randn(2, 0, 4), torch.randn(2, 0, 6)
    assert (AF.hard_attention(q, k, v) == 0).all()
    out = AF.additive_attention(q, k, v, torch.randn(8, 4), torch.randn(8, 4), torch.randn(8))
    assert out.shape == (2, 3, 6) and (out == 0).all()


def test_leading_batch_dims_beyond_four_as_torch():
    # before: a 5-D query raised
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, 2, 4, 5, 8, generator=g) for _ in range(3))
    mask = torch.rand(2, 1, 5, 5, generator=g) > 0.3
    mask[..., 0] = True
    torch.testing.assert_close(
        AF.scaled_dot_product_attention(q, k, v, mask),
        F.scaled_dot_product_attention(q, k, v, mask),
    )
    out, w = AF.scaled_dot_product_attention(q, k, v, return_weights="average")
    assert w.shape == (3, 2, 5, 5)
    torch.testing.assert_close(w.sum(-1), torch.ones(3, 2, 5))


@pytest.mark.parametrize("path", ["fused", "dropout", "weights-grad", "weights"])
def test_a_mask_that_would_enlarge_the_scores_is_refused_on_every_path(path):
    # before: accepted; wrong output shapes on the dropout and autograd paths
    q, k, v = qkv(B=1, H=1, Hkv=1, L=1, S=8)
    mask = torch.ones(1, 1, 3, 8, dtype=torch.bool)
    kw = {"dropout_p": 0.5} if path == "dropout" else {}
    if path.startswith("weights"):
        kw["return_weights"] = True
    if path == "weights-grad":
        q.requires_grad_()
    with pytest.raises(ValueError, match="without enlarging it"):
        AF.scaled_dot_product_attention(q, k, v, mask, **kw)


# --- every path compiles and exports -----------------------------------------------------------


class Fn(nn.Module):
    def __init__(self, **kw):
        super().__init__()
        self.kw = kw

    def forward(self, q, k, v, mask):
        return AF.scaled_dot_product_attention(q, k, v, mask, **self.kw)


def bool_mask(L=5, S=7):
    m = torch.rand(2, 1, L, S, generator=torch.Generator().manual_seed(3)) > 0.3
    m[..., 0] = True
    return m


CASES = {
    "bool mask, GQA": ({}, lambda: bool_mask()),
    "float mask": ({}, lambda: masks.to_additive(bool_mask())),
    "attnlab Mask": ({}, lambda: masks.padding_mask([7, 4], 7)),
    "bottom-right causal L != S": ({"is_causal": "bottom_right"}, lambda: None),
    "top-left causal + mask": ({"is_causal": "top_left"}, lambda: bool_mask()),
    "weights per head": ({"return_weights": True}, lambda: bool_mask()),
    "weights averaged, causal": (
        {"return_weights": "average", "is_causal": "bottom_right"},
        lambda: None,
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_function_exports_and_equals_eager(case):
    # before: torch.export with an attn_mask failed ("fake tensor in the exported program
    # constant's list"); bottom-right causal failed under compile (as_subclass)
    kw, make_mask = CASES[case]
    q, k, v = qkv()
    mask = make_mask()
    fn = Fn(**kw)
    want = fn(q, k, v, mask)
    exported = torch.export.export(fn, (q, k, v, mask))
    got = exported.module()(q, k, v, mask)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "case", ["bool mask, GQA", "bottom-right causal L != S", "weights per head"]
)
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_function_compiles_fullgraph_and_differentiates(case, backend):
    kw, make_mask = CASES[case]
    q, k, v = qkv()
    mask = make_mask()
    torch._dynamo.reset()
    compiled = torch.compile(Fn(**kw), fullgraph=True, backend=backend)
    qs = [q.clone().requires_grad_() for _ in range(2)]
    outs = [Fn(**kw)(qs[0], k, v, mask), compiled(qs[1], k, v, mask)]
    for o in outs:
        (o[0] if isinstance(o, tuple) else o).square().sum().backward()
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(qs[1].grad, qs[0].grad, rtol=1e-5, atol=1e-6)


MASK_INPUTS = {
    "padding_mask": lambda: masks.padding_mask([7, 4], 7),
    "sliding_window_mask": lambda: masks.sliding_window_mask(5, 7, window=3,
                                                             alignment="bottom_right"),
    "document_mask, sliced": lambda: masks.Mask(masks.document_mask([3, 4])[-5:]),
    "causal_mask": lambda: masks.causal_mask(5, 7, alignment="top_left"),
    "and_masks": lambda: masks.and_masks(masks.causal_mask(5, 7, alignment="bottom_right"),
                                         masks.padding_mask([7, 4], 7)),
}  # fmt: skip


@pytest.mark.parametrize("name", MASK_INPUTS)
def test_a_mask_of_attnlab_masks_is_an_input_of_compiled_functions(name):
    """A user compiles the model and passes it masks.padding_mask(...): AOTAutograd refused
    the Mask subclass as an input of the graph (any use of it, with aot_eager or inductor)."""
    q, k, v = qkv()
    m = MASK_INPUTS[name]()
    fn = Fn()
    torch._dynamo.reset()
    got = torch.compile(fn, fullgraph=True, backend="aot_eager")(q, k, v, m)
    torch.testing.assert_close(got, fn(q, k, v, masks.plain(m)), rtol=1e-6, atol=1e-6)
    assert isinstance(m, masks.Mask) and "True = may attend" in repr(m)  # untouched


def test_a_mask_input_compiles_with_inductor():
    q, k, v = qkv()
    m = masks.padding_mask([7, 4], 7)
    torch._dynamo.reset()
    got = torch.compile(Fn(), fullgraph=True)(q, k, v, m)
    torch.testing.assert_close(got, Fn()(q, k, v, m), rtol=1e-6, atol=1e-6)


def test_a_scale_that_compile_makes_symbolic_keeps_one_graph():
    """A float scale that changes between calls becomes symbolic (dynamic=True, or the default
    after a second value): checking it with math.isfinite broke the graph, and choosing torch's
    is_causal from its sign handed torch a SymBool."""
    q, k, v = qkv(L=7)
    for kw in ({}, {"is_causal": True}, {"return_weights": True}):
        torch._dynamo.reset()
        fn = torch.compile(AF.scaled_dot_product_attention, fullgraph=True, backend="aot_eager")
        for scale in (0.5, 0.25, -0.3):  # (the third: a scale <= 0 with is_causal)
            got, want = (
                fn(q, k, v, scale=scale, **kw),
                AF.scaled_dot_product_attention(q, k, v, scale=scale, **kw),
            )
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_bf16_dropout_compiles_fullgraph():
    """The dispatch described the blocked kernel's tiling even when no reason was wanted, and
    that read the CPU's bf16 flags (a cached function dynamo cannot trace)."""
    q, k, v = (t.bfloat16().requires_grad_() for t in qkv(L=7))
    torch._dynamo.reset()
    fn = torch.compile(AF.scaled_dot_product_attention, fullgraph=True, backend="aot_eager")
    torch.manual_seed(3)
    got = fn(q, k, v, dropout_p=0.2)
    torch.manual_seed(3)
    want = AF.scaled_dot_product_attention(q, k, v, dropout_p=0.2)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_weights_with_gradients_of_layers_compile_fullgraph():
    """A layer's heads are views of (B, L, H, E) projections: the weights backward wrote dQ
    into a tensor of their strides, whose blocks compiled graphs refuse as out=."""
    torch.manual_seed(0)
    layer = MultiHeadAttention(32, 4, num_kv_heads=2)
    x = torch.randn(2, 5, 32)
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    outs = [f(x, return_weights=True) for f in (layer, compiled)]
    grads = []
    for out, w in outs:
        layer.zero_grad()
        (out.square().sum() + w.square().sum()).backward()
        grads.append(layer.q_proj.weight.grad.clone())
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("return_weights", [True, "average"])
def test_an_exported_program_with_weights_keeps_its_gradients(return_weights):
    """torch.export ran the weights path's no_grad forward as the graph: its outputs, and every
    one computed after it, came out without gradients."""
    q, k, v = qkv()
    fn = Fn(return_weights=return_weights)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    exported = torch.export.export(fn, (*leaves, None)).module()
    outs = [f(*[t.detach().requires_grad_() for t in leaves], None) for f in (fn, exported)]
    for out, w in outs:
        assert out.requires_grad and w.requires_grad
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-6, atol=1e-6)


def test_a_sliding_window_layer_exports():
    """sliding_window_mask read query 0's position from a tensor (a data-dependent guard)."""
    torch.manual_seed(0)
    layer = MultiHeadAttention(32, 4, is_causal=True, sliding_window=2).eval()
    x = torch.randn(2, 6, 32)
    with torch.no_grad():
        got = torch.export.export(layer, (x,)).module()(x)
        torch.testing.assert_close(got, layer(x), rtol=1e-6, atol=1e-6)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn = MultiHeadAttention(
            32, 4, num_kv_heads=2, is_causal=True, rope=True, layer_idx=0
        )
        self.cross = MultiHeadAttention(32, 4, num_kv_heads=1)

    def forward(self, x, mem, key_mask, mask):
        y = self.self_attn(x, key_mask=key_mask)
        return self.cross(y, key=mem, mask=mask, return_weights=True)


def test_layers_compile_and_export():
    torch.manual_seed(0)
    block = Block().eval()
    x, mem = torch.randn(2, 5, 32), torch.randn(2, 7, 32)
    key_mask = torch.tensor([[True] * 5, [True] * 3 + [False] * 2])
    mask = masks.to_additive(bool_mask())
    with torch.no_grad():
        want = block(x, mem, key_mask, mask)
        got = torch.compile(block, fullgraph=True)(x, mem, key_mask, mask)
        exported = torch.export.export(block, (x, mem, key_mask, mask)).module()(
            x, mem, key_mask, mask
        )
    for out in (got, exported):
        torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("cache_kind", ["dynamic", "static"])
def test_cached_decode_step_compiles_fullgraph(cache_kind):
    torch.manual_seed(0)
    layer = MultiHeadAttention(32, 4, num_kv_heads=2, is_causal=True, rope=True, layer_idx=0).eval()
    x = torch.randn(2, 6, 32)

    def decode(step_fn, cache):
        outs = [step_fn(x[:, :3], cache)]
        outs += [step_fn(x[:, t : t + 1], cache) for t in range(3, 6)]
        return torch.cat(outs, 1)

    make = {"dynamic": DynamicCache, "static": lambda: StaticCache(8)}[cache_kind]
    torch._dynamo.reset()
    step = torch.compile(lambda t, c: layer(t, cache=c), fullgraph=True)
    with torch.no_grad():
        want = decode(lambda t, c: layer(t, cache=c), make())
        got = decode(step, make())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert math.isfinite(float(got.abs().sum()))


def test_input_of_another_dtype_than_the_layer_is_a_clear_error():
    # before: a RuntimeError from inside the projection
    layer = MultiHeadAttention(16, 4)
    with pytest.raises(TypeError, match=r"query is torch.float16 but the layer's weights are"):
        layer(torch.randn(2, 3, 16).half())
    with torch.autocast("cpu", dtype=torch.bfloat16):  # mixed precision stays allowed
        assert layer(torch.randn(2, 3, 16)).dtype == torch.bfloat16


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("where", ["query", "key", "value"])
def test_the_oracle_states_the_nan_policy_and_every_path_agrees(path, where):
    import attnlab.reference as R

    q, k, v = qkv(dtype=torch.float64)
    {"query": q, "key": k, "value": v}[where][1, 2 if where == "query" else 1, 3, 0] = nan
    mask = bool_mask()
    want = R.scaled_dot_product_attention(q.numpy(), k.numpy(), v.numpy(), mask.numpy())
    got = run_path(path, q, k, v, mask).numpy()
    assert (np.isnan(got) == np.isnan(want)).all() and np.isnan(want).any()
    np.testing.assert_allclose(got[~np.isnan(want)], want[~np.isnan(want)], rtol=0, atol=1e-12)


def test_additive_attention_beyond_four_dims_and_its_second_derivative():
    # before: (3, 2, 2, L, D) inputs raised "too many values to unpack"; a second derivative
    # (create_graph=True) failed inside torch ("functions with out=... arguments")
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 2, 2, 4, 3, generator=g, dtype=torch.float64)
    k = torch.randn(3, 2, 2, 5, 3, generator=g, dtype=torch.float64)
    v = torch.randn(3, 2, 2, 5, 7, generator=g, dtype=torch.float64)
    W, w = torch.randn(6, 3, generator=g, dtype=torch.float64), torch.randn(6, dtype=torch.float64)
    mask = torch.rand(4, 5, generator=g) > 0.3
    out = AF.additive_attention(q, k, v, W, W, w, attn_mask=mask)
    want = R.additive_attention(*map(np64, (q, k, v, W, W, w)), attn_mask=mask.numpy())
    np.testing.assert_allclose(out.numpy(), want, rtol=0, atol=1e-12)
    q = q[0, 0].clone().requires_grad_()
    out = AF.additive_attention(q, k[0, 0], v[0, 0], W, W, w)
    (dq,) = torch.autograd.grad(out.sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="chunked additive scores computes first"):
        dq.sum().backward()


# --- found by a review of the layers and the functional API ------------------------------------


def test_layer_refuses_a_3d_mask_that_broadcasting_would_read_per_head():
    # before: a Keras-style (B, L, S) mask with B == H was applied to head b of every batch row
    # (weights on padded keys, no error); with B != H it raised a broadcast error
    torch.manual_seed(0)
    layer = MultiHeadAttention(16, 4).eval()
    x = torch.randn(4, 5, 16)
    lengths = torch.tensor([5, 4, 2, 1])
    keras = (torch.arange(5)[None, None] < lengths[:, None, None]).expand(4, 5, 5)
    with pytest.raises(ValueError, match=r"ambiguous.*mask\[:, None\] for \(B, 1, L, S\)"):
        layer(x, mask=keras)
    out, w = layer(x, mask=keras[:, None], return_weights=True)  # the fix the message names
    assert w[3, :, :, 1:].abs().max() == 0 and w[2, :, :, 2:].abs().max() == 0
    torch.testing.assert_close(out, layer(x, key_mask=keras[:, 0]))
    layer(x, mask=keras[:1])  # (1, L, S) means one thing: taken


def test_from_torch_keeps_the_modules_mode_and_frozen_weights():
    # before: the converted layer was always in training mode: attention dropout ran on an
    # eval-mode model (outputs off by 0.16)
    torch.manual_seed(0)
    module = nn.MultiheadAttention(16, 4, dropout=0.1, batch_first=True).eval()
    x = torch.randn(2, 5, 16)
    layer = MultiHeadAttention.from_torch(module)
    assert not layer.training
    torch.testing.assert_close(layer(x), module(x, x, x)[0])
    assert MultiHeadAttention.from_torch(module.train()).training
    module.requires_grad_(False)
    assert not any(p.requires_grad for p in MultiHeadAttention.from_torch(module).parameters())


def test_layer_refuses_kv_with_key_or_value():
    # before: key= and value= were dropped without a word when kv= was given
    layer = MultiHeadAttention(16, 4)
    x, src = torch.randn(2, 5, 16), torch.randn(2, 3, 16)
    with pytest.raises(ValueError, match="kv= .* replaces key= and value="):
        layer(x, key=src, kv=layer.project_kv(src))


@pytest.mark.parametrize("bad", [1.5, -0.2, "0.1"])
def test_classic_layers_check_dropout_when_built(bad):
    # before: accepted, and raised only at the first forward in training mode
    from attnlab.nn import AdditiveAttention, LuongAttention

    for build in (
        lambda: AdditiveAttention(8, 6, 5, dropout=bad),
        lambda: LuongAttention(8, 8, score="general", dropout=bad),
        lambda: DotProductAttention(dropout=bad),
        lambda: MultiHeadAttention(16, 4, attn_dropout=bad),
    ):
        with pytest.raises(ValueError, match=r"dropout must be a probability in \[0, 1\)"):
            build()


def test_a_mask_shared_through_dlpack_forgets_its_structure():
    # before: writes through torch.from_dlpack(mask) bypassed the version counters and the
    # kernels kept skipping keys by the lengths the mask was built from
    mask = masks.padding_mask([6, 3])
    assert masks.structure(mask)[0] is not None
    shared = torch.from_dlpack(mask)
    shared[1, 0, 0, :] = True
    assert masks.structure(mask) == (None, None)  # its values alone say what it masks
    q, k, v = qkv(B=2, H=2, Hkv=2, L=4, S=6)
    got = AF.scaled_dot_product_attention(q, k, v, mask)
    torch.testing.assert_close(got, AF.scaled_dot_product_attention(q, k, v, mask.data.clone()))


def test_mask_builders_take_integers_only():
    # before: causal_mask(2.5, 4) built a mask from fractional positions; a numpy window was
    # refused where a numpy max_length was taken
    with pytest.raises(ValueError, match=r"query_length must be an int >= 0.*2.5"):
        masks.causal_mask(2.5, 4, alignment="bottom_right")
    with pytest.raises(ValueError, match=r"key_length must be an int >= 0.*-1"):
        masks.causal_mask(2, -1, alignment="top_left")
    assert torch.equal(
        masks.sliding_window_mask(np.int64(4), window=np.int64(2)),
        masks.sliding_window_mask(4, window=2),
    )


def test_scores_and_additive_attention_check_scale_and_dtypes():
    # before: scaled_dot_product_scores(scale=nan) gave all-NaN scores; additive attention ran
    # a float64 key in the float32 query's precision without a word
    q, k, _ = qkv()
    with pytest.raises(ValueError, match="scale must be a finite number"):
        AF.scaled_dot_product_scores(q, k, scale=nan)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 3, 8, generator=g), torch.randn(2, 5, 6, generator=g)
    w_q, w_k, w = torch.randn(16, 8), torch.randn(16, 6), torch.randn(16)
    with pytest.raises(TypeError, match="query and key must share one dtype"):
        AF.additive_attention(q, k.double(), k.double(), w_q, w_k, w)
    with pytest.raises(TypeError, match="key and value must share one dtype"):
        AF.additive_attention(q, k, k.half(), w_q, w_k, w)


def test_attention_over_given_scores_follows_the_value_side_of_the_nan_rule():
    # before: a NaN in a value that every query masks made only its column NaN (0 * NaN in the
    # product), and an unmasked +inf value gave inf, not NaN: attention(scores(q, k), v) was not
    # scaled_dot_product_attention(q, k, v) -- in the oracle too
    q, k, v = (t.double() for t in qkv(B=2, H=4, Hkv=2, L=3, S=5, E=4, Ev=3))
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[:, 2] = False
    for bad in (nan, inf):
        v_bad = v.clone()
        v_bad[1, 0, 2, 0] = bad  # batch 1, kv head 0 (query heads 0 and 1), a masked key
        scores = AF.scaled_dot_product_scores(q, k)
        out, w = AF.attention(scores, v_bad, mask, return_weights=True)
        ref_out, ref_w = R.attention(np64(scores), np64(v_bad), np64(mask), return_weights=True)
        np.testing.assert_array_equal(out.isnan().numpy(), np.isnan(ref_out))
        np.testing.assert_array_equal(w.isnan().numpy(), np.isnan(ref_w))
        assert out[1, :2].isnan().all() and w[1, :2].isnan().all()  # every row of both heads
        assert torch.isfinite(out[0]).all() and torch.isfinite(out[1, 2:]).all()
        sdpa = AF.scaled_dot_product_attention(q, k, v_bad, mask)
        torch.testing.assert_close(out, sdpa, equal_nan=True)
        np.testing.assert_allclose(out[0].numpy(), ref_out[0], atol=1e-12)


def test_sizes_take_numpy_integers_and_refuse_bools():
    # before: MultiHeadAttention(16, True) built a one-head layer and StaticCache(True) a
    # one-slot cache; numpy integers (e.g. from a config array) were refused
    for build in (
        lambda: MultiHeadAttention(16, True),
        lambda: MultiHeadAttention(16, 4, head_dim=2.0),
        lambda: StaticCache(True),
        lambda: DynamicCache(num_layers=False),
    ):
        with pytest.raises(ValueError, match=r"must be an int >= 1"):
            build()
    layer = MultiHeadAttention(np.int64(16), np.int64(4), num_kv_heads=np.int32(2))
    assert (layer.d_model, layer.num_heads, layer.num_kv_heads) == (16, 4, 2)
    assert type(layer.num_heads) is int
    assert StaticCache(np.int64(8)).max_length == 8


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_float32_bias_with_16bit_inputs_is_not_rounded_by_the_fused_path(dtype):
    """The fused path cast a float32 mask to the inputs' dtype: an ALiBi bias up to 255 moved by
    up to 0.5 in bfloat16 (output 0.73 off float64, where the blocked and eager paths, which add
    it in float32, are 0.008 off), so the answer changed with grad mode and the measured kernel
    choice. Now every path is within twice the float32-computing control."""
    g = torch.Generator().manual_seed(0)
    L = S = 256
    q, k, v = (torch.randn(1, 2, L, 32, generator=g).to(dtype) for _ in range(3))
    bias = 0.5 * torch.arange(S, dtype=torch.float32).expand(L, S) + torch.rand(L, S, generator=g)
    want, _ = R.scaled_dot_product_attention(
        *(np64(t) for t in (q, k, v, bias)), is_causal=True, return_weights=True
    )
    with torch.no_grad():
        assert AF.explain(q, k, v, bias, is_causal=True).path == "fused"
        got = AF.scaled_dot_product_attention(q, k, v, bias, is_causal=True)
        eager = AF.scaled_dot_product_attention(q, k, v, bias, is_causal=True, return_weights=True)
    control = np.abs(eager[0].double().numpy() - want).max()  # the weights path: float32 bias
    error = np.abs(got.double().numpy() - want).max()
    assert error <= max(2 * control, 4 * torch.finfo(dtype).eps * np.abs(want).max()), (
        error,
        control,
    )
