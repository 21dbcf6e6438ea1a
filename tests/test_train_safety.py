"""``attnlab train`` never loses a user's files: a failed ``--resume`` leaves the run as it was,
``--force`` never removes the ``--data`` it reads nor overwrites a folder that is not an attnlab
run, and ``--threads`` is bounded before it reaches ``torch.set_num_threads``.

The commands run in-process through :func:`attnlab.cli.main` on one tiny run of a user's pairs
(``--data``), trained once for the module; each test works on a copy.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("safetensors")
pytest.importorskip("sacrebleu")

from attnlab import cli  # noqa: E402
from attnlab.translate import checkpoint as ckpt  # noqa: E402
from conftest import copy_of_run  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

QUIET = ["--eval-limit", "2", "--beam-size", "1", "--threads", "1", "--no-progress"]
TINY = ["--tiny", "--max-steps", "3", "--vocab-size", "300", *QUIET]  # --data runs: BPE
DATES = ["--task", "dates", "--train-size", "100", "--tiny", "--max-steps", "3", *QUIET]
PAIRS = "".join(f"sentence number {i}\tfrase número {i}\n" for i in range(60))


def attnlab(capsys, *argv) -> tuple[int, str]:
    """Run ``attnlab ARGV`` in-process: (exit status, stderr)."""
    capsys.readouterr()
    code = cli.main([str(a) for a in argv])
    return code, capsys.readouterr().err


def one_line_error(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err
    assert lines and lines[-1].startswith("attnlab "), err
    return lines[-1]


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder``, by relative path: what must not change."""
    return {
        str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
    }


@pytest.fixture(scope="module")
def tsv_run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("safety")
    data = root / "pairs.tsv"
    data.write_text(PAIRS, encoding="utf-8")
    out = root / "run"
    assert cli.main(["train", "--data", str(data), *TINY, "--out", str(out)]) == 0
    assert (out / ckpt.WEIGHTS).is_file() and (out / ckpt.RESULTS).is_file()
    return out


@pytest.fixture
def run_copy(tsv_run, tmp_path) -> Path:
    return copy_of_run(tsv_run, tmp_path)


# ------------------------------------------------------------------------------ 1. resume
def test_a_resume_from_a_damaged_checkpoint_leaves_the_run_as_it_was(run_copy, capsys):
    """Before: model.safetensors, results.json and attention.png were deleted and config.json
    took the new budget, and then the checkpoint was found damaged."""
    (folder,) = (run_copy / ckpt.CHECKPOINTS).glob("step-*")
    damaged = folder / ckpt.WEIGHTS
    data = bytearray(damaged.read_bytes())
    data[-100] ^= 0x01
    damaged.write_bytes(bytes(data))
    before = snapshot(run_copy)

    code, err = attnlab(capsys, "train", "--out", run_copy, "--resume", "--more-steps", "10")

    assert code == 2
    line = one_line_error(err)
    assert str(damaged) in line and "damaged" in line
    assert snapshot(run_copy) == before  # the final files and config.json included
    assert json.loads((run_copy / ckpt.CONFIG).read_text())["train"]["max_steps"] == 3


def test_an_optimizer_state_that_does_not_fit_leaves_the_run_as_it_was(
    run_copy, capsys, monkeypatch
):
    """Before: the optimizer's parameter groups were checked only once training had begun, after
    the final files were removed. (An optimizer of one group stands for one that does not fit.)"""
    import torch

    from attnlab.translate import pipeline

    def one_group(model, opts):
        return torch.optim.AdamW(model.parameters(), lr=opts.lr)

    monkeypatch.setattr(pipeline, "make_optimizer", one_group)
    before = snapshot(run_copy)
    code, err = attnlab(capsys, "train", "--out", run_copy, "--resume", "--more-steps", "10")
    assert code == 2
    assert "parameter groups" in one_line_error(err)
    assert snapshot(run_copy) == before


def test_a_good_resume_writes_its_new_budget_and_new_final_files(run_copy, capsys):
    """(The order changed: config.json and the final files are rewritten after the check.)"""
    code, err = attnlab(capsys, "train", "--out", run_copy, "--resume", "--more-steps", "2")
    assert code == 0, err
    assert json.loads((run_copy / ckpt.CONFIG).read_text())["train"]["max_steps"] == 5
    assert ckpt.read_checkpoint_state(ckpt.latest_checkpoint(run_copy))["step"] == 5
    assert (run_copy / ckpt.WEIGHTS).is_file() and (run_copy / ckpt.RESULTS).is_file()


# ------------------------------------------------------------------------------ 5. no checkpoint
def test_a_resume_without_checkpoint_that_fails_keeps_the_run_and_says_one_line(run_copy, capsys):
    """A run killed before its first checkpoint, its max_len then set to 1. Before:
    UnboundLocalError ('created'), and the clean-up it aimed at would have removed the run's
    config.json and data.tsv."""
    shutil.rmtree(run_copy / ckpt.CHECKPOINTS)
    for name in (ckpt.WEIGHTS, ckpt.RESULTS, "attention.png"):
        (run_copy / name).unlink()
    config = json.loads((run_copy / ckpt.CONFIG).read_text())
    config["train"]["max_len"] = 1
    (run_copy / ckpt.CONFIG).write_text(json.dumps(config))
    before = snapshot(run_copy)

    code, err = attnlab(capsys, "train", "--out", run_copy, "--resume", "--more-steps", "4")

    assert code == 2
    assert "--max-len 1 leaves no training pair" in one_line_error(err)
    assert snapshot(run_copy) == before  # config.json (old budget), data.tsv, tokenizer.json


# ------------------------------------------------------------------------------ 2. --data in --out
def test_force_with_the_runs_own_data_keeps_it_and_trains_on_it(run_copy, capsys):
    """Before: --force removed data.tsv, then failed to copy it (the data was gone)."""
    data = run_copy / "data.tsv"
    before = data.read_bytes()
    code, err = attnlab(
        capsys, "train", "--data", data, *TINY, "--seed", "2", "--out", run_copy, "--force"
    )
    assert code == 0, err
    assert data.read_bytes() == before
    config = json.loads((run_copy / ckpt.CONFIG).read_text())
    assert config["task"]["path"] == "data.tsv" and config["train"]["seed"] == 2


def test_data_inside_a_new_out_folder_is_read_in_place_and_never_removed(tmp_path, capsys):
    """Before: shutil.SameFileError. Now it trains; and a run that fails keeps the user's file."""
    out = tmp_path / "mine"
    out.mkdir()
    data = out / "data.tsv"
    data.write_text(PAIRS, encoding="utf-8")
    code, err = attnlab(capsys, "train", "--data", data, *TINY, "--max-len", "1", "--out", out)
    assert code == 2 and "--max-len 1" in one_line_error(err)
    assert sorted(p.name for p in out.iterdir()) == ["data.tsv"]  # what the run wrote went
    assert data.read_text(encoding="utf-8") == PAIRS

    code, err = attnlab(capsys, "train", "--data", data, *TINY, "--out", out)
    assert code == 0, err
    assert data.read_text(encoding="utf-8") == PAIRS
    assert json.loads((out / ckpt.CONFIG).read_text())["task"]["path"] == "data.tsv"


# ------------------------------------------------------------------------------ 3. not a run
def hf_folder(path: Path) -> Path:
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["B"]}))
    (path / "model.safetensors").write_bytes(b"weights of someone else")
    (path / "tokenizer.json").write_text('{"model": {}}')
    return path


@pytest.mark.parametrize("force", [False, True])
def test_a_hugging_face_folder_is_never_overwritten(tmp_path, capsys, force):
    """Before: --force removed the model's weights and tokenizer ("already holds a run")."""
    folder = hf_folder(tmp_path / "bert")
    before = snapshot(folder)
    argv = ["train", *DATES, "--out", folder]
    code, err = attnlab(capsys, *argv, *(["--force"] if force else []))
    assert code == 2
    line = one_line_error(err)
    assert "Hugging Face model folder (bert)" in line and "choose another --out" in line
    assert snapshot(folder) == before


def test_a_folder_with_run_file_names_but_no_run_is_refused(tmp_path, capsys):
    """A folder of someone's tokenizer.json and weights, no config.json: before, training
    overwrote them (and removed them when it failed)."""
    folder = hf_folder(tmp_path / "weights")
    (folder / "config.json").unlink()
    before = snapshot(folder)
    argv = ["train", *DATES, "--out", folder]
    code, err = attnlab(capsys, *argv)
    assert code == 2
    line = one_line_error(err)
    assert "--out" in line and "tokenizer.json" in line and "model.safetensors" in line
    assert snapshot(folder) == before


# ------------------------------------------------------------------------------ 4. --threads
def test_threads_beyond_the_bound_are_refused_by_every_command(tsv_run, tmp_path, capsys):
    """Before: any positive integer went to torch.set_num_threads (100000 segfaulted)."""
    limit = cli.max_threads()
    too_many = str(limit + 1)
    for argv in (
        ["translate", tsv_run, "sentence number 3"],
        ["evaluate", tsv_run, "--limit", "1"],
        ["train", "--task", "dates", "--tiny", "--max-steps", "1", "--out", tmp_path / "t"],
        ["compare", "--out", tmp_path / "c"],
    ):
        code, err = attnlab(capsys, *argv, "--threads", too_many)
        assert code == 2, argv
        line = one_line_error(err)
        assert "--threads" in line and repr(too_many) in line and f"[1, {limit}]" in line
    assert not (tmp_path / "t").exists() and not (tmp_path / "c").exists()
    with pytest.raises(ValueError, match=r"--threads 100000: expected an integer in \[1, "):
        from attnlab.translate.pipeline import set_threads

        set_threads(100000)


def test_threads_100000_is_one_line_not_a_segfault(tsv_run):
    proc = subprocess.run(
        [sys.executable, "-m", "attnlab.cli", "translate", str(tsv_run), "--threads", "100000",
         "x"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "argument --threads" in proc.stderr and "'100000'" in proc.stderr


# ------------------------------------------------------------------------------ 6. smaller ones
def test_out_under_a_file_is_one_line_naming_out(tmp_path, capsys):
    """Before: the bare OS message ('[Errno 20] Not a directory: ...')."""
    file = tmp_path / "file"
    file.write_text("x")
    argv = ["train", *DATES, "--out", file / "run"]
    code, err = attnlab(capsys, *argv)
    assert code == 2
    line = one_line_error(err)
    assert f"--out {file / 'run'}" in line and "choose a writable --out" in line
    assert file.read_text() == "x"


def test_a_vocabulary_below_the_byte_alphabet_is_refused(tmp_path, capsys):
    """Before: --vocab-size 60 trained a vocabulary of 260 and config.json said 60."""
    data = tmp_path / "pairs.tsv"
    data.write_text(PAIRS, encoding="utf-8")
    out = tmp_path / "r"
    code, err = attnlab(capsys, "train", "--data", data, *TINY, "--vocab-size", "60", "--out", out)
    assert code == 2
    line = one_line_error(err)
    assert "--vocab-size 60" in line and "--vocab-size 260 or more" in line
    assert not out.exists()


def test_a_budget_that_ends_before_the_first_step_says_so(tmp_path, capsys):
    """Before: --epochs 1e-10 trained 0 steps and reported the scores without a word."""
    data = tmp_path / "pairs.tsv"
    data.write_text(PAIRS, encoding="utf-8")
    out = tmp_path / "r"
    argv = ["train", "--data", data, "--tiny", "--vocab-size", "300", *QUIET]
    code, err = attnlab(capsys, *argv, "--epochs", "1e-10", "--out", out)
    assert code == 0, err
    assert "warning: nothing was trained" in err and "--more-steps" in err
    assert ckpt.read_checkpoint_state(ckpt.latest_checkpoint(out))["step"] == 0


# ------------------------------------------------------------------------------ divergence advice
def test_the_divergence_advice_names_only_options_train_accepts(tmp_path):
    """The advice once said "--clip (e.g. --clip 1.0)": train had no --clip, and 1.0 was the
    clip already in use. Every option it names now parses, with a value unlike the run's."""
    import argparse
    import re

    from attnlab.translate import cmd_train
    from attnlab.translate.trainer import TrainOptions, TrainState, _diverged

    parser = argparse.ArgumentParser()
    cmd_train.add_arguments(parser)
    # the default clip (1.0) is halved; a run that did not clip is told to
    for opts, clip in ((TrainOptions(), "0.5"), (TrainOptions(clip=0.0), "1.0")):
        said = str(_diverged("the training loss is nan", TrainState(step=7), 1e-3, tmp_path, opts))
        fix = said.split("Fix: ")[1]
        named = re.findall(r"(--[a-z][a-z-]*)(?: (\d[\d.e-]*))?", fix)
        assert {name for name, _ in named} == {"--lr", "--clip", "--force"}
        for name, value in named:
            parser.parse_args([name, value] if value else [name])  # (argparse exits if not)
        assert dict(named)["--lr"] == "0.00025"  # a quarter of the default 1e-3
        assert dict(named)["--clip"] == clip


def test_clip_is_a_train_option_and_is_checked(capsys):
    import argparse

    from attnlab.translate import cmd_train
    from attnlab.translate.pipeline import build_config, resolve

    parser = argparse.ArgumentParser()
    cmd_train.add_arguments(parser)
    for clip in ("0.5", "0"):
        args = parser.parse_args(["--task", "dates", "--clip", clip])
        config = build_config(resolve(cmd_train.options_from_args(args)))
        assert config["train"]["clip"] == float(clip)
    for bad in ("-1", "nan", "inf", "strong"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--clip", bad])
        assert "--clip: " in capsys.readouterr().err


# ------------------------------------------------------------------------------ data.tsv digest
def test_a_run_whose_data_changed_is_not_evaluated_on_another_test_set(run_copy, capsys):
    """A --data run records its data.tsv's SHA-256; evaluate and --resume refuse the file once
    it changed (before: evaluate scored whatever test split the new file gave, exit 0)."""
    import hashlib

    data = run_copy / "data.tsv"
    task = json.loads((run_copy / ckpt.CONFIG).read_text())["task"]
    assert task["data_sha256"] == hashlib.sha256(data.read_bytes()).hexdigest()
    evaluate = ("evaluate", run_copy, "--limit", "2", "--no-aer", "--no-progress", "--json")
    assert attnlab(capsys, *evaluate)[0] == 0
    original = data.read_bytes()
    data.write_text(PAIRS.replace("number 7\t", "number 70\t"), encoding="utf-8")
    for argv in (evaluate, ("train", "--out", run_copy, "--resume", "--more-steps", "1", *QUIET)):
        code, err = attnlab(capsys, *argv)
        said = one_line_error(err)
        assert code == 2 and f"{data}: its contents changed since the run was trained" in said
        assert "put back the file the run was trained on" in said and "--data" in said
    data.write_bytes(original)
    assert attnlab(capsys, *evaluate)[0] == 0


@pytest.mark.parametrize(
    "key,value,said",
    [
        ("max_steps", 0, "'max_steps' must be an integer > 0, got 0"),
        ("train_seconds", 0, "'train_seconds' must be a number > 0"),
        ("cpu_seconds", 0.0, "'cpu_seconds' must be a number > 0"),
        ("epochs", 0, "'epochs' must be a number > 0"),
        ("eval_every", 0, "'eval_every' must be a number > 0"),
        ("val_pairs", 0, "'val_pairs' must be an integer > 0"),
        ("label_smoothing", 1.5, "'label_smoothing' must be a number >= 0 and < 1, got 1.5"),
        ("seed", -1, "'seed' must be an integer >= 0 and < 2**32, got -1"),
        ("seed", 2**32, "'seed' must be an integer >= 0 and < 2**32"),
        ("clip", -1.0, "'clip' must be a number >= 0"),
    ],
)
def test_training_settings_out_of_range_are_refused_from_files_and_the_api(key, value, said):
    """Before: a budget of 0 trained without end (read as no budget), eval_every 0 divided by
    zero, label_smoothing 1.5 failed mid-training, val_pairs 0 gave a NaN validation loss, a
    negative seed failed in NumPy; and the Python API checked nothing."""
    from attnlab.translate.trainer import TrainOptions

    for make in (
        lambda: TrainOptions.from_dict({key: value}),
        lambda: TrainOptions(**{key: value}),
    ):
        with pytest.raises(ValueError, match=re.escape(said)):
            make()
    assert TrainOptions(max_steps=1, label_smoothing=0.0, seed=2**32 - 1, clip=0.0).max_steps == 1
