"""The command line gives no silent wrong answers (issue 12): every mistake a user can make ends
in one line that names the option, the value and the fix, with exit status 2, and leaves nothing
behind that blocks the corrected command.

The commands run in-process through :func:`attnlab.cli.main` (as ``attnlab ...`` does), on one
tiny dates run trained once for the module.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("safetensors")
pytest.importorskip("sacrebleu")

from attnlab.cli import main  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = [
    "--task",
    "dates",
    "--tiny",
    "--train-size",
    "200",
    "--eval-limit",
    "5",
    "--beam-size",
    "1",
    "--threads",
    "1",
    "--no-progress",
]


def attnlab(capsys, *argv) -> tuple[int, str, str]:
    """Run ``attnlab ARGV`` in-process: (exit status, stdout, stderr)."""
    capsys.readouterr()
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(err: str) -> str:
    """The error line of stderr, which must be the only line."""
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A dates run of 4 steps, with checkpoints every 0.5 minutes."""
    pytest.importorskip("babel")
    out = tmp_path_factory.mktemp("trust") / "run"
    code = main(
        ["train", *TINY, "--max-steps", "4", "--checkpoint-every", "0.5", "--out", str(out)]
    )
    assert code == 0
    return out


@pytest.fixture
def run_copy(tiny_run, tmp_path):
    """A copy of the tiny run that a test may change."""
    return shutil.copytree(tiny_run, tmp_path / "run")


# ------------------------------------------------------------------------------ numbers
BAD_NUMBERS = [
    ("train", "--time-budget", "0"),
    ("train", "--time-budget", "-1"),
    ("train", "--time-budget", "nan"),
    ("train", "--time-budget", "inf"),
    ("train", "--cpu-budget", "0"),
    ("train", "--max-steps", "0"),
    ("train", "--epochs", "0"),
    ("train", "--train-size", "0"),
    ("train", "--eval-limit", "0"),
    ("train", "--max-tokens", "0"),
    ("train", "--threads", "0"),
    ("train", "--max-len", "0"),
    ("train", "--lr", "0"),
    ("train", "--lr", "-0.001"),
    ("train", "--dropout", "1"),
    ("train", "--dropout", "-0.1"),
    ("train", "--beam-size", "0"),
    ("train", "--heads", "0"),
    ("train", "--vocab-size", "0"),
    ("train", "--warmup", "-1"),
    ("train", "--seed", "-1"),
    ("train", "--checkpoint-every", "0"),
    ("train", "--more-minutes", "-2"),
    ("train", "--more-steps", "0"),
    ("translate", "--batch-size", "-1"),
    ("translate", "--beam-size", "0"),
    ("translate", "--threads", "0"),
    ("evaluate", "--limit", "-5"),
    ("evaluate", "--limit", "0"),
    ("compare", "--time-budget", "0"),
    ("compare", "--cpu-budget", "nan"),
    ("compare", "--epochs", "0"),
    ("compare", "--eval-limit", "0"),
    ("compare", "--beam-size", "0"),
    ("explain", "--max-tokens", "1"),
]


@pytest.mark.parametrize("command,option,value", BAD_NUMBERS)
def test_meaningless_numbers_are_refused_before_anything_is_written(
    tmp_path, monkeypatch, capsys, command, option, value
):
    monkeypatch.chdir(tmp_path)  # a default run folder would land here
    argv = [command]
    if command in ("translate", "evaluate"):
        argv.append(tmp_path / "run")
    argv += [option, value]
    if command in ("train", "compare"):
        argv += ["--out", tmp_path / "out"]
    code, _, err = attnlab(capsys, *argv)
    assert code == 2
    line = one_line_error(err)
    assert f"attnlab {command}: error: argument {option}" in line
    assert repr(value) in line  # the value given
    assert ">" in line or "[0, 1)" in line or "finite" in line  # what is expected
    assert list(tmp_path.iterdir()) == []  # nothing written


@pytest.mark.parametrize(
    "argv,expected",
    [
        (["--model", "transformer", "--heads", "5"], "--heads 5 does not divide"),
        (["--model", "rnn", "--attention", "multihead", "--heads", "5"], "--heads 5"),
        (["--model", "transformer", "--kv-heads", "3"], "--kv-heads 3 does not divide --heads 4"),
        # (before: gqa silently took 2 kv heads, or trained multi-head attention labelled gqa,
        # and multihead with --kv-heads 2 was relabelled gqa)
        (
            ["--model", "transformer", "--attention", "gqa", "--heads", "4", "--kv-heads", "4"],
            "gqa (grouped-query) needs",
        ),
        (
            ["--model", "transformer", "--attention", "gqa", "--heads", "1"],
            "Fix: --heads 2 or more",
        ),
        (
            ["--model", "transformer", "--attention", "multihead", "--kv-heads", "2"],
            "Fix: --attention gqa --kv-heads 2",
        ),
        (["--heads", "4"], "--heads 4 applies to --attention multihead"),
        (["--tokenizer", "char", "--vocab-size", "100"], "--vocab-size 100 applies to"),
        (["--size", "base", "--tiny"], "--tiny"),
    ],
)
def test_settings_that_cannot_build_or_would_be_ignored_leave_no_run_folder(
    tmp_path, capsys, argv, expected
):
    out = tmp_path / "r"
    code, _, err = attnlab(capsys, "train", "--task", "dates", *argv, "--out", out)
    assert code == 2
    assert expected in one_line_error(err)
    assert not out.exists()  # the corrected command is not told "already holds a run"


def test_a_max_len_that_leaves_no_validation_pair_stops_before_training(tmp_path, capsys):
    """Before: "validation loss nan", and NaN written into train.log and results.json."""
    import hashlib

    sources = [f"word{i} w{i}" for i in range(20)]
    held = sorted(sources, key=lambda s: hashlib.sha256(s.encode()).hexdigest())[1]
    lines = [f"{s}\t{'long ' * 30 if s == held else s.upper()}".strip() for s in sources]
    data = tmp_path / "pairs.tsv"
    data.write_text("\n".join(lines) + "\n")
    out = tmp_path / "r"
    code, _, err = attnlab(capsys, "train", "--data", data, "--tokenizer", "char", "--tiny",
                           "--max-steps", "3", "--max-len", "40", "--out", out)  # fmt: skip
    assert code == 2 and "--max-len 40 leaves no validation pair" in err.splitlines()[-1]
    assert not out.exists()


def test_a_max_len_that_leaves_no_training_pair_is_one_line_and_leaves_nothing(tmp_path, capsys):
    """Found only after the tokenizer is trained, in the run folder: before, a NumPy warning
    and "cannot convert float NaN to integer", and a half-made folder that refused the
    corrected command. A folder that was there keeps what it held."""
    out = tmp_path / "r"
    code, _, err = attnlab(capsys, "train", *TINY, "--max-len", "3", "--max-steps", "2",
                           "--out", out)  # fmt: skip
    assert code == 2 and "--max-len 3 leaves no training pair" in err.splitlines()[-1]
    assert "Traceback" not in err and "NaN" not in err and not out.exists()
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    code, _, _ = attnlab(capsys, "train", *TINY, "--max-len", "3", "--max-steps", "2",
                         "--out", out)  # fmt: skip
    assert code == 2 and [p.name for p in out.iterdir()] == ["notes.txt"]
    code, _, _ = attnlab(capsys, "train", *TINY, "--max-steps", "2", "--out", out)
    assert code == 0 and (out / "config.json").is_file()


def test_a_model_too_large_for_memory_is_refused_before_anything_is_written(
    tmp_path, capsys, monkeypatch
):
    """Its weights, gradients and Adam's moments alone would not fit: before, an allocator
    traceback after the run folder was written (or the machine swapped to a halt)."""
    from attnlab.translate import pipeline

    monkeypatch.setattr(pipeline, "_free_memory", lambda device: (2**28, "this machine"))
    out = tmp_path / "r"
    code, _, err = attnlab(capsys, "train", *TINY, "--hidden", "3000", "--out", out)
    said = one_line_error(err)
    assert code == 2 and "too large to train here" in said and "0.2 GiB free" in said
    assert "--hidden 3000" in said and not out.exists()


@pytest.mark.parametrize("model", ["rnn", "transformer"])
@pytest.mark.parametrize("layers", [1, 3])
def test_the_parameter_count_is_the_built_models(model, layers):
    """The memory check counts parameters from models of one and two layers (a model of
    65,536 layers took minutes to build, even on the meta device); it must be exact."""
    from attnlab.translate.models import build_model, model_config
    from attnlab.translate.pipeline import parameter_count

    extra = {"dec_layers": layers + 1} if model == "transformer" else {}
    cfg = model_config(model, None, "small", enc_layers=layers, **extra)
    built = build_model(cfg, 300)
    assert parameter_count(cfg, 300) == sum(p.numel() for p in built.parameters())


def test_train_size_outside_dates_is_refused_not_ignored(tmp_path, capsys):
    code, _, err = attnlab(capsys, "train", "--train-size", "100", "--out", tmp_path / "r")
    assert code == 2
    assert "--train-size 100 applies to --task dates only" in one_line_error(err)
    assert not (tmp_path / "r").exists()


def test_check_config_refuses_numbers_given_from_python():
    from attnlab.translate.pipeline import build_config, check_config, resolve

    config = build_config(resolve({"task": "dates", "tiny": True}))
    config["train"]["lr"] = float("nan")
    with pytest.raises(ValueError, match="--lr nan"):
        check_config(config)
    config = build_config(resolve({"task": "dates", "tiny": True}))
    config["model"]["dropout"] = 1.5
    with pytest.raises(ValueError, match="--dropout 1.5"):
        check_config(config)


# ------------------------------------------------------------------------------ resume
def test_resume_of_a_finished_run_refuses_to_add_nothing(run_copy, capsys):
    code, _, err = attnlab(capsys, "train", "--out", run_copy, "--resume", "--no-progress")
    assert code == 2
    line = one_line_error(err)
    assert "already trained its whole budget" in line and "--more-minutes" in line
    code, _, err = attnlab(capsys, "train", "--out", run_copy, "--resume", "--time-budget", "2")
    assert code == 2
    assert "--more-minutes 2" in one_line_error(err)
    code, _, err = attnlab(capsys, "train", "--out", run_copy, "--resume", "--max-steps", "4")
    assert code == 2
    line = one_line_error(err)
    assert "--max-steps 4 is a total" in line and "--more-steps" in line
    code, _, err = attnlab(capsys, "train", "--more-steps", "3")
    assert code == 2
    assert "--resume" in one_line_error(err)


def test_resume_more_steps_and_more_minutes_add_to_the_checkpoint(run_copy, capsys):
    results = json.loads((run_copy / "results.json").read_text())
    assert results["train"]["steps"] == 4
    common = ["--eval-limit", "3", "--threads", "1", "--no-progress"]
    code, _, err = attnlab(
        capsys, "train", "--out", run_copy, "--resume", "--more-steps", "2", *common
    )
    assert code == 0, err
    assert "resume added 2 step(s): step 4 -> 6" in err
    assert json.loads((run_copy / "results.json").read_text())["train"]["steps"] == 6

    state = json.loads(
        (run_copy / "checkpoint" / (run_copy / "checkpoint" / "LATEST").read_text().strip())
        .joinpath("state.json")
        .read_text()
    )
    code, _, err = attnlab(
        capsys, "train", "--out", run_copy, "--resume", "--more-minutes", "0.01", *common
    )
    assert code == 0, err
    train = json.loads((run_copy / "config.json").read_text())["train"]
    assert train["train_seconds"] == pytest.approx(state["elapsed"] + 0.6)
    assert "max_steps" not in train  # the new budget replaces the saved one
    steps = json.loads((run_copy / "results.json").read_text())["train"]["steps"]
    assert steps > 6
    assert f"resume added {steps - 6} step(s): step 6 -> {steps}" in err


def test_checkpoint_every_reaches_the_trainer(tiny_run):
    from attnlab.translate.pipeline import build_config, resolve
    from attnlab.translate.trainer import TrainOptions

    config = json.loads((tiny_run / "config.json").read_text())
    assert TrainOptions.from_dict(config["train"]).checkpoint_seconds == 30.0
    default = build_config(resolve({"task": "dates"}))
    assert TrainOptions.from_dict(default["train"]).checkpoint_seconds == 120.0


# ------------------------------------------------------------------------------ one line
@pytest.mark.parametrize(
    "device,expected",
    [("gpu", "pass cuda"), ("mps", "not supported"), ("tpu", "unknown device 'tpu'")],
)
def test_unknown_devices_are_one_line(tmp_path, capsys, device, expected):
    code, _, err = attnlab(capsys, "train", "--device", device, "--out", tmp_path / "r")
    assert code == 2
    assert expected in one_line_error(err)
    code, _, err = attnlab(capsys, "translate", tmp_path, "--device", device, "x")
    assert code == 2
    assert expected in one_line_error(err)


def test_cuda_without_a_gpu_is_one_line(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is visible")
    code, _, err = attnlab(capsys, "train", "--device", "cuda", "--out", tmp_path / "r")
    assert code == 2
    assert "no CUDA GPU" in one_line_error(err) and "--device cpu" in err
    assert not (tmp_path / "r").exists()


def test_mistyped_command_suggests_the_right_one(capsys):
    code, _, err = attnlab(capsys, "trian", "--task", "dates")
    assert code == 2
    assert one_line_error(err) == (
        "attnlab: unknown command 'trian'; did you mean 'train'? (see: attnlab --help)"
    )


def test_folders_that_are_not_runs_are_one_line(tmp_path, capsys):
    hf = tmp_path / "minilm"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"architectures": ["BertModel"]}))
    plain = tmp_path / "notes.txt"
    plain.write_text("hello\n")
    for argv in (["translate", hf, "hello"], ["evaluate", hf], ["train", "--out", hf, "--resume"]):
        code, _, err = attnlab(capsys, *argv)
        assert code == 2
        assert "Hugging Face model folder" in one_line_error(err)
    for argv in (["translate", plain, "hello"], ["evaluate", plain]):
        code, _, err = attnlab(capsys, *argv)
        assert code == 2
        assert "is a file, not a run directory" in one_line_error(err)


def test_debug_shows_the_traceback(monkeypatch, capsys):
    monkeypatch.delenv("ATTNLAB_DEBUG", raising=False)
    assert attnlab(capsys, "train", "--more-steps", "3")[0] == 2
    with pytest.raises(ValueError, match="--more-steps"):
        main(["--debug", "train", "--more-steps", "3"])
    with pytest.raises(ValueError, match="--more-steps"):
        main(["train", "--more-steps", "3", "--debug"])
    monkeypatch.setenv("ATTNLAB_DEBUG", "1")
    with pytest.raises(ValueError, match="--more-steps"):
        main(["train", "--more-steps", "3"])


def test_options_may_come_between_the_run_and_the_text(tiny_run, capsys):
    code, out, err = attnlab(
        capsys, "translate", tiny_run, "--beam-size", "1", "1 February 2005", "--threads", "1"
    )
    assert code == 0, err
    assert len(out.splitlines()) == 1


def test_top_level_help_does_not_import_torch():
    code = (
        "from attnlab.cli import main; main(['--help']); import sys; print('torch' in sys.modules)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert "train" in proc.stdout and proc.stdout.strip().endswith("False")


# ------------------------------------------------------------------------------ explain
def test_explain_refuses_a_mistyped_run_path(tmp_path, capsys):
    code, _, err = attnlab(capsys, "explain", "/mistyped/run/path", "--out", tmp_path / "x")
    assert code == 2
    line = one_line_error(err)
    assert "no such run folder: '/mistyped/run/path'" in line and "--model minilm" in line
    not_a_run = tmp_path / "folder"
    not_a_run.mkdir()
    code, _, err = attnlab(capsys, "explain", not_a_run, "--out", tmp_path / "x")
    assert code == 2
    assert "is not a run directory (no readable config.json)" in one_line_error(err)
    assert not (tmp_path / "x").exists()


def test_explain_refuses_a_run_folder_with_model(tiny_run, tmp_path, capsys):
    code, _, err = attnlab(capsys, "explain", tiny_run, "--model", "minilm", "--out", tmp_path)
    assert code == 2
    line = one_line_error(err)
    assert "--model minilm" in line and "pick one" in line


def test_explain_takes_a_sentence_with_a_slash_as_text():
    from attnlab.viz.cmd_explain import _looks_like_path

    assert not _looks_like_path("cats and/or dogs")
    assert _looks_like_path("runs/typo")


# ------------------------------------------------------------------------------ data paths
def test_evaluate_never_reads_a_path_config_json_makes_up(run_copy, tmp_path, capsys):
    config = json.loads((run_copy / "config.json").read_text())
    secret = tmp_path / "secret.tsv"
    secret.write_text("".join(f"top secret {i}\tsecreto {i}\n" for i in range(40)))
    (run_copy / "link.tsv").symlink_to(secret)
    for path in (str(secret), "/etc/passwd", "../secret.tsv", "link.tsv"):
        config["task"] = {"name": "tsv", "path": path, "skip_bad_lines": True}
        (run_copy / "config.json").write_text(json.dumps(config))
        for argv in (["evaluate", run_copy], ["train", "--out", run_copy, "--resume"]):
            code, out, err = attnlab(capsys, *argv)
            assert code == 2
            line = one_line_error(err)
            assert "config.json: task.path" in line and "outside the run folder" in line
            assert "secret" not in out and "root:" not in out + err


def test_user_data_is_copied_into_the_run_folder(tmp_path, capsys):
    data = tmp_path / "pairs.tsv"
    data.write_text("".join(f"sentence number {i}\tfrase número {i}\n" for i in range(60)))
    out = tmp_path / "r"
    code, _, err = attnlab(
        capsys, "train", "--data", data, "--tiny", "--max-steps", "2", "--vocab-size", "300",
        "--eval-limit", "3", "--beam-size", "1", "--threads", "1", "--no-progress", "--out", out,
    )  # fmt: skip
    assert code == 0, err
    assert json.loads((out / "config.json").read_text())["task"]["path"] == "data.tsv"
    assert (out / "data.tsv").read_bytes() == data.read_bytes()
    os.remove(data)  # the run folder is self-contained
    code, stdout, err = attnlab(capsys, "evaluate", out, "--limit", "3", "--json", "--no-aer")
    assert code == 0, err
    assert json.loads(stdout)["sentences"] == 3


def test_max_len_counts_what_it_leaves_out_of_validation_and_the_report_says_on_what(
    tmp_path, capsys
):
    """Before: validation pairs past --max-len vanished from the validation loss without a word,
    and the report did not say the loss was taken on the first 300 validation pairs left; the
    chrF signature was stored but never printed."""
    out = tmp_path / "r"
    code, stdout, err = attnlab(capsys, "train", *TINY, "--max-len", "18", "--max-steps", "2",
                                "--out", out)  # fmt: skip
    assert code == 0, err
    dropped = re.search(r"note: (\d+) validation pair\(s\) of 18 tokens or more left out", err)
    assert dropped and int(dropped.group(1)) > 0
    assert "training pair(s) of 18 tokens or more left out" in err
    results = json.loads((out / "results.json").read_text())
    assert results["train"]["val_loss_pairs"] == 300
    assert "(on a fixed random sample of 300 validation pairs)" in stdout
    for name in ("bleu_signature", "chrf_signature"):
        assert f"sacrebleu {results['test'][name]}" in stdout
