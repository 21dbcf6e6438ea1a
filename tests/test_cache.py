"""KV caches: decoding token by token equals recomputing the whole prefix, for every kind."""

from __future__ import annotations

import pytest
import torch

from attnlab.cache import DynamicCache, SlidingWindowCache, StaticCache
from attnlab.nn import MultiHeadAttention

WINDOW = 4


def make_layer(kind, heads, kv_heads, rope, seed=0):
    torch.manual_seed(seed)
    window = WINDOW if kind == "sliding" else None
    return MultiHeadAttention(
        32,
        heads,
        num_kv_heads=kv_heads,
        is_causal=True,
        rope=rope,
        sliding_window=window,
        layer_idx=0,
    ).eval()


def make_cache(kind, num_layers=None):
    return {
        "dynamic": lambda: DynamicCache(num_layers),
        "static": lambda: StaticCache(24, num_layers),
        "sliding": lambda: SlidingWindowCache(WINDOW, num_layers),
    }[kind]()


def decode(layer, x, cache, chunks, **kwargs):
    """Feed x through the layer in chunks of the given sizes, with the cache; concat outputs."""
    outs, t = [], 0
    for n in chunks:
        outs.append(layer(x[:, t : t + n], cache=cache, **kwargs))
        t += n
    return torch.cat(outs, dim=1)


KINDS = ["dynamic", "static", "sliding"]
HEADS = [(4, 4), (4, 2), (4, 1)]  # MHA, GQA, MQA


@pytest.mark.parametrize("rope", [False, True])
@pytest.mark.parametrize("heads,kv_heads", HEADS, ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("chunks", [[1] * 12, [5] + [1] * 7, [3, 4, 1, 2, 2]])
def test_cached_decoding_equals_recomputation(kind, heads, kv_heads, rope, chunks):
    layer = make_layer(kind, heads, kv_heads, rope)
    x = torch.randn(2, 12, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = layer(x)  # the whole prefix at once, no cache
        cached = decode(layer, x, make_cache(kind), chunks)
    torch.testing.assert_close(cached, full, rtol=0, atol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_padded_prompts_of_different_lengths(kind):
    """Left-padded prompts: each row decodes as if it were alone in the batch."""
    layer = make_layer(kind, 4, 2, rope=True)
    g = torch.Generator().manual_seed(2)
    lengths, P, steps = [6, 3], 6, 4
    seqs = [torch.randn(1, n + steps, 32, generator=g) for n in lengths]
    prompt = torch.zeros(2, P, 32)
    real = torch.zeros(2, P, dtype=torch.bool)
    for b, n in enumerate(lengths):
        prompt[b, P - n :] = seqs[b][0, :n]
        real[b, P - n :] = True
    positions = (real.cumsum(1) - 1).clamp_min(0)  # each row counts from its first real token
    with torch.no_grad():
        cache = make_cache(kind)
        out = [layer(prompt, cache=cache, key_mask=real, position_ids=positions)]
        for t in range(steps):
            step = torch.stack([seqs[b][0, n + t] for b, n in enumerate(lengths)])[:, None]
            pos = torch.tensor([[n + t] for n in lengths])
            out.append(layer(step, cache=cache, position_ids=pos))
        out = torch.cat(out, dim=1)
        for b, n in enumerate(lengths):
            alone = layer(seqs[b])  # (1, n + steps, 32), no padding, no cache
            got = torch.cat([out[b, P - n : P], out[b, P:]])
            torch.testing.assert_close(got, alone[0], rtol=0, atol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_reorder_and_filter_for_beam_search(kind):
    layer = make_layer(kind, 4, 2, rope=True)
    x = torch.randn(3, 9, 32, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        cache = make_cache(kind)
        first = decode(layer, x[:, :6], cache, [4, 1, 1])
        beams = torch.tensor([2, 0, 0])
        cache.reorder(beams)
        rest = decode(layer, x[beams, 6:], cache, [1, 1, 1])
        full = layer(x[beams])
        torch.testing.assert_close(first[beams], full[:, :6], rtol=0, atol=1e-6)
        torch.testing.assert_close(rest, full[:, 6:], rtol=0, atol=1e-6)
        cache.reorder(torch.tensor([1]))  # filter: keep one row
        assert cache.batch_size == 1


def test_cache_shapes():
    layer = make_layer("static", 4, 1, rope=False)
    static = StaticCache(16)
    dynamic = DynamicCache()
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        for cache in (static, dynamic):
            layer(x, cache=cache)
            layer(x[:, :1], cache=cache)
    assert static._layers[0].keys.shape == (2, 1, 16, 8)  # MQA caches one kv head, fixed size
    assert static.key_positions(0).tolist() == list(range(6)) + [-1] * 10
    assert dynamic.key_positions(0).tolist() == list(range(6))
    assert static.get_seq_length(0) == dynamic.get_seq_length(0) == 6


# --- misuse -----------------------------------------------------------------------------------


def test_cache_misuse_errors():
    k = torch.randn(2, 2, 3, 8)
    cache = DynamicCache(num_layers=2)
    cache.update(k, k, 0)
    with pytest.raises(ValueError, match="batch size changed from 2 to 3 without reorder"):
        cache.update(torch.randn(3, 2, 1, 8), torch.randn(3, 2, 1, 8), 0)
    with pytest.raises(ValueError, match=r"caches \(Hkv, E\) = \(2, 8\).*is layer_idx wrong"):
        cache.update(torch.randn(2, 4, 1, 8), torch.randn(2, 4, 1, 8), 0)
    with pytest.raises(ValueError, match="out of range for a cache of num_layers=2"):
        cache.update(k, k, 2)
    with pytest.raises(ValueError, match="layer_idx must be an int >= 0"):
        cache.update(k, k, -1)
    with pytest.raises(TypeError, match="caches torch.float32; got key torch.float64"):
        cache.update(k.double(), k.double(), 0)
    with pytest.raises(ValueError, match=r"key_mask must be a \(B, L\)"):
        cache.update(k, k, 1, key_mask=torch.ones(2, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="has nothing cached yet"):
        DynamicCache().key_positions(0)
    static = StaticCache(4)
    static.update(k, k, 0)
    with pytest.raises(ValueError, match=r"max_length=4 cannot take 2 more.*max_length >= 5"):
        static.update(k[:, :, :2], k[:, :, :2], 0)
    with pytest.raises(ValueError, match=r"index must lie in \[0, 2\)"):
        static.reorder(torch.tensor([0, 5]))


def test_layer_cache_misuse_errors():
    x = torch.randn(1, 3, 32)
    no_idx = MultiHeadAttention(32, 4, is_causal=True)
    with pytest.raises(ValueError, match="no layer_idx.*layer_idx=i"):
        no_idx(x, cache=DynamicCache())
    windowed = MultiHeadAttention(32, 4, is_causal=True, sliding_window=8, layer_idx=0)
    with pytest.raises(ValueError, match="SlidingWindowCache of window 4 drops keys"):
        windowed(x, cache=SlidingWindowCache(4))
    full = MultiHeadAttention(32, 4, is_causal=True, layer_idx=0)
    with pytest.raises(ValueError, match="drops keys"):
        full(x, cache=SlidingWindowCache(4))
    cross = MultiHeadAttention(32, 4, layer_idx=0)
    with pytest.raises(ValueError, match="self-attention only.*project_kv"):
        cross(x, key=torch.randn(1, 5, 32), cache=DynamicCache())


# --- storage for compiled decode steps ----------------------------------------------------------


@pytest.mark.parametrize("kind", ["static", "sliding"])
def test_fixed_shape_storage_keeps_its_address_through_reorder(kind):
    """A compiled step (and a CUDA graph) holds the storage's address: a beam reorder of the
    same batch size copies in place; filtering the batch allocates anew."""
    layer = make_layer(kind, 4, 2, rope=True)
    x = torch.randn(3, 6, 32, generator=torch.Generator().manual_seed(4))
    cache = make_cache(kind)
    with torch.no_grad():
        layer(x, cache=cache)
        keys, values, positions, real, finite = cache.buffers(0)
        before = [t.data_ptr() for t in (keys, values, positions, real, finite)]
        expected = keys[[2, 0, 0]].clone()
        cache.reorder(torch.tensor([2, 0, 0]))
        assert [t.data_ptr() for t in cache.buffers(0)] == before
        assert torch.equal(cache.buffers(0)[0], expected)
        cache.reorder(torch.tensor([1]))
        assert cache.buffers(0)[0].shape[0] == 1


def test_buffers_and_advance():
    cache = StaticCache(8, num_layers=2)
    k = torch.randn(1, 2, 3, 4)
    for i in range(2):
        cache.update(k, k, i)
    assert cache.capacity == 8
    keys, _, positions, _, _ = cache.buffers(1)
    assert keys.shape == (1, 2, 8, 4) and positions.tolist() == [0, 1, 2] + [-1] * 5
    positions[3] = 3  # what a compiled step writes, then counts
    cache.advance(1)
    assert cache.get_seq_length(0) == cache.get_seq_length(1) == 4
    assert cache.key_positions(1).tolist() == [0, 1, 2, 3] + [-1] * 4
    with pytest.raises(ValueError, match="nothing cached yet.*prefill"):
        StaticCache(8).buffers(0)
    dynamic = DynamicCache()
    dynamic.update(k, k, 0)
    with pytest.raises(TypeError, match="grows its storage.*StaticCache"):
        dynamic.buffers(0)


@pytest.mark.parametrize("kind", ["static", "sliding"])
def test_reset_keeps_fixed_storage_for_the_next_sequence_of_the_same_shape(kind):
    layer = make_layer(kind, 4, 2, rope=True)
    x = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(5))
    cache = make_cache(kind)
    with torch.no_grad():
        layer(x, cache=cache)
        before = cache.buffers(0)[0].data_ptr()
        cache.reset()
        again = decode(layer, x, cache, [3, 1, 1, 1])  # the same storage, emptied
        assert cache.buffers(0)[0].data_ptr() == before
        torch.testing.assert_close(again, layer(x), rtol=0, atol=1e-6)
        cache.reset()
        layer(x[:1], cache=cache)  # another batch size: new storage
        assert cache.batch_size == 1


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("chunks", [[12], [5] + [1] * 7, [3, 4, 1, 2, 2]])
def test_a_window_is_causal_through_a_cache_as_without_one(kind, chunks):
    """A sliding window is causal (itself and the w - 1 positions before it) whether or not
    the layer says is_causal. Chunks of several tokens through a cache let each query see the
    later tokens of its own chunk before (row 0 of a prefill saw keys 1-3)."""
    torch.manual_seed(0)
    layer = MultiHeadAttention(32, 4, num_kv_heads=2, sliding_window=WINDOW, layer_idx=0).eval()
    assert not layer.is_causal
    x = torch.randn(2, 12, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full, weights = layer(x, return_weights=True)
        assert (weights.triu(1) == 0).all()  # without a cache: causal
        cached = decode(layer, x, make_cache(kind), chunks)
    torch.testing.assert_close(cached, full, rtol=0, atol=1e-6)


def test_a_user_mask_that_does_not_fit_a_caches_keys_names_what_s_is():
    # before: a raw RuntimeError from torch ("The size of tensor a (3) must match ... (8)") on a
    # static or sliding-window cache, where S is the cache's slots, not P + L
    layer = MultiHeadAttention(32, 4, is_causal=True, sliding_window=4, layer_idx=0).eval()
    x = torch.randn(1, 3, 32)
    mask = torch.ones(3, 3, dtype=torch.bool)  # (L, P + L), P = 0
    with torch.no_grad():
        layer(x, cache=DynamicCache(), mask=mask)  # fits: S = P + L
        for cache, S in ((StaticCache(8), 8), (SlidingWindowCache(4), 7)):
            name = type(cache).__name__
            with pytest.raises(ValueError, match=rf"does not broadcast.*With a {name}, S = {S}"):
                layer(x, cache=cache, mask=mask)
        with pytest.raises(ValueError, match=r"mask of shape \(3, 5\) does not broadcast"):
            layer(x, mask=torch.ones(3, 5, dtype=torch.bool))  # no cache: the window's mask


@pytest.mark.parametrize(
    "make", [DynamicCache, lambda: StaticCache(8), lambda: SlidingWindowCache(4)]
)
def test_a_value_of_another_width_is_refused(make):
    """A (B, Hkv, 1, 1) value was broadcast over the cached width 8 (every column the same
    number, no error); a width 4 failed with torch's expand error."""
    cache = make()
    cache.update(torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8), layer_idx=0)
    for width in (1, 4):
        with pytest.raises(ValueError, match=rf"Ev = 8; got value \(1, 2, 1, {width}\).*Fix"):
            cache.update(torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, width), layer_idx=0)
    assert cache.get_seq_length(0) == 3  # (nothing written)
