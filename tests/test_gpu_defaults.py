"""GPU training defaults (attnlab.translate.gpu): batches sized from device memory, bf16
autocast. The arithmetic and the CUDA bookkeeping are tested here with the device's memory
figures stood in (no GPU in CI); the command runs end to end on CPU with both options."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

pytest.importorskip("tokenizers")
pytest.importorskip("babel")

from attnlab.translate import cmd_train, gpu  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def test_batches_scale_with_free_memory_within_bounds():
    # a 2,048-token probe peaked at 512 MiB: 0.25 MiB a token; 40 GiB free -> 0.6 * 40 GiB
    tokens = gpu.scaled_tokens(2048, 512 * 2**20, 40 * 2**30, base=2048)
    assert tokens == min(gpu.MAX_AUTO_TOKENS, int(0.6 * 40 * 4 * 1024) // 256 * 256)
    assert gpu.scaled_tokens(2048, 512 * 2**20, 6 * 2**30, base=2048) == 14592
    assert gpu.scaled_tokens(2048, 512 * 2**20, 2**20, base=2048) == 2048  # never below base
    assert gpu.scaled_tokens(2048, 2**10, 80 * 2**30, base=2048) == gpu.MAX_AUTO_TOKENS


def test_auto_max_tokens_measures_the_probe_on_cuda(monkeypatch):
    """The CUDA path with the device's figures stood in: the probe's own peak is what counts."""
    calls = []
    peak = {"now": 100 * 2**20}
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: calls.append(1))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 100 * 2**20)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: peak["now"])
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 * 2**30, 80 * 2**30))

    def step():
        peak["now"] += 256 * 2**20  # the probe takes 256 MiB on top of the weights

    tokens, how = gpu.auto_max_tokens(step, 1024, "cuda:0", base=2048)
    assert calls and tokens == gpu.scaled_tokens(1024, 256 * 2**20, 10 * 2**30, 2048) == 24576
    assert "256 MiB" in how and "10.0 of 80.0 GiB" in how
    assert gpu.auto_max_tokens(step, 1024, "cpu", base=1536)[0] == 1536


def test_probe_step_runs_a_real_backward_and_leaves_no_trace():
    """The probe is one forward+backward (it once ran under no_grad, so its backward raised
    "element 0 of tensors does not require grad" and --max-tokens auto crashed on CUDA)."""
    from attnlab.translate.batching import Encoded
    from attnlab.translate.models import build_model, model_config
    from attnlab.translate.trainer import probe_step

    torch.manual_seed(0)
    model = build_model(model_config("rnn", "luong-general", "tiny"), 50)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    data = Encoded([[5, 6, 7]] * 10, [[8, 9]] * 10)
    rng = torch.get_rng_state()
    with torch.no_grad():  # whatever the caller's grad mode
        tokens = probe_step(model, data, "cpu", 1536, "fp32")
    # one batch of all 10 pairs: sources of 3 tokens + EOS, targets BOS + 2 tokens
    assert tokens == 10 * (3 + 1) + 10 * (1 + 2) == 70
    assert all(p.grad is None for p in model.parameters())  # gradients dropped
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert torch.equal(torch.get_rng_state(), rng)  # random state untouched


def test_train_with_auto_batches_runs_the_real_probe_on_cuda_figures(tmp_path, monkeypatch, capsys):
    """``attnlab train --max-tokens auto`` end to end with the real probe step: on CPU, with the
    CUDA branch of auto_max_tokens taken and the device's memory figures stood in."""
    mib = 2**20
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 100 * mib)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 148 * mib)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (2**30, 80 * 2**30))
    probes = []
    real = gpu.auto_max_tokens

    def on_cuda(step, probe_tokens, device, base):
        assert device == "cpu"  # (the model trains on CPU; only the sizing takes CUDA's path)
        return real(lambda: probes.append(step()), probe_tokens, "cuda:0", base)

    monkeypatch.setattr(gpu, "auto_max_tokens", on_cuda)
    out = tmp_path / "run"
    train_tiny_dates(out, 2, "--max-tokens", "auto", "--device", "cpu")
    from attnlab.translate.settings import MODEL_DEFAULTS

    config = json.loads((out / "config.json").read_text())
    base = MODEL_DEFAULTS[config["model"]["kind"]]["max_tokens"]
    # the probe ran once (a real batch); 48 MiB for `base` tokens, 1 GiB free
    assert len(probes) == 1 and probes[0] > 0
    expected = int(gpu.MEMORY_SHARE * 2**30 / (48 * mib / base)) // 256 * 256
    assert (
        config["train"]["max_tokens"] == expected == gpu.scaled_tokens(base, 48 * mib, 2**30, base)
    )
    assert f"--max-tokens auto -> {expected} " in capsys.readouterr().err


def test_precision_auto_is_float32_on_cpu_and_choices_are_checked():
    assert gpu.resolve_precision(None, "cpu") == "fp32"
    assert gpu.resolve_precision("auto", "cpu") == "fp32"
    assert gpu.resolve_precision("bf16", "cpu") == "bf16"
    with pytest.raises(ValueError, match="precision must be one of"):
        gpu.resolve_precision("fp8", "cpu")
    assert isinstance(gpu.autocast("cpu", "bf16"), torch.autocast)


def train_tiny_dates(out, steps, *options) -> argparse.ArgumentParser:
    """``attnlab train`` of a tiny dates model into ``out`` for ``steps`` steps, on 1 thread;
    the parser it used."""
    parser = argparse.ArgumentParser()
    cmd_train.add_arguments(parser)
    argv = ["--task", "dates", "--tiny", "--max-steps", str(steps), "--train-size", "200"]
    argv += ["--eval-limit", "5", "--threads", "1", "--no-progress", "--out", str(out)]
    assert cmd_train.main(parser.parse_args([*argv, *options])) == 0
    return parser


def test_train_with_auto_batches_and_bf16_on_cpu(tmp_path, capsys):
    out = tmp_path / "run"
    parser = train_tiny_dates(out, 3, "--max-tokens", "auto", "--precision", "bf16")
    config = json.loads((out / "config.json").read_text())
    from attnlab.translate.settings import MODEL_DEFAULTS

    assert config["train"]["max_tokens"] == MODEL_DEFAULTS[config["model"]["kind"]]["max_tokens"]
    assert config["train"]["precision"] == "bf16"
    printed = capsys.readouterr()
    assert "--max-tokens auto ->" in printed.err and "bf16 autocast" in printed.err
    assert "target tokens/s" in printed.out  # the report says how fast it trained
    with pytest.raises(SystemExit):
        parser.parse_args(["--max-tokens", "lots"])


def test_attention_under_autocast_takes_mixed_dtypes_as_torch_does():
    import torch.nn.functional as F

    import attnlab

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 6, 8, generator=g).bfloat16()  # a bf16 projection...
    k, v = torch.randn(2, 4, 6, 8, generator=g), torch.randn(2, 4, 6, 8, generator=g)  # fp32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = attnlab.scaled_dot_product_attention(q, k, v, is_causal=True)
        theirs = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert ours.dtype == theirs.dtype == torch.bfloat16
    assert torch.equal(ours, theirs)
    with pytest.raises(TypeError, match="share one dtype"):  # outside autocast: refused
        attnlab.scaled_dot_product_attention(q, k, v)
