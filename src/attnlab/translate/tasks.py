"""The three sources of sentence pairs: the Bible corpus, the dates task, and a user's TSV file.

Every task gives the same thing, a :class:`Task`: train / validation / test pairs with fixed
splits, reference word alignments where they exist (Bible test and validation), and the
tokenizer that suits it.

The dates task has reference alignments too, derived here from the date itself: each digit of
the ISO target (``"2005-02-01"``, target units are *characters*) is linked to the source word
that states it: the year digits to the year, the month digits to the month's name (or number),
the day digits to the day. The hyphens have no link.

A user file has no splits of its own. Pairs are assigned by the SHA-256 of their source text
(so a repeated source never lands in two splits): 5% validation and 5% test, each capped at
1,000 pairs; the rest train.
"""

from __future__ import annotations

import hashlib
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from attnlab.data import Alignment, Pair

TASKS = ("bible", "dates", "tsv")
DATA_FILE = "data.tsv"  # a user's pairs, copied into the run folder by attnlab train
HELD_OUT_SHARE = 0.05
HELD_OUT_MAX = 1000


@dataclass
class Task:
    """Sentence pairs of one task, split, plus what the task needs to be trained and scored."""

    name: str
    train: list[Pair]
    validation: list[Pair]
    test: list[Pair]
    alignments: dict[str, dict[str, Alignment]] = field(default_factory=dict)  # split -> id -> ref
    tokenizer: str = "bpe"  # the tokenizer kind that suits the task
    exact_match: bool = False  # report exact-match accuracy (dates)
    problems: list = field(default_factory=list)  # bad lines of a TSV file that were skipped
    target_units: str = "words"  # what target indices of the alignments count: words or chars

    def split(self, name: str) -> list[Pair]:
        if name not in ("train", "validation", "test"):
            raise ValueError(f"unknown split {name!r}; expected train, validation or test")
        return getattr(self, name)


def load_task(spec: dict) -> Task:
    """Build a task from its JSON spec (stored in every run's config.json).

    ``{"name": "bible"}``, ``{"name": "dates", "train_size": 20000}`` or
    ``{"name": "tsv", "path": "/abs/pairs.tsv", "skip_bad_lines": false}``.
    """
    name = spec.get("name")
    if name == "bible":
        from attnlab.data import load_alignments, load_bible

        return Task(
            "bible",
            load_bible("train"),
            load_bible("validation"),
            load_bible("test"),
            alignments={
                "test": load_alignments("test"),
                "validation": load_alignments("validation"),
            },
        )
    if name == "dates":
        from attnlab.data import load_dates

        size = spec.get("train_size")
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise ValueError(f"--train-size must be an integer >= 1; got {size!r}")
        try:
            train = load_dates("train", size)
        except ModuleNotFoundError as e:
            raise ValueError(
                "the dates task needs Babel: pip install babel (or pip install attnlab[translate])"
            ) from e
        except ValueError as e:  # more pairs than the split can draw
            raise ValueError(f"--train-size {size}: {e}; pass a smaller number") from None
        validation, test = load_dates("validation"), load_dates("test")
        return Task(
            "dates",
            train,
            validation,
            test,
            alignments={"test": dates_alignments(test), "validation": dates_alignments(validation)},
            tokenizer="char",
            exact_match=True,
            target_units="chars",
        )
    if name == "tsv":
        return _tsv_task(spec["path"], skip_bad_lines=spec.get("skip_bad_lines", False))
    raise ValueError(f"unknown task {name!r}; expected one of {TASKS}")


def run_task(run_dir: str | os.PathLike[str], spec: dict) -> Task:
    """The task of a run folder's config.json, reading data only from where it may come from.

    The embedded tasks (bible, dates) read attnlab's shipped data. A user's pairs are read from
    the run folder itself (``attnlab train --data`` copies them there as ``data.tsv``): a
    config.json that names any other path (``/etc/passwd``, ``../../secret``, a symbolic link
    leading out of the folder) is refused without reading it.
    """
    run_dir = Path(run_dir)
    config = run_dir / "config.json"
    if not isinstance(spec, dict) or spec.get("name") not in TASKS:
        name = spec.get("name") if isinstance(spec, dict) else spec
        raise ValueError(f"{config}: task.name {name!r} is not one of {', '.join(TASKS)}")
    if spec["name"] != "tsv":
        return load_task(spec)
    path = spec.get("path")
    fix = (
        f"the pairs must be a file inside the run folder: copy them to {run_dir / DATA_FILE} and "
        f'set task.path to "{DATA_FILE}"'
    )
    if not isinstance(path, str) or not path.strip():
        raise ValueError(f"{config}: task.path is missing; {fix}")
    if Path(path).is_absolute():
        raise ValueError(f"{config}: task.path {path!r} is outside the run folder; {fix}")
    root = run_dir.resolve()
    full = (root / path).resolve()  # symbolic links followed: where the bytes really are
    if not full.is_relative_to(root):
        raise ValueError(f"{config}: task.path {path!r} leads outside the run folder; {fix}")
    if not full.is_file():
        raise ValueError(
            f"{config}: task.path {path!r}: no such file in the run folder (the run was trained "
            f"on it; put it back to evaluate or resume)"
        )
    return load_task({**spec, "path": str(full)})


def task_spec(task: str, data: str | None, skip_bad_lines: bool, train_size: int | None) -> dict:
    """The JSON spec of the task chosen on the command line (``--task`` / ``--data``)."""
    if data is not None:
        if task not in (None, "tsv"):
            raise ValueError(
                f"--data gives your own pairs, so --task {task} does not apply; drop one of them"
            )
        return {"name": "tsv", "path": str(Path(data).resolve()), "skip_bad_lines": skip_bad_lines}
    if skip_bad_lines:
        raise ValueError("--skip-bad-lines applies only to --data FILE; drop it or add --data")
    task = task or "bible"
    if task == "tsv":
        raise ValueError("--task tsv needs the file: pass --data pairs.tsv")
    spec = {"name": task}
    if task == "dates" and train_size:
        spec["train_size"] = train_size
    return spec


def dates_alignments(pairs) -> dict[str, Alignment]:
    """Reference links ``(source word, target character)`` of date pairs (module docstring).

    Pairs whose fields cannot be located unambiguously get no entry (none in practice).
    """
    from babel.dates import get_month_names

    from attnlab.data import words

    out = {}
    for pair in pairs:
        year, month, day = (int(x) for x in pair.target.split("-"))
        locale = pair.id.split("/")[1]
        names = {
            name.casefold().rstrip(".")
            for width in ("wide", "abbreviated")
            for context in ("format", "stand-alone")
            for name in [get_month_names(width, context, locale)[month]]
        }
        ws = words(pair.source)
        year_at = [i for i, w in enumerate(ws) if w.isdigit() and int(w) == year and len(w) == 4]
        month_at = [i for i, w in enumerate(ws) if w.casefold().rstrip(".") in names]
        numbers = [i for i, w in enumerate(ws) if w.isdigit() and i not in year_at]
        if len(year_at) != 1:
            continue
        if month_at:  # the month is a word: the day is the one other number
            day_at = [i for i in numbers if int(ws[i]) == day]
            if len(day_at) != 1:
                continue
            d, m = day_at[0], month_at[0]
        elif len(numbers) == 2:  # numeric styles are day-first in every locale drawn
            d, m = numbers
            if (int(ws[d]), int(ws[m])) != (day, month):
                continue
        else:
            continue
        y = year_at[0]
        links = [(y, t) for t in range(4)] + [(m, 5), (m, 6), (d, 8), (d, 9)]
        out[pair.id] = Alignment(frozenset(links), frozenset(links))
    return out


def _tsv_task(path: str | os.PathLike[str], *, skip_bad_lines: bool) -> Task:
    from attnlab.data import load_pairs

    try:
        pairs, problems = load_pairs(path, on_error="skip")
    except FileNotFoundError as e:
        raise FileNotFoundError(f"{e}; check the --data path") from None
    except ValueError as e:  # no valid pair at all
        first = str(e).splitlines()
        raise ValueError(" ".join(line.strip() for line in first[:3])) from None
    if problems and not skip_bad_lines:
        shown = "; ".join(str(p) for p in problems[:3])
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise ValueError(
            f"{path}: {len(problems)} bad line(s): {shown}{more}. Fix them, or pass "
            "--skip-bad-lines to train without them"
        )
    if problems:
        print(
            f"warning: skipped {len(problems)} bad line(s) of {path} (--skip-bad-lines), e.g. "
            + "; ".join(str(p) for p in problems[:3]),
            file=sys.stderr,
        )
    n_held = min(HELD_OUT_MAX, int(len(pairs) * HELD_OUT_SHARE))
    if len(pairs) < 20:
        raise ValueError(
            f"{path} has only {len(pairs)} valid pair(s); at least 20 are needed to train and to "
            "hold some out for validation and testing"
        )
    n_held = max(n_held, 1)
    order = sorted(pairs, key=lambda p: hashlib.sha256(p.source.encode("utf-8")).hexdigest())
    test, validation, train = order[:n_held], order[n_held : 2 * n_held], order[2 * n_held :]
    # A repeated source must not straddle two splits: move its copies to the first split it hit.
    held = {p.source for p in test} | {p.source for p in validation}
    train = [p for p in train if p.source not in held]
    keep = {id(p) for p in train}
    train = [p for p in pairs if id(p) in keep]  # file order, for a stable data order
    return Task("tsv", train, validation, test, problems=problems)
