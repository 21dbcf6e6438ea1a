"""A run folder is untrusted input: every damaged file ends in one clear line, never garbage.

A good tiny run is trained once; each test copies it, damages one file the way disks, crashes,
editors and mix-ups do (zero bytes, truncated, random bytes, another model's file, wrong shapes,
integer or NaN weights, a tokenizer of the wrong kind, broken JSON or UTF-8, missing keys, a
damaged optimizer state), and runs the command in-process: exit status 2 and one line on
stderr that names the damaged file. Before this, 14 of 39 such folders ended in a traceback,
and integer or NaN weights or an integer tokenizer translated garbage with exit status 0.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("safetensors")
pytest.importorskip("babel")

from safetensors.torch import load_file, save_file  # noqa: E402

from attnlab import cli  # noqa: E402
from attnlab.translate import checkpoint as ckpt  # noqa: E402
from attnlab.translate.run import load_run  # noqa: E402
from attnlab.translate.tokenizer import Tokenizer  # noqa: E402
from conftest import copy_of_run  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

QUIET = ["--eval-limit", "2", "--threads", "1", "--no-progress"]
SENTENCE = "mardi 1 février 2005"


@pytest.fixture(scope="module")
def good_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("runs") / "good"
    argv = ["train", "--task", "dates", "--tiny", "--max-steps", "12", "--train-size", "100"]
    assert cli.main([*argv, *QUIET, "--out", str(out)]) == 0
    return out


@pytest.fixture
def run_copy(good_run, tmp_path) -> Path:
    return copy_of_run(good_run, tmp_path)


def checkpoint_of(run_dir: Path) -> Path:
    (folder,) = (run_dir / ckpt.CHECKPOINTS).glob("step-*")
    return folder


# ------------------------------------------------------------------------------ damage
def edit_tensors(path: Path, edit) -> None:
    """Rewrite a safetensors file with edited tensors, as another program would (no checksum)."""
    save_file(edit(load_file(str(path))), str(path))


def edit_json(path: Path, edit) -> None:
    obj = json.loads(path.read_text(encoding="utf-8"))
    edit(obj)
    path.write_text(json.dumps(obj), encoding="utf-8")


def reseal(folder: Path) -> None:
    """Make the checkpoint's manifest match its files again: damage that the checksums cannot
    see, so the checks behind them are what must catch it."""
    manifest = json.loads((folder / "manifest.json").read_text())
    for name in manifest["files"]:
        data = (folder / name).read_bytes()
        manifest["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (folder / "manifest.json").write_text(json.dumps(manifest))


def first(tensors: dict) -> str:
    return sorted(tensors)[0]


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x01  # inside the last tensor: still a well-formed file
    path.write_bytes(bytes(data))


W, T, C = ckpt.WEIGHTS, ckpt.TOKENIZER, ckpt.CONFIG
CORRUPTIONS = {
    # weights
    "weights-zero-bytes": (W, lambda p: p.write_bytes(b"")),
    "weights-truncated": (W, lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])),
    "weights-random-bytes": (W, lambda p: p.write_bytes(os.urandom(4096))),
    "weights-one-bit-flipped": (W, flip_a_byte),
    "weights-foreign-names": (W, lambda p: save_file({"weight": torch.zeros(3, 3)}, str(p))),
    "weights-wrong-shape": (
        W,
        lambda p: edit_tensors(p, lambda t: {**t, first(t): torch.ones(2, 2)}),
    ),
    "weights-int32": (W, lambda p: edit_tensors(p, lambda t: {k: v.int() for k, v in t.items()})),
    "weights-all-nan": (
        W,
        lambda p: edit_tensors(p, lambda t: {k: v * float("nan") for k, v in t.items()}),
    ),
    "weights-one-inf": (
        W,
        lambda p: edit_tensors(
            p, lambda t: {**t, first(t): t[first(t)].index_fill(0, torch.tensor([0]), float("inf"))}
        ),
    ),
    # tokenizer
    "tokenizer-zero-bytes": (T, lambda p: p.write_bytes(b"")),
    "tokenizer-list-of-integers": (T, lambda p: p.write_text("[5, 17, 3, 99]")),
    "tokenizer-broken-json": (T, lambda p: p.write_text(p.read_text()[:40])),
    "tokenizer-latin-1": (T, lambda p: p.write_bytes(p.read_text().encode("latin-1", "replace"))),
    "tokenizer-chars-not-strings": (T, lambda p: edit_json(p, lambda o: o.update(chars=[1, 2, 3]))),
    "tokenizer-other-vocabulary": (
        T,
        lambda p: edit_json(p, lambda o: o.update(chars=list("abc"))),
    ),
    "tokenizer-no-kind": (T, lambda p: p.write_text('{"vocab": {"a": 1}}')),
    # config
    "config-empty-object": (C, lambda p: p.write_text("{}")),
    "config-no-model": (C, lambda p: edit_json(p, lambda c: c.pop("model"))),
    "config-zero-bytes": (C, lambda p: p.write_bytes(b"")),
    "config-broken-json": (C, lambda p: p.write_text(p.read_text()[:-5])),
    "config-latin-1": (
        C,
        lambda p: p.write_bytes(p.read_text().replace("dates", "datés").encode("latin-1")),
    ),
    "config-width-a-string": (C, lambda p: edit_json(p, lambda c: c["model"].update(hidden="64"))),
    "config-odd-width": (C, lambda p: edit_json(p, lambda c: c["model"].update(hidden=63))),
    "config-unknown-model": (C, lambda p: edit_json(p, lambda c: c["model"].update(kind="lstm"))),
    "config-learning-rate-a-string": (
        C,
        lambda p: edit_json(p, lambda c: c["train"].update(lr="fast")),
    ),
}


def assert_one_line_error(code: int, err: str, file: Path) -> None:
    lines = err.strip().splitlines()
    errors = [line for line in lines if "error:" in line]
    assert code == 2, err
    assert len(errors) == 1 and errors[0] == lines[-1], err  # one line, and the last
    named = str(file) in errors[0] or (str(file.parent) in errors[0] and file.name in errors[0])
    assert named, err
    assert "Traceback" not in err


@pytest.mark.parametrize("damage", list(CORRUPTIONS))
def test_translate_names_the_damaged_file(run_copy, capsys, damage):
    name, corrupt = CORRUPTIONS[damage]
    corrupt(run_copy / name)
    capsys.readouterr()
    code = cli.main(["translate", str(run_copy), SENTENCE])
    err = capsys.readouterr().err
    assert_one_line_error(code, err, run_copy / name)
    assert len(err.strip().splitlines()) == 1


def test_a_run_without_final_weights_checks_its_checkpoint(run_copy, capsys):
    (run_copy / W).unlink()  # interrupted: translate uses the last checkpoint
    weights = checkpoint_of(run_copy) / W
    edit_tensors(weights, lambda t: {k: v * float("nan") for k, v in t.items()})
    capsys.readouterr()
    code = cli.main(["translate", str(run_copy), SENTENCE])
    assert_one_line_error(code, capsys.readouterr().err, weights)


OPT = "optimizer.safetensors"
RESUME_CORRUPTIONS = {
    "optimizer-zero-bytes": (OPT, lambda p: p.write_bytes(b""), False),
    "optimizer-truncated": (OPT, lambda p: p.write_bytes(p.read_bytes()[:3000]), False),
    "optimizer-one-bit-flipped": (OPT, flip_a_byte, False),
    "optimizer-no-rng-state": (
        OPT,
        lambda p: edit_tensors(
            p, lambda t: {k: v for k, v in t.items() if not k.startswith("rng.")}
        ),
        True,
    ),
    "optimizer-nan-moments": (
        OPT,
        lambda p: edit_tensors(
            p, lambda t: {k: v * float("nan") if "exp_avg" in k else v for k, v in t.items()}
        ),
        True,
    ),
    "optimizer-moments-wrong-shape": (
        OPT,
        lambda p: edit_tensors(
            p, lambda t: {k: v[:1] if k.endswith("exp_avg") else v for k, v in t.items()}
        ),
        True,
    ),
    "checkpoint-weights-int32": (
        W,
        lambda p: edit_tensors(p, lambda t: {k: v.int() for k, v in t.items()}),
        True,
    ),
}


@pytest.mark.parametrize("damage", list(RESUME_CORRUPTIONS))
def test_resume_names_the_damaged_checkpoint_file(run_copy, capsys, damage):
    name, corrupt, sealed = RESUME_CORRUPTIONS[damage]
    folder = checkpoint_of(run_copy)
    corrupt(folder / name)
    if sealed:
        reseal(folder)
    capsys.readouterr()
    code = cli.main(["train", "--out", str(run_copy), "--resume", "--more-steps", "1", *QUIET])
    assert_one_line_error(code, capsys.readouterr().err, folder / name)
    assert checkpoint_of(run_copy) == folder and (folder / name).exists()  # left for a look


def test_the_good_folder_still_works(good_run, run_copy, capsys):
    """The checks pass what attnlab wrote: translate, and resume a step."""
    capsys.readouterr()
    assert cli.main(["translate", str(good_run), SENTENCE]) == 0
    assert capsys.readouterr().out.strip()
    code = cli.main(["train", "--out", str(run_copy), "--resume", "--more-steps", "1", *QUIET])
    assert code == 0
    assert ckpt.read_checkpoint_state(checkpoint_of(run_copy))["step"] == 13


# ------------------------------------------------------------------------------ the API
def test_load_run_and_checkpoints_raise_one_value_error_naming_the_file(run_copy):
    (run_copy / C).write_text('{"attnlab_run": 1}')
    with pytest.raises(ckpt.RunFileError, match=r"config\.json: missing section"):
        load_run(run_copy)

    folder = checkpoint_of(run_copy)
    (folder / "state.json").write_text('{"step": ')
    reseal(folder)
    with pytest.raises(ValueError, match=r"state\.json: not valid JSON"):
        ckpt.read_checkpoint_state(folder)
    edit = {"step": "twelve", "optimizer": {}, "rng": {}}
    (folder / "state.json").write_text(json.dumps(edit))
    with pytest.raises(ckpt.RunFileError, match=r"state\.json: 'step' must be an integer"):
        ckpt.read_checkpoint_state(folder)


def test_sizes_are_checked_before_memory_is_allocated(run_copy):
    config = json.loads((run_copy / C).read_text())
    config["model"].update(hidden=512)  # wider than the weights: refused before building it
    (run_copy / C).write_text(json.dumps(config))
    with pytest.raises(ckpt.RunFileError, match=r"model\.safetensors: holds .* needs"):
        load_run(run_copy)
    config["model"].update(hidden=65536, emb_dim=65536)  # ~10^10 parameters: not even tried
    (run_copy / C).write_text(json.dumps(config))
    with pytest.raises(ckpt.RunFileError, match=r"config\.json: .* parameters"):
        load_run(run_copy)


def test_bpe_tokenizer_with_other_special_ids_is_refused(tmp_path):
    tok = Tokenizer.train(["the cat sat on the mat"] * 10, "bpe", vocab_size=60)
    path = tmp_path / T
    tok.save(path)
    assert Tokenizer.load(path).vocab_size == tok.vocab_size
    data = json.loads(path.read_text())
    vocab = data["model"]["vocab"]
    other = next(k for k, v in vocab.items() if v == 10)
    vocab["<pad>"], vocab[other] = 10, 0  # "<pad>" is no longer id 0
    for added in data["added_tokens"]:
        if added["content"] == "<pad>":
            added["id"] = 10
    path.write_text(json.dumps(data))
    with pytest.raises(ckpt.RunFileError, match=r"tokenizer\.json: .*'<pad>' must have id 0"):
        Tokenizer.load(path)


# ------------------------------------------------------------------------------ unfinished runs
def test_evaluating_an_unfinished_run_says_so(run_copy, capsys):
    """Without model.safetensors the last checkpoint is scored: a warning names its step and
    the run's budget, and the scores record both (they once came with exit 0 and no word)."""
    (run_copy / W).unlink()
    edit_json(run_copy / C, lambda c: c["train"].update(max_steps=20))  # 12 of 20 steps done
    capsys.readouterr()
    argv = ["evaluate", str(run_copy), "--limit", "2", "-b", "1", "--no-aer", "--no-progress"]
    assert cli.main([*argv, "--json"]) == 0
    out, err = capsys.readouterr()
    res = json.loads(out)
    assert (res["checkpoint_step"], res["finished"]) == (12, False)
    assert "no model.safetensors" in err and "checkpoint, step 12" in err
    assert "training has not finished" in err and "its budget is 20 steps" in err
    assert cli.main(argv) == 0
    out, err = capsys.readouterr()
    assert "the weights of checkpoint step 12 (training unfinished)" in out and "step 12" in err

    edit_json(run_copy / C, lambda c: c["train"].update(max_steps=12))  # its whole budget
    tr = load_run(run_copy)
    assert (tr.checkpoint_step, tr.finished) == (12, True)
    err = capsys.readouterr().err
    assert "used its whole budget (12 steps)" in err and "--resume" in err


def test_a_finished_run_records_its_final_weights(good_run, capsys):
    tr = load_run(good_run)
    assert (tr.checkpoint_step, tr.finished) == (None, True)
    assert capsys.readouterr().err == ""
    results = json.loads((good_run / ckpt.RESULTS).read_text())["test"]
    assert (results["checkpoint_step"], results["finished"]) == (None, True)
