"""From options to a trained, evaluated run directory: what ``attnlab train`` and
``attnlab compare`` do, as functions.

Settings are resolved in this order (later wins): the task's defaults, the model's defaults, a
``--preset``, then the options given explicitly.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch

from attnlab.translate import checkpoint as ckpt
from attnlab.translate.models import build_model, count_parameters, model_config
from attnlab.translate.tasks import load_task, task_spec
from attnlab.translate.tokenizer import Tokenizer
from attnlab.translate.trainer import TrainOptions, fit, init_distributed

# What each task trains by default (a plain `attnlab train` is the first row). For 15 minutes
# of CPU the RNN with Luong attention learns fastest: its decoder GRU and its attention each run
# over all target positions at once (no step-by-step loop in training). At 20 CPU-minutes on
# the Bible it reached BLEU 20.1 where Bahdanau's step-by-step decoder reached 7.9; the
# Transformer needs more time (`--preset bible-long`).
TASK_DEFAULTS = {
    "bible": {
        "model": "rnn",
        "attention": "luong-general",
        "size": "small",
        "tokenizer": "bpe",
        "vocab_size": 8000,
        "time_budget": 15.0,
    },
    "dates": {
        "model": "rnn",
        "attention": "luong-general",
        "size": "small",
        "tokenizer": "char",
        "time_budget": 4.0,
        "max_tokens": 1024,
    },
    "tsv": {
        "model": "transformer",
        "size": "small",
        "tokenizer": "bpe",
        "vocab_size": 8000,
        "time_budget": 15.0,
    },
}
# Small batches, many steps: with minutes to hours of CPU, more updates of fewer tokens learn
# faster (at 6 CPU-minutes on the Bible, 1,536-token batches at lr 2e-3 reached a validation
# loss of 4.79 where 4,096-token batches at lr 1e-3 reached 5.54).
MODEL_DEFAULTS = {
    "transformer": {"lr": 2e-3, "warmup": 200, "max_tokens": 1536, "label_smoothing": 0.1},
    "rnn": {"lr": 2e-3, "warmup": 200, "max_tokens": 1536, "label_smoothing": 0.1},
}
# Named recipes; every key is an option of `attnlab train`.
PRESETS = {
    "bible-long": {
        # A Transformer of 7.5M parameters for 5 hours or 30 epochs, whichever ends first
        # (an epoch costs about 13 minutes of one CPU core).
        "task": "bible",
        "model": "transformer",
        "size": "base",
        "layers": 3,
        "time_budget": 300.0,
        "epochs": 30.0,
        "vocab_size": 8000,
        "lr": 1.5e-3,
        "warmup": 800,
        "max_tokens": 2048,
    },
    "dates": {"task": "dates", "model": "rnn", "attention": "luong-general", "size": "small"},
}
MODEL_OPTIONS = (
    "emb_dim",
    "hidden",
    "d_model",
    "heads",
    "kv_heads",
    "d_ff",
    "enc_layers",
    "dec_layers",
    "dropout",
)
TRAIN_OPTIONS = (
    "lr",
    "warmup",
    "max_tokens",
    "label_smoothing",
    "max_len",
    "seed",
    "weight_decay",
    "clip",
    "max_steps",
)


def resolve(options: dict) -> dict:
    """Merge defaults, preset and explicit options (``None`` = not given) into one dict."""
    explicit = {k: v for k, v in options.items() if v is not None}
    preset = {}
    if explicit.get("preset"):
        if explicit["preset"] not in PRESETS:
            raise ValueError(
                f"unknown preset {explicit['preset']!r}; expected one of {list(PRESETS)}"
            )
        preset = PRESETS[explicit["preset"]]
    task = explicit.get("task") or preset.get("task")
    if explicit.get("data"):
        if explicit.get("task") not in (None, "tsv"):
            raise ValueError(
                f"--data gives your own pairs, so --task {explicit['task']} does not apply; "
                "drop one of them"
            )
        task = "tsv"
    task = task or "bible"
    merged = dict(TASK_DEFAULTS[task])
    model = explicit.get("model") or preset.get("model") or merged["model"]
    if model != merged["model"]:  # another model than the task's default: drop its attention
        merged.pop("attention", None)
    for key, value in MODEL_DEFAULTS[model].items():
        if key not in TASK_DEFAULTS[task]:  # a task's own setting (dates: small batches) wins
            merged[key] = value
    merged.update(preset)
    merged.update(explicit)
    merged["task"], merged["model"] = task, model
    by_count = "epochs" in explicit or "max_steps" in explicit or "cpu_budget" in explicit
    if by_count and "time_budget" not in explicit and "time_budget" not in preset:
        merged["time_budget"] = None  # --epochs / --max-steps alone: no clock
    if merged.get("tiny"):
        merged["size"] = "tiny"
    return merged


def build_config(o: dict) -> dict:
    """The run's config.json from resolved options."""
    spec = task_spec(
        o["task"] if not o.get("data") else None,
        o.get("data"),
        bool(o.get("skip_bad_lines")),
        o.get("train_size"),
    )
    if o["model"] == "rnn" and o.get("kv_heads"):
        raise ValueError("--kv-heads (grouped-query attention) applies to --model transformer only")
    overrides = {k: o.get(k) for k in MODEL_OPTIONS}
    if overrides.get("enc_layers") is None and o.get("layers") is not None:
        overrides["enc_layers"] = o["layers"]
        if o["model"] == "transformer":
            overrides["dec_layers"] = o["layers"]
    if o["model"] == "rnn":
        for k in ("d_model", "d_ff", "dec_layers", "kv_heads"):
            overrides.pop(k, None)
    else:
        for k in ("emb_dim", "hidden"):
            overrides.pop(k, None)
    model = model_config(o["model"], o.get("attention"), o.get("size", "small"), **overrides)
    train = {k: o[k] for k in TRAIN_OPTIONS if o.get(k) is not None}
    if o.get("epochs") is not None:
        train["epochs"] = o["epochs"]
    if o.get("cpu_budget") is not None:
        train["cpu_seconds"] = o["cpu_budget"] * 60.0
    return {
        "attnlab_run": 1,
        "task": spec,
        "tokenizer": {"kind": o.get("tokenizer") or "bpe", "vocab_size": o.get("vocab_size", 8000)},
        "model": model,
        "train": train,
        "time_budget_minutes": o.get("time_budget"),
        "decode": {"beam_size": o.get("beam_size") or 4, "length_penalty": 0.6},
    }


def default_run_dir(config: dict) -> Path:
    m = config["model"]
    return Path("runs") / f"{config['task']['name']}-{m['kind']}-{m['attention']}"


RUN_FILES = (ckpt.CONFIG, ckpt.TOKENIZER, ckpt.WEIGHTS, ckpt.RESULTS, "train.log", "attention.png")


def check_run_dir_free(run_dir: Path, *, force: bool) -> None:
    """Raise unless a new run may start in ``run_dir`` (read-only: every process calls it)."""
    if (run_dir / ckpt.CONFIG).exists() and not force:
        raise ValueError(
            f"{run_dir} already holds a run; continue it with --resume, start it over with "
            "--force, or choose another --out"
        )
    if run_dir.exists() and not run_dir.is_dir():
        raise ValueError(f"--out {run_dir} is a file; pass a folder")


def prepare_run_dir(run_dir: Path, *, resume: bool, force: bool) -> None:
    """Make ``run_dir`` ready for a new run (``--force``: remove the old run's files)."""
    if resume:
        return
    check_run_dir_free(run_dir, force=force)
    if (run_dir / ckpt.CONFIG).exists():
        for name in RUN_FILES:
            (run_dir / name).unlink(missing_ok=True)
        shutil.rmtree(run_dir / ckpt.CHECKPOINTS, ignore_errors=True)
    run_dir.mkdir(parents=True, exist_ok=True)


def pick_device(name: str | None) -> str:
    if name in (None, "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA GPU is visible to torch here; use --device cpu")
    if name != "cpu" and not name.startswith("cuda"):
        raise ValueError(f"--device must be cpu, cuda, cuda:N or auto; got {name!r}")
    return name


def log(msg: str = "") -> None:
    print(msg, file=sys.stderr, flush=True)


def train_run(
    run_dir: Path,
    config: dict,
    *,
    resume: bool = False,
    device: str = "cpu",
    threads: int | None = None,
    started: float | None = None,
    eval_reserve: float | None = None,
    progress_bar: bool = True,
    stop_at_step: int | None = None,
    task=None,
):
    """Train (or continue) the run in ``run_dir``; returns ``(model, tokenizer, task, state)``.

    ``started``: the command's start time (``time.monotonic()``), so that a time budget counts
    everything (data, tokenizer, training, evaluation). ``eval_reserve``: seconds kept for the
    evaluation after training.
    """
    started = time.monotonic() if started is None else started
    dist = init_distributed(device)
    if device.startswith("cuda") and dist.active:
        device = f"cuda:{dist.local_rank}"
        torch.cuda.set_device(device)
    threads = threads or default_threads()
    torch.set_num_threads(threads)

    task = task or load_task(config["task"])
    tok_path = run_dir / ckpt.TOKENIZER
    if dist.main and not tok_path.is_file():
        t0 = time.monotonic()
        tokenizer = train_tokenizer(task, config)
        tokenizer.save(tok_path)
        log(
            f"tokenizer: {tokenizer.kind}, {tokenizer.vocab_size:,} symbols, trained in "
            f"{time.monotonic() - t0:.1f} s on {len(task.train):,} training pairs"
        )
    if dist.active:
        import torch.distributed as tdist

        tdist.barrier()
    tokenizer = Tokenizer.load(tok_path)

    from attnlab.translate.batching import encode_pairs

    opts = TrainOptions.from_dict(config["train"])
    train_data, dropped = encode_pairs(tokenizer, task.train, opts.max_len)
    val_data, _ = encode_pairs(tokenizer, task.validation, opts.max_len)
    if dropped and dist.main:
        log(f"note: {dropped} training pair(s) longer than {opts.max_len} tokens left out")
    torch.manual_seed(opts.seed)
    model = build_model(config["model"], tokenizer.vocab_size).to(device)
    if dist.main:
        m = config["model"]
        log(
            f"model: {m['kind']} with {m['attention']} attention, "
            f"{count_parameters(model):,} parameters; device {device}, {threads} thread(s)"
            + (f", {dist.world} processes" if dist.active else "")
        )
    budget = config.get("time_budget_minutes")
    if budget:
        if "train_seconds" not in config["train"]:
            reserve = eval_reserve if eval_reserve is not None else default_reserve(budget)
            spent = time.monotonic() - started
            config["train"]["train_seconds"] = max(1.0, budget * 60 - spent - reserve)
            if dist.main:
                ckpt.atomic_write_json(run_dir / ckpt.CONFIG, config)
        opts.train_seconds = config["train"]["train_seconds"]
    state = fit(
        model,
        train_data,
        val_data,
        opts,
        run_dir,
        device=device,
        resume=resume,
        dist=dist,
        progress_bar=progress_bar and dist.main,
        stop_at_step=stop_at_step,
    )
    if dist.main and not getattr(state, "interrupted", False):
        ckpt.save_tensors(run_dir / ckpt.WEIGHTS, ckpt.model_state(model))
    return model, tokenizer, task, state, dist


def train_tokenizer(task, config: dict) -> Tokenizer:
    """The run's vocabulary, trained on both sides of the task's training split."""
    texts = [p.source for p in task.train] + [p.target for p in task.train]
    return Tokenizer.train(texts, config["tokenizer"]["kind"], config["tokenizer"]["vocab_size"])


def add_run_arguments(parser) -> None:
    """The options of the commands that use a trained run: RUN_DIR, beam, device, threads."""
    parser.add_argument(
        "run_dir", type=Path, metavar="RUN_DIR", help="a folder written by attnlab train"
    )
    parser.add_argument(
        "--beam-size",
        "-b",
        type=int,
        default=None,
        help="beam width (1 = greedy; default: the run's, 4)",
    )
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument(
        "--threads", type=int, default=None, help="CPU threads (default: the idle cores, >= 1)"
    )


def open_run(args):
    """The :class:`~attnlab.translate.run.Translator` that :func:`add_run_arguments` names."""
    from attnlab.translate.run import load_run

    if args.beam_size is not None and args.beam_size < 1:
        raise ValueError(
            f"--beam-size must be >= 1, got {args.beam_size}; fix: --beam-size 1 or more"
        )
    torch.set_num_threads(args.threads or default_threads())
    return load_run(args.run_dir, device=args.device)


def default_threads() -> int:
    """CPU threads: the cores other processes leave idle right now, shared among this machine's
    training processes, at least 1.

    On a busy machine, more OpenMP threads than idle cores is much slower than one thread: the
    threads of a parallel region wait for each other while the OS runs someone else. "Right
    now" is a 0.2 s sample of ``/proc/stat`` on Linux (the load average lags by a minute, so
    it would still count an install that just finished); elsewhere the load average.
    """
    cores = os.cpu_count() or 1
    busy = _busy_cores(cores)
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    idle = int(cores - busy + 0.5)
    return max(1, min(cores, idle) // per_node)


def _busy_cores(cores: int, interval: float = 0.2) -> float:
    """How many cores other processes keep busy: a /proc/stat sample, else the load average."""

    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        return sum(fields[:8]), idle

    try:
        total0, idle0 = sample()
        time.sleep(interval)
        total1, idle1 = sample()
        if total1 > total0:
            return cores * (1.0 - (idle1 - idle0) / (total1 - total0))
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.getloadavg()[0]
    except OSError:  # pragma: no cover - no load average on this platform
        return 0.0


def default_reserve(budget_minutes: float) -> float:
    """Seconds of a time budget kept for the final evaluation (decode test split, AER, plot)."""
    return min(120.0, max(4.0, 0.1 * budget_minutes * 60))


def write_results(run_dir: Path, results: dict) -> None:
    ckpt.atomic_write_json(run_dir / ckpt.RESULTS, results)


def read_results(run_dir: Path) -> dict:
    path = run_dir / ckpt.RESULTS
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
