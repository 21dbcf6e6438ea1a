"""``attnlab.compat.MultiheadAttention`` vs ``torch.nn.MultiheadAttention``: a port is one import.

The usage patterns torch's own module is tested with, in our words: self- and cross-attention,
kdim/vdim, bool and float masks of both shapes, key padding, batch_first both ways, unbatched
inputs, weights averaged or per head, the is_causal hint, add_bias_kv, add_zero_attn,
bias=False, dropout, state dicts both ways, float32 and float64, gradients, and the exceptions
for bad inputs. Each case builds torch's module from a seed, loads its state dict into ours
(strict) and compares values.

Tolerances: float64 at 1e-12 (a few dozen roundings of ~1e-16). float32 is held to a control:
torch's float64 result is the reference, and our float32 error may be at most twice torch's own
float32 error (plus a few ulps of the output's scale, for the case where torch is lucky).

torch is run on its slow path (``torch.backends.mha.set_fastpath_enabled(False)``), the one this
module follows; one test checks that the fast path agrees too where it applies.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from attnlab.compat import MultiheadAttention

F64_ATOL = 1e-12
D, H = 16, 4  # embed_dim, num_heads
N, L, S = 3, 5, 7  # batch, query length, key length


@pytest.fixture(autouse=True)
def torch_slow_path():
    before = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    yield
    torch.backends.mha.set_fastpath_enabled(before)


def pair(dtype=torch.float64, seed=0, **kwargs):
    """torch's module built from ``seed`` and ours with its state dict (strict), both eval."""
    torch.manual_seed(seed)
    theirs = nn.MultiheadAttention(D, H, dtype=dtype, **kwargs).eval()
    ours = MultiheadAttention(D, H, dtype=dtype, **kwargs).eval()
    ours.load_state_dict(theirs.state_dict(), strict=True)
    with torch.no_grad():  # non-zero biases, so that a bias in the wrong place shows
        for name, p in theirs.named_parameters():
            if "bias" in name and p.dim() == 1:
                p.uniform_(-0.5, 0.5)
        ours.load_state_dict(theirs.state_dict(), strict=True)
    return theirs, ours


def inputs(dtype=torch.float64, batch_first=False, kdim=D, vdim=D, seed=1, n=N, l=L, s=S):
    """query, key, value in torch's layout: (L, N, D), or (N, L, D) with batch_first."""
    g = torch.Generator().manual_seed(seed)

    def make(length, width):
        x = torch.randn(n, length, width, generator=g, dtype=dtype)
        return x if batch_first else x.transpose(0, 1)

    return make(l, D), make(s, kdim), make(s, vdim)


def padding(n=N, s=S, seed=2):
    """A torch key_padding_mask (True = padding) that leaves every row at least 2 real keys."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, s + 1, (n,), generator=g)
    return torch.arange(s)[None, :] >= lengths[:, None]  # (N, S)


def bool_mask(shape, seed=3):
    """A torch bool attn_mask (True = masked) that leaves key 0 visible to every query."""
    g = torch.Generator().manual_seed(seed)
    masked = torch.rand(shape, generator=g) < 0.4
    masked[..., 0] = False
    return masked


def as_float(masked: torch.Tensor, dtype=torch.float64) -> torch.Tensor:
    """The same torch mask as an additive bias (-inf where masked), plus a finite bias."""
    g = torch.Generator().manual_seed(4)
    bias = torch.randn(masked.shape, generator=g, dtype=dtype) * 0.5
    return bias.masked_fill(masked, float("-inf"))


def both(theirs, ours, *args, **kwargs):
    return theirs(*args, **kwargs), ours(*args, **kwargs)


def assert_f64_equal(got, expected, atol=F64_ATOL):
    if expected is None:
        assert got is None
        return
    assert got.shape == expected.shape and got.dtype == expected.dtype
    torch.testing.assert_close(got, expected, rtol=0, atol=atol)


def assert_f32_within_control(got32, torch32, torch64):
    """Our float32 error vs torch's float64 at most 2x torch's own float32 error (+ ulps)."""
    assert got32.shape == torch32.shape and got32.dtype == torch.float32
    ours = (got32.double() - torch64).abs().max().item()
    control = (torch32.double() - torch64).abs().max().item()
    floor = 4 * torch.finfo(torch.float32).eps * torch64.abs().max().item()
    assert ours <= 2 * control + floor, (ours, control, floor)


# --- parameters and state dicts ------------------------------------------------------------

CONFIGS = [
    {},
    {"kdim": 5, "vdim": 7},
    {"bias": False},
    {"add_bias_kv": True},
    {"add_zero_attn": True},
    {"add_bias_kv": True, "add_zero_attn": True, "kdim": 6, "vdim": 6},
]


@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_same_seed_gives_the_same_parameters_and_the_same_state_dict(config):
    torch.manual_seed(7)
    theirs = nn.MultiheadAttention(D, H, **config)
    torch.manual_seed(7)
    ours = MultiheadAttention(D, H, **config)
    a, b = theirs.state_dict(), ours.state_dict()
    assert list(a) == list(b)  # names and order
    for name in a:
        assert torch.equal(a[name], b[name]), name  # torch's initialisation, draw for draw
    assert [n for n, _ in theirs.named_parameters()] == [n for n, _ in ours.named_parameters()]
    for attr in ("embed_dim", "num_heads", "head_dim", "kdim", "vdim", "dropout", "batch_first"):
        assert getattr(ours, attr) == getattr(theirs, attr), attr
    assert ours._qkv_same_embed_dim == theirs._qkv_same_embed_dim
    assert (ours.in_proj_bias is None) == (theirs.in_proj_bias is None)
    assert (ours.out_proj.bias is None) == (theirs.out_proj.bias is None)


@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_state_dict_round_trip_both_ways_strict(config):
    torch.manual_seed(0)
    theirs = nn.MultiheadAttention(D, H, dtype=torch.float64, **config).eval()
    torch.manual_seed(99)  # different parameters: loading must overwrite every one
    ours = MultiheadAttention(D, H, dtype=torch.float64, **config).eval()
    ours.load_state_dict(theirs.state_dict(), strict=True)
    q, k, v = inputs(kdim=ours.kdim, vdim=ours.vdim)
    expected = theirs(q, k, v)
    for a, b in zip(ours(q, k, v), expected, strict=True):
        assert_f64_equal(a, b)
    # and back: torch's module loads ours (strict) and computes the same
    ours.train()
    with torch.no_grad():
        for p in ours.parameters():
            p.add_(0.01)
    fresh = nn.MultiheadAttention(D, H, dtype=torch.float64, **config).eval()
    fresh.load_state_dict(ours.state_dict(), strict=True)
    ours.eval()
    for a, b in zip(ours(q, k, v), fresh(q, k, v), strict=True):
        assert_f64_equal(a, b)


# --- forward, value by value ---------------------------------------------------------------


@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("average", [True, False])
def test_self_attention_float64(batch_first, need_weights, average):
    theirs, ours = pair(batch_first=batch_first)
    x, _, _ = inputs(batch_first=batch_first)
    (out_t, w_t), (out_o, w_o) = both(
        theirs, ours, x, x, x, need_weights=need_weights, average_attn_weights=average
    )
    assert_f64_equal(out_o, out_t)
    assert_f64_equal(w_o, w_t)
    if need_weights:  # (N, L, S) averaged, (N, H, L, S) per head
        assert w_o.shape == ((N, L, L) if average else (N, H, L, L))


@pytest.mark.parametrize("need_weights", [True, False])
def test_self_attention_float32_against_a_float64_control(need_weights):
    theirs64, _ = pair(torch.float64)
    theirs32, ours32 = pair(torch.float32)
    ours32.load_state_dict({k: v.float() for k, v in theirs64.state_dict().items()})
    theirs32.load_state_dict(ours32.state_dict())
    x = inputs(torch.float32)[0]
    mask = bool_mask((L, L))
    out64, w64 = theirs64(x.double(), x.double(), x.double(), attn_mask=mask)
    (out_t, w_t), (out_o, w_o) = both(
        theirs32, ours32, x, x, x, attn_mask=mask, need_weights=need_weights
    )
    assert_f32_within_control(out_o, out_t, out64)
    if need_weights:
        assert_f32_within_control(w_o, w_t, w64)


@pytest.mark.parametrize("kdim, vdim", [(5, 7), (D, 9), (11, D)])
@pytest.mark.parametrize("batch_first", [False, True])
def test_cross_attention_with_kdim_vdim(kdim, vdim, batch_first):
    theirs, ours = pair(kdim=kdim, vdim=vdim, batch_first=batch_first)
    assert ours.in_proj_weight is None and ours.k_proj_weight.shape == (D, kdim)
    q, k, v = inputs(batch_first=batch_first, kdim=kdim, vdim=vdim)
    kpm = padding()
    for need_weights in (True, False):
        (out_t, w_t), (out_o, w_o) = both(
            theirs, ours, q, k, v, key_padding_mask=kpm, need_weights=need_weights
        )
        assert_f64_equal(out_o, out_t)
        assert_f64_equal(w_o, w_t)


def test_cross_attention_key_is_value():
    theirs, ours = pair()
    q, k, _ = inputs()
    (out_t, w_t), (out_o, w_o) = both(theirs, ours, q, k, k)
    assert_f64_equal(out_o, out_t)
    assert_f64_equal(w_o, w_t)


@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("dims", [2, 3])
@pytest.mark.parametrize("need_weights", [True, False])
def test_attn_mask_bool_and_float_2d_and_3d(kind, dims, need_weights):
    theirs, ours = pair()
    q, k, v = inputs()
    masked = bool_mask((L, S) if dims == 2 else (N * H, L, S))
    mask = masked if kind == "bool" else as_float(masked)
    (out_t, w_t), (out_o, w_o) = both(
        theirs, ours, q, k, v, attn_mask=mask, need_weights=need_weights
    )
    assert_f64_equal(out_o, out_t)
    assert_f64_equal(w_o, w_t)
    if need_weights:  # masked weights are exactly zero, in torch's polarity
        _, w_heads = ours(q, k, v, attn_mask=mask, average_attn_weights=False)
        hidden = masked if dims == 2 else masked.view(N, H, L, S)
        assert (w_heads[hidden.expand(N, H, L, S)] == 0).all()


def test_3d_attn_mask_is_batch_major_then_heads():
    """(N * H, L, S): entry n * H + h is batch n, head h, as in torch."""
    _, ours = pair()
    q, k, v = inputs()
    masked = torch.ones(N * H, L, S, dtype=torch.bool)
    for n in range(N):
        for h in range(H):
            masked[n * H + h, :, (n + h) % S] = False  # only one key visible
    _, w = ours(q, k, v, attn_mask=masked, average_attn_weights=False)
    for n in range(N):
        for h in range(H):
            assert (w[n, h, :, (n + h) % S] == 1).all()


@pytest.mark.parametrize("kpm_kind", ["bool", "float"])
@pytest.mark.parametrize("mask_kind", [None, "bool", "float"])
@pytest.mark.parametrize("average", [True, False])
def test_key_padding_mask_bool_and_float_alone_and_with_attn_mask(kpm_kind, mask_kind, average):
    theirs, ours = pair()
    q, k, v = inputs()
    kpm = padding()
    kpm = kpm if kpm_kind == "bool" else as_float(kpm)
    mask = None
    if mask_kind is not None:
        mask = bool_mask((L, S))
        mask = mask if mask_kind == "bool" else as_float(mask)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        (out_t, w_t), (out_o, w_o) = both(
            theirs, ours, q, k, v, key_padding_mask=kpm, attn_mask=mask,
            average_attn_weights=average,
        )  # fmt: skip
    assert_f64_equal(out_o, out_t)
    assert_f64_equal(w_o, w_t)
    mixed = mask is not None and mask.dtype != kpm.dtype
    assert len([w for w in seen if "dtype" in str(w.message) or "mismatch" in str(w.message)]) == (
        2 if mixed else 0
    )  # torch warns about mixed mask dtypes; so do we


def test_all_false_key_padding_mask_equals_no_mask():
    """torch's all-False key_padding_mask means "no padding" (attnlab's own layer reads a bool
    key padding mask as True = real token, where all-False would mask every key)."""
    theirs, ours = pair()
    q, k, v = inputs()
    none = torch.zeros(N, S, dtype=torch.bool)
    (out_t, w_t), (out_o, w_o) = both(theirs, ours, q, k, v, key_padding_mask=none)
    out_plain, w_plain = ours(q, k, v)
    assert_f64_equal(out_o, out_t)
    assert_f64_equal(w_o, w_t)
    assert_f64_equal(out_o, out_plain)
    assert_f64_equal(w_o, w_plain)
    assert (w_o > 0).all()


@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("average", [True, False])
def test_unbatched_inputs(need_weights, average):
    theirs, ours = pair(batch_first=True)  # batch_first is ignored for unbatched input
    q, k, v = (x[:, 0] for x in inputs())  # (L, D), (S, D), (S, D)
    kpm = padding(n=1)[0]  # (S,)
    mask = bool_mask((H, L, S))  # (num_heads, L, S)
    for kwargs in ({}, {"key_padding_mask": kpm}, {"attn_mask": mask}, {"attn_mask": mask[0]}):
        (out_t, w_t), (out_o, w_o) = both(
            theirs, ours, q, k, v, need_weights=need_weights, average_attn_weights=average,
            **kwargs,
        )  # fmt: skip
        assert out_o.shape == (L, D)
        assert_f64_equal(out_o, out_t)
        assert_f64_equal(w_o, w_t)


@pytest.mark.parametrize("with_padding", [False, True])
@pytest.mark.parametrize("need_weights", [True, False])
def test_is_causal_with_a_causal_mask(with_padding, need_weights):
    theirs, ours = pair(batch_first=True)
    x = inputs(batch_first=True)[0]
    causal = nn.Transformer.generate_square_subsequent_mask(L, dtype=torch.float64)
    for mask in (causal, torch.ones(L, L, dtype=torch.bool).triu(1)):
        kpm = None
        if with_padding:  # the same dtype for both masks, as torch asks
            kpm = padding(s=L) if mask.dtype == torch.bool else as_float(padding(s=L))
        (out_t, w_t), (out_o, w_o) = both(
            theirs, ours, x, x, x, attn_mask=mask, is_causal=True, key_padding_mask=kpm,
            need_weights=need_weights,
        )  # fmt: skip
        assert_f64_equal(out_o, out_t)
        assert_f64_equal(w_o, w_t)


@pytest.mark.parametrize(
    "config", [{}, {"add_zero_attn": True}, {"add_bias_kv": True, "add_zero_attn": True}], ids=str
)
def test_is_causal_hint_without_weights_reads_no_mask_as_torch(config):
    """torch trusts the hint: with need_weights=False and no key padding it runs top-left
    causal attention and never reads attn_mask (appended keys included: top-left over S + 1 or
    S + 2 keys). We do the same, so ports agree."""
    theirs, ours = pair(batch_first=True, **config)
    x = inputs(batch_first=True)[0]
    not_causal = bool_mask((L, L))
    (out_t, _), (out_o, _) = both(
        theirs, ours, x, x, x, attn_mask=not_causal, is_causal=True, need_weights=False
    )
    assert_f64_equal(out_o, out_t)
    if not config:  # no appended keys: the hint is the causal mask
        causal = torch.ones(L, L, dtype=torch.bool).triu(1)
        assert_f64_equal(out_o, ours(x, x, x, attn_mask=causal, need_weights=False)[0])


def test_is_causal_without_attn_mask_raises_runtime_error_as_torch():
    theirs, ours = pair()
    x = inputs()[0]
    with pytest.raises(RuntimeError):
        theirs(x, x, x, is_causal=True)
    with pytest.raises(RuntimeError, match="attn_mask"):
        ours(x, x, x, is_causal=True)


@pytest.mark.parametrize(
    "config",
    [{"add_bias_kv": True}, {"add_zero_attn": True}, {"add_bias_kv": True, "add_zero_attn": True}],
    ids=str,
)
@pytest.mark.parametrize("masks", ["none", "bool", "float"])
@pytest.mark.parametrize("need_weights", [True, False])
def test_add_bias_kv_and_add_zero_attn(config, masks, need_weights):
    theirs, ours = pair(**config)
    q, k, v = inputs()
    kwargs = {}
    if masks != "none":
        kpm, mask = padding(), bool_mask((N * H, L, S))
        kwargs = (
            {"key_padding_mask": kpm, "attn_mask": mask}
            if masks == "bool"
            else {"key_padding_mask": as_float(kpm), "attn_mask": as_float(mask)}
        )
    (out_t, w_t), (out_o, w_o) = both(
        theirs, ours, q, k, v, need_weights=need_weights, average_attn_weights=False, **kwargs
    )
    assert_f64_equal(out_o, out_t)
    assert_f64_equal(w_o, w_t)
    if need_weights:  # one more key per option, never masked
        extra = len(config)
        assert w_o.shape == (N, H, L, S + extra)
        assert (w_o[..., S:] > 0).all()


def test_add_zero_attn_rescues_fully_padded_rows_as_torch():
    """A zero key is never masked: a fully padded sequence attends to it (no NaN in torch)."""
    theirs, ours = pair(add_zero_attn=True)
    q, k, v = inputs()
    kpm = padding()
    kpm[1] = True
    (out_t, w_t), (out_o, w_o) = both(theirs, ours, q, k, v, key_padding_mask=kpm)
    assert not out_t.isnan().any()
    assert_f64_equal(out_o, out_t)
    assert_f64_equal(w_o, w_t)
    assert (w_o[1, :, S] == 1).all()


@pytest.mark.parametrize("config", [{}, {"add_bias_kv": True, "add_zero_attn": True}])
@pytest.mark.parametrize("batch_first", [False, True])
def test_an_empty_batch_gives_torchs_empty_results(config, batch_first):
    """N = 0 (a data loader's empty last batch): torch returns empty results; ours did
    ``view(N, -1, ...)``, which cannot infer -1 from 0 elements, and raised."""
    theirs, ours = pair(batch_first=batch_first, **config)
    (out_t, w_t), (out_o, w_o) = both(theirs, ours, *inputs(batch_first=batch_first, n=0))
    assert out_o.shape == out_t.shape and w_o.shape == w_t.shape
    assert out_o.numel() == 0 and w_o.numel() == 0


def test_bias_false():
    theirs, ours = pair(bias=False)
    assert ours.in_proj_bias is None and ours.out_proj.bias is None
    q, k, v = inputs()
    mask = bool_mask((L, S))
    for a, b in zip(ours(q, k, v, attn_mask=mask), theirs(q, k, v, attn_mask=mask), strict=True):
        assert_f64_equal(a, b)


def test_fast_path_agrees_where_torch_takes_it():
    """eval, batch_first, self-attention, even heads, no grad: torch's fused fast path."""
    torch.backends.mha.set_fastpath_enabled(True)
    theirs, ours = pair(torch.float32, batch_first=True)
    theirs64, _ = pair(torch.float64, batch_first=True)
    theirs64.load_state_dict({k: v.double() for k, v in theirs.state_dict().items()})
    x = inputs(torch.float32, batch_first=True)[0]
    kpm = padding(s=L)
    with torch.no_grad():
        (out_t, _), (out_o, _) = both(theirs, ours, x, x, x, key_padding_mask=kpm)
        out64, _ = theirs64(x.double(), x.double(), x.double(), key_padding_mask=kpm)
    assert_f32_within_control(out_o, out_t, out64)


# a GPU, where there is one, runs the same checks (no skip: CI fails on skipped tests)
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("need_weights", [True, False])
def test_float32_matches_torch_with_masks_and_dead_rows(device, need_weights):
    theirs, ours = pair(torch.float32, batch_first=True)
    theirs64, _ = pair(torch.float64, batch_first=True)
    theirs64.load_state_dict({k: v.double() for k, v in theirs.state_dict().items()})
    theirs, ours = theirs.to(device), ours.to(device)
    q, k, v = inputs(torch.float32, batch_first=True)
    kpm, mask = padding(), bool_mask((L, S))
    mask[1] = True  # query 1 sees nothing: 0 here (torch: NaN, or 0 on some kernels)
    args = [t.to(device) for t in (q, k, v)]
    kw = {"key_padding_mask": kpm.to(device), "attn_mask": mask.to(device)}
    kw["need_weights"] = need_weights
    with torch.no_grad():
        (out_t, _), (out_o, w_o) = both(theirs, ours, *args, **kw)
        out64, _ = theirs64(
            q.double(), k.double(), v.double(), key_padding_mask=kpm, attn_mask=mask
        )
    alive = [i for i in range(L) if i != 1]
    assert out_o.isfinite().all()
    assert_f32_within_control(out_o[:, alive].cpu(), out_t[:, alive].cpu(), out64[:, alive])
    torch.testing.assert_close(out_o[:, 1], ours.out_proj.bias.detach().expand(N, D))
    if need_weights:
        assert (w_o[:, 1] == 0).all()


# --- where we differ on purpose: rows with no key to attend ---------------------------------


@pytest.mark.parametrize("need_weights", [True, False])
def test_fully_masked_rows_give_zero_attention_where_torch_gives_nan(need_weights):
    theirs, ours = pair()
    q, k, v = (x.clone().requires_grad_() for x in inputs())
    masked = bool_mask((L, S))
    masked[2] = True  # query 2 may attend nothing
    (out_t, w_t), (out_o, w_o) = both(
        theirs, ours, q, k, v, attn_mask=masked, need_weights=need_weights
    )
    alive = [i for i in range(L) if i != 2]
    assert_f64_equal(out_o[alive], out_t[alive])
    # attention output 0, so the layer returns out_proj's bias for that row
    assert_f64_equal(out_o[2], ours.out_proj.bias.expand(N, D).detach())
    if need_weights:  # torch: NaN for the whole row (its SDPA path, need_weights=False, may
        assert out_t[2].isnan().all()  # give NaN or, on CPU, 0 like us: torch is not consistent)
    else:
        assert out_t[2].isnan().all() or torch.equal(out_t[2], out_o[2])
    if need_weights:
        assert (w_o[:, 2] == 0).all()
        assert_f64_equal(w_o[:, alive], w_t[:, alive])
    out_o.sum().backward()
    for x in (q, k, v, *ours.parameters()):
        assert x.grad.isfinite().all()


# --- dropout -------------------------------------------------------------------------------


def test_dropout_in_eval_mode_is_deterministic_and_equals_torch():
    theirs, ours = pair(dropout=0.5)
    q, k, v = inputs()
    first = ours(q, k, v)
    for a, b, c in zip(first, ours(q, k, v), theirs(q, k, v), strict=True):
        assert torch.equal(a, b)
        assert_f64_equal(a, c)


@pytest.mark.parametrize("p", [0.2, 0.5])
def test_dropout_in_training_mode_has_torchs_statistics(p):
    theirs, ours = pair(dropout=p)
    q, k, v = inputs()
    _, clean = ours(q, k, v, average_attn_weights=False)  # eval: no dropout
    ours.train()
    theirs.train()
    torch.manual_seed(5)
    _, dropped = ours(q, k, v, average_attn_weights=False)
    # each weight is zeroed with probability p, survivors are scaled by 1 / (1 - p)
    kept = dropped != 0
    torch.testing.assert_close(dropped[kept], clean[kept] / (1 - p), rtol=1e-12, atol=0)
    n, rate = kept.numel(), 1 - kept.double().mean().item()
    sigma = (p * (1 - p) / n) ** 0.5
    assert abs(rate - p) < 5 * sigma, (rate, p)
    _, theirs_dropped = theirs(q, k, v, average_attn_weights=False)
    theirs_rate = 1 - (theirs_dropped != 0).double().mean().item()
    assert abs(theirs_rate - p) < 5 * sigma
    # the output is unbiased: its mean over many draws approaches the eval output
    outs = torch.stack([ours(q, k, v, need_weights=False)[0] for _ in range(400)])
    ours.eval()
    expected = ours(q, k, v, need_weights=False)[0]
    spread = outs.std(0) / 400**0.5
    assert ((outs.mean(0) - expected).abs() <= 5 * spread + 1e-12).float().mean() > 0.99


# --- gradients -----------------------------------------------------------------------------


@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize(
    "config", [{}, {"kdim": 5, "vdim": 7}, {"add_bias_kv": True, "add_zero_attn": True}], ids=str
)
def test_gradients_equal_torchs(need_weights, config):
    theirs, ours = pair(**config)
    q, k, v = inputs(kdim=ours.kdim, vdim=ours.vdim)
    kpm, mask = as_float(padding()), as_float(bool_mask((L, S)))
    g = torch.Generator().manual_seed(6)
    grads = {}
    for name, module in (("theirs", theirs), ("ours", ours)):
        module.zero_grad()
        x = [t.clone().requires_grad_() for t in (q, k, v)]
        out, w = module(*x, key_padding_mask=kpm, attn_mask=mask, need_weights=need_weights)
        g.manual_seed(6)
        loss = (out * torch.randn(out.shape, generator=g, dtype=out.dtype)).sum()
        if need_weights:  # gradients through the weights too
            loss = loss + (w * torch.randn(w.shape, generator=g, dtype=w.dtype)).sum()
        loss.backward()
        grads[name] = [t.grad for t in x] + [p.grad for _, p in module.named_parameters()]
    assert len(grads["ours"]) == len(grads["theirs"])
    for a, b in zip(grads["ours"], grads["theirs"], strict=True):
        assert_f64_equal(a, b)


# --- the same exceptions for the same bad inputs -------------------------------------------


def test_constructor_errors_are_torchs():
    for args, error in (((D, 3), AssertionError), ((0, 2), ValueError), ((D, 0), ValueError)):
        with pytest.raises(error):
            nn.MultiheadAttention(*args)
        with pytest.raises(error) as info:
            MultiheadAttention(*args)
        assert isinstance(info.value, ValueError)  # attnlab's convention as well
    with pytest.raises(ValueError, match=r"num_heads=3 must divide embed_dim=16.*\[1, 2, 4, 8"):
        MultiheadAttention(D, 3)


def _bad_calls():
    q, k, v = inputs()
    kpm, mask = padding(), bool_mask((L, S))
    return {
        "query of the wrong width": ({}, (q[..., :8], k, v), {}),
        "1-D query": ({}, (q[0, 0], k[0, 0], v[0, 0]), {}),
        "2-D key for a 3-D query": ({}, (q, k[:, 0], v), {}),
        "2-D value for a 3-D query": ({}, (q, k, v[:, 0]), {}),
        "key and value lengths differ": ({}, (q, k, v[:-1]), {}),
        "key of the wrong width (packed weights)": ({}, (q, k[..., :8], v[..., :8]), {}),
        "key of the wrong width (kdim)": ({"kdim": 5, "vdim": 7}, (q, k[..., :4], v[..., :7]), {}),
        "key_padding_mask 1-D for a 3-D query": ({}, (q, k, v), {"key_padding_mask": kpm[0]}),
        "key_padding_mask of the wrong length": ({}, (q, k, v), {"key_padding_mask": kpm[:, 1:]}),
        "key_padding_mask of the wrong batch": ({}, (q, k, v), {"key_padding_mask": kpm[1:]}),
        "attn_mask 1-D": ({}, (q, k, v), {"attn_mask": mask[0]}),
        "attn_mask 4-D": ({}, (q, k, v), {"attn_mask": mask[None, None]}),
        "attn_mask (L, S) transposed": ({}, (q, k, v), {"attn_mask": mask.T}),
        "attn_mask (N, L, S) not (N * H, L, S)": (
            {},
            (q, k, v),
            {"attn_mask": mask.expand(N, L, S)},
        ),
        "unbatched attn_mask (N * H, L, S)": (
            {},
            (q[:, 0], k[:, 0], v[:, 0]),
            {"attn_mask": mask.expand(N * H, L, S)},
        ),
        "integer attn_mask": ({}, (q, k, v), {"attn_mask": mask.long()}),
        "integer key_padding_mask": ({}, (q, k, v), {"key_padding_mask": kpm.int()}),
    }


@pytest.mark.parametrize("case", list(_bad_calls()))
def test_bad_inputs_raise_torchs_exception_type_with_a_clear_message(case):
    config, args, kwargs = _bad_calls()[case]
    theirs, ours = pair(**config)
    with pytest.raises(Exception) as torch_error:
        theirs(*args, **kwargs)
    expected = type(torch_error.value)
    assert expected in (AssertionError, RuntimeError), expected
    with pytest.raises(expected) as info:
        ours(*args, **kwargs)
    assert isinstance(info.value, ValueError | TypeError)  # attnlab's convention as well
    message = str(info.value)
    named = [w for w in ("query", "key", "value", "key_padding_mask", "attn_mask") if w in message]
    assert named, message
    assert "got" in message, message  # says what it received


def test_docstring_example_runs():
    import doctest

    import attnlab.compat

    result = doctest.testmod(
        attnlab.compat, extraglobs={"torch": torch}, optionflags=doctest.ELLIPSIS
    )
    assert result.attempted >= 5 and result.failed == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("which", ["key_padding_mask", "attn_mask"])
def test_a_float_mask_out_of_the_inputs_range_is_refused_not_made_dead(dtype, which):
    # before: a float32 mask row of finfo(float32).min, cast to 16 bits, became -inf: a dead row
    # (output = out_proj.bias) where torch attends uniformly
    theirs, ours = pair(dtype=dtype)
    q, k, v = (t.to(dtype) for t in inputs())
    mask = torch.zeros(N, S) if which == "key_padding_mask" else torch.zeros(L, S)
    mask[1] = torch.finfo(torch.float32).min
    with pytest.raises(ValueError, match=rf"{which} \(torch.float32\).*outside.*True = masked"):
        ours(q, k, v, **{which: mask}, need_weights=False)
    mask[1, :3] = -float("inf")  # the fix the message names (a row keeping some keys)
    mask[1, 3:] = 0.0
    with torch.no_grad():
        expected, _ = theirs(q, k, v, **{which: mask}, need_weights=False)
        got, _ = ours(q, k, v, **{which: mask}, need_weights=False)
    torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2)


def test_is_causal_without_a_mask_raises_torchs_type_and_attnlabs():
    # from a review: a bare RuntimeError, which `except ValueError` (attnlab's rule) missed
    mha = MultiheadAttention(8, 2, batch_first=True)
    x = torch.randn(1, 3, 8)
    for kind in (ValueError, RuntimeError):
        with pytest.raises(kind, match="is_causal=True is a hint"):
            mha(x, x, x, is_causal=True)
