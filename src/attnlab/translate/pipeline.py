"""From options to a trained, evaluated run directory: what ``attnlab train`` and
``attnlab compare`` do, as functions.

Settings are resolved in this order (later wins): the task's defaults, the model's defaults, a
``--preset``, then the options given explicitly.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

import torch

from attnlab.translate import checkpoint as ckpt
from attnlab.translate import gpu
from attnlab.translate.models import build_model, count_parameters, model_config
from attnlab.translate.settings import MODEL_DEFAULTS, PRESETS, TASK_DEFAULTS
from attnlab.translate.tasks import DATA_FILE, data_sha256, run_task, task_spec
from attnlab.translate.tokenizer import SPECIALS, Tokenizer
from attnlab.translate.trainer import (
    TrainOptions,
    fit,
    init_distributed,
    make_optimizer,
    probe_step,
)

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
    "precision",
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
    # options that would be silently ignored are refused
    if explicit.get("train_size") is not None and task != "dates":
        raise ValueError(
            f"--train-size {explicit['train_size']} applies to --task dates only (the {task} "
            "task has fixed splits); drop it"
        )
    if explicit.get("vocab_size") is not None and merged.get("tokenizer") == "char":
        raise ValueError(
            f"--vocab-size {explicit['vocab_size']} applies to the BPE tokenizer, and this run "
            "uses --tokenizer char (one symbol per character); drop --vocab-size or pass "
            "--tokenizer bpe"
        )
    smallest = MIN_BPE_VOCAB
    if explicit.get("vocab_size") is not None and explicit["vocab_size"] < smallest:
        raise ValueError(
            f"--vocab-size {explicit['vocab_size']} is below the smallest BPE vocabulary, "
            f"{smallest} (the 256 byte symbols and {smallest - 256} special tokens, which "
            f"every vocabulary holds); pass --vocab-size {smallest} or more"
        )
    if explicit.get("tiny") and explicit.get("size") not in (None, "tiny"):
        raise ValueError(
            f"--tiny is --size tiny, and --size {explicit['size']} was given; pick one"
        )
    by_count = "epochs" in explicit or "max_steps" in explicit or "cpu_budget" in explicit
    if by_count and "time_budget" not in explicit and "time_budget" not in preset:
        merged["time_budget"] = None  # --epochs / --max-steps alone: no clock
    if merged.get("tiny"):
        merged["size"] = "tiny"
    return merged


MIN_BPE_VOCAB = 256 + len(SPECIALS)  # byte-level BPE: every byte is a symbol, plus the specials


def build_config(o: dict, device: str = "cpu") -> dict:
    """The run's config.json from resolved options (checked for ``device``: see
    :func:`check_config`)."""
    spec = task_spec(
        o["task"] if not o.get("data") else None,
        o.get("data"),
        bool(o.get("skip_bad_lines")),
        o.get("train_size"),
    )
    if o["model"] == "rnn" and o.get("kv_heads"):
        raise ValueError("--kv-heads (grouped-query attention) applies to --model transformer only")
    if o["model"] == "rnn" and o.get("heads") and o.get("attention") != "multihead":
        raise ValueError(
            f"--heads {o['heads']} applies to --attention multihead (or --model transformer); "
            f"the RNN's {o.get('attention') or 'default'} attention has one head: drop --heads"
        )
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
    train["checkpoint_seconds"] = 60.0 * (o.get("checkpoint_every") or CHECKPOINT_MINUTES)
    config = {
        "attnlab_run": 1,
        "task": spec,
        "tokenizer": {"kind": o.get("tokenizer") or "bpe", "vocab_size": o.get("vocab_size", 8000)},
        "model": model,
        "train": train,
        "time_budget_minutes": o.get("time_budget"),
        "decode": {"beam_size": o.get("beam_size") or 4, "length_penalty": 0.6},
    }
    check_config(config, device)
    return config


CHECKPOINT_MINUTES = 2.0  # default of --checkpoint-every
# config key -> the option of `attnlab train` that sets it (for messages)
OPTION_OF = {
    "emb_dim": "--emb-dim",
    "hidden": "--hidden",
    "d_model": "--d-model",
    "heads": "--heads",
    "kv_heads": "--kv-heads",
    "d_ff": "--d-ff",
    "enc_layers": "--layers",
    "dec_layers": "--layers",
    "dropout": "--dropout",
    "lr": "--lr",
    "clip": "--clip",
    "max_tokens": "--max-tokens",
    "precision": "--precision",
    "max_len": "--max-len",
    "max_steps": "--max-steps",
    "epochs": "--epochs",
    "warmup": "--warmup",
}


def check_config(config: dict, device: str = "cpu") -> None:
    """Refuse a config that cannot train, before anything is written.

    The numbers are checked one by one (the command line's own checks, again for callers that
    build configs in Python); models of one and two layers of these widths are built on the
    ``meta`` device (shapes only, no memory, no computation), so whatever their constructors
    refuse is refused here too, and they give the parameter count: a model whose training
    state alone would not fit in the memory free on ``device`` is refused
    (:func:`check_model_fits`).
    """
    m = config["model"]
    for key, value in m.items():
        if key in ("kind", "attention"):
            continue
        bad = value is None or isinstance(value, bool) or not isinstance(value, (int, float))
        if not bad and key == "dropout":
            bad = not 0 <= value < 1
        elif not bad:
            bad = not isinstance(value, int) or value < 1
        if bad:
            raise ValueError(
                f"{OPTION_OF.get(key, key)} {value!r} is not a valid model setting; expected "
                + ("a number in [0, 1)" if key == "dropout" else "an integer >= 1")
            )
    width_key = "d_model" if m["kind"] == "transformer" else "hidden"
    if m["attention"] in ("multihead", "gqa") and m[width_key] % m["heads"]:
        raise ValueError(
            f"--heads {m['heads']} does not divide the model width "
            f"({OPTION_OF[width_key]} {m[width_key]}): each head takes an equal share; pass "
            f"--heads as a divisor of {m[width_key]}, or change {OPTION_OF[width_key]}"
        )
    if m.get("kv_heads") and m["heads"] % m["kv_heads"]:
        raise ValueError(
            f"--kv-heads {m['kv_heads']} does not divide --heads {m['heads']}: each key/value "
            f"head serves an equal group of query heads; pass a divisor of {m['heads']}"
        )
    for key, value in config["train"].items():
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if (key, value) == ("max_tokens", "auto") or key == "precision":
            continue  # decided on the device when training starts (translate/gpu.py)
        if key in ("seed", "warmup"):
            ok, want = isinstance(value, int) and number and value >= 0, "an integer >= 0"
        elif key in ("label_smoothing", "weight_decay", "clip"):
            ok, want = number and math.isfinite(value) and value >= 0, "a number >= 0"
        else:
            ok, want = number and math.isfinite(value) and value > 0, "a number > 0"
        if not ok:
            raise ValueError(f"{OPTION_OF.get(key, key)} {value!r} cannot train; expected {want}")
    vocab = config["tokenizer"].get("vocab_size") or 512
    try:  # (models of one and two layers of these widths are built on the meta device)
        parameters = parameter_count(m, vocab)
    except (ValueError, TypeError, AssertionError, RuntimeError) as e:
        raise ValueError(f"the model settings do not fit together: {e}") from None
    check_model_fits(m, parameters, device)


TRAIN_BYTES_PER_PARAMETER = 16  # float32 weights, their gradients and Adam's two moments
LAYER_KEYS = ("enc_layers", "dec_layers")


def parameter_count(model: dict, vocab: int) -> int:
    """The parameters of ``build_model(model, vocab)``, from models of one and two layers built
    on the meta device (each layer adds the same count): a model of 65,536 layers is not
    built to be counted (building it, even on the meta device, takes minutes). Whatever the
    constructors refuse of these settings is raised here."""

    def count(**layers) -> int:
        with torch.device("meta"):
            built = build_model({**model, **layers}, vocab)
        return sum(p.numel() for p in built.parameters())

    present = [k for k in LAYER_KEYS if k in model]
    ones = dict.fromkeys(present, 1)
    base = count(**ones)
    total = base
    for key in present:
        per_layer = count(**{**ones, key: 2}) - base
        total += per_layer * (model[key] - 1)
    return total


def check_model_fits(model: dict, n: int, device: str) -> None:
    """Refuse a model of ``n`` parameters whose training state alone
    (``TRAIN_BYTES_PER_PARAMETER`` bytes a parameter; activations come on top) is more than the
    memory free on ``device``: it would fail after the run folder is written (an allocator
    traceback), or swap the machine to a halt."""
    free, where = _free_memory(device)
    need = n * TRAIN_BYTES_PER_PARAMETER
    if free is not None and need > free:
        sizes = ", ".join(f"{OPTION_OF.get(k, k)} {model[k]}" for k in
                          ("hidden", "d_model", "d_ff", *LAYER_KEYS) if k in model)  # fmt: skip
        raise ValueError(
            f"a model of {sizes} has {n:,} parameters: too large to train here, its weights, "
            f"gradients and Adam's two moments alone take {need / 2**30:.1f} GiB and {where} "
            f"has {free / 2**30:.1f} GiB free. Fix: a smaller width or fewer --layers"
        )


def _free_memory(device: str) -> tuple[int | None, str]:
    """(bytes free on ``device``, what it is called), or (None, ...) when it cannot be read."""
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            return None, device
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return free, f"GPU {device}"
    try:  # Linux: what can be allocated without swapping
        with open("/proc/meminfo", encoding="ascii") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024, "this machine"
    except (OSError, KeyError, ValueError):
        return None, "this machine"


def default_run_dir(config: dict) -> Path:
    m = config["model"]
    return Path("runs") / f"{config['task']['name']}-{m['kind']}-{m['attention']}"


RUN_FILES = (
    ckpt.CONFIG,
    ckpt.TOKENIZER,
    ckpt.WEIGHTS,
    ckpt.RESULTS,
    "train.log",
    "attention.png",
    DATA_FILE,
)


def check_run_dir_free(run_dir: Path, *, force: bool, config: dict | None = None) -> None:
    """Raise unless a new run may start in ``run_dir`` (read-only: every process calls it).

    Only an attnlab run is ever overwritten (with ``force``): a folder whose config.json is
    someone else's (a Hugging Face model folder, say) is refused even then, and so is a folder
    without a run that holds files of the names a run writes (they would be overwritten, or
    removed if the new run fails). ``config``: the new run's, whose ``--data`` may be the
    folder's own data.tsv (kept and read in place).
    """
    if run_dir.exists() and not run_dir.is_dir():
        raise ValueError(f"--out {run_dir} is a file; pass a folder")
    file = run_dir / ckpt.CONFIG
    if file.exists():
        what = _foreign_config(file)
        if what is not None:
            raise ValueError(
                f"--out {run_dir} is {what}, not an attnlab run: attnlab train does not "
                "overwrite it, even with --force; choose another --out"
            )
        if not force:
            raise ValueError(
                f"{run_dir} already holds a run; continue it with --resume, start it over with "
                "--force, or choose another --out"
            )
        return
    own_data = config is not None and data_in_run_dir(config, run_dir)
    taken = [
        name
        for name in (*RUN_FILES, ckpt.CHECKPOINTS)
        if (run_dir / name).exists() and not (name == DATA_FILE and own_data)
    ]
    if taken:
        raise ValueError(
            f"--out {run_dir} holds {', '.join(taken)} but no attnlab run (no {ckpt.CONFIG}): "
            "a new run would overwrite them; choose another --out, or move them out"
        )


def _not_a_run(config: object) -> str | None:
    """What a folder whose config.json holds ``config`` is, when not an attnlab run; None if
    it is one."""
    if isinstance(config, dict) and "attnlab_run" in config:
        return None
    if isinstance(config, dict) and ("architectures" in config or "model_type" in config):
        kind = config.get("model_type")
        return "a Hugging Face model folder" + (f" ({kind})" if isinstance(kind, str) else "")
    return f"a folder whose {ckpt.CONFIG} has no 'attnlab_run'"


def _foreign_config(file: Path) -> str | None:
    """What ``file`` (a folder's config.json) is when it is not an attnlab run's; None if it is."""
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return f"a folder whose {ckpt.CONFIG} is not readable JSON"
    return _not_a_run(config)


def data_in_run_dir(config: dict, run_dir: Path) -> bool:
    """Whether the run's ``--data`` file is ``run_dir``'s own data.tsv (read in place, never
    copied onto itself nor removed)."""
    spec = config["task"]
    if spec.get("name") != "tsv" or not spec.get("path"):
        return False
    target = run_dir / DATA_FILE
    if spec["path"] == DATA_FILE:
        return True
    try:
        return target.exists() and os.path.samefile(spec["path"], target)
    except OSError:
        return False


def place_data(config: dict, run_dir: Path) -> None:
    """Copy a user's pairs file into the run folder, point ``config`` at the copy and record
    its SHA-256.

    A run folder is self-contained: ``evaluate`` and ``--resume`` read the data from inside it
    (:func:`attnlab.translate.tasks.run_task`), never from a path a config.json names. A
    ``--data`` that already is the folder's data.tsv is read in place.
    """
    spec = config["task"]
    if spec.get("name") != "tsv" or spec.get("path") == DATA_FILE:
        return
    if not data_in_run_dir(config, run_dir):
        shutil.copyfile(spec["path"], run_dir / DATA_FILE)
    spec["path"] = DATA_FILE
    # checked whenever the run reads its pairs again (evaluate, --resume: tasks.run_task)
    spec["data_sha256"] = data_sha256(run_dir / DATA_FILE)


def read_run_config(run_dir: str | os.PathLike[str]) -> dict:
    """The config.json of a folder written by ``attnlab train``; one-line errors otherwise
    (no folder, a file, a Hugging Face model folder, a damaged config)."""
    path = Path(run_dir)
    hint = "pass the folder that `attnlab train` wrote (it prints it at the end)"
    if not path.exists():
        raise ValueError(
            f"run directory {str(path)!r} does not exist; train one with: "
            f"attnlab train --out {path}"
        )
    if not path.is_dir():
        raise ValueError(f"{str(path)!r} is a file, not a run directory; {hint}")
    file = path / ckpt.CONFIG
    if not file.is_file():
        raise ValueError(f"{str(path)!r} is not a run directory (no {ckpt.CONFIG}); {hint}")
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{file} is not valid JSON ({e}); {hint}") from None
    what = _not_a_run(config)
    if what is not None:
        raise ValueError(f"{str(path)!r} is {what}, not a run directory; {hint}")
    from attnlab.translate.run import read_config  # its every section, checked, in one place

    return read_config(path)


def prepare_run_dir(
    run_dir: Path, *, resume: bool, force: bool, config: dict | None = None
) -> None:
    """Make ``run_dir`` ready for a new run (``--force``: remove the old run's files, except
    the data.tsv that ``config``'s ``--data`` names: the new run reads it)."""
    if resume:
        return
    check_run_dir_free(run_dir, force=force, config=config)
    keep = (DATA_FILE,) if config is not None and data_in_run_dir(config, run_dir) else ()
    if (run_dir / ckpt.CONFIG).exists():
        _remove_run_files(run_dir, keep=keep)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(
            f"--out {run_dir}: cannot create the run folder ({e.strerror or e}); "
            "choose a writable --out"
        ) from None


def _remove_run_files(run_dir: Path, keep: tuple[str, ...] = ()) -> None:
    """Remove what a run writes into ``run_dir`` (its run files and checkpoint folder, but not
    those named in ``keep``), and nothing else that the folder holds."""
    for name in RUN_FILES:
        if name not in keep:
            (run_dir / name).unlink(missing_ok=True)
    shutil.rmtree(run_dir / ckpt.CHECKPOINTS, ignore_errors=True)


def discard_new_run(run_dir: Path, created: bool, keep: tuple[str, ...] = ()) -> None:
    """Remove what a new run wrote into ``run_dir`` (its run files and checkpoint folder, but
    not those named in ``keep``: a user's data.tsv that it read in place), and the folder
    itself if this run ``created`` it and nothing else is left in it."""
    _remove_run_files(run_dir, keep)
    if created and run_dir.is_dir() and not any(run_dir.iterdir()):
        run_dir.rmdir()


def pick_device(name: str | None) -> str:
    """The torch device of ``--device`` (``auto``: cuda when there is one); one-line errors."""
    from attnlab.cli import device_name

    if name in (None, "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        name = device_name(name)
    except Exception as e:  # argparse.ArgumentTypeError, when called from Python
        raise ValueError(f"--device: {e}") from None
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError(
                f"--device {name}: no CUDA GPU is visible to torch here; use --device cpu"
            )
        index = int(name.split(":")[1]) if ":" in name else 0
        if index >= torch.cuda.device_count():
            raise ValueError(
                f"--device {name}: there are {torch.cuda.device_count()} CUDA GPU(s) here "
                f"(cuda:0 to cuda:{torch.cuda.device_count() - 1}); pick one of them"
            )
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
    save_config: bool = False,
):
    """Train (or continue) the run in ``run_dir``; returns ``(model, tokenizer, task, state)``.

    ``started``: the command's start time (``time.monotonic()``), so that a time budget counts
    everything (data, tokenizer, training, evaluation). ``eval_reserve``: seconds kept for the
    evaluation after training. ``save_config``: write ``config`` to the run's config.json
    just before training starts (after a resumed run's checkpoint is checked), so that a
    resume that fails before leaves the run as it was.
    """
    started = time.monotonic() if started is None else started
    dist = init_distributed(device)
    if device.startswith("cuda") and dist.active:
        device = f"cuda:{dist.local_rank}"
        torch.cuda.set_device(device)
    threads = set_threads(threads)

    task = task or run_task(run_dir, config["task"])
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

    train_cfg = config["train"]
    # every setting checked now; "auto" batches and precision are decided below, on the device
    early = TrainOptions.from_dict(
        {k: v for k, v in train_cfg.items() if v != "auto" and k != "precision"}
    )
    train_data, dropped = encode_pairs(tokenizer, task.train, early.max_len)
    val_data, val_dropped = encode_pairs(tokenizer, task.validation, early.max_len)
    if not len(train_data):
        raise ValueError(
            f"--max-len {early.max_len} leaves no training pair: all {dropped:,} have "
            f"{early.max_len} tokens or more (in tokens of this run's tokenizer). Fix: a larger "
            f"--max-len, or leave it out"
        )
    if not len(val_data):  # (the validation loss of no pair is NaN: say so before training)
        raise ValueError(
            f"--max-len {early.max_len} leaves no validation pair: all {val_dropped:,} have "
            f"{early.max_len} tokens or more (in tokens of this run's tokenizer). Fix: a larger "
            f"--max-len, or leave it out"
            if val_dropped
            else "the task has no validation pairs: the validation loss would be NaN. Fix: "
            "give the data more pairs (a share of them is held out for validation)"
        )
    if dropped and dist.main:
        log(f"note: {dropped} training pair(s) of {early.max_len} tokens or more left out")
    if val_dropped and dist.main:
        log(
            f"note: {val_dropped} validation pair(s) of {early.max_len} tokens or more left out "
            f"of the validation loss"
        )
    torch.manual_seed(early.seed)
    model = build_model(config["model"], tokenizer.vocab_size).to(device)
    precision = gpu.resolve_precision(train_cfg.get("precision"), device)
    auto = train_cfg.get("max_tokens") == "auto"
    if auto or train_cfg.get("precision") != precision:
        # decided once, on this device, and saved: a resumed run keeps the same batches
        train_cfg["precision"] = precision
        if auto:
            base = MODEL_DEFAULTS[config["model"]["kind"]]["max_tokens"]
            probe = lambda: probe_step(model, train_data, device, base, precision)  # noqa: E731
            train_cfg["max_tokens"], how = gpu.auto_max_tokens(probe, base, device, base)
            if dist.main:
                log(f"batches: --max-tokens auto -> {how}")
        if dist.main:
            ckpt.atomic_write_json(run_dir / ckpt.CONFIG, config)
    opts = TrainOptions.from_dict(train_cfg)
    if resume:
        # Read and check the checkpoint (weights, optimizer state for the optimizer training
        # builds) before the run folder changes: a damaged one raises here, naming its file,
        # and leaves config.json and the final files as they were.
        ckpt.check_resumable(run_dir, model, make_optimizer(model, opts))
    if dist.main:
        m = config["model"]
        log(
            f"model: {m['kind']} with {m['attention']} attention, "
            f"{count_parameters(model):,} parameters; device {device}, {threads} thread(s)"
            + (f", {dist.world} processes" if dist.active else "")
            + (", bf16 autocast" if opts.precision == "bf16" else "")
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
    if save_config and dist.main:  # (a resumed run's new budget: its checkpoint is checked)
        ckpt.atomic_write_json(run_dir / ckpt.CONFIG, config)
    if resume and dist.main:
        # The final files describe the weights of the last completed session; training on
        # makes them stale, and an interrupted session would leave them beside a newer
        # checkpoint (translate and evaluate read them first). Written again when it completes.
        for name in (ckpt.WEIGHTS, ckpt.RESULTS, "attention.png"):
            (run_dir / name).unlink(missing_ok=True)
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


def open_run(args):
    """The :class:`~attnlab.translate.run.Translator` that ``cmd_translate.add_run_arguments``
    names."""
    from attnlab.translate.run import load_run

    if args.beam_size is not None and args.beam_size < 1:
        raise ValueError(
            f"--beam-size must be >= 1, got {args.beam_size}; fix: --beam-size 1 or more"
        )
    device = pick_device(args.device)
    read_run_config(args.run_dir)  # a run folder, not a model folder or a file
    set_threads(args.threads)
    translator = load_run(args.run_dir, device=device)
    if getattr(args, "compile", False):
        kind = translator.config["model"]["kind"]
        if kind != "transformer":
            raise ValueError(
                f"--compile compiles a Transformer's decoder step (over its KV cache); "
                f"{args.run_dir} is a {kind} run. Fix: leave --compile out."
            )
        translator.compile_decoding = True
    return translator


def set_threads(threads: int | None) -> int:
    """``torch.set_num_threads`` of ``--threads`` (None: :func:`default_threads`), refused
    beyond :func:`attnlab.cli.max_threads` (tens of thousands crash the process in libgomp)."""
    from attnlab.cli import max_threads

    if threads is not None and not 1 <= threads <= max_threads():
        raise ValueError(
            f"--threads {threads}: expected an integer in [1, {max_threads()}] (4 per core of "
            f"this machine); pass {os.cpu_count() or 1} (one per core) or leave it out"
        )
    threads = threads or default_threads()
    torch.set_num_threads(threads)
    return threads


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
