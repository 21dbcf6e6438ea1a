"""The compiled decode step (attnlab.models.decode): the same tokens as eager decoding and as full
recomputation, one graph that stops recompiling, and misuse refused with the fix.

Tolerance from a control: eager cached decoding (every layer through MultiHeadAttention) differs
from recomputing the whole sequence by some rounding; the compiled step may differ from the
recomputation by at most twice that, plus a few float32 ulps of the logits' scale.

Compiling is slow on 2 cores, so the compiled steps are shared by the tests of one model (module
fixtures, one geometry: batch 3, 32 slots) and most use the ``aot_eager`` backend (dynamo's
capture and functionalization of the in-place cache writes, without generating code); one test
runs the real inductor backend through ``generate(compile=True)``.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

import attnlab.cache
from attnlab.cache import DynamicCache, StaticCache
from attnlab.models import DecodeStep, LlamaConfig, LlamaModel
from attnlab.nn import MultiHeadAttention

B, SLOTS, VOCAB = 3, 32, 64


@pytest.fixture(scope="module", autouse=True)
def compile_settings():
    # Every model and geometry of this file compiles the same function; keep them all cached.
    with torch._dynamo.config.patch(recompile_limit=64):
        yield
    torch._dynamo.reset()


def make_model(num_kv_heads=2, sliding_window=None, seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        d_model=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=num_kv_heads,
        d_ff=64,
        sliding_window=sliding_window,
    )
    return LlamaModel(cfg).eval()


@pytest.fixture(scope="module")
def models():
    """MHA, GQA, MQA and a sliding-window model, each with one shared compiled step."""
    built = {
        "mha": make_model(4),
        "gqa": make_model(2),
        "mqa": make_model(1),
        "window": make_model(2, sliding_window=4),
    }
    return {name: (m, DecodeStep(m, backend="aot_eager")) for name, m in built.items()}


def prompt_batch(P=7, lengths=(7, 4, 6), seed=1):
    """Left-padded prompts (B, P) and their key_mask, True = real token."""
    ids = torch.randint(1, VOCAB, (B, P), generator=torch.Generator().manual_seed(seed))
    mask = torch.zeros(B, P, dtype=torch.bool)
    for b, n in enumerate(lengths):
        mask[b, P - n :] = True
    return ids.masked_fill(~mask, 0), mask


def eager_step(model):
    return lambda tok, cache, pos: model(tok, cache=cache, position_ids=pos)


@torch.no_grad()
def greedy(model, step, ids, mask, n, cache, reorder=None):
    """Prefill eagerly, then n steps with ``step``; (tokens (B, P+1+n), logits (B, n, V) of the
    steps, history mask). ``reorder=(t, index)``: follow beams index before step t."""
    logits = model(ids, cache=cache, key_mask=mask)
    tokens, mask = (
        torch.cat([ids, logits[:, -1:].argmax(-1)], 1),
        torch.cat([mask, mask[:, :1] | True], 1),
    )
    pos = mask[:, :-1].long().sum(1, keepdim=True)
    out = []
    for t in range(n):
        if reorder is not None and reorder[0] == t:
            index = reorder[1]
            cache.reorder(index)
            tokens, mask, pos = tokens[index], mask[index], pos[index]
            out = [o[index] for o in out]
        logits = step(tokens[:, -1:], cache, pos)
        out.append(logits[:, -1:])
        tokens = torch.cat([tokens, logits[:, -1:].argmax(-1)], 1)
        mask = torch.cat([mask, mask[:, :1] | True], 1)
        pos = pos + 1
    return tokens, torch.cat(out, 1), mask


@torch.no_grad()
def recompute(model, tokens, mask, n):
    """The logits of the last n decode steps, recomputed from the whole sequence (no cache)."""
    full = model(tokens[:, :-1], key_mask=mask[:, :-1])
    return full[:, -n:]


def check(model, step, *, n=9, cache="static", reorder=None, lengths=(7, 4, 6)):
    ids, mask = prompt_batch(lengths=lengths)
    make = lambda: model.make_cache(cache, SLOTS)  # noqa: E731
    want, want_logits, hist = greedy(model, eager_step(model), ids, mask, n, make(), reorder)
    got, got_logits, _ = greedy(model, step, ids, mask, n, make(), reorder)
    assert torch.equal(got, want)
    full = recompute(model, want, hist, n)
    real = hist[:, -n - 1 : -1, None]  # the steps' rows (all real)
    control = ((want_logits - full) * real).abs().max()
    err = ((got_logits - full) * real).abs().max()
    floor = 8 * torch.finfo(torch.float32).eps * full.abs().max()
    assert err <= 2 * control + floor, (err, control)
    torch.testing.assert_close(got_logits, want_logits, rtol=0, atol=float(2 * control + floor))


# --- equal to eager decoding and to recomputation -------------------------------------------


@pytest.mark.parametrize("heads", ["mha", "gqa", "mqa"])
def test_compiled_step_equals_eager_and_recomputation(models, heads):
    check(*models[heads])


@pytest.mark.parametrize("heads", ["mha", "mqa"])
def test_left_padded_batch(models, heads):
    check(*models[heads], lengths=(7, 2, 5))


@pytest.mark.parametrize("cache", ["static", "sliding"])
def test_sliding_window_model_with_static_and_ring_caches(models, cache):
    model, _ = models["window"]
    check(model, DecodeStep(model, backend="aot_eager"), cache=cache, n=10)  # past the window


def test_beam_reorder_between_steps(models):
    model, step = models["gqa"]
    check(model, step, reorder=(4, torch.tensor([2, 2, 0])))


def test_dynamic_cache_is_refused_with_the_fix(models):
    model, step = models["gqa"]
    ids, mask = prompt_batch()
    cache = DynamicCache()
    with torch.no_grad():
        model(ids, cache=cache, key_mask=mask)
        with pytest.raises(TypeError, match="fixed-shape cache.*cache='static'"):
            step(ids[:, -1:], cache)
        with pytest.raises(TypeError, match="cache='static'"):
            model.generate(ids, 3, cache="dynamic", compile=True)


def test_generate_compile_with_inductor_equals_eager():
    """The real path: inductor, left padding, the length rounded up to a multiple of 64."""
    model = make_model(2, seed=3)
    ids, mask = prompt_batch(lengths=(7, 3, 5))
    want = model.generate(ids, 8, cache="static", key_mask=mask)
    assert torch.equal(model.generate(ids, 8, key_mask=mask, compile=True), want)
    assert torch.equal(model.generate(ids, 8, cache="dynamic", key_mask=mask), want)
    # the next call reuses the cache's storage (a CUDA graph keeps replaying over it)
    cache = attnlab.cache._KEPT[model]
    assert cache.max_length == 64
    address = cache.buffers(0)[0].data_ptr()
    assert torch.equal(model.generate(ids, 8, key_mask=mask, compile=True), want)
    assert attnlab.cache._KEPT[model].buffers(0)[0].data_ptr() == address


# --- one graph, no recompilation ------------------------------------------------------------


class CountingBackend:
    """A torch.compile backend that counts the graphs it is given (then runs aot_eager)."""

    def __init__(self):
        self.graphs = 0

    def __call__(self, gm, example_inputs):
        from torch._dynamo.backends.registry import lookup_backend

        self.graphs += 1
        return lookup_backend("aot_eager")(gm, example_inputs)


def test_no_recompilation_as_the_sequence_grows(models):
    model, _ = models["gqa"]
    backend = CountingBackend()
    step = DecodeStep(model, backend=backend)
    ids, mask = prompt_batch()
    seen = []

    def counted(tok, cache, pos):
        logits = step(tok, cache, pos)
        seen.append(backend.graphs)
        return logits

    greedy(model, counted, ids, mask, 8, model.make_cache("static", SLOTS))
    greedy(model, counted, ids, mask, 4, model.make_cache("static", SLOTS))  # a new cache
    greedy(
        model,
        counted,
        ids,
        mask,
        4,
        model.make_cache("static", SLOTS),
        (1, torch.tensor([1, 0, 2])),
    )
    assert seen[0] == 1 and seen[-1] == 1, seen  # one graph for every step, cache and order


def test_mha_model_recipe_compiles_once_and_equals_eager():
    """The documented recipe for any model of MultiHeadAttention layers: compile its own cached
    forward with fullgraph=True; the cache length, a Python int, turns symbolic after one change,
    so there is no new graph after the second step."""
    torch.manual_seed(4)
    layers = torch.nn.ModuleList(
        MultiHeadAttention(32, 4, num_kv_heads=2, is_causal=True, rope=True, layer_idx=i)
        for i in range(2)
    ).eval()

    def model(x, cache, pos):
        for layer in layers:
            x = x + layer(x, cache=cache, position_ids=pos)
        return x

    backend = CountingBackend()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    x = torch.randn(2, 12, 32, generator=torch.Generator().manual_seed(5))
    outs, counts = {}, []
    with torch.no_grad():
        for name, fn in (("eager", model), ("compiled", compiled)):
            cache = StaticCache(16, num_layers=2)
            model(x[:, :5], cache, torch.arange(5))  # prefill, eager
            steps = []
            for t in range(5, 12):
                steps.append(fn(x[:, t : t + 1], cache, torch.tensor([t])))
                if name == "compiled":
                    counts.append(backend.graphs)
            outs[name] = torch.cat(steps, 1)
    torch.testing.assert_close(outs["compiled"], outs["eager"], rtol=0, atol=1e-6)
    assert counts[1] == counts[-1], counts


# --- misuse ---------------------------------------------------------------------------------


def test_misuse_is_refused_with_the_fix(models):
    model, step = models["gqa"]
    ids, mask = prompt_batch()
    with torch.no_grad():
        check(model, step, n=1)  # binds the shared step to (batch 3, 32 slots) if not yet
        other = model.make_cache("static", SLOTS + 8)
        model(ids, cache=other, key_mask=mask)
        with pytest.raises(ValueError, match=r"compiled for a StaticCache of batch 3 x 32 slots"):
            step(ids[:, -1:], other)
        cache = model.make_cache("static", SLOTS)
        model(ids, cache=cache, key_mask=mask)
        with pytest.raises(ValueError, match=r"batch size changed from 3.*to 2.*cache.reorder"):
            step(ids[:2, -1:], cache)
        with pytest.raises(ValueError, match=r"tokens \(B, 1\)"):
            step(ids[:, -2:], cache)
        with pytest.raises(ValueError, match="prefill it"):
            step(ids[:, -1:], model.make_cache("static", SLOTS))
        full = model.make_cache("static", SLOTS)
        model(torch.randint(1, VOCAB, (B, SLOTS)), cache=full)
        with pytest.raises(ValueError, match=r"max_length=32 is full.*max_length >= 33"):
            step(ids[:, -1:], full)
    with pytest.raises(TypeError, match="no forward_step"):
        DecodeStep(torch.nn.Linear(2, 2))
