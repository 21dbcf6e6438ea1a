"""The translator's Transformer decodes with a compiled step (issue 11, item 1).

``beam_search(..., compile=...)`` / ``greedy`` run every step after the first through one
``DecodeStep`` graph over a ``StaticCache``, with the encoder's memory as graph inputs and
symbolic sizes: the same hypotheses as eager decoding, one compilation for batches of every
size and source length. A counting backend (aot_eager underneath) counts graphs; one test goes
through inductor.
"""

from __future__ import annotations

import argparse

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F

import attnlab.cache
import attnlab.functional as AF
from attnlab.cache import StaticCache
from attnlab.models import DecodeStep
from attnlab.translate.decoding import beam_search, greedy
from attnlab.translate.models import build_model, model_config
from attnlab.translate.tokenizer import EOS

V = 40


class Graphs:
    """A torch.compile backend that counts compilations (then runs aot_eager).

    Counted by compile id: dynamo may call the backend twice for one compilation (it restarts
    its analysis after turning Python float scalars into tensors)."""

    def __init__(self):
        self.ids = set()

    @property
    def count(self):
        return len(self.ids)

    def __call__(self, gm, example_inputs):
        from torch._dynamo.backends.registry import lookup_backend
        from torch._guards import CompileContext

        cid = CompileContext.current_compile_id()
        self.ids.add((cid.frame_id, cid.frame_compile_id))
        return lookup_backend("aot_eager")(gm, example_inputs)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def model_of(attention="gqa", seed=0, eos=2.0):
    """A random tiny model whose EOS logit is raised by ``eos`` (so that some hypotheses end
    with EOS and others at their length limit: both paths of the search)."""
    torch.manual_seed(seed)
    cfg = model_config("transformer", attention, "tiny", heads=4, d_model=32, dec_layers=2)
    model = build_model(cfg, V).eval()
    with torch.no_grad():
        e = model.embedding.weight[EOS]
        model.dec_norm.bias += eos * e / e.square().sum()
    return model


def batch(B, S, seed):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, S + 1, (B,), generator=g)
    lengths[0] = S
    src = torch.randint(4, V, (B, S), generator=g)
    src[torch.arange(S)[None] >= lengths[:, None]] = 0
    return src, lengths


def same(a, b):
    assert [h.tokens for h in a] == [h.tokens for h in b]
    assert [h.eos for h in a] == [h.eos for h in b]
    for x, y in zip(a, b, strict=True):
        assert x.score == pytest.approx(y.score, abs=1e-5)


@pytest.mark.parametrize(
    "attention,beam,eos",  # (eos: a mix of ended and cut hypotheses for each, measured)
    [("multihead", 1, 3.5), ("multihead", 3, 1.5), ("gqa", 1, 2.5), ("gqa", 3, 0.5)],
)
def test_compiled_decoding_equals_eager_with_one_graph_for_every_batch(attention, beam, eos):
    model, graphs = model_of(attention, eos=eos), Graphs()
    decode = greedy if beam == 1 else beam_search
    kw = {} if beam == 1 else {"beam_size": beam}
    ended = []
    for B, S, seed in ((3, 7, 0), (3, 9, 1), (5, 12, 2), (2, 4, 3)):
        src, lengths = batch(B, S, seed)
        want = decode(model, src, lengths, **kw)
        got = decode(model, src, lengths, compile={"backend": graphs}, **kw)
        same(got, want)
        ended += [h.eos for h in want]
    assert graphs.count == 1  # symbolic sizes: new batch sizes, lengths, caches reuse it
    assert any(ended) and not all(ended)  # some ended with EOS, others at their length limit


def test_compiled_beam_search_keeps_attention_maps_on_request():
    model = model_of()
    src, lengths = batch(3, 7, 4)
    want = beam_search(model, src, lengths, beam_size=2, return_attention=True)
    got = beam_search(
        model, src, lengths, beam_size=2, return_attention=True, compile={"backend": Graphs()}
    )  # (maps asked for: every step eager over the static cache)
    same(got, want)
    for x, y in zip(got, want, strict=True):
        torch.testing.assert_close(x.attention, y.attention, rtol=0, atol=1e-6)


def test_a_model_that_decoded_compiled_still_pickles_and_copies():
    import copy
    import io

    model = model_of()
    src, lengths = batch(2, 5, 9)
    want = greedy(model, src, lengths, compile={"backend": Graphs()})
    buffer = io.BytesIO()
    torch.save(model, buffer)  # (the compiled steps are not part of the model's state)
    buffer.seek(0)
    again = torch.load(buffer, weights_only=False)
    same(greedy(again, src, lengths), want)
    same(greedy(copy.deepcopy(model), src, lengths), want)


def test_compiled_decoding_through_inductor():
    model = model_of("gqa", seed=1)
    for B, S, seed in ((2, 6, 5), (4, 9, 6)):
        src, lengths = batch(B, S, seed)
        same(
            beam_search(model, src, lengths, beam_size=2, compile=True),
            beam_search(model, src, lengths, beam_size=2),
        )


def test_attention_compiles_with_symbolic_sizes_and_grouped_heads():
    """torch's SDPA takes a Python bool for enable_gqa: attnlab's must not hand it a SymBool."""
    fn = torch.compile(AF.scaled_dot_product_attention, dynamic=True, fullgraph=True)
    for B, L, S in ((2, 3, 5), (3, 4, 7)):
        q, k, v = torch.randn(B, 4, L, 8), torch.randn(B, 2, S, 8), torch.randn(B, 2, S, 8)
        want = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        torch.testing.assert_close(fn(q, k, v), want, rtol=0, atol=1e-6)


def test_compiled_decoding_reuses_one_static_cache_across_batches():
    """A CUDA graph replays over the cache's addresses: a new cache per batch would record it
    again every time. greedy and beam_search reset and reuse the model's last cache."""
    model, graphs = model_of("gqa", eos=1.5), Graphs()
    kept = attnlab.cache._KEPT  # model -> its last cache
    src, lengths = batch(3, 7, 0)
    want = beam_search(model, src, lengths, beam_size=2)
    addresses = []
    for _ in range(2):
        got = beam_search(model, src, lengths, beam_size=2, compile={"backend": graphs})
        same(got, want)  # a reset cache: nothing of the last decoding leaks into this one
        cache = kept[model]
        addresses.append([layer.keys.data_ptr() for layer in cache._layers.values()])
    assert addresses[0] == addresses[1] and addresses[0]
    greedy(model, *batch(2, 30, 1), compile={"backend": graphs})  # another length: replaced
    assert kept[model] is not cache and kept[model].max_length != cache.max_length
    state = model.start(model.encode(src, lengths), max_length=8, compile={"backend": graphs})
    assert state["cache"] is not kept[model]  # start() alone: its own cache


def test_compiled_state_rounds_cache_and_source_up_to_a_bucket():
    """(A CUDA graph is recorded per geometry: rounding keeps them few.)"""
    model = model_of()
    memory = model.encode(*batch(2, 5, 7))
    state = model.start(memory, max_length=17, compile={"backend": Graphs()})
    assert state["cache"].max_length == 32 and state["source_length"] == 5
    assert state["mask"].shape == (2, 16) and not state["mask"][:, 5:].any()
    assert state["k0"].shape[2] == 16 and state["k0"][:, :, 5:].abs().max() == 0
    torch.testing.assert_close(state["v1"][:, :, :5], memory["v1"], rtol=0, atol=0)


def test_misuse_is_refused_with_the_fix():
    model = model_of()
    memory = model.encode(*batch(2, 5, 7))
    with pytest.raises(ValueError, match=r"max_length >= 1; got None"):
        model.start(memory, compile=True)
    rnn = build_model(model_config("rnn", "bahdanau", "tiny"), V).eval()
    with pytest.raises(ValueError, match=r"this is an RNN.*Fix: compile=False"):
        greedy(rnn, *batch(2, 5, 7), compile=True)


def test_decode_step_inputs_are_part_of_a_fixed_geometry():
    """A DecodeStep specialised to one geometry (dynamic=False) refuses memory of another
    shape instead of silently compiling again; a model with its own step takes no inputs."""
    model = model_of()
    from attnlab.translate.transformer import StepDecoder

    src, lengths = batch(2, 5, 8)
    state = model.start(model.encode(src, lengths))  # eager, to fill a static cache's first slot
    step = DecodeStep(StepDecoder(model), backend=Graphs())
    cache = StaticCache(8)
    token = torch.full((2,), 1)
    model.step(token, {**state, "cache": cache})
    kv = tuple((state[f"k{i}"], state[f"v{i}"]) for i in range(2))
    step(token[:, None], cache, mask=state["mask"], kv=kv)
    longer = tuple((k.repeat(1, 1, 2, 1), v.repeat(1, 1, 2, 1)) for k, v in kv)
    with pytest.raises(ValueError, match=r"compiled for inputs of shapes .* Fix: a new DecodeStep"):
        step(token[:, None], cache, mask=state["mask"].repeat(1, 2), kv=longer)

    from attnlab.models import LlamaConfig, LlamaModel

    llama = LlamaModel(LlamaConfig(vocab_size=20, d_model=16, num_layers=1, num_heads=2,
                                   num_kv_heads=1, d_ff=32)).eval()  # fmt: skip
    llama_cache = llama.make_cache("static", max_length=8)
    with torch.no_grad():
        llama(torch.tensor([[1, 2]]), cache=llama_cache)
    with pytest.raises(TypeError, match=r"forward_step takes no other inputs; got \['mask'\]"):
        DecodeStep(llama)(torch.tensor([[3]]), llama_cache, mask=state["mask"])


def test_the_compile_option_of_the_run_commands_refuses_an_rnn_run(tmp_path, monkeypatch):
    from attnlab.translate import pipeline

    class Run:
        config = {"model": {"kind": "rnn"}}
        compile_decoding = False

    monkeypatch.setattr("attnlab.translate.run.load_run", lambda *a, **k: Run())
    monkeypatch.setattr(pipeline, "read_run_config", lambda *a: None)
    args = argparse.Namespace(beam_size=None, device="cpu", threads=1, run_dir=tmp_path)
    assert pipeline.open_run(args).compile_decoding is False
    args.compile = True
    with pytest.raises(ValueError, match=r"--compile compiles a Transformer's decoder step"):
        pipeline.open_run(args)
    Run.config = {"model": {"kind": "transformer"}}
    assert pipeline.open_run(args).compile_decoding is True
