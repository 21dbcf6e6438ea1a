"""A linear layer over a few rows on CPU (attnlab.kernels.few_rows): the weight-major product
equals the layer's own to rounding (tolerance from F.linear's own error against float64), is
taken only where nothing else could tell, and the measured choice holds inside torch.compile.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch._dynamo
from torch import nn

from attnlab.kernels import few_rows
from attnlab.models import DecodeStep, LlamaConfig, LlamaModel

ENV = few_rows.ENV
UNCACHED_MEASURE = few_rows.measure.__wrapped__  # (the probe itself, without the process cache)


@pytest.fixture
def taken(monkeypatch):
    """Counts the weight-major products run (``taken[0]``)."""
    count = [0]
    product = few_rows._weight_major_product

    def counted(*args):
        count[0] += 1
        return product(*args)

    monkeypatch.setattr(few_rows, "_weight_major_product", counted)
    return count


def layer(out_features=48, in_features=40, bias=True, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return nn.Linear(in_features, out_features, bias=bias).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("lead", [(2,), (3,), (2, 1), (4, 2), (1, 16)])
def test_weight_major_equals_the_layer_to_rounding(monkeypatch, taken, dtype, bias, lead):
    monkeypatch.setenv(ENV, "weight-major")
    mod = layer(bias=bias, dtype=dtype)
    x = torch.randn(*lead, 40).to(dtype)
    with torch.no_grad():
        got, control = few_rows.linear(mod, x), mod(x)
    assert taken[0] == 1
    assert got.shape == control.shape == (*lead, 48) and got.is_contiguous()
    w, b = mod.weight.double(), None if mod.bias is None else mod.bias.double()
    want = nn.functional.linear(x.double(), w, b)
    # as close to float64 as the layer's own product, within a rounding of the output
    err, own = (got.double() - want).abs().max(), (control.double() - want).abs().max()
    ulp = torch.finfo(dtype).eps * want.abs().max()
    assert err <= 2 * own + 2 * ulp, (err, own)


def test_a_wrong_bias_axis_or_transpose_would_fail(monkeypatch):
    """(The control for the test above: a product that adds the bias along the rows, or returns
    the transposed result's memory, is far off.)"""
    monkeypatch.setenv(ENV, "weight-major")
    mod = layer(out_features=4, in_features=4)
    x = torch.randn(4, 4)
    with torch.no_grad():
        want = mod(x)
        wrong = torch.mm(mod.weight, x.t()).t() + mod.bias[:, None]
        assert (wrong - want).abs().max() > 1e-3
        assert torch.allclose(few_rows.linear(mod, x), want, atol=1e-6)


@pytest.mark.parametrize(
    "case",
    [
        "grad",
        "bias-only grad",
        "many rows",
        "hooked",
        "forward replaced",
        "subclass",
        "weight subclass",
        "setting linear",
        "other dtype",
        "autocast",
        "jit trace",
    ],  # fmt: skip
)
def test_the_layer_is_called_as_itself_where_the_order_could_show(monkeypatch, taken, case):
    monkeypatch.setenv(ENV, "weight-major")
    mod, x = layer(), torch.randn(2, 40)
    called = []
    if case == "grad":
        x.requires_grad_()
    if case == "bias-only grad":  # (BitFit: the bias alone trains)
        mod.weight.requires_grad_(False)
    if case == "forward replaced":  # (accelerate's hooks replace the instance's forward)
        plain_forward = mod.forward
        mod.forward = lambda x: 2 * plain_forward(x)
    if case == "weight subclass":

        class Tagged(torch.Tensor):
            pass

        mod.weight = nn.Parameter(mod.weight.detach().as_subclass(Tagged))
    if case == "many rows":
        x = torch.randn(few_rows.FEW_ROWS + 1, 40)
    if case == "hooked":
        mod.register_forward_hook(lambda m, args, out: called.append(out))
    if case == "subclass":

        class Scaled(nn.Linear):
            def forward(self, x):
                return 2 * super().forward(x)

        mod = Scaled(40, 48)
    if case == "setting linear":
        monkeypatch.setenv(ENV, "linear")
    if case == "other dtype":
        x = x.double()  # (the layer raises as it would: a dtype mismatch is the caller's)
        with pytest.raises(RuntimeError):
            few_rows.linear(mod, x)
        assert taken[0] == 0
        return
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=case == "autocast")
    with torch.set_grad_enabled(case.endswith("grad")), autocast:
        if case == "jit trace":
            mod.requires_grad_(False)  # (a traced function keeps the parameters as constants)
            # (check_trace=False: the check reruns the function untraced, where it may take
            # the weight-major order)
            traced = torch.jit.trace(lambda x: few_rows.linear(mod, x), (x,), check_trace=False)
            x = torch.randn(3, 1, 40)  # (another rank: a traced weight-major view would fail)
            got = traced(x)
        else:
            got = few_rows.linear(mod, x)
        want = mod(x)
    assert taken[0] == 0
    assert torch.equal(got, want)
    if case.endswith("grad"):
        got.sum().backward()
        assert mod.bias.grad is not None
    if case == "hooked":
        assert len(called) == 2  # (the hook saw the call through few_rows.linear too)


@pytest.mark.parametrize("transform", ["vmap", "jvp", "dual"])
def test_torch_func_and_forward_mode_ad_call_the_layer_as_itself(monkeypatch, taken, transform):
    # from a review: they took the weight-major order, which the docstring excludes (autograd
    # records there, through wrapped or dual tensors no requires_grad shows)
    import torch.autograd.forward_ad as fwAD

    monkeypatch.setenv(ENV, "weight-major")
    mod, x, t = layer(), torch.randn(2, 40), torch.randn(2, 40)
    mod.requires_grad_(False)
    with torch.no_grad():
        if transform == "vmap":
            got = torch.func.vmap(lambda r: few_rows.linear(mod, r[None]))(x)[:, 0]
        elif transform == "jvp":
            got = torch.func.jvp(lambda r: few_rows.linear(mod, r), (x,), (t,))[0]
        else:
            with fwAD.dual_level():
                got = fwAD.unpack_dual(few_rows.linear(mod, fwAD.make_dual(x, t))).primal
    assert taken[0] == 0
    torch.testing.assert_close(got, mod(x), rtol=0, atol=0)
    few_rows.linear(mod, x)  # (outside them: the weight-major order, as set)
    assert taken[0] == 1


@pytest.mark.parametrize("case", ["0-d input", "wrong width", "no outputs", "broadcast bias"])
def test_sizes_the_layer_refuses_or_broadcasts_keep_its_own_answer(monkeypatch, taken, case):
    monkeypatch.setenv(ENV, "weight-major")
    mod, x = layer(out_features=3, in_features=1), torch.randn(2, 1)
    if case == "0-d input":
        x = torch.tensor(1.5)
    if case == "wrong width":
        mod = layer()
        x = torch.randn(2, 20)
    if case == "no outputs":
        mod = nn.Linear(4, 0)
        x = torch.randn(2, 4)
    if case == "broadcast bias":
        mod.bias = nn.Parameter(torch.randn(2, 3))
    with torch.no_grad():
        try:
            want = mod(x)
        except RuntimeError as error:
            with pytest.raises(RuntimeError, match=str(error)[:40].replace("(", r"\(")):
                few_rows.linear(mod, x)
        else:
            assert torch.equal(few_rows.linear(mod, x), want)
    assert taken[0] == 0


@pytest.mark.parametrize("mode", ["fake", "meta default device"])
def test_no_probe_runs_under_a_mode_and_none_is_cached_there(monkeypatch, taken, mode):
    """A probe run under FakeTensorMode or a default-device mode would time nothing real and
    keep its ratio for the rest of the process: there the layer is called as itself."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    monkeypatch.delenv(ENV, raising=False)
    probed = []
    monkeypatch.setattr(few_rows, "measure", lambda *key: probed.append(key) or 0.5)
    mod = layer(out_features=512, in_features=256)
    if mode == "fake":
        with FakeTensorMode() as fake:
            fake_mod = nn.Linear(256, 512)
            out = few_rows.linear(fake_mod, fake.from_tensor(torch.randn(3, 256)))
            assert out.shape == (3, 512)
    else:
        x = torch.randn(3, 256)
        with torch.device("meta"), torch.no_grad():
            assert torch.equal(few_rows.linear(mod, x), mod(x))
    assert probed == [] and taken[0] == 0


def test_a_bad_setting_names_the_variable_and_the_choices(monkeypatch):
    monkeypatch.setenv(ENV, "fast")
    with pytest.raises(ValueError, match=f"{ENV} must be one of measure, linear, weight-major"):
        with torch.no_grad():
            few_rows.linear(layer(), torch.randn(2, 40))


def test_measured_by_row_class_and_not_for_small_matrices_or_one_row(monkeypatch, taken):
    monkeypatch.delenv(ENV, raising=False)
    calls = []
    monkeypatch.setattr(
        few_rows, "measure", lambda *key: calls.append(key) or (0.5 if key[3] == 4 else 1.0)
    )
    big = layer(out_features=512, in_features=256)  # 512 KiB: measured
    with torch.no_grad():
        few_rows.linear(layer(), torch.randn(3, 40))  # 7.5 KiB: F.linear, no probe
        few_rows.linear(big, torch.randn(1, 256))  # one row: F.linear, no probe
        assert calls == [] and taken[0] == 0
        for rows in (3, 2, 4):
            few_rows.linear(big, torch.randn(rows, 256))
    threads = torch.get_num_threads()
    # rows in classes (powers of two): 3 and 4 ask for one measurement (cached by measure)
    key = (torch.float32, 512, 256)
    assert calls == [(*key, 4, threads), (*key, 2, threads), (*key, 4, threads)]
    assert taken[0] == 2  # (3 and 4 rows, where the probe said 0.5)


def test_the_probe_times_both_orders_and_returns_their_ratio(monkeypatch):
    """On a fake clock where a weight-major product takes 3 ticks and F.linear 1, the probe
    returns 3 (not 1/3: the ratio's direction decides the order), and each round multiplies
    every copy of the matrix, of the probed shape, by the rows' class."""
    clock, seen = [0.0], {"linear": [], "weight-major": []}

    def ticking(name, ticks):
        def product(x, w, *rest):
            seen[name].append((tuple(x.shape), tuple(w.shape), w.data_ptr()))
            clock[0] += ticks
            return None

        return product

    monkeypatch.setattr(few_rows, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(few_rows, "F", SimpleNamespace(linear=ticking("linear", 1.0)))
    monkeypatch.setattr(few_rows, "_weight_major_product", ticking("weight-major", 3.0))
    monkeypatch.setattr(few_rows, "COLD_BYTES", 2**20)
    ratio = UNCACHED_MEASURE(torch.float32, 256, 128, 4, 1, rounds=2)
    assert ratio == 3.0
    copies = 2**20 // (256 * 128 * 4)
    for calls in seen.values():
        assert len(calls) == 3 * copies  # a warm-up round and two timed ones
        assert {(x, w) for x, w, _ in calls} == {((4, 128), (256, 128))}
        assert len({ptr for _, _, ptr in calls}) == copies  # every copy, each once a round
    # a matrix over COLD_BYTES is probed by the first rows that fit
    seen["linear"].clear()
    UNCACHED_MEASURE(torch.float32, 4096, 128, 4, 1, rounds=1)
    assert {w for _, w, _ in seen["linear"]} == {(2**20 // (128 * 4), 128)}


def test_inside_torch_compile_the_choice_is_a_constant_of_the_graph(monkeypatch, taken):
    """Within fixed_sizes() (a graph specialised to its sizes), the probe runs when dynamo
    traces the call (no graph break), and the compiled function takes the order it chose;
    outside it (sizes may be symbolic) a traced call keeps F.linear and probes nothing."""
    monkeypatch.delenv(ENV, raising=False)
    seen = []

    def fake_measure(*key):
        seen.append(key)
        return 0.5

    monkeypatch.setattr(few_rows, "measure", fake_measure)
    mod = layer(out_features=512, in_features=256)
    x = torch.randn(2, 256)
    for dynamic in (False, True):
        torch._dynamo.reset()
        compiled = torch.compile(
            lambda x: few_rows.linear(mod, x), backend="eager", fullgraph=True, dynamic=dynamic
        )
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), mod(x), rtol=1e-5, atol=1e-5)
        assert seen == [] and taken[0] == 0
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: few_rows.linear(mod, x), backend="eager", fullgraph=True)
    with torch.no_grad(), few_rows.fixed_sizes():
        got = compiled(x)
    with torch.no_grad():
        want = mod(x)
    assert len(seen) == 1 and seen[0][1:4] == (512, 256, 2)
    assert taken[0] >= 1  # (traced through the weight-major product)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the real probe, run while dynamo traces: on real tensors (no fake mode), a finite ratio
    monkeypatch.setattr(few_rows, "COLD_BYTES", 2**20)
    ratios = []
    monkeypatch.setattr(
        few_rows, "measure", lambda *key: ratios.append(UNCACHED_MEASURE(*key)) or ratios[-1]
    )
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: few_rows.linear(mod, x), backend="eager", fullgraph=True)
    with torch.no_grad(), few_rows.fixed_sizes():
        torch.testing.assert_close(compiled(x), want, rtol=1e-5, atol=1e-5)
    assert len(ratios) == 1 and 0.0 < ratios[0] < float("inf")
    torch._dynamo.reset()


@pytest.mark.parametrize("compiled", [False, True])
def test_decoding_gives_the_same_tokens_either_order(monkeypatch, taken, compiled):
    """A Llama decoded greedily with every product weight-major: the same tokens as with
    F.linear, logits within float32 rounding, eager and through the compiled step."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                      d_ff=64)  # fmt: skip
    model = LlamaModel(cfg).eval()
    ids = torch.randint(1, 64, (3, 5), generator=torch.Generator().manual_seed(1))
    runs = {}
    for setting in ("linear", "weight-major"):
        monkeypatch.setenv(ENV, setting)
        torch._dynamo.reset()
        cache = model.make_cache("static", 16)
        step = DecodeStep(model, backend="aot_eager", compile=compiled)
        logits = []
        with torch.no_grad():
            out = model(ids, cache=cache)[:, -1:]
            token = out.argmax(-1)
            tokens = [token]
            for _ in range(6):
                out = step(token, cache)[:, -1:]
                logits.append(out)
                token = out.argmax(-1)
                tokens.append(token)
        runs[setting] = torch.cat(tokens, 1), torch.cat(logits, 1)
        # (the steps' projections and lm_head took it: run, or traced once when compiled)
        assert (taken[0] > 0) == (setting == "weight-major")
    torch._dynamo.reset()
    assert torch.equal(runs["linear"][0], runs["weight-major"][0])
    torch.testing.assert_close(runs["weight-major"][1], runs["linear"][1], rtol=1e-5, atol=1e-5)
