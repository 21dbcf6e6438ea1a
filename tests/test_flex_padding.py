"""Key padding through torch's FlexAttention (attnlab.kernels.flex_padding).

The dispatch routes it there on CUDA; these tests route CPU tensors there (the route's device
list patched), through FlexAttention compiled for the CPU, which honours the block mask as the
GPU kernel does (skips empty tiles, reads no mask in full ones): a wrong block mask gives wrong
values here. The eager FlexAttention ignores the tiles (it applies ``mask_mod`` everywhere), so
the block mask is also checked tile by tile against the element mask.
"""

from __future__ import annotations

import pytest
import torch

import attnlab
import attnlab.functional as AF
import attnlab.reference as R
from attnlab import masks
from attnlab.kernels import flex_padding
from conftest import naive_sdpa

ALIGNMENTS = [None, "top_left", "bottom_right"]


def _tiles(block, B: int, L: int, S: int, size: int, element):
    """What a kernel reading ``block`` lets each row see: full tiles whole, listed (partial)
    tiles through ``element`` (B, L, S), the rest nothing."""
    seen = torch.zeros(B, L, S, dtype=torch.bool)
    lists = (
        (block.kv_num_blocks, block.kv_indices, False),
        (block.full_kv_num_blocks, block.full_kv_indices, True),
    )
    for counts, indices, full in lists:
        for b in range(B):
            for r in range(counts.shape[-1]):
                for j in indices[b, 0, r, : counts[b, 0, r]].tolist():
                    rows, keys = slice(r * size, (r + 1) * size), slice(j * size, (j + 1) * size)
                    seen[b, rows, keys] = True if full else element[b, rows, keys]
    return seen


def _element(start, end, alignment, L, S):
    keys = torch.arange(S)
    keep = (keys >= start[:, None]) & (keys < end[:, None])  # (B, S)
    keep = keep[:, None, :].expand(-1, L, -1)
    if alignment is not None:
        keep = keep & masks.causal_keep(L, S, alignment, "cpu")
    return keep


@pytest.mark.parametrize("alignment", ALIGNMENTS)
@pytest.mark.parametrize("L,S", [(37, 45), (45, 37), (16, 16), (5, 70)])
def test_block_mask_lists_the_tiles_each_row_may_see(alignment, L, S, monkeypatch):
    """Every key a row may attend lies in a full tile or a listed one; a full tile holds only
    keys it may attend; a listed tile is read through the element rule and is truly partial
    (no tile read through the mask that could be skipped or taken whole). Lengths at tile
    edges, 0 (a dead row) and S, right and left padding."""
    monkeypatch.setattr(flex_padding, "BLOCK", 8)
    g = torch.Generator().manual_seed(L * 100 + S)
    ends = [S, 0, 8, 9, min(S, 16), int(torch.randint(1, S + 1, (1,), generator=g))]
    for side in ("right", "left"):
        pad = masks.padding_mask(torch.tensor(ends), S, side=side)
        start, end = pad.key_range
        element = _element(start.long(), end.long(), alignment, L, S)
        block = flex_padding.block_mask(pad.key_range, alignment, L, S)
        assert torch.equal(_tiles(block, len(ends), L, S, 8, element), element)
        full = _tiles(block, len(ends), L, S, 8, torch.zeros_like(element))  # full tiles alone
        assert not (full & ~element).any()
        # and exactly: a listed (partial) tile allows some pairs and not all
        for b in range(len(ends)):
            for r in range(block.kv_num_blocks.shape[-1]):
                for j in block.kv_indices[b, 0, r, : block.kv_num_blocks[b, 0, r]].tolist():
                    tile = element[b, r * 8 : (r + 1) * 8, j * 8 : (j + 1) * 8]
                    assert tile.any() and not tile.all(), (side, b, r, j)


def test_block_mask_is_kept_with_its_ranges_and_rebuilt_when_they_change():
    """Cached per range tensors (every layer reads one mask), rebuilt when they change in
    place or another end comes with the same start, and dropped with the mask (the block mask
    holds copies of the ranges, not the cache's key)."""
    import gc

    pad = masks.padding_mask([5, 3], 7)
    first = flex_padding.block_mask(pad.key_range, None, 4, 7)
    assert flex_padding.block_mask(pad.key_range, None, 4, 7) is first  # the next layer's call
    assert flex_padding.block_mask(pad.key_range, "top_left", 4, 7) is not first
    pad.key_range[1][0] = 6  # changed in place: a new block mask
    second = flex_padding.block_mask(pad.key_range, None, 4, 7)
    assert second is not first
    other_end = (pad.key_range[0], torch.tensor([2, 2], dtype=torch.int32))
    assert flex_padding.block_mask(other_end, None, 4, 7) is not second
    del pad, other_end, first, second
    gc.collect()
    assert len(flex_padding._cache) == 0


@pytest.fixture
def flex_on_cpu(monkeypatch):
    """The route taken for CPU tensors, FlexAttention compiled for the CPU, small tiles."""
    monkeypatch.setattr(flex_padding, "SERVES_ON", ("cpu", "cuda"))
    monkeypatch.setattr(flex_padding, "COMPILED_ON", ("cpu", "cuda"))
    monkeypatch.setattr(flex_padding, "BLOCK", 16)


def test_flex_route_equals_the_oracle_and_compiles_once_for_new_lengths(flex_on_cpu):
    """bf16, GQA, every causal alignment, L != S, a dead row: within twice the naive bf16
    formula's error against float64; dead rows exactly 0. New lengths (a new mask every call)
    and the causal alignment reuse the compiled graph: dynamo's counters say one graph; new
    sequence lengths compile it once more, with dynamic sizes (not once per length)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    B, H, Hkv, L, S, E = 3, 4, 2, 37, 45, 16
    g = torch.Generator().manual_seed(0)
    for alignment in ALIGNMENTS:
        for draw in range(2):
            q = torch.randn(B, H, L, E, generator=g).bfloat16()
            k, v = (torch.randn(B, Hkv, S, E, generator=g).bfloat16() for _ in range(2))
            lengths = torch.randint(1, S + 1, (B,), generator=g)
            lengths[draw] = 0
            pad = masks.padding_mask(lengths, S, side="left" if draw else "right")
            said = attnlab.explain(q, k, v, pad, is_causal=alignment or False)
            assert said.path == "flex" and "FlexAttention (compiled)" in str(said)
            got = AF.scaled_dot_product_attention(q, k, v, pad, is_causal=alignment or False)
            q64, k64, v64 = (t.double().numpy() for t in (q, k, v))
            keep = pad.clone()  # (plain(pad) would make it forget its lengths)
            if alignment is not None:
                keep = keep & masks.causal_keep(L, S, alignment, "cpu")
            want = torch.from_numpy(R.scaled_dot_product_attention(q64, k64, v64, keep.numpy()))
            control = (naive_sdpa(q, k, v, keep).double() - want).abs().max()
            assert (got.double() - want).abs().max() <= 2 * control + 1e-3
            assert not got[draw].any()  # the dead row
    assert counters["stats"]["unique_graphs"] == 1
    for scale in (0.3, 0.2):  # new scales: the same graph (the scale is a tensor there)
        got = AF.scaled_dot_product_attention(q, k, v, pad, scale=scale)
        keep = pad.clone()  # (plain(pad) would make it forget its lengths)
        want = naive_sdpa(q.double(), k.double(), v.double(), keep, scale=scale)
        control = (naive_sdpa(q, k, v, keep, scale=scale).double() - want).abs().max()
        assert (got.double() - want).abs().max() <= 2 * control + 1e-3
    assert counters["stats"]["unique_graphs"] == 1
    # new sequence lengths, and as many kv heads as query heads: one more graph, dynamic in
    # the sizes that changed, then none
    for L, heads in ((21, Hkv), (50, H), (64, Hkv), (30, H)):
        q = torch.randn(B, H, L, E, generator=g).bfloat16()
        k, v = (torch.randn(B, heads, L, E, generator=g).bfloat16() for _ in range(2))
        pad = masks.padding_mask(torch.randint(1, L + 1, (B,), generator=g), L)
        AF.scaled_dot_product_attention(q, k, v, pad, is_causal=True)
    assert counters["stats"]["unique_graphs"] == 3


def test_flex_route_keeps_attnlabs_nan_rule(flex_on_cpu, monkeypatch):
    """A NaN in a key reaches every row that can see it (the NaN rule), on this path too."""
    monkeypatch.setattr(flex_padding, "COMPILED_ON", ())  # (values only: eager is enough)
    q, k, v = (t.bfloat16() for t in _qkv())
    k[1, 0, 2, 0] = float("nan")
    pad = masks.padding_mask([9, 9], 9)
    assert attnlab.explain(q, k, v, pad).path == "flex"
    out = AF.scaled_dot_product_attention(q, k, v, pad)
    assert out[1, :2].isnan().all() and not out[0].isnan().any() and not out[1, 2:].isnan().any()


def _qkv():
    g = torch.Generator().manual_seed(3)
    return (
        torch.randn(2, 4, 9, 16, generator=g),
        torch.randn(2, 2, 9, 16, generator=g),
        torch.randn(2, 2, 9, 16, generator=g),
    )


def test_what_the_route_does_not_take_keeps_the_other_paths_and_says_why(monkeypatch):
    monkeypatch.setattr(flex_padding, "SERVES_ON", ("cpu",))
    q, k, v = _qkv()
    pad = masks.padding_mask([9, 4], 9)
    b = [t.bfloat16() for t in (q, k, v)]
    assert attnlab.explain(*b, pad).path == "flex"
    why = {
        "float32": flex_padding.unfit(q, k, v, pad.key_range, None, 0.0, False),
        "weights": flex_padding.unfit(*b, pad.key_range, None, 0.0, True),
        "dropout": flex_padding.unfit(*b, pad.key_range, None, 0.1, False),
        "window": flex_padding.unfit(*b, pad.key_range, (None, -2, 0), 0.0, False),
        "head dim": flex_padding.unfit(
            b[0][..., :12], b[1][..., :12], b[2], pad.key_range, None, 0.0, False
        ),  # fmt: skip
    }
    assert "bfloat16 and float16" in why["float32"] and "weights or dropout" in why["weights"]
    assert "weights or dropout" in why["dropout"] and "windows" in why["window"]
    assert "E=12" in why["head dim"]
    docs = masks.document_mask([5, 4])
    assert flex_padding.unfit(*b, docs.key_range, None, 0.0, False) is not None
    for args, kw in (((*b, pad), {"return_weights": True}), (((q, k, v, pad)), {})):
        assert attnlab.explain(*args, **kw).path != "flex"
    monkeypatch.setattr(flex_padding, "available", lambda: False)  # (an older torch)
    assert "no FlexAttention that takes" in flex_padding.unfit(*b, pad.key_range, None, 0.0, False)
    assert attnlab.explain(*b, pad).path != "flex"
    monkeypatch.setattr(flex_padding, "SERVES_ON", ("cuda",))
    assert "cpu tensors" in flex_padding.unfit(*b, pad.key_range, None, 0.0, False)
    assert attnlab.explain(*b, pad).path != "flex"
