"""The command line's front door: help without torch, --version, `show` (and its old name
`explain`), the defaults `train --help` states, and progress output fit for a log file."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from importlib import metadata

import pytest

from attnlab import cli

# Every command's --help, in one fresh interpreter; then whether torch (or NumPy) got imported.
HELP_WITHOUT_TORCH = """
import contextlib, io, sys
from attnlab.cli import COMMANDS, main
for argv in [["--help"], ["--version"], *[[name, "--help"] for name in COMMANDS]]:
    with contextlib.redirect_stdout(io.StringIO()) as out:
        assert main(argv) == 0, argv
    assert out.getvalue().strip(), argv
print(sorted(m for m in ("torch", "numpy", "transformers", "matplotlib") if m in sys.modules))
"""


def test_help_of_every_command_imports_no_torch():
    proc = subprocess.run(
        [sys.executable, "-c", HELP_WITHOUT_TORCH],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", proc.stdout  # none of them


def test_version_is_the_installed_distribution(capsys):
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out == f"attnlab {metadata.version('attnlab')}\n"
    import attnlab

    assert attnlab.__version__ == metadata.version("attnlab")


def test_examples_help_lists_the_examples_that_exist():
    from attnlab.cli_examples import NAMES
    from attnlab.examples import EXAMPLES

    assert NAMES == tuple(EXAMPLES)


def test_train_help_names_the_real_defaults(capsys):
    assert cli.main(["train", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "rnn (bi-GRU encoder, GRU decoder; the default, for every task and for --data)" in text
    assert "(default luong-general)" in text
    assert "transformer (default for bible)" not in text


@pytest.mark.parametrize("options", [{}, {"task": "dates"}, {"data": "pairs.tsv"}])
def test_data_does_not_switch_the_model(options):
    from attnlab.translate.pipeline import resolve

    resolved = resolve(options)
    assert (resolved["model"], resolved["attention"]) == ("rnn", "luong-general")
    assert resolve({**options, "model": "transformer"})["model"] == "transformer"


# ------------------------------------------------------------------------------ show / explain
def test_show_is_listed_and_explain_is_not(capsys):
    assert cli.main(["--help"]) == 0
    commands = capsys.readouterr().out.split("positional arguments:")[1].split("options:")[0]
    assert "show" in commands and "draw a real model's attention" in commands
    assert "explain" not in commands


def test_show_draws_a_trained_run_and_explain_still_works_with_a_note(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    pytest.importorskip("tokenizers")
    run = tmp_path / "run"
    argv = ["train", "--task", "dates", "--tiny", "--train-size", "200", "--max-steps", "3"]
    argv += ["--eval-limit", "3", "--beam-size", "1", "--threads", "1", "--no-progress"]
    assert cli.main([*argv, "--out", str(run)]) == 0
    capsys.readouterr()

    assert cli.main(["show", str(run), "--no-html", "--quiet", "--out", str(tmp_path / "a")]) == 0
    _, err = capsys.readouterr()
    assert err == ""  # the new name: no note
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert "alignment.png" in json.dumps(summary)
    assert (tmp_path / "a" / "alignment.png").stat().st_size > 1000

    out = tmp_path / "b"
    assert cli.main(["explain", str(run), "--no-html", "--quiet", "--out", str(out)]) == 0
    _, err = capsys.readouterr()
    assert err.splitlines() == [cli.deprecation_note("explain")]
    assert "now 'attnlab show'" in err
    assert (out / "alignment.png").read_bytes() == (tmp_path / "a" / "alignment.png").read_bytes()


def test_errors_name_the_command_as_typed_in_one_line(tmp_path, capsys):
    for name in ("show", "explain"):
        code = cli.main([name, "/mistyped/run/path", "--out", str(tmp_path / "x")])
        _, err = capsys.readouterr()
        assert code == 2
        lines = err.splitlines()
        assert len(lines) == 1, err  # the error alone: no deprecation note after a failure
        assert lines[0].startswith(f"attnlab {name}: error: no such run folder")
        assert f"name the model: attnlab {name} /mistyped/run/path --model minilm" in lines[0]


def test_the_old_name_is_suggested_for_near_misses(capsys):
    assert cli.main(["shwo"]) == 2
    assert "did you mean 'show'?" in capsys.readouterr().err


# ------------------------------------------------------------------------------ progress output
class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_progress_is_a_line_a_minute_when_not_a_terminal():
    from attnlab.translate.progress import LogLines, progress_bar

    log = io.StringIO()  # not a terminal
    assert isinstance(progress_bar(total=10, desc="x", file=log), LogLines)
    clock = Clock()
    bar = LogLines(total=1000, desc="training", unit="‰", file=log, clock=clock)
    for step in range(900):  # 15 minutes of steps, one a second
        clock.now = step + 1.0
        bar.set_postfix_str(f"step {step + 1}")
        bar.update(1)
    bar.write("  step 900: validation loss 1.234")
    bar.close()
    lines = log.getvalue().splitlines()
    assert "\r" not in log.getvalue()
    assert len(lines) == 15 + 1 + 1  # one a minute, the validation line, and "done"
    assert lines[0] == "training: 6%, 1:00 elapsed step 60"
    assert lines[-1] == "training: 90%, 15:00 elapsed step 900"

    quiet = io.StringIO()
    clock.now = 0.0
    short = LogLines(range(5), desc="translating", unit="batch", file=quiet, clock=clock)
    assert list(short) == list(range(5))
    assert quiet.getvalue() == ""  # under a minute: nothing at all


def test_progress_is_a_live_bar_on_a_terminal():
    from attnlab.translate.progress import LogLines, progress_bar

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    pytest.importorskip("tqdm")
    bar = progress_bar(total=3, desc="x", file=Terminal())
    assert not isinstance(bar, LogLines) and type(bar).__module__.startswith("tqdm")
    bar.close()
