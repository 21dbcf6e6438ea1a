"""The translator end to end: the commands, their errors, and distributed training.

* ``attnlab train`` with a tiny budget writes a run directory that ``translate``, ``evaluate``
  and :func:`attnlab.translate.load_run` use.
* Bad input gives one-line errors with the fix.
* Two CPU processes under ``torchrun`` (gloo) keep identical replicas, equal to one process
  training on the same global batches.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

pytest.importorskip("tokenizers")
pytest.importorskip("safetensors")
pytest.importorskip("sacrebleu")

from attnlab.translate import cmd_compare, cmd_evaluate, cmd_train, cmd_translate  # noqa: E402
from conftest import run_command as run  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def dates_run(tmp_path_factory):
    pytest.importorskip("babel")
    out = tmp_path_factory.mktemp("runs") / "dates-tiny"
    code = run(
        cmd_train,
        [
            "--task",
            "dates",
            "--tiny",
            "--time-budget",
            "0.2",
            "--train-size",
            "600",
            "--eval-limit",
            "40",
            "--threads",
            "1",
            "--no-progress",
            "--out",
            str(out),
        ],
    )
    assert code == 0
    return out


def test_train_writes_a_usable_run_dir(dates_run, capsys):
    for name in (
        "config.json",
        "tokenizer.json",
        "model.safetensors",
        "results.json",
        "train.log",
        "checkpoint/LATEST",
    ):
        assert (dates_run / name).is_file(), name
    results = json.loads((dates_run / "results.json").read_text())
    assert results["test"]["sentences"] == 40
    assert {"bleu", "chrf", "exact_match"} <= set(results["test"])
    config = json.loads((dates_run / "config.json").read_text())
    assert config["model"]["kind"] == "rnn" and config["tokenizer"]["kind"] == "char"
    assert config["train"]["train_seconds"] < 12  # the budget covers set-up and evaluation too


def test_translate_command_and_load_run(dates_run, capsys, tmp_path):
    capsys.readouterr()
    assert run(cmd_translate, [str(dates_run), "1 February 2005", "mardi 1 mars 2005"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2
    infile = tmp_path / "in.txt"
    infile.write_text("1 February 2005\n\n3 March 1999\n", encoding="utf-8")
    assert (
        run(cmd_translate, [str(dates_run), "--input", str(infile), "--beam-size", "3", "--json"])
        == 0
    )
    out = capsys.readouterr().out.split("\n")[:-1]
    assert len(out) == 3 and json.loads(out[0])["source"] == "1 February 2005"
    assert json.loads(out[1]) == {"source": "", "translation": "", "source_tokens": [],
                                  "target_tokens": [], "score": None,
                                  "complete": None}  # fmt: skip

    from attnlab.translate import load_run

    tr = load_run(dates_run)
    res = tr.translate(["1 February 2005", "3 March 1999"], beam_size=2)
    for r in res:
        assert r.attention.shape == (len(r.target_tokens), len(r.source_tokens))
        assert r.source_tokens[-1] == "</s>"
        assert abs(r.attention.sum(-1) - 1).max() < 1e-4


def test_translations_stay_on_their_lines_whatever_the_characters(dates_run, capsys, tmp_path):
    """One output line per input line as wc -l counts them (at \\n): U+2028, U+0085, a form
    feed or a lone carriage return inside a line split it before, and every translation after
    it stood next to another line. Whitespace-only arguments are empty lines, as in a file."""
    sentences = ["1 mars 1999", "3 avril\u2028 2001", "5 mai\x85 2002", "\f7 juin 2003",
                 "9 juillet\r 2004", "", "   ", "11 août 2005\r"]  # fmt: skip
    infile = tmp_path / "odd.txt"
    infile.write_bytes("\n".join(sentences).encode("utf-8") + b"\r\n")
    # one thread here and below (the command sets torch's count for the process): a barely
    # trained model's near-ties can flip with the rounding of another thread count
    argv = [str(dates_run), "--input", str(infile), "--beam-size", "1", "--threads", "1"]
    assert run(cmd_translate, argv) == 0
    got = capsys.readouterr().out.split("\n")[:-1]
    assert len(got) == len(sentences) == infile.read_bytes().count(b"\n")
    from attnlab.translate import load_run

    each = load_run(dates_run).translate([t.strip() for t in sentences if t.strip()], beam_size=1)
    assert [line for line in got if line] == [r.text for r in each]
    assert got[5] == got[6] == ""
    argv = [str(dates_run), "   ", "", "1 mars 1999", "--beam-size", "1", "--threads", "1"]
    assert run(cmd_translate, argv) == 0  # (before: the run's beam, 4, against greedy below)
    # (decoded alone, as the command decodes its one non-empty line: in a batch of others its
    # rounding differs)
    alone = load_run(dates_run).translate(["1 mars 1999"], beam_size=1)[0].text
    assert capsys.readouterr().out.split("\n")[:-1] == ["", "", alone]


def test_input_that_is_not_utf8_is_refused_in_one_line(dates_run, tmp_path, monkeypatch, capsys):
    """Before: a file gave Python's codec message, and the same bytes on stdin were read with
    surrogates and translated as unknown symbols ("3 août 1999" -> "1999-10-33")."""
    import io

    from attnlab import cli

    latin1 = "1 mars 1999\n3 août 1999\n".encode("latin-1")
    infile = tmp_path / "latin1.txt"
    infile.write_bytes(latin1)
    assert cli.main(["translate", str(dates_run), "--input", str(infile)]) == 2
    said = capsys.readouterr().err
    assert "not UTF-8 text: byte 0xfb on line 2" in said and "iconv" in said  # (û)
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(latin1)))
    assert cli.main(["translate", str(dates_run)]) == 2
    assert "standard input is not UTF-8 text" in capsys.readouterr().err
    assert cli.main(["translate", str(dates_run), "--input", str(tmp_path)]) == 2
    assert "a folder; pass a text file" in capsys.readouterr().err


def test_evaluate_command(dates_run, capsys):
    capsys.readouterr()
    assert run(cmd_evaluate, [str(dates_run), "--limit", "20", "--json", "--no-progress"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["sentences"] == 20 and "exact_match" in res
    assert 0 <= res["alignment"]["aer_referenced"] <= 100  # dates: digits vs the words
    # the scores are sacrebleu's on the run's own translations of the first 20 test pairs
    import sacrebleu

    from attnlab.translate import load_run
    from attnlab.translate.tasks import load_task

    translator = load_run(dates_run)
    pairs = load_task(translator.config["task"]).split("test")[:20]
    hyps = [
        t.text for t in translator.translate([p.source for p in pairs], beam_size=res["beam_size"])
    ]
    refs = [p.target for p in pairs]
    assert res["bleu"] == pytest.approx(sacrebleu.corpus_bleu(hyps, [refs]).score, abs=0.01)
    assert res["chrf"] == pytest.approx(sacrebleu.corpus_chrf(hyps, [refs]).score, abs=0.01)
    exact = 100 * sum(h == r for h, r in zip(hyps, refs, strict=True)) / len(refs)
    assert res["exact_match"] == pytest.approx(exact, abs=0.01)


def test_resume_continues_a_finished_run(dates_run, capsys):
    before = json.loads((dates_run / "results.json").read_text())["train"]["steps"]
    assert (
        run(
            cmd_train,
            [
                "--out",
                str(dates_run),
                "--resume",
                "--more-steps",
                "3",
                "--eval-limit",
                "10",
                "--no-progress",
            ],
        )
        == 0
    )
    after = json.loads((dates_run / "results.json").read_text())["train"]["steps"]
    assert after == before + 3


@pytest.mark.parametrize(
    "module,argv,message",
    [
        (cmd_translate, ["{tmp}/nowhere", "hello"], "does not exist"),
        (cmd_translate, ["{tmp}", "hello"], "is not a run directory"),
        (cmd_evaluate, ["{tmp}/nowhere"], "train one with"),
        (cmd_train, ["--model", "rnn", "--kv-heads", "2"], "--model transformer only"),
        (cmd_train, ["--model", "transformer", "--attention", "bahdanau"], "--model rnn"),
        (cmd_train, ["--task", "dates", "--data", "x.tsv"], "drop one of them"),
        (cmd_train, ["--resume"], "--resume --out RUN_DIR"),
        (cmd_train, ["--skip-bad-lines"], "applies only to --data"),
        (cmd_train, ["--data", "{tmp}/missing.tsv", "--out", "{tmp}/r"], "does not exist"),
    ],
)
def test_bad_input_gives_one_line_with_the_fix(tmp_path, monkeypatch, module, argv, message):
    monkeypatch.chdir(tmp_path)  # a default run dir would land here
    argv = [a.format(tmp=tmp_path) for a in argv]
    with pytest.raises((ValueError, FileNotFoundError)) as err:
        run(module, argv)
    text = str(err.value)
    assert message in text and "\n" not in text


def test_bad_tsv_lines_are_reported_and_can_be_skipped(tmp_path, capsys):
    path = tmp_path / "pairs.tsv"
    good = [f"sentence number {i}\tfrase número {i}" for i in range(60)]
    path.write_text(
        "\n".join(good[:10] + ["no tab on this line", "a\tb\tc\td"] + good[10:]) + "\n",
        encoding="utf-8",
    )
    argv = [
        "--data",
        str(path),
        "--tiny",
        "--max-steps",
        "2",
        "--vocab-size",
        "300",
        "--eval-limit",
        "3",
        "--no-progress",
        "--threads",
        "1",
        "--out",
        str(tmp_path / "r"),
    ]
    with pytest.raises(ValueError) as err:
        run(cmd_train, argv)
    text = str(err.value)
    assert "2 bad line(s)" in text and "line 11" in text and "line 12" in text
    assert "--skip-bad-lines" in text and "\n" not in text
    assert run(cmd_train, argv + ["--skip-bad-lines"]) == 0
    assert "skipped 2 bad line(s)" in capsys.readouterr().err


def test_existing_run_dir_is_not_overwritten(dates_run):
    with pytest.raises(ValueError, match="--resume"):
        run(cmd_train, ["--task", "dates", "--tiny", "--out", str(dates_run)])


def test_compare_two_variants(tmp_path, capsys):
    pytest.importorskip("babel")
    out = tmp_path / "cmp"
    assert (
        run(
            cmd_compare,
            [
                "--task",
                "dates",
                "--variants",
                "rnn-none,transformer-gqa",
                "--size",
                "tiny",
                "--epochs",
                "0.05",
                "--eval-limit",
                "10",
                "--beam-size",
                "1",
                "--threads",
                "1",
                "--no-progress",
                "--out",
                str(out),
            ],
        )
        == 0
    )
    md = (out / "compare.md").read_text()
    assert "rnn-none" in md and "transformer-gqa" in md
    assert "scored on the first 10 test pairs" in md  # (before: the title did not say)
    assert (out / "compare.csv").read_text().count("\n") == 3
    cut = any(r["cut_at_length_limit"] for r in json.loads((out / "compare.json").read_text()))
    assert ("cut at limit" in md) == cut
    # each row carries its own variant's scores, as its run directory recorded them
    rows = json.loads((out / "compare.json").read_text())
    assert [r["variant"] for r in rows] == ["rnn-none", "transformer-gqa"]
    for row in rows:
        results = json.loads((out / row["variant"] / "results.json").read_text())
        test = results["test"]
        assert (row["bleu"], row["chrf"]) == (test["bleu"], test["chrf"])
        assert row["parameters"] == results["parameters"]
        # (before: translations cut at the length limit were not in the table)
        assert row["cut_at_length_limit"] == test.get("cut_at_length_limit", 0)
        assert row["sentences"] == test["sentences"] == 10
        if row["variant"] == "rnn-none":
            assert row["aer"] == "" and "alignment" not in test  # no attention, no AER
        else:
            assert row["aer"] == test["alignment"]["aer"]


DDP_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    from attnlab.data import Pair
    from attnlab.translate.batching import encode_pairs
    from attnlab.translate.models import build_model, model_config
    from attnlab.translate.tokenizer import Tokenizer
    from attnlab.translate.trainer import TrainOptions, fit, init_distributed

    torch.set_num_threads(1)
    out = sys.argv[1]
    pairs = [Pair(f"{i} {i * 7 % 10} {i % 3}", f"{i % 3} {i * 7 % 10} {i}", str(i))
             for i in range(40)]
    tok = Tokenizer.train([p.source for p in pairs] + [p.target for p in pairs], "char")
    data, _ = encode_pairs(tok, pairs)
    dist = init_distributed("cpu")
    torch.manual_seed(0)
    model = build_model(model_config("transformer", "multihead", "tiny"), tok.vocab_size)
    opts = TrainOptions(lr=3e-3, warmup=2, max_tokens=48, max_steps=6, seed=3, label_smoothing=0.1)
    state = fit(model, data, data, opts, out + "/run", dist=dist, progress_bar=False)
    torch.save({"params": model.state_dict(), "step": state.step, "history": state.history},
               f"{out}/rank{dist.rank}.pt")
    """
)


def test_ddp_two_processes_keep_identical_replicas(tmp_path):
    script = tmp_path / "ddp_train.py"
    script.write_text(DDP_SCRIPT, encoding="utf-8")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(script),
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r0 = torch.load(tmp_path / "rank0.pt")
    r1 = torch.load(tmp_path / "rank1.pt")
    assert r0["step"] == r1["step"] == 6
    for name, p in r0["params"].items():
        assert torch.equal(p, r1["params"][name]), name  # the replicas never drift apart

    # One process on the same global batches (2 x 48 tokens) learns the same. (Parameters are
    # not compared: Adam's first steps move every weight by ~lr * sign(gradient), so rounding
    # noise in a near-zero gradient becomes a difference of ~lr.)
    from attnlab.data import Pair
    from attnlab.translate.batching import encode_pairs
    from attnlab.translate.models import build_model, model_config
    from attnlab.translate.tokenizer import Tokenizer
    from attnlab.translate.trainer import TrainOptions, fit

    pairs = [
        Pair(f"{i} {i * 7 % 10} {i % 3}", f"{i % 3} {i * 7 % 10} {i}", str(i)) for i in range(40)
    ]
    tok = Tokenizer.train([p.source for p in pairs] + [p.target for p in pairs], "char")
    data, _ = encode_pairs(tok, pairs)
    torch.manual_seed(0)
    model = build_model(model_config("transformer", "multihead", "tiny"), tok.vocab_size)
    opts = TrainOptions(lr=3e-3, warmup=2, max_tokens=96, max_steps=6, seed=3, label_smoothing=0.1)
    single = fit(model, data, data, opts, tmp_path / "single", progress_bar=False)
    ddp_loss, one_loss = r0["history"][-1]["val_loss"], single.history[-1]["val_loss"]
    assert abs(ddp_loss - one_loss) < 0.01 * one_loss, (ddp_loss, one_loss)


def test_compare_chart_rows_line_up_across_panels():
    """A variant without attention has no AER: its panel must still put every bar on its row."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from attnlab.translate.plot import compare_figure

    rows = [
        {"variant": "rnn-none", "bleu": 10.0, "chrf": 30.0, "aer_referenced": ""},
        {"variant": "rnn-bahdanau", "bleu": 20.0, "chrf": 40.0, "aer_referenced": 5.0},
        {"variant": "rnn-luong-dot", "bleu": 30.0, "chrf": 50.0, "aer_referenced": 7.0},
    ]
    fig = compare_figure(rows)
    try:
        assert len(fig.axes) == 3
        limits = {tuple(ax.get_ylim()) for ax in fig.axes}
        assert limits == {(2.5, -0.5)}  # the same rows, first on top, in every panel
        aer = fig.axes[2]
        widths = {round(p.get_y() + p.get_height() / 2): p.get_width() for p in aer.patches}
        assert widths[1] == 5.0 and widths[2] == 7.0
        assert np.isnan(widths[0])  # no bar where there is no attention
    finally:
        plt.close(fig)


def test_a_translation_cut_at_the_length_limit_is_said(dates_run, capsys, monkeypatch):
    # before: a translation stopped by the length limit looked like any other, in the API, the
    # command's output and the evaluation's figures
    import attnlab.translate.run as run_module
    from attnlab.translate import load_run
    from attnlab.translate.evaluation import evaluate
    from attnlab.translate.tasks import load_task

    monkeypatch.setattr(run_module, "length_limits", lambda lengths: lengths * 0 + 2)
    translator = load_run(dates_run)
    out = translator.translate(["1 mars 1999", "3 avril 2001"], beam_size=1)
    for t in out:  # two tokens at most: cut unless the second one ended the sentence
        assert t.complete == (t.target_tokens[-1] == "</s>")
    assert not all(t.complete for t in out)
    argv = [str(dates_run), "1 mars 1999", "--beam-size", "1", "--json", "--threads", "1"]
    assert run(cmd_translate, argv) == 0
    said = capsys.readouterr()
    assert json.loads(said.out)["complete"] is out[0].complete
    assert ("note: line 1's translation stopped at the length limit" in said.err) is (
        not out[0].complete
    )
    config = json.loads((dates_run / "config.json").read_text())
    res = evaluate(translator, load_task(config["task"]), limit=6, beam_size=1, progress=False)
    cut = res["cut_at_length_limit"]
    assert 0 < cut <= 6
