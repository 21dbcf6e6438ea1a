"""Training killed with SIGKILL at the worst moments loses nothing but the unsaved stretch.

Each test starts ``attnlab train`` in a subprocess that kills itself with SIGKILL at a named
point (``ATTNLAB_TEST_KILL_AT=LABEL@N``, see :func:`attnlab._files.kill_point`): after an
optimizer step, during a validation, while a checkpoint is written, while an old one is
deleted, and at every point of a re-save of the same step. Then the run must load, and
``--resume`` must finish it bit-identical to an uninterrupted run of the same seed: the same
final tensors, the same ``train.log``, no leftovers.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

pytest.importorskip("safetensors")
pytest.importorskip("babel")

from safetensors.torch import load_file  # noqa: E402

from attnlab import cli  # noqa: E402
from attnlab.translate import checkpoint as ckpt  # noqa: E402
from attnlab.translate.run import load_run  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS = 30
# dropout: the resumed run must also restore the random generators to match
TRAIN = ["--task", "dates", "--tiny", "--dropout", "0.1", "--train-size", "200"]
TRAIN += ["--max-steps", str(STEPS), "--checkpoint-every", "0.001"]  # every 60 ms: many
QUIET = ["--eval-limit", "3", "--threads", "1", "--no-progress"]


def train_in_process(*args: str) -> None:
    assert cli.main(["train", *args, *QUIET]) == 0


def killed(args: list[str], kill_at: str) -> subprocess.CompletedProcess:
    """Run Python with ``args``, told to kill itself at ``kill_at``; check that it did."""
    env = {**os.environ, "ATTNLAB_TEST_KILL_AT": kill_at, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, *args], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == -signal.SIGKILL, (kill_at, proc.returncode, proc.stderr[-2000:])
    return proc


def tensors_of(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path))


def assert_bitwise_equal(a: Path, b: Path) -> None:
    ta, tb = tensors_of(a), tensors_of(b)
    assert ta.keys() == tb.keys()
    for name in ta:
        assert torch.equal(ta[name], tb[name]), name


def validations(run_dir: Path) -> list[tuple[int, float]]:
    lines = (run_dir / "train.log").read_text(encoding="utf-8").splitlines()
    return [(r["step"], r["val_loss"]) for r in map(json.loads, lines)]


def assert_no_leftovers(run_dir: Path) -> None:
    root = run_dir / ckpt.CHECKPOINTS
    assert not list(run_dir.glob(".*.tmp")) and not list(root.glob(".*"))
    folders = sorted(p.name for p in root.iterdir() if p.is_dir())
    assert folders == [(root / ckpt.LATEST).read_text().strip()]  # keep=1: the latest only


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The uninterrupted run."""
    out = tmp_path_factory.mktemp("faults") / "reference"
    train_in_process(*TRAIN, "--out", str(out))
    return out


# ------------------------------------------------------------------------------ the kills
# Mid-run kills: a fresh run killed at LABEL@N; resumed, it must equal the reference.
MID_RUN = {
    "step@13": "mid-training, between two checkpoints",
    "evaluate@2": "mid-validation",
    "evaluate:logged@2": "train.log has a line that the last checkpoint does not know",
    "checkpoint:writing@4": "a half-written checkpoint folder",
    "checkpoint:deleting@4": "the previous checkpoint half deleted",
}
# Same-step re-save kills: the finished reference resumed (it trains nothing and saves its
# step again: two folders of one step), killed at LABEL.
RESAVE_AT = {
    "checkpoint:writing": "the new copy half written",
    "checkpoint:complete": "the new copy complete, under its temporary name",
    "checkpoint:renamed": "two complete copies of the step; LATEST names the old one",
    "checkpoint:latest": "LATEST names the new copy; the old one not yet deleted",
    "checkpoint:deleting": "the old copy half deleted",
}
RESAVE = """
import sys
from pathlib import Path
from attnlab.translate.pipeline import train_run
from attnlab.translate.run import read_config

run_dir = Path(sys.argv[1])
# the run has used its budget: fit() resumes, trains nothing, and saves the same step again
train_run(run_dir, read_config(run_dir), resume=True, threads=1, progress_bar=False)
raise SystemExit("not killed")
"""


@pytest.fixture(scope="module")
def kills(reference, tmp_path_factory) -> dict[str, Path]:
    """Every killed run, keyed ``mid:LABEL`` or ``resave:LABEL``; the processes run three at a
    time (they are mostly Python start-up)."""
    root = tmp_path_factory.mktemp("kills")
    jobs = {}
    for i, label in enumerate(MID_RUN):
        out = root / f"mid{i}"
        jobs[f"mid:{label}"] = (
            out,
            ["-m", "attnlab.cli", "train", *TRAIN, *QUIET, "--out", str(out)],
        )
    for i, label in enumerate(RESAVE_AT):
        out = root / f"resave{i}"
        shutil.copytree(reference, out)
        jobs[f"resave:{label}"] = (out, ["-c", RESAVE, str(out)])
    with ThreadPoolExecutor(max_workers=3) as pool:
        done = {
            key: pool.submit(killed, args, key.split(":", 1)[1]) for key, (_, args) in jobs.items()
        }
        for future in done.values():
            future.result()
    return {key: out for key, (out, _) in jobs.items()}


# ------------------------------------------------------------------------------ kill, resume
@pytest.mark.parametrize("kill_at", list(MID_RUN))
def test_kill_9_then_resume_equals_the_uninterrupted_run(reference, kills, tmp_path, kill_at):
    out = kills[f"mid:{kill_at}"]
    latest = ckpt.latest_checkpoint(out)
    assert latest is not None  # several steps were saved: there is something to resume
    saved = ckpt.read_checkpoint_state(latest)["step"]
    assert 1 <= saved < STEPS
    assert load_run(out).translate("lunes 3 marzo 1980", beam_size=1)  # usable as it is
    if kill_at == "evaluate:logged@2":
        assert max(s for s, _ in validations(out)) > saved  # a line of the lost stretch

    train_in_process("--out", str(out), "--resume")

    assert_bitwise_equal(out / ckpt.WEIGHTS, reference / ckpt.WEIGHTS)
    assert validations(out) == validations(reference)  # rewound, then the same validations
    assert_no_leftovers(out)


# ------------------------------------------------------------------------------ same-step re-save
@pytest.fixture(scope="module")
def resumed_reference(reference, tmp_path_factory) -> Path:
    """The finished reference run, trained a step more after an uneventful restart."""
    out = tmp_path_factory.mktemp("faults") / "resumed"
    shutil.copytree(reference, out)
    train_in_process("--out", str(out), "--resume", "--more-steps", "1")
    return out


@pytest.mark.parametrize("kill_at", list(RESAVE_AT))
def test_kill_9_inside_a_same_step_resave_loses_nothing(
    reference, kills, resumed_reference, kill_at
):
    out = kills[f"resave:{kill_at}"]
    latest = ckpt.latest_checkpoint(out)
    assert latest is not None and ckpt.read_checkpoint_state(latest)["step"] == STEPS
    before = ckpt.latest_checkpoint(reference)
    for name in (ckpt.WEIGHTS, ckpt.OPTIMIZER):
        assert_bitwise_equal(latest / name, before / name)
    assert not (out / ckpt.WEIGHTS).exists()  # a resumed session removes the stale final files
    # (so translate reads the checkpoint itself)
    assert load_run(out).translate("lunes 3 marzo 1980", beam_size=1)

    train_in_process("--out", str(out), "--resume", "--more-steps", "1")

    assert_bitwise_equal(out / ckpt.WEIGHTS, resumed_reference / ckpt.WEIGHTS)
    assert validations(out) == validations(resumed_reference)
    assert_no_leftovers(out)


# ------------------------------------------------------------------------------ what a crash leaves
def test_damaged_latest_falls_back_and_leftovers_are_removed(reference, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    root = out / ckpt.CHECKPOINTS
    good = ckpt.latest_checkpoint(out)
    assert good.name == f"step-{STEPS:08d}"
    # LATEST names a folder that a crash half deleted (no manifest), beside temporary leftovers
    half = root / "step-00000099"
    shutil.copytree(good, half)
    (half / ckpt.MANIFEST).unlink()
    (half / ckpt.OPTIMIZER).unlink()
    (root / ckpt.LATEST).write_text("step-00000099\n")
    (root / ".LATEST.abc123.tmp").write_text("step-0000")
    (root / ".step-00000031.xyz.tmp").mkdir()
    (root / ".step-00000031.xyz.tmp" / ckpt.WEIGHTS).write_bytes(b"\0" * 10)
    (out / ".model.safetensors.q1w2.tmp").write_bytes(b"\0")
    assert ckpt.latest_checkpoint(out) == good  # not the half-deleted folder
    (root / ckpt.LATEST).unlink()
    assert ckpt.latest_checkpoint(out) == good  # no LATEST at all: the newest complete one

    train_in_process("--out", str(out), "--resume", "--more-steps", "1")
    assert ckpt.read_checkpoint_state(ckpt.latest_checkpoint(out))["step"] == STEPS + 1
    assert_no_leftovers(out)
    capsys.readouterr()


def test_resume_skips_a_damaged_checkpoint_for_an_older_complete_one(reference, tmp_path, capsys):
    """Two complete folders (a crash between rename and clean-up); the newer one damaged."""
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    newer = newer_copy(out)
    (newer / ckpt.OPTIMIZER).write_bytes(b"\0" * 100)
    capsys.readouterr()
    train_in_process("--out", str(out), "--resume", "--more-steps", "1")
    err = capsys.readouterr().err
    assert "skipped a damaged checkpoint" in err and ckpt.OPTIMIZER in err
    assert ckpt.read_checkpoint_state(ckpt.latest_checkpoint(out))["step"] == STEPS + 1


def newer_copy(run_dir: Path) -> Path:
    """A complete copy of the run's checkpoint saved after it (a crash between rename and
    clean-up leaves two), named by LATEST: the one a resume tries first."""
    root = run_dir / ckpt.CHECKPOINTS
    good = ckpt.latest_checkpoint(run_dir)
    newer = root / f"{good.name}.1"
    shutil.copytree(good, newer)
    manifest = json.loads((newer / ckpt.MANIFEST).read_text())
    manifest["saved_ns"] += 1
    (newer / ckpt.MANIFEST).write_text(json.dumps(manifest))
    (root / ckpt.LATEST).write_text(newer.name)
    assert ckpt.latest_checkpoint(run_dir) == newer
    return newer


def newer_copy_with_a_damaged_state(run_dir: Path, damage: str) -> Path:
    """:func:`newer_copy`, whose state.json is then damaged."""
    newer = newer_copy(run_dir)
    state = (newer / ckpt.STATE).read_text()
    if damage == "truncated":  # cut short: not JSON
        (newer / ckpt.STATE).write_text(state[: len(state) // 2])
    else:  # still JSON, but not what was saved (its checksum says so)
        (newer / ckpt.STATE).write_text(state.replace(f'"step": {STEPS}', '"step": 99', 1))
    return newer


@pytest.mark.parametrize("damage", ["truncated", "altered"])
def test_a_damaged_newest_state_falls_back_to_the_older_intact_checkpoint(
    reference, tmp_path, capsys, damage
):
    """Before: --resume read the step and the budget from the newest folder's state.json, not
    from the checkpoint training resumes from: a truncated one stopped the resume although an
    intact checkpoint was there; an altered one said "resuming at step 99" and --more-steps 1
    trained 70 steps."""
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    newer = newer_copy_with_a_damaged_state(out, damage)
    capsys.readouterr()
    train_in_process("--out", str(out), "--resume", "--more-steps", "1")
    err = capsys.readouterr().err
    assert f"skipped a damaged checkpoint: {newer / ckpt.STATE}" in err
    assert f"resuming at step {STEPS};" in err and "step 99" not in err
    assert ckpt.read_checkpoint_state(ckpt.latest_checkpoint(out))["step"] == STEPS + 1


def test_an_unfinished_run_loads_its_newest_intact_checkpoint(reference, tmp_path, capsys):
    """Before: translate / evaluate of a run without final weights read the newest checkpoint
    folder only, and a damaged state.json there stopped them beside an intact older one."""
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    (out / "model.safetensors").unlink()
    newer = newer_copy_with_a_damaged_state(out, "truncated")
    capsys.readouterr()
    translator = load_run(out)
    err = capsys.readouterr().err
    assert f"skipped a damaged checkpoint: {newer / ckpt.STATE}" in err
    assert translator.checkpoint_step == STEPS
    assert translator.translate(["1 mars 1999"])[0]
    for name in (newer, out / ckpt.CHECKPOINTS / f"step-{STEPS:08d}"):  # all damaged: its error
        (name / ckpt.STATE).write_text("{")
    with pytest.raises(ckpt.RunFileError, match="state.json: damaged"):
        load_run(out)


# ------------------------------------------------------------------------------ divergence
def test_a_diverging_run_stops_at_the_first_nonfinite_loss_and_keeps_its_last_checkpoint(
    tmp_path, capsys
):
    """A learning rate of 1e6 sends the loss to inf within ten steps. Before: training went on
    to its budget, saved the NaN weights over every finite checkpoint and as the model, and
    the run could then be neither resumed, translated nor evaluated."""
    out = tmp_path / "run"
    args = [*TRAIN[:-4], "--max-steps", "30", "--checkpoint-every", "0.00001", "--lr", "1e6"]
    assert cli.main(["train", *args, "--warmup", "0", "--out", str(out), *QUIET]) == 2
    said = capsys.readouterr().err
    assert "training diverged at step" in said and "--lr" in said and "--clip" in said
    step = int(said.split("training diverged at step ")[1].split(":")[0])
    latest = ckpt.latest_checkpoint(out)
    kept = ckpt.read_checkpoint_state(latest)["step"]
    assert 0 < kept < step < 30 and f"keeps its last checkpoint, step {kept}" in said
    weights = tensors_of(latest / "model.safetensors")
    assert all(torch.isfinite(t).all() for t in weights.values())
    assert not (out / "model.safetensors").exists()  # (written when training completes)
    assert all(v == v for _, v in validations(out))  # no NaN in train.log
    load_run(out).translate(["1 mars 1999"])  # the run still loads and translates


def test_weights_that_overflow_under_a_finite_loss_are_not_saved(tmp_path, capsys, monkeypatch):
    """An optimizer step can leave inf weights after a finite loss (an overflowing gradient);
    the checkpoint that would follow is refused, not written."""
    step = torch.optim.AdamW.step

    def poisoned(self, *args, **kwargs):
        result = step(self, *args, **kwargs)
        if self.state[self.param_groups[0]["params"][0]]["step"] == 5:
            self.param_groups[0]["params"][0].data.fill_(float("inf"))
        return result

    monkeypatch.setattr(torch.optim.AdamW, "step", poisoned)
    out = tmp_path / "run"
    args = [*TRAIN[:-4], "--max-steps", "5", "--checkpoint-every", "100"]
    assert cli.main(["train", *args, "--out", str(out), *QUIET]) == 2
    said = capsys.readouterr().err
    assert "diverged at step 5: the weights hold a NaN or an inf" in said
    assert ckpt.latest_checkpoint(out) is None and "has no checkpoint yet" in said


def test_adam_moments_that_overflow_under_finite_weights_are_not_saved(
    tmp_path, capsys, monkeypatch
):
    """--clip 0 and a gradient whose square overflows float32: Adam's exp_avg_sq becomes inf,
    exp_avg stays finite, so every update is exp_avg / sqrt(inf) = 0: the loss and the weights
    stay finite and the weights stop learning. Before: training went on and saved the inf
    moments, in a checkpoint that could not be resumed."""
    step = torch.optim.AdamW.step

    def overflowing(self, *args, **kwargs):
        first = self.param_groups[0]["params"][0]
        if int(self.state.get(first, {}).get("step", 0)) == 2:  # the third step
            first.grad.fill_(1e30)  # finite; its square is not
        return step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", overflowing)
    out = tmp_path / "run"
    args = [*TRAIN[:-4], "--max-steps", "5", "--checkpoint-every", "100", "--clip", "0"]
    assert cli.main(["train", *args, "--out", str(out), *QUIET]) == 2
    said = capsys.readouterr().err
    assert "diverged at step 5: the optimizer's 'exp_avg_sq' holds a NaN or an inf" in said
    assert "--clip 1.0 (this run did not clip)" in said
    assert ckpt.latest_checkpoint(out) is None and "has no checkpoint yet" in said
    assert not (out / "model.safetensors").exists()


def test_kill_9_in_the_final_evaluation_then_resume_finishes_the_report(reference, tmp_path):
    """Trained and saved, killed while evaluating: before, --resume refused ("already trained
    its whole budget") and results.json could only come back by training more."""
    out = tmp_path / "run"
    killed(["-m", "attnlab.cli", "train", *TRAIN, *QUIET, "--out", str(out)], "report@1")
    assert (out / "model.safetensors").is_file() and not (out / "results.json").exists()
    assert cli.main(["train", "--out", str(out), "--resume", *QUIET]) == 0
    assert (out / "results.json").is_file()
    assert_bitwise_equal(out / "model.safetensors", reference / "model.safetensors")
    # finished now: a second --resume has nothing to add and says so
    assert cli.main(["train", "--out", str(out), "--resume", *QUIET]) == 2


def test_an_interrupted_resumed_session_is_read_from_its_newest_checkpoint(reference, tmp_path):
    """A finished run trained on with --more-steps and killed: before, translate and evaluate
    went on reading the first session's model.safetensors beside the newer checkpoint."""
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    more = ["-m", "attnlab.cli", "train", "--out", str(out), "--resume", "--more-steps", "10"]
    killed([*more, *QUIET, "--checkpoint-every", "0.00001"], "step@4")
    assert not (out / "model.safetensors").exists() and not (out / "results.json").exists()
    latest = ckpt.latest_checkpoint(out)
    assert ckpt.read_checkpoint_state(latest)["step"] > STEPS
    translator = load_run(out)
    newest = tensors_of(latest / "model.safetensors")
    loaded = ckpt.model_state(translator.model)
    assert loaded.keys() == newest.keys()
    assert all(torch.equal(loaded[name], newest[name]) for name in newest)
