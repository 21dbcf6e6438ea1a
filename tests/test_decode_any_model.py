"""DecodeStep for any model built from MultiHeadAttention layers (issue 11, item 1).

Around the compiled call the cache is ``stepping``: each layer takes its token's position from
the cache's positions tensor and writes at a slot found on the device, and the step counts the
token afterwards. So the graph holds no Python int that changes per step: one graph for every
step (which is what a CUDA graph needs: checked here as "no symbolic int among its inputs"),
equal to eager cached decoding and to recomputing the whole sequence.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

from attnlab.cache import DynamicCache, SlidingWindowCache, StaticCache
from attnlab.models import DecodeStep
from attnlab.nn import MultiHeadAttention

VOCAB, D = 40, 32


class TinyDecoder(torch.nn.Module):
    """Embedding, two causal RoPE attention layers with residuals, a vocabulary head."""

    def __init__(self, kv_heads=2, window=None, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(VOCAB, D)
        self.layers = torch.nn.ModuleList(
            MultiHeadAttention(
                D,
                4,
                num_kv_heads=kv_heads,
                is_causal=True,
                rope=True,
                sliding_window=window,
                layer_idx=i,
            )
            for i in range(2)
        )
        self.head = torch.nn.Linear(D, VOCAB)

    def forward(self, ids, cache=None, position_ids=None):
        x = self.embed(ids)  # (B, L) -> (B, L, D)
        for layer in self.layers:
            x = x + layer(x, cache=cache, position_ids=position_ids)
        return self.head(x)


class Graphs:
    """A torch.compile backend that keeps each graph's input kinds (then runs aot_eager)."""

    def __init__(self):
        self.inputs = []

    def __call__(self, gm, example_inputs):
        from torch._dynamo.backends.registry import lookup_backend

        kinds = [type(n.meta.get("example_value")).__name__ for n in gm.graph.nodes]
        self.inputs.append(
            [k for k, n in zip(kinds, gm.graph.nodes, strict=True) if n.op == "placeholder"]
        )
        return lookup_backend("aot_eager")(gm, example_inputs)


@torch.no_grad()
def decode(model, step, cache, ids, n, reorder=None):
    """Prefill ids (eager), then n greedy steps through ``step``; logits (B, n, V), tokens."""
    tokens = torch.cat([ids, model(ids, cache=cache)[:, -1:].argmax(-1)], 1)
    out = []
    for t in range(n):
        if reorder is not None and t == reorder[0]:
            cache.reorder(reorder[1])
            tokens, out = tokens[reorder[1]], [o[reorder[1]] for o in out]
        logits = step(tokens[:, -1:], cache)[:, -1:]
        out.append(logits)
        tokens = torch.cat([tokens, logits.argmax(-1)], 1)
    return torch.cat(out, 1), tokens


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize(
    "kv_heads,window,make",
    [
        (2, None, lambda: StaticCache(20)),
        (1, None, lambda: StaticCache(20)),
        (4, 3, lambda: SlidingWindowCache(3)),
        (2, 3, lambda: StaticCache(20)),
    ],
    ids=["gqa-static", "mqa-static", "mha-ring", "gqa-window-static"],
)
def test_one_graph_for_every_step_equal_to_eager_and_recomputation(kv_heads, window, make):
    model = TinyDecoder(kv_heads, window).eval()
    ids = torch.randint(1, VOCAB, (3, 5), generator=torch.Generator().manual_seed(1))
    eager = lambda tok, cache: model(tok, cache=cache)  # noqa: E731
    want, tokens = decode(model, eager, make(), ids, 8)
    graphs = Graphs()
    got, got_tokens = decode(model, DecodeStep(model, backend=graphs), make(), ids, 8)
    assert torch.equal(got_tokens, tokens)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    with torch.no_grad():
        full = model(tokens[:, :-1])[:, -8:]  # the whole sequence at once, no cache
    torch.testing.assert_close(got, full, rtol=0, atol=1e-5)
    assert len(graphs.inputs) == 1, graphs.inputs  # compiled once for 8 steps
    assert "SymInt" not in graphs.inputs[0] and "FakeTensor" in graphs.inputs[0]


def test_beam_reorder_between_steps_keeps_the_graph():
    model = TinyDecoder().eval()
    ids = torch.randint(1, VOCAB, (3, 5), generator=torch.Generator().manual_seed(2))
    index = torch.tensor([2, 2, 0])
    eager = lambda tok, cache: model(tok, cache=cache)  # noqa: E731
    want, _ = decode(model, eager, StaticCache(16), ids, 6, reorder=(3, index))
    graphs = Graphs()
    step = DecodeStep(model, backend=graphs)
    got, _ = decode(model, step, StaticCache(16), ids, 6, (3, index))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    again, _ = decode(model, step, StaticCache(16), ids, 6)  # a new cache of the same geometry
    torch.testing.assert_close(
        again, decode(model, eager, StaticCache(16), ids, 6)[0], rtol=0, atol=1e-5
    )
    assert len(graphs.inputs) == 1  # one graph for both caches, reorders included


def test_eager_step_and_misuse():
    model = TinyDecoder().eval()
    ids = torch.randint(1, VOCAB, (2, 4), generator=torch.Generator().manual_seed(3))
    step = DecodeStep(model, compile=False)
    with torch.no_grad():
        cache = StaticCache(6)
        model(ids, cache=cache)
        step(ids[:, -1:], cache)
        step(ids[:, -1:], cache)
        assert cache.get_seq_length(0) == cache.get_seq_length(1) == 6
        assert not cache.stepping  # set only around the call
        with pytest.raises(ValueError, match=r"max_length=6 is full"):
            step(ids[:, -1:], cache)
        with pytest.raises(TypeError, match="needs a fixed-shape cache"):
            step(ids[:, -1:], DynamicCache())
        with pytest.raises(ValueError, match="prefill it"):
            step(ids[:, -1:], StaticCache(6))
        layer = model.layers[0]
        cache = StaticCache(8)
        model(ids, cache=cache)
        cache.stepping = True
        with pytest.raises(ValueError, match=r"one new token per row.*got L=2"):
            layer(torch.randn(2, 2, D), cache=cache)
    with pytest.raises(TypeError, match="no forward_step.*MultiHeadAttention"):
        DecodeStep(torch.nn.Linear(2, 2))


def test_with_inductor_the_real_code_equals_eager():
    """aot_eager checks the capture; inductor generates the code (its CPU code generator has
    failed on some forms of the NaN bookkeeping, so it is run once for real)."""
    model = TinyDecoder().eval()
    ids = torch.randint(1, VOCAB, (3, 5), generator=torch.Generator().manual_seed(4))
    eager = lambda tok, cache: model(tok, cache=cache)  # noqa: E731
    want, tokens = decode(model, eager, StaticCache(12), ids, 5)
    got, got_tokens = decode(model, DecodeStep(model), StaticCache(12), ids, 5)
    assert torch.equal(got_tokens, tokens)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_a_full_static_cache_is_refused_by_an_eager_step_write():
    cache = StaticCache(3)
    k = torch.randn(1, 2, 3, 4)
    cache.update(k, k, 0)
    with pytest.raises(ValueError, match=r"max_length=3 is full.*overwrite the first"):
        cache.write_step(k[:, :, :1], k[:, :, :1], 0, cache.next_position(0))
    ring = SlidingWindowCache(3)
    ring.update(k, k, 0)
    ring.write_step(k[:, :, :1] * 0, k[:, :, :1] * 0, 0, ring.next_position(0))  # wraps: fine
    ring.advance(1)
    assert ring.key_positions(0).tolist() == [3, 1, 2] and ring.get_seq_length(0) == 4
