"""A user's pairs split by whole sources, and ``attnlab compare --resume`` that keeps its settings.

* Every pair of a TSV file lands in exactly one split, all the pairs of one source in the same
  one; a source repeated more than a held-out split holds trains; data that cannot give a
  held-out split is refused in one line. Runs recorded before the rule keep their split.
* ``compare --resume`` refuses settings other than the recorded ones (before training anything),
  takes the ones it is not given from the record, and continues an interrupted variant from its
  checkpoint.
"""

from __future__ import annotations

import hashlib
import json

import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("safetensors")
pytest.importorskip("sacrebleu")

from attnlab.translate import cmd_compare, cmd_train, pipeline  # noqa: E402
from attnlab.translate.tasks import load_task, run_task, task_spec  # noqa: E402
from conftest import run_command as run  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def write(path, lines):
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def old_rule(pairs, n_held):
    """The first rule (what runs without task.split were trained on)."""
    order = sorted(pairs, key=lambda p: hashlib.sha256(p.source.encode("utf-8")).hexdigest())
    test, validation, rest = order[:n_held], order[n_held : 2 * n_held], order[2 * n_held :]
    held = {p.source for p in test + validation}
    kept = {id(p) for p in rest if p.source not in held}
    return [p for p in pairs if id(p) in kept], validation, test


# -- splitting a user's pairs ------------------------------------------------------------------


@pytest.fixture
def repeated(tmp_path):
    """600 distinct pairs and 400 pairs of one source (the reviewer's case)."""
    lines = [f"sentence {i}\tfrase {i}" for i in range(600)]
    lines += [f"Hello 990\tHola variante {n}" for n in range(400)]
    return write(tmp_path / "rep.tsv", lines)


def test_tsv_split_keeps_every_pair_and_each_source_in_one_split(repeated):
    from attnlab.data import load_pairs

    task = load_task(task_spec(None, str(repeated), False, None))
    assert task_spec(None, str(repeated), False, None)["split"] == "source-groups"
    sizes = (len(task.train), len(task.validation), len(task.test))
    assert sizes == (900, 50, 50)  # no pair dropped
    every = task.train + task.validation + task.test
    assert sorted(p.id for p in every) == sorted(p.id for p in load_pairs(repeated)[0])
    sources = [{p.source for p in task.split(s)} for s in ("train", "validation", "test")]
    assert not sources[0] & sources[1] and not sources[0] & sources[2]
    assert not sources[1] & sources[2]
    # the source repeated 400 times (more than a held-out split's 50) trains, all of it
    assert sum(p.source == "Hello 990" for p in task.train) == 400


def test_tsv_split_packs_small_groups_whole(tmp_path):
    # 30 sources, each 3 times, and 10 distinct: 100 pairs, held-out splits of 5 pairs
    lines = [f"s{i}\tt{i} {k}" for i in range(30) for k in range(3)]
    lines += [f"u{i}\tv{i}" for i in range(10)]
    task = load_task({"name": "tsv", "path": str(write(tmp_path / "g.tsv", lines))})
    assert len(task.train) + len(task.validation) + len(task.test) == 100
    for split in (task.validation, task.test):
        assert 1 <= len(split) <= 5
        for source in {p.source for p in split}:  # a held-out source has all its copies
            assert sum(p.source == source for p in split) == (1 if source[0] == "u" else 3)
    again = load_task({"name": "tsv", "path": str(tmp_path / "g.tsv")})
    assert (again.train, again.validation, again.test) == (task.train, task.validation, task.test)


def test_tsv_split_of_distinct_sources_is_the_first_rules(tmp_path):
    from attnlab.data import load_pairs

    path = write(tmp_path / "d.tsv", [f"sentence {i}\tfrase {i}" for i in range(333)])
    task = load_task({"name": "tsv", "path": str(path)})
    expected = old_rule(load_pairs(path)[0], 16)  # int(333 * 0.05)
    assert (task.train, task.validation, task.test) == expected


def test_tsv_that_cannot_hold_out_a_split_is_refused_in_one_line(tmp_path):
    path = write(tmp_path / "same.tsv", [f"Hello\tHola {n}" for n in range(400)])
    with pytest.raises(ValueError) as err:
        load_task({"name": "tsv", "path": str(path)})
    text = str(err.value)
    assert "\n" not in text
    assert "no validation or test split can be held out" in text
    assert "400 pairs have 1 distinct source(s)" in text and "at most 20 pair(s)" in text


def test_train_refuses_such_data_before_making_the_run(tmp_path):
    path = write(tmp_path / "same.tsv", [f"Hello\tHola {n}" for n in range(400)])
    out = tmp_path / "run"
    with pytest.raises(ValueError, match="no validation or test split can be held out"):
        run(cmd_train, ["--data", str(path), "--tiny", "--max-steps", "1", "--out", str(out)])
    assert not out.exists()


def test_a_run_recorded_without_split_rule_keeps_its_split(repeated, tmp_path, capsys):
    from attnlab.data import load_pairs

    run_dir = tmp_path / "old-run"
    run_dir.mkdir()
    (run_dir / "data.tsv").write_bytes(repeated.read_bytes())
    spec = {"name": "tsv", "path": "data.tsv", "skip_bad_lines": False}  # as attnlab wrote it
    task = run_task(run_dir, spec)
    assert (task.train, task.validation, task.test) == old_rule(
        load_pairs(run_dir / "data.tsv")[0], 50
    )
    err = capsys.readouterr().err
    assert "legacy rule" in err and "300 pair(s) are in no split" in err
    assert "1 source(s) are in both validation and test" in err
    new = run_task(run_dir, {**spec, "split": "source-groups"})  # a new run's config.json
    assert (len(new.train), len(new.validation), len(new.test)) == (900, 50, 50)
    assert capsys.readouterr().err == ""
    with pytest.raises(ValueError, match="task.split 'other' is not one of"):
        run_task(run_dir, {**spec, "split": "other"})


# -- compare --resume ----------------------------------------------------------------------------

FIRST = ["--task", "dates", "--size", "tiny", "--epochs", "0.05", "--seed", "3"]
QUICK = ["--eval-limit", "5", "--beam-size", "1", "--threads", "1", "--no-progress"]


@pytest.fixture
def compared(tmp_path):
    pytest.importorskip("babel")
    out = tmp_path / "cmp"
    assert run(cmd_compare, [*FIRST, *QUICK, "--variants", "rnn-none", "--out", str(out)]) == 0
    return out


@pytest.mark.parametrize(
    "change, said",
    [
        (["--size", "small"], "--size tiny (now --size small)"),
        (["--seed", "7"], "--seed 3 (now --seed 7)"),
        (["--epochs", "0.1"], "--epochs 0.05 (now --epochs 0.1)"),
        (["--time-budget", "1"], "--epochs 0.05 (now --time-budget 1)"),
        (["--beam-size", "4"], "--beam-size 1 (now --beam-size 4)"),
        (["--task", "bible"], "--task dates (now --task bible)"),
    ],
)
def test_compare_resume_refuses_other_settings(compared, change, said):
    before = (compared / "compare.json").read_text()
    settings = dict(zip(FIRST[::2], FIRST[1::2], strict=True))
    if change[0] == "--time-budget":
        del settings["--epochs"]  # one budget at a time
    settings.update([change])
    argv = [*QUICK, *(x for kv in settings.items() for x in kv)]  # the change wins
    argv += ["--variants", "rnn-none,rnn-luong-dot"]
    with pytest.raises(ValueError) as err:
        run(cmd_compare, [*argv, "--out", str(compared), "--resume"])
    text = str(err.value)
    assert said in text and "\n" not in text and "new --out" in text
    assert not (compared / "rnn-luong-dot").exists()  # refused before training anything
    assert (compared / "compare.json").read_text() == before


def test_compare_resume_refuses_other_data(compared, tmp_path):
    data = write(tmp_path / "p.tsv", [f"sentence {i}\tfrase {i}" for i in range(40)])
    argv = ["--data", str(data), "--size", "tiny", "--epochs", "0.05", "--seed", "3", *QUICK]
    with pytest.raises(ValueError, match=r"--task dates \(now --data .*p\.tsv\)"):
        run(cmd_compare, [*argv, "--variants", "rnn-none", "--out", str(compared), "--resume"])
    assert json.loads((compared / "compare-settings.json").read_text())["task"] == "dates"


def test_compare_resume_without_a_settings_file_checks_the_variants(compared):
    (compared / "compare-settings.json").unlink()  # a comparison of an older attnlab
    argv = [*FIRST, *QUICK, "--size", "small", "--variants", "rnn-none"]
    with pytest.raises(ValueError, match="rnn-none was trained with other settings: model"):
        run(cmd_compare, [*argv, "--out", str(compared), "--resume"])


def test_compare_resume_takes_the_recorded_settings(compared, capsys):
    argv = ["--task", "dates", "--epochs", "0.05", "--threads", "1", "--no-progress"]
    assert (
        run(
            cmd_compare,
            [*argv, "--variants", "rnn-none,rnn-luong-dot", "--out", str(compared), "--resume"],
        )
        == 0
    )
    md = (compared / "compare.md").read_text()
    assert "0.05 epoch(s) each, size tiny, seed 3" in md
    config = json.loads((compared / "rnn-luong-dot" / "config.json").read_text())
    first = json.loads((compared / "rnn-none" / "config.json").read_text())
    assert config["model"]["hidden"] == first["model"]["hidden"]  # tiny, as recorded
    assert config["train"]["seed"] == 3
    results = json.loads((compared / "rnn-luong-dot" / "results.json").read_text())
    assert results["test"]["sentences"] == 5  # the recorded --eval-limit


def test_compare_resume_continues_an_interrupted_variant(tmp_path, monkeypatch):
    pytest.importorskip("babel")
    out = tmp_path / "cmp"
    real = pipeline.train_run
    calls = []

    def stop_early(*a, **k):
        calls.append(k.get("resume", False))
        return real(*a, **k, stop_at_step=5)  # as if Ctrl-C came after step 5

    monkeypatch.setattr(pipeline, "train_run", stop_early)
    argv = [*FIRST, *QUICK, "--variants", "rnn-none", "--out", str(out)]
    assert run(cmd_compare, argv) == 130
    assert (out / "rnn-none" / "checkpoint" / "step-00000005").is_dir()

    def spy(*a, **k):
        calls.append(k.get("resume", False))
        return real(*a, **k)

    monkeypatch.setattr(pipeline, "train_run", spy)
    assert run(cmd_compare, [*argv, "--resume"]) == 0
    assert calls == [False, True]  # the second session continued the checkpoint
    log = (out / "rnn-none" / "train.log").read_text()
    assert '"step": 5,' in log  # the first session's record is still there
    results = json.loads((out / "rnn-none" / "results.json").read_text())
    plain = tmp_path / "plain"
    monkeypatch.setattr(pipeline, "train_run", real)
    assert run(cmd_compare, [*FIRST, *QUICK, "--variants", "rnn-none", "--out", str(plain)]) == 0
    whole = json.loads((plain / "rnn-none" / "results.json").read_text())
    assert results["train"]["steps"] == whole["train"]["steps"]
    assert results["train"]["val_loss"] == whole["train"]["val_loss"]  # resumed exactly
