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

from attnlab.translate.models import MODELS, SIZES, TRANSFORMER_ATTENTIONS
from attnlab.translate.rnn import RNN_ATTENTIONS

EPILOG = """\
examples:
  attnlab train                                   # Bible en->es, RNN + Luong, 15 minutes
  attnlab train --task dates                      # dates -> ISO, RNN + Luong, 4 minutes
  attnlab train --model transformer --time-budget 60
  attnlab train --model rnn --attention luong-general --time-budget 30
  attnlab train --preset bible-long               # the long recipe (hours on 2 CPU cores)
  attnlab train --data pairs.tsv --skip-bad-lines # your own source<TAB>target pairs
  attnlab train --out runs/x --resume             # continue an interrupted run (Ctrl-C saves)
  torchrun --nproc-per-node 2 -m attnlab.cli train --epochs 1   # distributed (gloo / NCCL)
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from attnlab.translate.pipeline import PRESETS

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
        help="your own pairs: UTF-8 text, one 'source<TAB>target' per line",
    )
    g.add_argument(
        "--skip-bad-lines",
        action="store_true",
        default=None,
        help="with --data: drop malformed lines (they are listed) instead of stopping",
    )
    g.add_argument(
        "--train-size",
        type=int,
        default=None,
        help="dates: number of training pairs (default 20000)",
    )
    g.add_argument(
        "--tokenizer",
        choices=["bpe", "char"],
        default=None,
        help="subword BPE (default; char for dates)",
    )
    g.add_argument("--vocab-size", type=int, default=None, help="BPE vocabulary (default 8000)")
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
        help="rnn (bi-GRU encoder, GRU decoder) or transformer (default for bible)",
    )
    g.add_argument(
        "--attention",
        default=None,
        choices=sorted(set(RNN_ATTENTIONS) | set(TRANSFORMER_ATTENTIONS)),
        help="RNN: " + ", ".join(RNN_ATTENTIONS) + "; Transformer: multihead, gqa",
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
        ("--emb-dim", int, "RNN embedding width"),
        ("--hidden", int, "RNN hidden width"),
        ("--d-model", int, "Transformer width"),
        ("--heads", int, "attention heads (Transformer; RNN multihead)"),
        ("--kv-heads", int, "Transformer key/value heads (< heads: grouped-query attention)"),
        ("--d-ff", int, "Transformer feed-forward width"),
        ("--layers", int, "encoder (and Transformer decoder) layers"),
        ("--dropout", float, "dropout"),
    ):
        g.add_argument(name, type=kind, default=None, help=text)
    g = parser.add_argument_group("budget and optimisation")
    g.add_argument(
        "--time-budget",
        type=float,
        default=None,
        metavar="MIN",
        help="wall-clock minutes for the whole command, evaluation included "
        "(default 15 for bible, 4 for dates)",
    )
    g.add_argument(
        "--epochs", type=float, default=None, help="train this many epochs (alone: no time budget)"
    )
    g.add_argument("--max-steps", type=int, default=None, help="stop after this many steps")
    g.add_argument(
        "--cpu-budget",
        type=float,
        default=None,
        metavar="MIN",
        help="minutes of this process's CPU time for training (alone: no clock budget); "
        "the same work whatever else runs on the machine",
    )
    g.add_argument("--lr", type=float, default=None, help="peak learning rate")
    g.add_argument("--warmup", type=int, default=None, help="warm-up steps")
    g.add_argument(
        "--max-tokens", type=int, default=None, help="tokens per batch (padding included)"
    )
    g.add_argument(
        "--max-len",
        type=int,
        default=None,
        help="leave out training pairs longer than this many tokens (default 128)",
    )
    g.add_argument("--seed", type=int, default=None, help="random seed (default 1)")
    g = parser.add_argument_group("run")
    g.add_argument(
        "--out",
        type=Path,
        default=None,
        metavar="RUN_DIR",
        help="run directory (default runs/<task>-<model>-<attention>)",
    )
    g.add_argument(
        "--resume", action="store_true", help="continue the run in --out from its last checkpoint"
    )
    g.add_argument("--force", action="store_true", help="overwrite an existing run in --out")
    g.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default)")
    g.add_argument(
        "--threads", type=int, default=None, help="CPU threads (default: the cores idle now, >= 1)"
    )
    g.add_argument("--beam-size", type=int, default=None, help="beam for the test translation (4)")
    g.add_argument(
        "--eval-limit",
        type=int,
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
        "max_tokens",
        "max_len",
        "seed",
        "beam_size",
    )
    return {k: getattr(args, k, None) for k in keys}


def main(args: argparse.Namespace) -> int:
    started = time.monotonic()
    from attnlab.translate import checkpoint as ckpt
    from attnlab.translate.pipeline import (
        build_config,
        check_run_dir_free,
        default_run_dir,
        pick_device,
        prepare_run_dir,
        resolve,
        train_run,
    )
    from attnlab.translate.pipeline import log as log_all
    from attnlab.translate.run import read_config
    from attnlab.translate.tasks import load_task
    from attnlab.translate.trainer import init_distributed

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
    if args.resume:
        if args.out is None:
            raise ValueError("--resume needs the run to continue: --resume --out RUN_DIR")
        if args.force:
            raise ValueError("--resume continues a run and --force starts it over; pick one")
        config = read_config(args.out)
        given = [
            k
            for k, v in options_from_args(args).items()
            if v is not None
            and k not in ("time_budget", "epochs", "max_steps", "cpu_budget", "beam_size")
        ]
        if given:
            log(f"note: --resume uses the run's saved settings; ignoring {', '.join(given)}")
        if args.time_budget is not None:  # a new total budget: recompute the training share
            config["time_budget_minutes"] = args.time_budget
            config["train"].pop("train_seconds", None)
        for key in ("epochs", "max_steps"):
            if getattr(args, key) is not None:
                config["train"][key] = getattr(args, key)
        if args.cpu_budget is not None:
            config["train"]["cpu_seconds"] = args.cpu_budget * 60.0
        if args.beam_size:
            config.setdefault("decode", {})["beam_size"] = args.beam_size
        run_dir = args.out
        if ckpt.latest_checkpoint(run_dir) is None:
            log(f"note: {run_dir} has no checkpoint yet; starting its training from the beginning")
            args.resume = False
        if config.get("time_budget_minutes") and "train_seconds" in config["train"]:
            started = time.monotonic()  # the saved training share already excludes set-up
    else:
        opts = resolve(options_from_args(args))
        config = build_config(opts)
        task = load_task(config["task"])  # bad data fails here, before a run dir is made
        run_dir = Path(args.out or default_run_dir(config))
        check_run_dir_free(run_dir, force=args.force)  # every process, before any is changed
        barrier()
        if dist.main:
            prepare_run_dir(run_dir, resume=False, force=args.force)
    run_dir = Path(run_dir)
    if dist.main:
        ckpt.atomic_write_json(run_dir / ckpt.CONFIG, config)
    barrier()
    budget = config.get("time_budget_minutes")
    deadline = started + budget * 60 if budget else None
    log(f"run directory: {run_dir}")
    model, tokenizer, task, state, dist = train_run(
        run_dir,
        config,
        resume=args.resume,
        device=device,
        threads=args.threads,
        started=started,
        progress_bar=not args.no_progress,
        task=task,
    )
    if not dist.main:
        return 0
    if getattr(state, "interrupted", False):
        log(
            f"interrupted after step {state.step}; checkpoint saved. Continue with:\n"
            f"  attnlab train --out {run_dir} --resume"
        )
        return 130
    from attnlab.translate.report import final_report

    final_report(
        run_dir,
        task,
        state,
        beam_size=args.beam_size,
        eval_limit=args.eval_limit,
        deadline=deadline,
        quiet=False,
        progress=not args.no_progress,
    )
    log(f"total wall time {time.monotonic() - started:.0f} s")
    return 0
