"""``attnlab compare``: train every attention variant on the same data with the same budget, then
tabulate BLEU, chrF, alignment error rate, parameters and training time (Markdown, CSV, chart).

Variants: the RNN encoder-decoder with no attention (the fixed-vector bottleneck), Bahdanau
(additive), Luong dot / general / concat, multi-head cross-attention and hard (argmax,
straight-through) attention; the Transformer with multi-head and grouped-query attention. They
share one tokenizer (trained once), the seed, the batches and the budget: ``--time-budget``
minutes of training each (evaluation not counted), ``--cpu-budget`` minutes of CPU time each
(fair on a busy machine, where a clock budget buys less work as the load grows), or ``--epochs``
(the same data seen by all).

``--resume`` finishes a comparison in the same ``--out``: it keeps the variants that finished,
continues a variant that was interrupted from its checkpoint, and trains the missing ones. The
settings of the comparison (data, size, seed, budget, beam, evaluation limit) are recorded in
``compare-settings.json`` when it starts; a resume takes the ones it is not given from there and
refuses different ones, so that every row of the table was made with the settings its title
states.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import shutil
import time
from pathlib import Path

from attnlab._files import atomic_write_json, atomic_write_text

VARIANTS = (
    "rnn-none",
    "rnn-bahdanau",
    "rnn-luong-dot",
    "rnn-luong-general",
    "rnn-luong-concat",
    "rnn-multihead",
    "rnn-hard",
    "transformer-multihead",
    "transformer-gqa",
)
SETTINGS = "compare-settings.json"  # the settings of a comparison, written when it starts
DEFAULTS = {"size": "small", "seed": 1, "beam_size": 4}
BUDGETS = ("time_budget", "cpu_budget", "epochs")
COLUMNS = (
    "variant",
    "model",
    "attention",
    "parameters",
    "train_seconds",
    "steps",
    "epochs",
    "val_loss",
    "bleu",
    "chrf",
    "exact_match",
    "sentences",
    "cut_at_length_limit",
    "aer",
    "aer_referenced",
    "best_head_aer",
)

EPILOG = """\
examples:
  attnlab compare --task dates --time-budget 3
  attnlab compare --variants rnn-none,rnn-bahdanau,transformer-multihead --epochs 2
  attnlab compare --out runs/compare-bible --resume     # finish the variants not yet done
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from attnlab.cli import device_name, positive_float, positive_int, seed_int, thread_count

    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EPILOG
    parser.add_argument(
        "--task", choices=["bible", "dates"], default=None, help="embedded task (default bible)"
    )
    parser.add_argument("--data", default=None, metavar="FILE", help="your own TSV pairs instead")
    parser.add_argument(
        "--skip-bad-lines",
        action="store_true",
        default=None,
        help="with --data: drop malformed lines instead of stopping",
    )
    parser.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help="comma-separated list (default: all): " + ", ".join(VARIANTS),
    )
    parser.add_argument(
        "--time-budget",
        type=positive_float,
        default=None,
        metavar="MIN",
        help="training minutes per variant (default 10 for bible, 2 for dates)",
    )
    parser.add_argument(
        "--cpu-budget",
        type=positive_float,
        default=None,
        metavar="MIN",
        help="training minutes of CPU time per variant: fair on a machine shared with other "
        "jobs (use --threads 1; then it is the clock time of an idle machine)",
    )
    parser.add_argument(
        "--epochs",
        type=positive_float,
        default=None,
        help="train each variant this many epochs instead of a time budget",
    )
    parser.add_argument(
        "--size",
        choices=["tiny", "small", "base"],
        default=None,
        help="model size of every variant (default small)",
    )
    parser.add_argument("--seed", type=seed_int, default=None, help="random seed (default 1)")
    parser.add_argument(
        "--beam-size", type=positive_int, default=None, help="beam for the test translation (4)"
    )
    parser.add_argument(
        "--eval-limit",
        type=positive_int,
        default=None,
        metavar="N",
        help="score on the first N test pairs only",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="folder for the runs and the table (default runs/compare-<task>)",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="finish the comparison in --out with its recorded settings: keep finished "
        "variants, continue an interrupted one, train the missing ones",
    )
    parser.add_argument(
        "--device", type=device_name, default="auto", help="cpu, cuda, cuda:N or auto (default)"
    )
    parser.add_argument(
        "--threads", type=thread_count, default=None, help="CPU threads, at most 4 per core"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def _row(variant: str, results: dict) -> dict:
    test = results["test"]
    al = test.get("alignment") or {}
    tr = results["train"]
    return {
        "variant": variant,
        "model": results["model"]["kind"],
        "attention": results["model"]["attention"],
        "parameters": results["parameters"],
        "train_seconds": tr["seconds"],
        "steps": tr["steps"],
        "epochs": tr["epochs"],
        "val_loss": tr["val_loss"],
        "bleu": test["bleu"],
        "chrf": test["chrf"],
        "exact_match": test.get("exact_match", ""),
        "sentences": test["sentences"],
        "cut_at_length_limit": test.get("cut_at_length_limit", 0),
        "aer": al.get("aer", ""),
        "aer_referenced": al.get("aer_referenced", ""),
        "best_head_aer": (al.get("best_head") or {}).get("aer_referenced", ""),
    }


def write_table(out: Path, rows: list[dict], title: str) -> None:
    """compare.csv, compare.md and compare.png in ``out``."""
    buffer = io.StringIO(newline="")
    w = csv.DictWriter(buffer, fieldnames=COLUMNS)
    w.writeheader()
    w.writerows(rows)
    atomic_write_text(out / "compare.csv", buffer.getvalue())
    # (column of the rows, header of the Markdown table)
    shown = (
        ("variant", "variant"),
        ("parameters", "params"),
        ("train_seconds", "train s"),
        ("steps", "steps"),
        ("epochs", "epochs"),
        ("val_loss", "val loss"),
        ("bleu", "BLEU"),
        ("chrf", "chrF"),
        ("exact_match", "exact %"),
        ("cut_at_length_limit", "cut at limit"),
        ("aer_referenced", "AER %"),
        ("best_head_aer", "best head AER %"),
        ("aer", "AER all words %"),
    )
    keys, headers = zip(*shown, strict=True)

    def filled(k: str) -> bool:  # (no translation cut in any variant: no such column)
        blank = ("", None, 0) if k == "cut_at_length_limit" else ("", None)
        return any(r.get(k) not in blank for r in rows)

    show = [i for i, k in enumerate(keys) if filled(k)]
    lines = [
        f"# {title}",
        "",
        "| " + " | ".join(headers[i] for i in show) + " |",
        "|" + "|".join("---" for _ in show) + "|",
    ]
    for r in rows:
        cells = []
        for i in show:
            v = r.get(keys[i])
            cells.append(f"{v:,}" if isinstance(v, int) else str(v if v is not None else ""))
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "AER: alignment error rate of the cross-attention (Transformer: average of all "
        "heads; 'best head': the head chosen on validation pairs) against the reference word "
        "alignments, over the target words that have a reference link. Lower is better. "
        "'AER all words' counts the target words without any reference link too, which no "
        "aligner gets right (a perfect one scores ~24% on the Bible test split, ~11% on "
        "dates).",
    ]
    if "cut_at_length_limit" in (keys[i] for i in show):
        lines += [
            "",
            "cut at limit: test translations that decoding stopped at the length limit "
            "(1.5 x (source tokens + 1) + 10), their text cut short.",
        ]
    atomic_write_text(out / "compare.md", "\n".join(lines) + "\n")
    try:
        from attnlab.translate.plot import compare_chart

        compare_chart(out / "compare.png", rows, title)
    except ModuleNotFoundError:
        pass


def _show_data(s: dict) -> str:
    return f"--data {s['data']}" if s["task"] == "tsv" else f"--task {s['task']}"


def _show(key: str, s: dict) -> str:
    if key == "budget":
        kind, value = s["budget"]
        return f"--{kind.replace('_', '-')} {value:g}"
    if key == "skip_bad_lines":
        return "--skip-bad-lines" if s[key] else "no --skip-bad-lines"
    value = s[key]
    return f"--{key.replace('_', '-')} {'(none)' if value is None else value}"


def resolve_settings(args: argparse.Namespace, recorded: dict | None) -> tuple[dict, list[str]]:
    """The settings of this comparison, and how they differ from ``recorded`` (a resume's).

    A setting the command line does not give is the recorded one (or the default).
    """
    from attnlab.translate.tasks import data_sha256

    given: dict = {}
    if args.data is not None:
        given.update(task="tsv", data=str(Path(args.data).resolve()))
    elif args.task is not None:
        given.update(task=args.task, data=None)
    if args.skip_bad_lines:
        given["skip_bad_lines"] = True
    for key in ("size", "seed", "beam_size", "eval_limit"):
        if getattr(args, key) is not None:
            given[key] = getattr(args, key)
    for key in BUDGETS:
        if getattr(args, key) is not None:
            given["budget"] = [key, getattr(args, key)]
    base = recorded or {"task": "bible", "data": None, "skip_bad_lines": False, **DEFAULTS}
    settings = {"eval_limit": None, **base, **given}
    if "budget" not in settings:  # a clock budget by default, shorter for the quick task
        settings["budget"] = ["time_budget", 2.0 if settings["task"] == "dates" else 10.0]
    settings["data_sha256"] = data_sha256(settings["data"]) if settings["task"] == "tsv" else None
    if recorded is None:
        return settings, []
    diffs = []
    if (settings["task"], settings["data"]) != (recorded.get("task"), recorded.get("data")):
        diffs.append(f"{_show_data(recorded)} (now {_show_data(settings)})")
    elif settings["data_sha256"] != recorded.get("data_sha256"):
        diffs.append(f"--data {settings['data']} (its contents changed since)")
    for key in ("skip_bad_lines", "size", "seed", "budget", "beam_size", "eval_limit"):
        if settings[key] != recorded.get(key):
            diffs.append(f"{_show(key, recorded)} (now {_show(key, settings)})")
    return settings, diffs


def _config_diffs(saved: dict, config: dict, run_dir: Path) -> list[str]:
    """How a variant's saved config.json differs from the one these settings give (the task's
    file, its digest and split rule aside: the file is compared by its bytes)."""
    from attnlab.translate.tasks import DATA_FILE, data_sha256

    diffs = []
    for section in ("task", "tokenizer", "model"):
        old, new = saved.get(section) or {}, config[section]
        for key in sorted((set(old) | set(new)) - {"path", "split", "data_sha256"}):
            if old.get(key) != new.get(key):
                diffs.append(f"{section}.{key} {old.get(key)} (now {new.get(key)})")
    old, new = saved.get("train") or {}, config["train"]
    for key in ("seed", "epochs", "cpu_seconds", "train_seconds", "max_steps"):
        if old.get(key) != new.get(key):
            diffs.append(f"train.{key} {old.get(key)} (now {new.get(key)})")
    if config["task"]["name"] == "tsv" and not diffs:
        if data_sha256(run_dir / DATA_FILE) != data_sha256(config["task"]["path"]):
            diffs.append(f"its {DATA_FILE} differs from --data {config['task']['path']}")
    return diffs


def main(args: argparse.Namespace) -> int:

    from attnlab.translate import checkpoint as ckpt
    from attnlab.translate.pipeline import (
        build_config,
        log,
        pick_device,
        place_data,
        read_results,
        resolve,
        train_run,
        train_tokenizer,
    )
    from attnlab.translate.report import final_report
    from attnlab.translate.tasks import LEGACY_SPLIT, load_task

    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown variant(s) {unknown}; choose from {', '.join(VARIANTS)}")
    if not variants:
        raise ValueError(
            f"--variants {args.variants!r} names none; choose from {', '.join(VARIANTS)}"
        )
    if len(set(variants)) < len(variants):
        raise ValueError(f"--variants {args.variants!r} names a variant twice; list each once")
    if sum(x is not None for x in (args.time_budget, args.epochs, args.cpu_budget)) > 1:
        raise ValueError(
            "give one of --time-budget, --cpu-budget and --epochs: the budget must be one thing"
        )
    task_name = "tsv" if args.data else (args.task or "bible")
    out = args.out or Path("runs") / f"compare-{task_name}"
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; pass a folder")
    if out.exists() and any(out.iterdir()) and not args.resume:
        raise ValueError(
            f"{out} is not empty; pass --resume to finish the comparison it holds, or "
            "choose another --out"
        )
    recorded = None
    if args.resume and (out / SETTINGS).is_file():
        try:
            recorded = json.loads((out / SETTINGS).read_text(encoding="utf-8"))
            if not isinstance(recorded, dict) or recorded.get("attnlab_compare") != 1:
                raise ValueError("not a comparison's settings")
        except ValueError as e:
            raise ValueError(
                f"--resume: {out / SETTINGS} is damaged ({e}); compare in a new --out"
            ) from None
    settings, diffs = resolve_settings(args, recorded)
    if diffs:
        raise ValueError(
            f"--resume: {out} holds a comparison with other settings: {'; '.join(diffs)}. Fix: "
            f"resume it with its own settings (leave them out: --resume reads them from "
            f"{out / SETTINGS}), or compare these settings in a new --out without --resume"
        )
    # the settings this command runs with, recorded or given
    args.task = settings["task"] if settings["task"] != "tsv" else None
    args.data = settings["data"]
    args.skip_bad_lines = settings["skip_bad_lines"] or None
    args.size, args.seed = settings["size"], settings["seed"]
    args.beam_size, args.eval_limit = settings["beam_size"], settings["eval_limit"]
    for key in BUDGETS:
        setattr(args, key, settings["budget"][1] if settings["budget"][0] == key else None)
    device = pick_device(args.device)
    base = {
        "task": args.task,
        "data": args.data,
        "skip_bad_lines": args.skip_bad_lines,
        "size": args.size,
        "seed": args.seed,
        "beam_size": args.beam_size,
    }
    task_name = settings["task"]
    minutes = args.time_budget
    # every variant's config is checked (model built on no memory) before anything is written
    configs = {}
    for variant in variants:
        model, attention = variant.split("-", 1)
        opts = resolve(
            {
                **base,
                "model": model,
                "attention": attention,
                "epochs": args.epochs,
                "cpu_budget": args.cpu_budget,
            }
        )
        config = build_config(opts)
        config["time_budget_minutes"] = None
        if minutes is not None:
            config["train"]["train_seconds"] = minutes * 60.0  # training only, same for all
        configs[variant] = config
    # A variant trained already must have been trained with these settings (a folder from
    # before compare-settings.json is checked by its variants' config.json alone).
    saved = {}
    for variant in variants:
        path = out / variant / ckpt.CONFIG
        if not path.is_file():
            continue
        try:
            saved[variant] = json.loads(path.read_text(encoding="utf-8"))
        except ValueError as e:
            raise ValueError(
                f"--resume: {path} is damaged ({e}); delete {out / variant} to train it again"
            ) from None
        differ = _config_diffs(saved[variant], configs[variant], out / variant)
        if differ:
            raise ValueError(
                f"--resume: {out / variant} was trained with other settings: "
                f"{'; '.join(differ)}. Fix: resume with the settings it was trained with, or "
                "compare these settings in a new --out without --resume"
            )
    if task_name == "tsv" and any("split" not in c.get("task", {}) for c in saved.values()):
        for config in configs.values():  # keep the split the first variants were trained on
            config["task"]["split"] = LEGACY_SPLIT
    # the same data for every variant, loaded once (bad data fails here, before --out is made)
    task = load_task(configs[variants[0]]["task"])
    out.mkdir(parents=True, exist_ok=True)
    if recorded is None:
        atomic_write_json(out / SETTINGS, {"attnlab_compare": 1, **settings})

    rows = []
    shared_tokenizer = out / ckpt.TOKENIZER
    if shared_tokenizer.is_file() and recorded is None and not saved:
        shared_tokenizer.unlink()  # left by an older attnlab for unknown settings: made again
    if args.epochs:
        budget_text = f"{args.epochs:g} epoch(s)"
    elif args.cpu_budget:
        budget_text = f"{args.cpu_budget:g} CPU-min of training"
    else:
        budget_text = f"{minutes:g} min of training"
    title = (
        f"Attention variants on {task_name}: {budget_text} each, size {args.size}, seed {args.seed}"
        + (f", scored on the first {args.eval_limit:,} test pairs" if args.eval_limit else "")
    )
    started_all = time.monotonic()
    for n, variant in enumerate(variants, 1):
        run_dir = out / variant
        done = read_results(run_dir)
        if args.resume and done.get("test"):
            log(f"[{n}/{len(variants)}] {variant}: done already")
            rows.append(_row(variant, done))
            continue
        # (the checkpoint its training resumes from: a damaged newer one is named and skipped)
        found = ckpt.intact_checkpoint(run_dir) if variant in saved else None
        resume = found is not None
        if resume:  # interrupted: continue from its checkpoint, with its saved config
            config = saved[variant]
            step = found[1]["step"]
            log(f"[{n}/{len(variants)}] {variant}: resuming its training at step {step}")
        else:
            log(f"[{n}/{len(variants)}] {variant}: training ({budget_text})")
            config = configs[variant]
            if run_dir.exists():  # no checkpoint: nothing was trained in it
                shutil.rmtree(run_dir)
            run_dir.mkdir(parents=True)
            if not shared_tokenizer.is_file():
                train_tokenizer(task, config).save(shared_tokenizer)
            shutil.copyfile(shared_tokenizer, run_dir / ckpt.TOKENIZER)
            place_data(config, run_dir)  # a run folder reads its pairs from itself only
            ckpt.atomic_write_json(run_dir / ckpt.CONFIG, config)
        _, _, task, state, dist = train_run(
            run_dir,
            config,
            resume=resume,
            device=device,
            threads=args.threads,
            progress_bar=not args.no_progress,
            task=task,
        )
        if not dist.main:
            continue
        if getattr(state, "interrupted", False):
            log(
                f"interrupted; finished variants and {variant}'s checkpoint are kept. Continue "
                f"with: attnlab compare --out {out} --resume"
            )
            return 130
        results = final_report(
            run_dir,
            task,
            state,
            beam_size=args.beam_size,
            eval_limit=args.eval_limit,
            quiet=True,
            device=device,
        )
        row = _row(variant, results)
        rows.append(row)
        log(
            f"    BLEU {row['bleu']}  chrF {row['chrf']}  "
            f"AER {row['aer_referenced']} (all target words {row['aer']})"
            + (f"  exact {row['exact_match']}%" if row["exact_match"] != "" else "")
        )
        write_table(out, rows, title)
    write_table(out, rows, title)
    atomic_write_json(out / "compare.json", rows)
    print((out / "compare.md").read_text(encoding="utf-8"))
    print(
        f"table: {out / 'compare.md'}, {out / 'compare.csv'}; chart: {out / 'compare.png'}; "
        f"runs: {out}/<variant>; {time.monotonic() - started_all:.0f} s in all"
    )
    return 0
