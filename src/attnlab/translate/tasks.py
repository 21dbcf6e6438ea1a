"""The three sources of sentence pairs: the Bible corpus, the dates task, and a user's TSV file.

Every task gives the same thing, a :class:`Task`: train / validation / test pairs with fixed
splits, reference word alignments where they exist (Bible test and validation), and the
tokenizer that suits it.

The dates task has reference alignments too, derived here from the date itself: each digit of
the ISO target (``"2005-02-01"``, target units are *characters*) is linked to the source word
that states it: the year digits to the year, the month digits to the month's name (or number),
the day digits to the day. The hyphens have no link.

A user file has no splits of its own. Its pairs are grouped by source text (every pair of one
source lands in the same split) and the groups ranked by the SHA-256 of that source. In that order
each group goes whole to the test split if it still fits there, else to validation if it fits
there, else to training. Each held-out split holds at most 5% of the pairs (at most 1,000), so a
source repeated more often than that always trains: one very common source never fills a held-out
split. No pair is dropped. With distinct sources this is the first 5% by hash for test, the next
5% for validation, the rest for training.

Runs trained before this rule (a config.json whose task has no ``"split"``) keep the split they
were trained on (``"legacy-hash"``: the first 5% by hash, then the next 5%, and the copies of a
held-out source left out of training), with a warning that counts the pairs it left out.
"""

from __future__ import annotations

import hashlib
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from attnlab._files import file_sha256
from attnlab.data import Alignment, Pair

TASKS = ("bible", "dates", "tsv")
DATA_FILE = "data.tsv"  # a user's pairs, copied into the run folder by attnlab train
HELD_OUT_SHARE = 0.05
HELD_OUT_MAX = 1000
SPLIT_RULE = "source-groups"  # how a user's pairs are split (module docstring); in the task spec
LEGACY_SPLIT = "legacy-hash"  # the rule of runs whose config.json names none
SPLIT_RULES = (SPLIT_RULE, LEGACY_SPLIT)


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
    ``{"name": "tsv", "path": "/abs/pairs.tsv", "skip_bad_lines": false, "split":
    "source-groups"}`` (``split`` defaults to ``"source-groups"``; see the module docstring).
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
        rule = spec.get("split", SPLIT_RULE)
        if rule not in SPLIT_RULES:
            raise ValueError(
                f"task.split {rule!r} is not one of {', '.join(SPLIT_RULES)}; leave it out for "
                f"{SPLIT_RULE}"
            )
        return _tsv_task(spec["path"], skip_bad_lines=spec.get("skip_bad_lines", False), rule=rule)
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
    recorded = spec.get("data_sha256")  # (runs trained before it was recorded: not checked)
    if recorded is not None and data_sha256(full) != recorded:
        raise ValueError(
            f"{run_dir / path}: its contents changed since the run was trained on it (its "
            f"SHA-256 is not the data_sha256 in {config}), so its splits are no longer the ones "
            f"the run trained and was scored on. Fix: put back the file the run was trained "
            f"on, or train a new run on this one: attnlab train --data {run_dir / path} "
            f"--out NEW_RUN"
        )
    # A run recorded before the split had a rule name was split by the legacy rule: keep the
    # split it was trained on, or its test pairs could be pairs it trained on.
    return load_task({"split": LEGACY_SPLIT, **spec, "path": str(full)})


def data_sha256(path: str | os.PathLike[str]) -> str | None:
    """The SHA-256 of a pairs file (recorded in a ``--data`` run's config.json, and in
    ``attnlab compare``'s settings); None when it cannot be read (a missing file fails later,
    with the task's own message)."""
    try:
        return file_sha256(path)
    except OSError:
        return None


def task_spec(task: str, data: str | None, skip_bad_lines: bool, train_size: int | None) -> dict:
    """The JSON spec of the task chosen on the command line (``--task`` / ``--data``)."""
    if data is not None:
        if task not in (None, "tsv"):
            raise ValueError(
                f"--data gives your own pairs, so --task {task} does not apply; drop one of them"
            )
        return {
            "name": "tsv",
            "path": str(Path(data).resolve()),
            "skip_bad_lines": skip_bad_lines,
            "split": SPLIT_RULE,
        }
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

    Pairs whose fields cannot be located unambiguously get no entry (rare: a weekday spelt as
    the month, Spanish "mar 24 mar 2037", martes and marzo).
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
        if len(year_at) != 1 or len(month_at) > 1:  # (several month words: which is it?)
            continue
        if month_at:  # the month is a word: the day is the one other number
            day_at = [i for i in numbers if int(ws[i]) == day]
            if len(day_at) != 1:
                continue
            d, m = day_at[0], month_at[0]  # (the one month word)
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


def _tsv_task(path: str | os.PathLike[str], *, skip_bad_lines: bool, rule: str) -> Task:
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
    if len(pairs) < 20:
        raise ValueError(
            f"{path} has only {len(pairs)} valid pair(s); at least 20 are needed to train and to "
            "hold some out for validation and testing"
        )
    n_held = max(1, min(HELD_OUT_MAX, int(len(pairs) * HELD_OUT_SHARE)))
    if rule == LEGACY_SPLIT:
        train, validation, test = _legacy_split(pairs, n_held, path)
    else:
        train, validation, test = split_by_source(pairs, n_held)
    empty = [name for name, part in (("validation", validation), ("test", test)) if not part]
    if empty:
        n_sources = len({p.source for p in pairs})
        raise ValueError(
            f"{path}: no {' or '.join(empty)} split can be held out: its {len(pairs)} pairs have "
            f"{n_sources} distinct source(s), and a held-out split takes whole sources (a source "
            f"never lands in two splits) of at most {n_held} pair(s) (5% of the pairs); add "
            "pairs with other sources, or repeat the common ones less"
        )
    return Task("tsv", train, validation, test, problems=problems)


def _source_rank(pair: Pair) -> str:
    return hashlib.sha256(pair.source.encode("utf-8")).hexdigest()


def split_by_source(pairs: list[Pair], n_held: int) -> tuple[list[Pair], list[Pair], list[Pair]]:
    """``(train, validation, test)`` of a user's pairs by the rule of the module docstring.

    Every pair lands in exactly one split, and all the pairs of one source in the same one.
    Held-out splits are in hash order (a source's copies in file order), training in file order.
    """
    groups: dict[str, list[Pair]] = {}
    for p in pairs:
        groups.setdefault(p.source, []).append(p)
    test: list[Pair] = []
    validation: list[Pair] = []
    held: set[str] = set()
    for source in sorted(groups, key=lambda s: _source_rank(groups[s][0])):
        group = groups[source]
        for split in (test, validation):  # a group too big for both (> n_held) trains
            if len(split) + len(group) <= n_held:
                split.extend(group)
                held.add(source)
                break
    train = [p for p in pairs if p.source not in held]  # file order, for a stable data order
    return train, validation, test


def _legacy_split(pairs: list[Pair], n_held: int, path) -> tuple[list, list, list]:
    """The split of runs trained before :data:`SPLIT_RULE` (kept so they evaluate and resume on
    the pairs they were trained on). It leaves out of training the copies of a held-out source
    that ranked past the held-out splits, and a source may straddle validation and test: the
    warning says how many pairs that touches."""
    order = sorted(pairs, key=_source_rank)
    test, validation, train = order[:n_held], order[n_held : 2 * n_held], order[2 * n_held :]
    held = {p.source for p in test} | {p.source for p in validation}
    train = [p for p in train if p.source not in held]
    keep = {id(p) for p in train}
    train = [p for p in pairs if id(p) in keep]
    lost = len(pairs) - len(train) - len(validation) - len(test)
    shared = {p.source for p in test} & {p.source for p in validation}
    if lost or shared:
        print(
            f"warning: {path} is split by the legacy rule of this run (recorded before attnlab "
            f"split by whole sources): {lost} pair(s) are in no split and {len(shared)} "
            "source(s) are in both validation and test. The run keeps the split it was trained "
            "on; train a new run on the file to use every pair",
            file=sys.stderr,
        )
    return train, validation, test
