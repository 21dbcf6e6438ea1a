"""``attnlab train``: train a translator with attention, then score it on the held-out test split.

With no options it trains the default model (a GRU encoder-decoder with Luong attention) on the
embedded English -> Spanish Bible corpus within 15 minutes of wall-clock time on a 2-core CPU,
everything included, prints BLEU / chrF / alignment error rate, a few translations, writes an
attention heatmap and says how to use the model. The same command under
``torchrun --nproc-per-node N`` trains with DistributedDataParallel.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from attnlab.translate.settings import (
    MODELS,
    PRESETS,
    RNN_ATTENTIONS,
    SIZES,
    TRANSFORMER_ATTENTIONS,
)

EPILOG = """\
examples:
  attnlab train                                   # Bible en->es, RNN + Luong, 15 minutes
  attnlab train --task dates                      # dates -> ISO, RNN + Luong, 4 minutes
  attnlab train --model transformer --time-budget 60
  attnlab train --model rnn --attention luong-general --time-budget 30
  attnlab train --preset bible-long               # the long recipe (hours on 2 CPU cores)
  attnlab train --data pairs.tsv --skip-bad-lines # your own source<TAB>target pairs
  attnlab train --out runs/x --resume             # continue an interrupted run (Ctrl-C saves)
  attnlab train --out runs/x --resume --more-minutes 10   # train a finished run 10 min more
  torchrun --nproc-per-node 2 -m attnlab.cli train --epochs 1   # distributed (gloo / NCCL)
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from attnlab.cli import (
        device_name,
        fraction,
        non_negative_float,
        non_negative_int,
        positive_float,
        positive_int,
        seed_int,
        thread_count,
        tokens_or_auto,
    )

    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EPILOG
    g = parser.add_argument_group("data")
    g.add_argument(
        "--task",
        choices=["bible", "dates"],
        default=None,
        help="embedded task: bible (English->Spanish verses, default) or dates "
        "(human dates -> ISO)",
    )
    g.add_argument(
        "--data",
        metavar="FILE",
        default=None,
        help="your own pairs: UTF-8 text, one 'source<TAB>target' per line (copied into the "
        "run folder as data.tsv)",
    )
    g.add_argument(
        "--skip-bad-lines",
        action="store_true",
        default=None,
        help="with --data: drop malformed lines (they are listed) instead of stopping",
    )
    g.add_argument(
        "--train-size",
        type=positive_int,
        default=None,
        metavar="N",
        help="dates: number of training pairs (default 20000)",
    )
    g.add_argument(
        "--tokenizer",
        choices=["bpe", "char"],
        default=None,
        help="subword BPE (default; char for dates)",
    )
    g.add_argument(
        "--vocab-size", type=positive_int, default=None, help="BPE vocabulary (default 8000)"
    )
    g = parser.add_argument_group("model")
    g.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default=None,
        help="a named recipe (bible-long: beats the rule-based Apertium baseline)",
    )
    g.add_argument(
        "--model",
        choices=MODELS,
        default=None,
        help="rnn (bi-GRU encoder, GRU decoder; the default, for every task and for --data) "
        "or transformer",
    )
    g.add_argument(
        "--attention",
        default=None,
        choices=sorted(set(RNN_ATTENTIONS) | set(TRANSFORMER_ATTENTIONS)),
        help="RNN: "
        + ", ".join(RNN_ATTENTIONS)
        + " (default luong-general); Transformer: "
        + ", ".join(TRANSFORMER_ATTENTIONS)
        + " (default multihead)",
    )
    g.add_argument(
        "--size", choices=list(SIZES["rnn"]), default=None, help="model size (default small)"
    )
    g.add_argument(
        "--tiny",
        action="store_true",
        default=None,
        help="a tiny model (same as --size tiny): smoke tests",
    )
    for name, kind, text in (
        ("--emb-dim", positive_int, "RNN embedding width"),
        ("--hidden", positive_int, "RNN hidden width"),
        ("--d-model", positive_int, "Transformer width"),
        ("--heads", positive_int, "attention heads (Transformer; RNN multihead)"),
        (
            "--kv-heads",
            positive_int,
            "Transformer key/value heads (< heads: grouped-query attention)",
        ),
        ("--d-ff", positive_int, "Transformer feed-forward width"),
        ("--layers", positive_int, "encoder (and Transformer decoder) layers"),
        ("--dropout", fraction, "dropout, in [0, 1)"),
    ):
        g.add_argument(name, type=kind, default=None, help=text)
    g = parser.add_argument_group("budget and optimisation")
    g.add_argument(
        "--time-budget",
        type=positive_float,
        default=None,
        metavar="MIN",
        help="wall-clock minutes for the whole command, evaluation included "
        "(default 15 for bible, 4 for dates); with --resume use --more-minutes",
    )
    g.add_argument(
        "--epochs",
        type=positive_float,
        default=None,
        help="train this many epochs (alone: no time budget)",
    )
    g.add_argument(
        "--max-steps", type=positive_int, default=None, help="stop after this many steps"
    )
    g.add_argument(
        "--cpu-budget",
        type=positive_float,
        default=None,
        metavar="MIN",
        help="minutes of this process's CPU time for training (alone: no clock budget); "
        "the same work whatever else runs on the machine",
    )
    g.add_argument("--lr", type=positive_float, default=None, help="peak learning rate")
    g.add_argument("--warmup", type=non_negative_int, default=None, help="warm-up steps")
    g.add_argument(
        "--clip",
        type=non_negative_float,
        default=None,
        metavar="NORM",
        help="clip the gradient's norm to this (default 1.0; 0: no clipping)",
    )
    g.add_argument(
        "--max-tokens",
        type=tokens_or_auto,
        default=None,
        metavar="N|auto",
        help="tokens per batch (padding included); auto: sized from the GPU's free memory by "
        "a probe step (the default on CUDA; on CPU auto is the model's default)",
    )
    g.add_argument(
        "--precision",
        choices=["auto", "fp32", "bf16"],
        default=None,
        help="bf16: forward and loss under bfloat16 autocast (weights and optimizer stay "
        "float32); auto (default): bf16 on a CUDA GPU that supports it, fp32 elsewhere",
    )
    g.add_argument(
        "--max-len",
        type=positive_int,
        default=None,
        help="leave out training and validation pairs of this many tokens or more (default 128)",
    )
    g.add_argument("--seed", type=seed_int, default=None, help="random seed (default 1)")
    g = parser.add_argument_group("run")
    g.add_argument(
        "--out",
        type=Path,
        default=None,
        metavar="RUN_DIR",
        help="run directory (default runs/<task>-<model>-<attention>)",
    )
    g.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in --out from its last checkpoint (to its saved budget, or "
        "for --more-minutes / --more-epochs / --more-steps)",
    )
    g.add_argument(
        "--more-minutes",
        type=positive_float,
        default=None,
        metavar="MIN",
        help="with --resume: train MIN more minutes than the checkpoint has (training only)",
    )
    g.add_argument(
        "--more-epochs",
        type=positive_float,
        default=None,
        metavar="N",
        help="with --resume: train N more epochs than the checkpoint has",
    )
    g.add_argument(
        "--more-steps",
        type=positive_int,
        default=None,
        metavar="N",
        help="with --resume: train N more steps than the checkpoint has",
    )
    g.add_argument(
        "--checkpoint-every",
        type=positive_float,
        default=None,
        metavar="MIN",
        help="minutes of training between checkpoints (default 2): a crash loses at most this",
    )
    g.add_argument("--force", action="store_true", help="overwrite an existing run in --out")
    g.add_argument(
        "--device",
        type=device_name,
        default="auto",
        help="cpu, cuda, cuda:N or auto (default)",
    )
    g.add_argument(
        "--threads",
        type=thread_count,
        default=None,
        help="CPU threads, at most 4 per core (default: the cores idle now, >= 1)",
    )
    g.add_argument(
        "--beam-size", type=positive_int, default=None, help="beam for the test translation (4)"
    )
    g.add_argument(
        "--eval-limit",
        type=positive_int,
        default=None,
        metavar="N",
        help="evaluate on the first N test pairs only",
    )
    g.add_argument("--no-progress", action="store_true", help="no progress bars")


def options_from_args(args: argparse.Namespace) -> dict:
    keys = (
        "task",
        "data",
        "skip_bad_lines",
        "train_size",
        "tokenizer",
        "vocab_size",
        "preset",
        "model",
        "attention",
        "size",
        "tiny",
        "emb_dim",
        "hidden",
        "d_model",
        "heads",
        "kv_heads",
        "d_ff",
        "layers",
        "dropout",
        "time_budget",
        "epochs",
        "max_steps",
        "cpu_budget",
        "lr",
        "warmup",
        "clip",
        "max_tokens",
        "precision",
        "max_len",
        "seed",
        "beam_size",
        "checkpoint_every",
    )
    return {k: getattr(args, k, None) for k in keys}


# Budgets of a new run; with --resume the --more-* options say how much to add.
TOTAL_BUDGETS = ("time_budget", "epochs", "max_steps", "cpu_budget")
MORE_BUDGETS = ("more_minutes", "more_epochs", "more_steps")


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def check_budget_options(args: argparse.Namespace) -> None:
    """Refuse budget options that would do nothing, or something else than they seem to."""
    more = [k for k in MORE_BUDGETS if getattr(args, k, None) is not None]
    if more and not args.resume:
        raise ValueError(
            f"{_flag(more[0])} adds to a run that already trained: pass --resume --out RUN_DIR "
            f"too, or give a new run its budget with --time-budget / --epochs / --max-steps"
        )
    if args.resume and args.time_budget is not None:
        raise ValueError(
            f"--time-budget {args.time_budget:g} with --resume is ambiguous (the total of all "
            f"sessions, or more?); to train {args.time_budget:g} more minutes pass "
            f"--more-minutes {args.time_budget:g}"
        )


def done_so_far(state: dict) -> dict:
    """What a checkpoint's ``state.json`` says was trained: steps, seconds, CPU seconds, epochs.

    The exact epoch fraction is the state's ``epochs_done`` (written with every checkpoint), or
    in the last validation record when it was taken at the checkpoint's step; else (a periodic
    checkpoint of an older run) whole epochs are counted.
    """
    history = state.get("history") or []
    epochs = float(state.get("epoch", 0))
    if history and history[-1].get("step") == state.get("step"):
        epochs = float(history[-1].get("epoch", epochs))
    # (older runs wrote epochs_done at the end of a session only: never more than the truth)
    epochs = max(epochs, float(state.get("epochs_done") or 0.0))
    return {
        "steps": int(state.get("step", 0)),
        "seconds": float(state.get("elapsed", 0.0)),
        "cpu_seconds": float(state.get("cpu_seconds", 0.0)),
        "epochs": epochs,
    }


def budget_reached(train: dict, done: dict) -> str | None:
    """Which of the saved budgets the checkpoint has used up (None: training is unfinished)."""
    if train.get("max_steps") and done["steps"] >= train["max_steps"]:
        return f"{train['max_steps']} steps"
    if train.get("epochs") and done["epochs"] >= train["epochs"] - 1e-6:
        return f"{train['epochs']:g} epoch(s)"
    if train.get("train_seconds") and done["seconds"] >= train["train_seconds"]:
        return f"{train['train_seconds'] / 60:.2f} minutes of training"
    if train.get("cpu_seconds") and done["cpu_seconds"] >= train["cpu_seconds"]:
        return f"{train['cpu_seconds'] / 60:.2f} CPU-minutes of training"
    return None


def resume_budget(args: argparse.Namespace, config: dict, done: dict, run_dir: Path) -> bool:
    """Set the budget of a resumed run in ``config``; True when the options gave a new one.

    ``--more-*`` count from the checkpoint; ``--max-steps``, ``--epochs`` and ``--cpu-budget``
    are totals of all sessions and must exceed what was done. A new budget replaces the saved
    one (and the whole-command clock of the first session). Without one, the saved budget
    stands, and a run that used it up is refused: resuming it would add nothing.
    """
    train = config["train"]
    new = {}
    if args.more_minutes is not None:
        new["train_seconds"] = done["seconds"] + args.more_minutes * 60.0
    if args.more_epochs is not None:
        new["epochs"] = done["epochs"] + args.more_epochs
    if args.more_steps is not None:
        new["max_steps"] = done["steps"] + args.more_steps
    totals = (
        ("max_steps", args.max_steps, done["steps"], "steps", "--more-steps N"),
        ("epochs", args.epochs, done["epochs"], "epochs", "--more-epochs N"),
        (
            "cpu_seconds",
            None if args.cpu_budget is None else args.cpu_budget * 60.0,
            done["cpu_seconds"],
            "CPU seconds",
            "--more-minutes MIN",
        ),
    )
    for key, value, already, unit, more in totals:
        if value is None:
            continue
        if value <= already + 1e-9:
            flag = "--cpu-budget" if key == "cpu_seconds" else _flag(key)
            given = args.cpu_budget if key == "cpu_seconds" else value
            raise ValueError(
                f"{flag} {given:g} is a total, and the checkpoint in {run_dir} has already "
                f"trained {already:g} {unit}: it would add nothing; to train more pass {more}"
            )
        new[key] = value
    if not new:
        reached = budget_reached(train, done)
        from attnlab.translate.checkpoint import RESULTS

        if reached and not (run_dir / RESULTS).is_file():
            return False  # trained, but stopped in its final evaluation: --resume finishes it
        if reached:
            raise ValueError(
                f"{run_dir} has already trained its whole budget ({reached}, step "
                f"{done['steps']}); to train longer pass --more-minutes MIN, --more-epochs N "
                "or --more-steps N"
            )
        return False
    for key in ("train_seconds", "epochs", "max_steps", "cpu_seconds"):
        train.pop(key, None)
    train.update(new)
    config["time_budget_minutes"] = None  # the first session's whole-command clock is over
    return True


def main(args: argparse.Namespace) -> int:
    started = time.monotonic()
    from attnlab.translate import checkpoint as ckpt
    from attnlab.translate.pipeline import (
        build_config,
        check_run_dir_free,
        data_in_run_dir,
        default_run_dir,
        discard_new_run,
        pick_device,
        place_data,
        prepare_run_dir,
        read_run_config,
        resolve,
        train_run,
    )
    from attnlab.translate.pipeline import log as log_all
    from attnlab.translate.run import describe_budget
    from attnlab.translate.tasks import DATA_FILE, load_task, run_task
    from attnlab.translate.trainer import init_distributed

    check_budget_options(args)
    if args.resume:
        if args.out is None:
            raise ValueError("--resume needs the run to continue: --resume --out RUN_DIR")
        if args.force:
            raise ValueError("--resume continues a run and --force starts it over; pick one")
    device = pick_device(args.device)
    # Under torchrun every process runs this; only process 0 writes the run directory.
    dist = init_distributed(device)

    def log(msg: str) -> None:
        if dist.main:
            log_all(msg)

    def barrier() -> None:
        if dist.active:
            import torch.distributed

            torch.distributed.barrier()

    task = None
    start_step = 0
    new_run = not args.resume  # (a resumed run without a checkpoint trains from step 0)
    created, keep = False, ()  # a new run: whether it made run_dir; files it must not remove
    new_budget = finishing = False  # finishing: a trained run whose evaluation was cut short
    if args.resume:
        run_dir = Path(args.out)
        config = read_run_config(run_dir)
        task = run_task(run_dir, config["task"])  # data from the run folder or attnlab only
        given = [
            k
            for k, v in options_from_args(args).items()
            if v is not None and k not in (*TOTAL_BUDGETS, "beam_size", "checkpoint_every")
        ]
        if given:
            log(f"note: --resume uses the run's saved settings; ignoring {', '.join(given)}")
        if args.checkpoint_every is not None:
            config["train"]["checkpoint_seconds"] = args.checkpoint_every * 60.0
        if args.beam_size:
            config.setdefault("decode", {})["beam_size"] = args.beam_size
        # the checkpoint training will resume from: the newest that reads intact (a damaged
        # newer one is named and skipped); every one damaged raises, naming the first
        found = ckpt.intact_checkpoint(run_dir, quiet=not dist.main)
        if found is None:
            log(f"note: {run_dir} has no checkpoint yet; starting its training from the beginning")
            args.resume = False
            done = done_so_far({})
        else:
            done = done_so_far(found[1])
        new_budget = resume_budget(args, config, done, run_dir)
        finishing = not new_budget and bool(budget_reached(config["train"], done))
        start_step = done["steps"]
        if (
            not new_budget
            and config.get("time_budget_minutes")
            and "train_seconds" in config["train"]
        ):
            started = time.monotonic()  # the saved training share already excludes set-up
    else:
        if device.startswith("cuda") and args.max_tokens is None:
            args.max_tokens = "auto"  # the CPU default would keep a large GPU idle
        opts = resolve(options_from_args(args))
        config = build_config(opts, device)  # every setting checked; the model built on no memory
        task = load_task(config["task"])  # bad data fails here, before a run dir is made
        run_dir = Path(args.out or default_run_dir(config))
        # every process, before any is changed
        check_run_dir_free(run_dir, force=args.force, config=config)
        created = not run_dir.exists()
        keep = (DATA_FILE,) if data_in_run_dir(config, run_dir) else ()  # --data RUN/data.tsv
        barrier()
        if dist.main:
            prepare_run_dir(run_dir, resume=False, force=args.force, config=config)
            try:
                place_data(config, run_dir)
                ckpt.atomic_write_json(run_dir / ckpt.CONFIG, config)
            except OSError as e:  # a read-only folder, a full disk
                discard_new_run(run_dir, created, keep)
                raise ValueError(
                    f"--out {run_dir}: cannot write the run's files there "
                    f"({e.strerror or e}); choose a writable --out"
                ) from None
    # A resumed run's config.json (its new budget) is written by train_run once its checkpoint
    # has been read and checked: a resume that fails before training leaves the run as it was.
    barrier()
    budget = config.get("time_budget_minutes")
    deadline = started + budget * 60 if budget else None
    log(f"run directory: {run_dir}")
    resumed = args.resume
    if resumed:
        budget_words = describe_budget(config["train"])
        log(f"resuming at step {start_step}; the budget: {budget_words}")
    try:
        model, tokenizer, task, state, dist = train_run(
            run_dir,
            config,
            resume=args.resume,
            device=device,
            threads=args.threads,
            started=started,
            progress_bar=not args.no_progress,
            task=task,
            save_config=not new_run,
        )
    except Exception:
        # A new run that fails before its first checkpoint (training data that --max-len
        # empties, a model the allocator refuses) holds nothing worth keeping, and its
        # config.json would refuse the corrected command: what this command wrote goes.
        # Never a resumed run's files (its config.json and data.tsv are the run).
        if new_run and dist.main and ckpt.latest_checkpoint(run_dir) is None:
            discard_new_run(run_dir, created, keep)
        raise
    if not dist.main:
        return 0
    if getattr(state, "interrupted", False):
        log(
            f"interrupted after step {state.step}; checkpoint saved. Continue with:\n"
            f"  attnlab train --out {run_dir} --resume"
        )
        return 130
    if new_run and state.step == 0:
        log(
            "warning: nothing was trained: the budget ended before the first step, so the "
            "scores below are those of an untrained model. Fix: a larger --epochs / "
            f"--cpu-budget / --time-budget, or train on with: attnlab train --out {run_dir} "
            "--resume --more-steps N"
        )
    if resumed and finishing:
        log(f"training was complete at step {state.step}; finishing its evaluation")
    elif resumed:
        added = state.step - start_step
        log(
            f"resume added {added} step(s): step {start_step} -> {state.step}"
            + ("" if added else " (warning: nothing was trained; see the budget above)")
        )
    from attnlab.translate.report import final_report

    try:
        final_report(
            run_dir,
            task,
            state,
            beam_size=args.beam_size,
            eval_limit=args.eval_limit,
            deadline=deadline,
            quiet=False,
            progress=not args.no_progress,
            device=device,
        )
    except KeyboardInterrupt:
        log(
            f"interrupted during the final evaluation; training is complete and saved. "
            f"Finish it with:\n  attnlab train --out {run_dir} --resume"
        )
        return 130
    log(f"total wall time {time.monotonic() - started:.0f} s")
    return 0
