"""attnlab's Llama-architecture decoder against Hugging Face's, on random and on real weights.

Tolerances come from a control: Hugging Face's own two implementations ("eager" and "sdpa")
disagree by some amount on the same weights; attnlab may differ from eager by at most twice that
(plus a few float32 ulps of the logits' scale, in case the control happens to agree exactly).
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from attnlab.functional import rotary_frequencies  # noqa: E402
from attnlab.models import LlamaModel  # noqa: E402
from attnlab.models.decode import DecodeStep  # noqa: E402


def hf_logits(model, ids, mask, impl):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits


def check_logits(hf_model, ours, ids, mask):
    eager = hf_logits(hf_model, ids, mask, "eager")
    sdpa = hf_logits(hf_model, ids, mask, "sdpa")
    with torch.no_grad():
        got = ours(ids, key_mask=mask.bool())
    real = mask.bool()
    control = (sdpa - eager)[real].abs().max()
    err = (got - eager)[real].abs().max()
    floor = 8 * torch.finfo(torch.float32).eps * eager[real].abs().max()
    assert err <= 2 * control + floor, (err, control)
    return err, control


def tiny(model_cls, config_cls, **extra):
    torch.manual_seed(0)
    cfg = config_cls(
        vocab_size=120,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        **extra,
    )
    return model_cls(cfg).eval()


def padded_batch(vocab, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    P = max(lengths)
    ids = torch.randint(3, vocab, (len(lengths), P), generator=g)
    mask = torch.zeros(len(lengths), P, dtype=torch.long)
    for b, n in enumerate(lengths):
        mask[b, P - n :] = 1
        ids[b, : P - n] = 0
    return ids, mask


def test_tiny_llama_logits_and_generation():
    hf_model = tiny(transformers.LlamaForCausalLM, transformers.LlamaConfig)
    ours = LlamaModel.from_hf(hf_model)
    ids, mask = padded_batch(120, [9, 5, 7])
    check_logits(hf_model, ours, ids, mask)
    hf_model.set_attn_implementation("eager")
    want = hf_model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0
    )
    for kind in ("dynamic", "static"):
        got = ours.generate(ids, 10, cache=kind, key_mask=mask.bool())
        assert torch.equal(got, want), kind


def test_tiny_mistral_sliding_window_with_every_cache():
    """Sliding-window attention (Mistral) with the sliding-window ring-buffer cache."""
    hf_model = tiny(transformers.MistralForCausalLM, transformers.MistralConfig, sliding_window=4)
    ours = LlamaModel.from_hf(hf_model)
    assert ours.cfg.sliding_window == 4
    ids = torch.randint(3, 120, (2, 11), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    check_logits(hf_model, ours, ids, mask)
    hf_model.set_attn_implementation("eager")
    want = hf_model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0
    )
    for kind in ("dynamic", "static", "sliding"):
        assert torch.equal(ours.generate(ids, 8, cache=kind), want), kind


def test_a_llama_config_with_a_sliding_window_attends_every_key_as_hf():
    """Hugging Face's Llama never reads config.sliding_window (Mistral's does); attnlab applied
    it to any config (0.09-0.35 off eager past the window before)."""
    hf_model = tiny(transformers.LlamaForCausalLM, transformers.LlamaConfig, sliding_window=4)
    ours = LlamaModel.from_hf(hf_model)
    assert ours.cfg.sliding_window is None
    ids = torch.randint(3, 120, (2, 11), generator=torch.Generator().manual_seed(1))
    check_logits(hf_model, ours, ids, torch.ones_like(ids))


def test_position_ids_of_one_row_are_shared_as_hugging_face_passes_them():
    hf_model = tiny(transformers.LlamaForCausalLM, transformers.LlamaConfig)
    ours = LlamaModel.from_hf(hf_model)
    ids = torch.randint(3, 120, (3, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = ours(ids, position_ids=torch.arange(7) + 2)
        got = ours(ids, position_ids=torch.arange(7)[None] + 2)  # (1, L): refused before
    assert torch.equal(got, want)


@pytest.fixture(scope="module")
def smollm2():
    from attnlab.pretrained import load_model

    model, tokenizer = load_model("smollm2", attn_implementation="eager")
    return model, tokenizer


def test_smollm2_real_weights(smollm2):
    """SmolLM2-135M (30 layers, GQA 9/3, RoPE base 1e5) through attnlab's layers."""
    hf_model, tok = smollm2
    ours = LlamaModel.from_hf(hf_model)
    batch = tok(
        ["The capital of France is", "Attention is all you need, said"],
        return_tensors="pt",
        padding=True,
        padding_side="left",
    )
    check_logits(hf_model, ours, batch["input_ids"], batch["attention_mask"])
    hf_model.set_attn_implementation("eager")
    want = hf_model.generate(**batch, max_new_tokens=12, do_sample=False)
    for kind in ("dynamic", "static"):
        got = ours.generate(
            batch["input_ids"], 12, cache=kind, key_mask=batch["attention_mask"].bool()
        )
        assert torch.equal(got, want), kind
    assert "Paris" in tok.decode(want[0, -12:])


def test_eager_static_cache_attends_to_its_filled_slots_as_a_dynamic_cache_does():
    """Eagerly, a StaticCache's layers read its filled slots alone (slots fill in order from 0):
    the same keys, alignment and kernel as a DynamicCache, so the same logits bit for bit (when
    the empty slots were masked instead, the sums ran over other blocks: last-bit differences).
    Weights still span every slot, the empty ones 0."""
    from attnlab.models.llama import LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=128, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, d_ff=128
    )
    model = LlamaModel(cfg).eval()
    prompt = torch.randint(0, 128, (2, 37), generator=torch.Generator().manual_seed(1))
    static, dynamic = model.make_cache("static", max_length=300), model.make_cache("dynamic")
    with torch.no_grad():
        for tokens in (prompt, prompt[:, :1], prompt[:, 1:3]):  # a prefill, then 1 and 2 tokens
            a, b = model(tokens, cache=static), model(tokens, cache=dynamic)
            assert torch.equal(a, b)
            assert static.filled_prefix(0) == dynamic.filled_prefix(0) == static.get_seq_length()
        _, weights = model(prompt[:, :1], cache=static, return_weights=True)
    n = static.get_seq_length()
    assert weights[0].shape == (2, 4, 1, 300)
    assert weights[0][..., n:].abs().max() == 0
    torch.testing.assert_close(weights[0].sum(-1), torch.ones(2, 4, 1))


def test_static_cache_decode_step_compiles_as_one_graph_and_stops_recompiling():
    """torch.compile(fullgraph=True) on a decode step with a StaticCache: no graph break, the
    logits of eager decoding (within twice eager's float32 error against float64: the compiled
    step attends to every slot with a mask, eager to the filled ones), and no new graph after
    the second step (fixed shapes)."""
    import copy

    import torch._dynamo
    from torch._dynamo.utils import counters

    from attnlab.models.llama import LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=128, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, d_ff=128
    )
    model = LlamaModel(cfg).eval()
    model64 = copy.deepcopy(model).double()
    prompt = torch.randint(0, 128, (2, 5), generator=torch.Generator().manual_seed(1))
    tokens = torch.randint(0, 128, (2, 6), generator=torch.Generator().manual_seed(2))

    def decode(model, step, on_step=lambda i: None):  # the same tokens fed to every decoder
        cache = model.make_cache("static", max_length=16)
        model(prompt, cache=cache)
        out = []
        for i in range(tokens.shape[1]):
            out.append(step(tokens[:, i : i + 1], cache))
            on_step(i)
        return torch.cat(out, 1)

    torch._dynamo.reset()
    counters.clear()
    graphs = []
    compiled = torch.compile(
        lambda tok, cache: model(tok, cache=cache), backend="aot_eager", fullgraph=True
    )
    with torch.no_grad():
        got = decode(model, compiled, lambda i: graphs.append(counters["stats"]["unique_graphs"]))
        want = decode(model, lambda tok, cache: model(tok, cache=cache))
        exact = decode(model64, lambda tok, cache: model64(tok, cache=cache))
    torch._dynamo.reset()
    err, control = (got.double() - exact).abs().max(), (want.double() - exact).abs().max()
    floor = 4 * torch.finfo(torch.float32).eps * exact.abs().max()
    assert err <= 2 * control + floor, (err, control)
    assert graphs[1] == graphs[-1], graphs  # steps 3..6 reuse the graphs of steps 1..2


@pytest.mark.parametrize(
    "config_cls, extra, named",
    [
        ("LlamaConfig", {"attention_bias": True}, "attention_bias=True"),
        ("LlamaConfig", {"mlp_bias": True}, "mlp_bias=True"),
        ("LlamaConfig", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
        (
            "LlamaConfig",
            {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}},
            "rope_type='yarn'",
        ),  # fmt: skip
        (
            "LlamaConfig",
            {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 4.0}},
            "rope_type='dynamic'",
        ),  # fmt: skip
        ("Qwen2Config", {}, "model_type='qwen2'"),
    ],
)
def test_a_config_computed_otherwise_is_refused_not_loaded(config_cls, extra, named):
    """These load without complaint into a SwiGLU, bias-free model with plain, linear or
    Llama 3 rotary frequencies and give other logits: refused, naming the setting and the way
    that runs them (Hugging Face's model on attnlab's attention)."""
    model_cls = getattr(transformers, config_cls.replace("Config", "ForCausalLM"))
    hf_model = tiny(model_cls, getattr(transformers, config_cls), **extra)
    with pytest.raises(ValueError) as info:
        LlamaModel.from_hf(hf_model)
    assert named in str(info.value) and "attn_implementation='attnlab'" in str(info.value)


@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_generate_continues_a_cache_that_holds_tokens_at_the_right_positions(kind):
    # before: the prefill continued after the cached tokens but every decode step restarted at
    # position P (the prompt's length): other tokens than decoding the whole sequence at once
    from attnlab.models import LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=100, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2)
    model = LlamaModel(cfg).double().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    prefix, prompt = torch.randint(0, 100, (2, 6)), torch.randint(0, 100, (2, 5))
    whole = model.generate(torch.cat([prefix, prompt], 1), 8)[:, 11:]
    cache = model.make_cache(kind, max_length=32)
    with torch.no_grad():
        model(prefix, cache=cache)
    continued = model.generate(prompt, 8, cache=cache)
    assert torch.equal(continued[:, 5:], whole)
    assert cache.get_seq_length(0) == 6 + 5 + 7  # (the last token needs no forward)
    with pytest.raises(ValueError, match=r"key_mask .* needs an empty cache; this one holds 18"):
        model.generate(prompt, 2, cache=cache, key_mask=torch.ones(2, 5, dtype=torch.bool))
    cache.reset()
    assert torch.equal(model.generate(prompt, 8, cache=cache), model.generate(prompt, 8))


def _sharp_tiny_llama(**extra):
    from attnlab.models import LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=50, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                      d_ff=48, **extra)  # fmt: skip
    model = LlamaModel(cfg).double().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3)  # sharper logits: a wrong position changes the tokens
    return model


@pytest.mark.parametrize("kind", ["dynamic", "static", "sliding"])
def test_continuing_a_padded_cache_counts_each_rows_own_positions(kind):
    # before: a continuation counted every row from the cache's length, padding included, so a
    # left-padded row's logits were off by up to ~200 and its greedy tokens differed
    from attnlab.models import DecodeStep

    model = _sharp_tiny_llama(**({"sliding_window": 64} if kind == "sliding" else {}))
    ids = torch.tensor([[0, 0, 0, 7, 8], [3, 4, 5, 6, 9]])  # row 0 left-padded
    km = torch.tensor([[0, 0, 0, 1, 1], [1, 1, 1, 1, 1]], dtype=torch.bool)
    with torch.no_grad():
        cache = model.make_cache(kind, max_length=32)
        model(ids, cache=cache, key_mask=km)
        assert cache.token_counts(0).tolist() == [2, 5]
        got = model(torch.tensor([[11, 13], [12, 14]]), cache=cache)[:, -1]  # no key_mask
        want0 = model(torch.tensor([[7, 8, 11, 13]]))[0, -1]
        want1 = model(torch.tensor([[3, 4, 5, 6, 9, 12, 14]]))[0, -1]
        torch.testing.assert_close(got, torch.stack([want0, want1]), rtol=0, atol=1e-10)
        # a decode step run directly, without position_ids, counts the same way
        step = DecodeStep(model, compile=False)
        if kind != "dynamic":
            got = step(torch.tensor([[21], [22]]), cache)[:, -1]
            want0 = model(torch.tensor([[7, 8, 11, 13, 21]]))[0, -1]
            torch.testing.assert_close(got[0], want0, rtol=0, atol=1e-10)
    cache = model.make_cache(kind, max_length=32)
    first = model.generate(ids, 3, cache=cache, key_mask=km)
    continued = model.generate(first[:, -1:], 4, cache=cache)
    alone = model.generate(first[:1, 3:], 4)  # row 0 without its padding
    assert torch.equal(continued[0, 1:], alone[0, -4:])


def test_generate_refuses_a_right_padded_prompt():
    # before: row 0's next token was read at a padding position (it generated [0, 0, 0, 0])
    model = _sharp_tiny_llama()
    ids = torch.tensor([[7, 8, 0, 0], [3, 4, 5, 6]])
    km = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    with pytest.raises(ValueError, match=r"row\(s\) \[0\] as padding.*left-padded"):
        model.generate(ids, 4, key_mask=km)


def test_a_sliding_window_refuses_padding_after_a_real_token():
    # before: accepted; the window counted slots (padding included) while positions counted
    # real tokens, so a right-padded or inner-padded row's logits were off by up to ~170 and
    # its greedy tokens differed from the row run alone
    model = _sharp_tiny_llama(sliding_window=2)
    ids = torch.tensor([[7, 8, 9, 0, 0], [3, 4, 5, 6, 9]])
    right = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    inner = torch.tensor([[1, 0, 1, 1, 1], [1, 1, 1, 1, 1]], dtype=torch.bool)
    for km in (right, inner):
        with pytest.raises(ValueError, match=r"row\(s\) \[0\] pad after a real token.*left-pad"):
            model(ids, cache=model.make_cache("dynamic"), key_mask=km)
    with pytest.raises(ValueError, match=r"row\(s\) \[0\] pad after a real token"):
        model.generate(ids, 2, key_mask=inner)
    cache = model.make_cache("dynamic")
    with torch.no_grad():
        model(torch.tensor([[3, 4], [1, 2]]), cache=cache)
    with pytest.raises(ValueError, match="padding follows the 2 token"):  # a padded chunk
        model(ids[:, :2], cache=cache, key_mask=torch.tensor([[0, 1], [1, 1]], dtype=torch.bool))
    # left padding of a new sequence stays right: row 0 equals itself run alone
    left = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], dtype=torch.bool)
    ids = torch.tensor([[0, 0, 7, 8, 9], [3, 4, 5, 6, 9]])
    with torch.no_grad():
        got = model(ids, key_mask=left)[0, -1]
        want = model(torch.tensor([[7, 8, 9]]))[0, -1]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
    # without a window, padding anywhere is right (positions and the mask agree)
    model = _sharp_tiny_llama()
    with torch.no_grad():
        got = model(torch.tensor([[7, 0, 8, 9]]), key_mask=torch.tensor([[1, 0, 1, 1]]).bool())[
            0, -1
        ]
        want = model(torch.tensor([[7, 8, 9]]))[0, -1]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)


def test_generate_checks_key_mask_and_max_new_tokens():
    model = _sharp_tiny_llama()
    ids = torch.tensor([[7, 8, 9, 0], [3, 4, 5, 6]])
    # before: an int64 mask (a tokenizer's attention_mask) was read with ~ as bitwise not, and
    # the error named both rows; a (B,) mask raised a bare IndexError
    for km, got in [
        (torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]]), r"\(2, 4\) torch.int64"),
        (torch.ones(2, dtype=torch.bool), r"\(2,\) torch.bool"),
        (torch.ones(2, 5, dtype=torch.bool), r"\(2, 5\) torch.bool"),
    ]:
        with pytest.raises(ValueError, match=r"key_mask must be a \(B, L\) = \(2, 4\) bool.*"
                           + got + r".*attention_mask.bool\(\)"):  # fmt: skip
            model.generate(ids, 2, key_mask=km)
    for n in (0, -3, 2.0):  # before: the prompt came back after a full prefill
        with pytest.raises(ValueError, match=f"max_new_tokens must be an int >= 1; got {n}"):
            model.generate(ids, n)


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "linear", "rope_theta": 1e4, "factor": 4.0},
        # head_dim 16: wavelengths 6.3 (fast: < 64 / 8), 20 and 63 (blended), 199... (slow)
        {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0, "low_freq_factor": 1.0,
         "high_freq_factor": 8.0, "original_max_position_embeddings": 64},
    ],
    ids=["linear", "llama3"],
)  # fmt: skip
def test_scaled_rotary_models_load_and_match_hugging_face(rope):
    """Llama 3.1/3.2 (and position-interpolated) configs load and give Hugging Face's logits and
    greedy tokens; before, they were refused. Without the scaling the same weights are far off,
    so the comparison can fail."""
    hf_model = tiny(transformers.LlamaForCausalLM, transformers.LlamaConfig, rope_parameters=rope)
    ours = LlamaModel.from_hf(hf_model)
    assert ours.cfg.rope_scaling is not None and ours.cfg.rope_scaling.kind == rope["rope_type"]
    inv_freq = hf_model.model.rotary_emb.inv_freq
    mine = rotary_frequencies(16, 1e4, ours.cfg.rope_scaling, torch.float64)
    torch.testing.assert_close(inv_freq.double(), mine, rtol=4e-7, atol=0)  # float32 rounding
    ids, mask = padded_batch(120, [48, 30, 41])
    err, control = check_logits(hf_model, ours, ids, mask)
    for block in ours.blocks:  # the same weights, plain frequencies
        block.attn.rope_scaling = None
    with torch.no_grad():
        plain = ours(ids, key_mask=mask.bool())
        eager = hf_logits(hf_model, ids, mask, "eager")
    assert (plain - eager)[mask.bool()].abs().max() > 1000 * (err + control)
    for block in ours.blocks:
        block.attn.rope_scaling = ours.cfg.rope_scaling
    hf_model.set_attn_implementation("eager")
    want = hf_model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0
    )
    for kind in ("dynamic", "static"):
        assert torch.equal(ours.generate(ids, 8, cache=kind, key_mask=mask.bool()), want), kind
    # the decode step, traced whole (as compiled) and run on the traced graph: scaled too
    step = DecodeStep(ours, backend="eager")
    cache = ours.make_cache("static", ids.shape[1] + 8)
    with torch.no_grad():
        token = ours(ids, cache=cache, key_mask=mask.bool())[:, -1:].argmax(-1)
        got = [token]
        for _ in range(7):
            token = step(token, cache)[:, -1:].argmax(-1)
            got.append(token)
    assert torch.equal(torch.cat([ids, *got], 1), want)


def test_generate_keeps_the_layers_forward_while_hooks_sit_on_them():
    """generate(compile=False) with a static cache decodes with forward_step, which does not
    call the blocks' and attention layers' forward: a hook there must still run for every
    token (the readable forward then), with the same tokens."""
    from attnlab.models import LlamaConfig

    torch.manual_seed(0)
    model = LlamaModel(LlamaConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=4,
                                   num_kv_heads=2, d_ff=64)).eval()  # fmt: skip
    prompt = torch.randint(0, 64, (2, 5))
    want = model.generate(prompt, 6, cache="static")
    assert model._steps_as_forward()
    calls = []
    hook = model.blocks[1].attn.register_forward_hook(lambda *a: calls.append(1))
    try:
        assert not model._steps_as_forward()
        assert torch.equal(model.generate(prompt, 6, cache="static"), want)
    finally:
        hook.remove()
    assert len(calls) == 6  # the prefill and 5 decode steps
    assert model._steps_as_forward()


def test_generate_keeps_the_layers_forward_while_one_is_replaced_on_the_instance():
    """A forward set on the instance (accelerate's add_hook_to_module, a user's edit) runs for
    every token as a hook does: before, a static cache's steps bypassed it (other tokens)."""
    import functools

    from attnlab.models import LlamaConfig

    torch.manual_seed(0)
    model = LlamaModel(LlamaConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=4,
                                   num_kv_heads=2, d_ff=64)).eval()  # fmt: skip
    prompt = torch.randint(0, 64, (2, 5))
    attn, calls = model.blocks[1].attn, []
    own = attn.forward

    def edited(self, *args, **kwargs):  # the layer's output scaled: other tokens
        calls.append(1)
        out = own(*args, **kwargs)
        return (out[0] * -20, *out[1:]) if isinstance(out, tuple) else out * -20

    want = model.generate(prompt, 6, cache="static")
    attn.forward = functools.partial(edited, attn)
    try:
        assert not model._steps_as_forward()
        replaced = model.generate(prompt, 6, cache="dynamic")  # (forward for every token)
        assert not torch.equal(replaced, want)  # (the replacement changes the tokens)
        calls.clear()
        assert torch.equal(model.generate(prompt, 6, cache="static"), replaced)
        assert len(calls) == 6  # the prefill and 5 decode steps
    finally:
        del attn.forward
    assert model._steps_as_forward()


def test_a_step_past_a_full_static_cache_is_not_counted():
    """forward_step checks nothing on the host: on a full StaticCache its token wraps to slot
    0 over the first one. advance() then refuses to count it, with the fix."""
    from attnlab.cache import StaticCache
    from attnlab.models import LlamaConfig

    torch.manual_seed(0)
    model = LlamaModel(LlamaConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=4,
                                   num_kv_heads=2, d_ff=64)).eval()  # fmt: skip
    ids = torch.randint(0, 64, (1, 9))
    cache = StaticCache(8, num_layers=2)
    with torch.no_grad():
        model(ids[:, :7], cache=cache)
        model.forward_step(ids[:, 7:8], tuple(cache.buffers(i) for i in range(2)))
        cache.advance(1)  # the 8th slot: fits
        assert cache.get_seq_length(0) == 8
        model.forward_step(ids[:, 8:9], tuple(cache.buffers(i) for i in range(2)))
        with pytest.raises(ValueError, match=r"max_length=8 holds 8 .*\(max_length >= 9\)"):
            cache.advance(1)
    assert cache.get_seq_length(0) == 8


def test_generate_refuses_a_static_cache_too_small_before_any_work():
    """Before: it failed after decoding some tokens, and its fix named the length it had
    reached, not the one generate needs."""
    from attnlab.cache import StaticCache
    from attnlab.models import LlamaConfig

    torch.manual_seed(0)
    model = LlamaModel(LlamaConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=4,
                                   num_kv_heads=2, d_ff=64)).eval()  # fmt: skip
    prompt = torch.randint(0, 64, (1, 5))
    cache = StaticCache(10, num_layers=2)
    with pytest.raises(ValueError, match=r"max_length >= 12"):
        model.generate(prompt, 8, cache=cache)
    assert cache.get_seq_length(0) == 0  # nothing written
    assert model.generate(prompt, 6, cache=cache).shape == (1, 11)  # 5 + 5 written: fits


def test_generate_stops_at_any_of_several_eos_ids_and_names_a_headless_model():
    # from a review: a list (as Llama 3 configs hold) crashed in masked_fill; a headless
    # transformers.LlamaModel raised "no attribute 'model'"
    hf_model = tiny(transformers.LlamaForCausalLM, transformers.LlamaConfig)
    ours = LlamaModel.from_hf(hf_model)
    ids, _ = padded_batch(120, [6, 6])
    free = ours.generate(ids, 8)  # greedy, no stopping
    stops = {int(free[0, 8]), int(free[1, 10])}  # row 0's 3rd new token, row 1's 5th
    want, ends = free.clone(), []
    for row in want:  # each row stops at its first new token that is one of them, repeated
        ends.append(next(i for i in range(6, 14) if int(row[i]) in stops))
        row[ends[-1] :] = row[ends[-1]]
    want = want[:, : max(ends) + 1]  # (generation ends when every row has stopped)
    assert want.shape[1] < free.shape[1] and len({int(want[0, -1]), int(want[1, -1])}) == 2
    for eos in (sorted(stops), tuple(stops), torch.tensor(sorted(stops))):
        assert torch.equal(ours.generate(ids, 8, eos_token_id=eos), want)
    for bad in ([], [1.5], True):
        with pytest.raises(TypeError, match="eos_token_id must be a token id"):
            ours.generate(ids, 2, eos_token_id=bad)
    with pytest.raises(ValueError, match="AutoModelForCausalLM"):
        LlamaModel.from_hf(hf_model.model)
