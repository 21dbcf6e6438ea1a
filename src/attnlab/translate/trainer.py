"""The training loop: budgets, schedule, checkpoints, resume, Ctrl-C, and DistributedDataParallel.

**Budget.** Training stops at the first of: ``epochs`` epochs, ``max_steps`` optimizer steps,
``train_seconds`` seconds of training (the command's ``--time-budget`` minus what evaluation
needs), ``cpu_seconds`` seconds of this process's CPU time (``--cpu-budget``: on a machine shared
with other jobs a clock budget buys less and less work as the load grows; a CPU budget buys the
same work whatever the load, and with one thread it equals the clock time of an idle machine).
The learning rate warms up linearly, then follows a cosine from its peak down to 5%
of it over the budget's *progress*: the fraction of epochs, steps or seconds used, whichever is
furthest along. Runs budgeted by epochs or steps are exactly reproducible; a time budget makes
the step count, hence the result, depend on the machine's speed.

**Resume.** A checkpoint holds the parameters, the optimizer's moments, the step, the epoch and
the position in that epoch's batch order (which depends only on the seed and the epoch), and the
torch / CUDA / Python / NumPy random states of every process; one is written every
``checkpoint_seconds`` of training (``attnlab train --checkpoint-every MIN``) and at the end.
Restoring all of it makes a resumed run continue exactly as the uninterrupted one: the same
batches, the same dropout masks, bit-identical parameters.
Ctrl-C (SIGINT) or SIGTERM finishes the current step, saves a checkpoint and stops; a second
Ctrl-C stops at once. A ``kill -9`` or a power cut at any instant loses only the steps after the
last complete checkpoint (:mod:`attnlab.translate.checkpoint` says why). On resume, ``train.log``
is rewritten to the validations the checkpoint knows, so none of the lost stretch remains.

**Distributed.** Under ``torchrun`` (``WORLD_SIZE > 1``) the model is wrapped in
``DistributedDataParallel`` (gloo on CPU, NCCL on GPU). All processes build the same batches;
each takes its share of every batch (:func:`attnlab.translate.batching.shard`) and scales its
loss so that the averaged gradient is the gradient of the whole batch's mean token loss. Each
step the processes agree on the elapsed time and on interruption (one small all-reduce), so
they always stop, and checkpoint, at the same step; process 0 writes checkpoints (with every
process's random states: each restores its own on resume) and logs. A checkpoint written by
another number of processes cannot give each its own generators back: each then starts fresh
ones, distinct per process, and says so (:func:`attnlab.translate.checkpoint.set_rng_state`).
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from attnlab._files import kill_point
from attnlab.translate import checkpoint as ckpt
from attnlab.translate import gpu
from attnlab.translate.batching import Encoded, collate, epoch_batches, fixed_sample, shard
from attnlab.translate.tokenizer import PAD


@dataclass
class TrainOptions:
    """Optimisation and budget settings (the ``"train"`` section of a run's config.json)."""

    lr: float = 1e-3
    warmup: int = 400
    min_lr_ratio: float = 0.05
    weight_decay: float = 0.01
    label_smoothing: float = 0.1
    clip: float = 1.0
    max_tokens: int = 4096
    max_sentences: int | None = None
    max_len: int = 128
    epochs: float | None = None
    max_steps: int | None = None
    train_seconds: float | None = None
    cpu_seconds: float | None = None
    seed: int = 1
    eval_every: float = 0.2  # validation loss every this fraction of progress
    val_pairs: int = 300  # validation pairs used for that (a fixed random sample)
    checkpoint_seconds: float = 120.0  # seconds of training between checkpoints
    precision: str = "fp32"  # "bf16": forward and loss under torch.autocast (translate/gpu.py)

    def __post_init__(self) -> None:  # (the Python API is checked as config.json is)
        for key, spec in self.__dataclass_fields__.items():
            check_option(key, getattr(self, key), spec.type)

    @classmethod
    def from_dict(cls, d: dict) -> TrainOptions:
        d = dict(d)
        if "checkpoint_every" in d:  # its former name, in older config.json files
            d.setdefault("checkpoint_seconds", d.pop("checkpoint_every"))
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})


# Settings whose 0 means nothing sensible: a budget of 0 read as "no budget" and trained without
# end, eval_every 0 divided by zero, val_pairs 0 gave a NaN validation loss.
_POSITIVE = {"max_tokens", "max_sentences", "max_len", "epochs", "max_steps", "train_seconds",
             "cpu_seconds", "eval_every", "val_pairs", "lr", "checkpoint_seconds"}  # fmt: skip
_ABOVE = {  # upper bounds: (within, said)
    "label_smoothing": (lambda v: v < 1, "< 1"),
    "min_lr_ratio": (lambda v: v <= 1, "<= 1"),
    "seed": (lambda v: v < 2**32, "< 2**32"),
}


def check_option(key: str, value, annotation: str) -> None:
    """A training setting must have its field's type and lie in its range: > 0 for sizes,
    budgets and rates, >= 0 otherwise; label_smoothing < 1, min_lr_ratio <= 1, seed < 2^32."""
    if value is None and "None" in annotation:
        return
    if annotation == "str":
        if value not in ("fp32", "bf16"):
            raise ValueError(f"training setting {key!r} must be 'fp32' or 'bf16', got {value!r}")
        return
    wanted = "an integer" if annotation.startswith("int") else "a number"
    ok = ckpt.is_int(value) if annotation.startswith("int") else ckpt.is_number(value)
    positive = key in _POSITIVE
    within, said = _ABOVE.get(key, (lambda v: True, ""))
    if not ok or value < 0 or (positive and value == 0) or not within(value):
        bounds = ("> 0" if positive else ">= 0") + (f" and {said}" if said else "")
        raise ValueError(f"training setting {key!r} must be {wanted} {bounds}, got {value!r}")


@dataclass
class TrainState:
    step: int = 0
    epoch: int = 0
    position: int = 0  # batches of the current epoch already done
    elapsed: float = 0.0  # seconds of training so far (all sessions)
    cpu_seconds: float = 0.0  # CPU time of this process while training (all sessions)
    tokens: int = 0
    epochs_done: float = 0.0  # epoch + fraction of the current one
    history: list = field(default_factory=list)  # validation records

    def to_dict(self) -> dict:
        return dict(vars(self))


class Schedule:
    """Linear warm-up (``warmup`` steps or 5% of the budget, the shorter), then cosine decay to
    ``min_lr_ratio * lr`` over the budget's progress."""

    def __init__(self, lr: float, warmup: int, min_lr_ratio: float):
        self.lr, self.warmup, self.min_ratio = lr, warmup, min_lr_ratio

    def __call__(self, step: int, progress: float) -> float:
        # warm-up ends after `warmup` steps or 5% of the budget, whichever comes first
        warm = min(1.0, max((step + 1) / max(1, self.warmup), progress / 0.05))
        p = min(max(progress, 0.0), 1.0)
        decay = self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * p))
        return self.lr * warm * decay


# ------------------------------------------------------------------------------ distributed
@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world > 1


def init_distributed(device: str) -> Dist:
    """Join the process group torchrun set up (``WORLD_SIZE`` > 1); otherwise a single process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Dist()
    import torch.distributed as dist

    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if not dist.is_initialized():
        backend = "nccl" if device.startswith("cuda") else "gloo"
        dist.init_process_group(backend=backend)
    return Dist(rank, world, local)


# ------------------------------------------------------------------------------ interruption
class StopFlag:
    """SIGINT / SIGTERM set a flag; the loop saves and stops after the current step.

    A signal the process was started ignoring stays ignored (``nohup``, a shell's background
    job: a Ctrl-C meant for the shell in front must not stop it), as Python itself does."""

    def __init__(self):
        self.requested = False
        self._old = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                if signal.getsignal(sig) is not signal.SIG_IGN:
                    self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt  # second Ctrl-C: stop now
        self.requested = True
        print(
            "\nstopping after this step and saving a checkpoint (Ctrl-C again to stop now)",
            file=sys.stderr,
        )

    def __exit__(self, *exc):
        for sig, handler in self._old.items():
            signal.signal(sig, handler)
        return False


# ------------------------------------------------------------------------------ the loop
class Diverged(ValueError):
    """Training met a NaN or an infinity (in the loss, the weights or the optimizer's moments).
    It stops at once and saves nothing of it: the run folder keeps its last finite checkpoint,
    if any."""


def _nonfinite(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str | None:
    """What holds a NaN or an inf, in words: the weights, or the optimizer's state; None if
    nothing does.

    The state matters on its own: without clipping, a gradient of ~1e20 is finite but its
    square is not (float32 ends at 3.4e38). Adam's ``exp_avg_sq`` becomes inf while its
    ``exp_avg`` stays finite, so each update is ``exp_avg / sqrt(inf) = 0``: the loss and the
    weights stay finite, the weights stop learning, and the checkpoint cannot be resumed.
    """
    if not all(bool(torch.isfinite(p).all()) for p in model.parameters()):
        return "the weights hold a NaN or an inf"
    for state in optimizer.state.values():
        for name, value in state.items():
            if torch.is_tensor(value) and value.is_floating_point():
                if not bool(torch.isfinite(value).all()):
                    return (
                        f"the optimizer's {name!r} holds a NaN or an inf (most likely a gradient "
                        "whose square overflows float32), so the weights had stopped learning"
                    )
    return None


def _diverged(what: str, state, lr: float, run_dir: Path, opts: TrainOptions) -> Diverged:
    try:  # (the checkpoint a resume would take: a damaged newer one is not it)
        found = ckpt.intact_checkpoint(run_dir, quiet=True)
    except ckpt.RunFileError:  # every one damaged
        kept = f"{run_dir} has no intact checkpoint"
    else:
        kept = (
            f"{run_dir} keeps its last checkpoint, step {found[1]['step']}"
            if found is not None
            else f"{run_dir} has no checkpoint yet"
        )
    # (options of `attnlab train`, with values that differ from this run's)
    clip = (
        f"--clip {opts.clip / 2:g} (this run clipped the gradient's norm to {opts.clip:g})"
        if opts.clip
        else "--clip 1.0 (this run did not clip)"
    )
    return Diverged(
        f"training diverged at step {state.step}: {what} (learning rate then {lr:.3g}); "
        f"nothing of it was saved and {kept}. Fix: train again with a smaller peak learning "
        f"rate, e.g. --lr {opts.lr / 4:g} (this run's: {opts.lr:g}), and/or a tighter {clip}, "
        f"with --force to start this run over"
    )


def token_loss(logits, target, label_smoothing: float = 0.0) -> torch.Tensor:
    """Summed cross-entropy over non-pad target tokens. logits (B, T, V), target (B, T)."""
    return F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]),
        target.reshape(-1),
        ignore_index=PAD,
        reduction="sum",
        label_smoothing=label_smoothing,
    )


@torch.enable_grad()  # (its backward needs the graph, whatever the caller's grad mode)
def probe_step(model, data: Encoded, device, max_tokens: int, precision: str) -> int:
    """One forward+backward of the first batch of ``max_tokens`` (for sizing batches from
    the memory it takes); gradients dropped, random state untouched. Returns its tokens."""
    batch = next(iter(epoch_batches(data, seed=0, epoch=0, max_tokens=max_tokens)))
    b = collate(data, batch).to(device)
    with torch.random.fork_rng(devices=[torch.device(device)] if "cuda" in str(device) else []):
        with gpu.autocast(device, precision):
            loss = token_loss(model(b.src, b.src_lengths, b.tgt_in), b.tgt_out)
        loss.backward()
    model.zero_grad(set_to_none=True)
    return int(b.src.numel() + b.tgt_in.numel())


@torch.no_grad()  # (no graph: the loss is read, never differentiated)
def validation_loss(model, data: Encoded, device, max_tokens: int = 8192) -> float:
    """Mean token cross-entropy (nats, no label smoothing) over ``data``."""
    if len(data) == 0:
        return float("nan")
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for batch in epoch_batches(data, seed=0, epoch=0, max_tokens=max_tokens):
        b = collate(data, batch).to(device)
        logits = model(b.src, b.src_lengths, b.tgt_in)
        total += float(token_loss(logits, b.tgt_out))
        count += b.num_tokens
    model.train(was_training)
    return total / max(1, count)


def _gather_rng_states(dist: Dist) -> list[tuple[dict, dict]] | None:
    """Every process's random generator states (:func:`ckpt.rng_state`), by rank, on process
    0 (None on the others); all processes must call it together.

    Each process draws its own dropout masks (its torch generator is seeded with seed + rank),
    so a checkpoint keeps every one: restoring process 0's everywhere made all processes draw
    the same masks after a resume. (Under NCCL the objects travel through the current CUDA
    device, which :func:`attnlab.translate.pipeline.train_run` sets for each process.)"""
    own = ckpt.rng_state()
    if not dist.active:
        return [own]
    import torch.distributed as tdist

    states = [None] * dist.world if dist.main else None
    tdist.gather_object(own, states, dst=0)  # (pickled between this run's own processes)
    return states


def make_optimizer(model: torch.nn.Module, opts: TrainOptions) -> torch.optim.Optimizer:
    """AdamW, weight decay on the matrices only (not on biases, norms, embeddings' 1-D)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if p.dim() < 2 or "norm" in name else decay).append(p)
    return torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": opts.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=opts.lr,
        betas=(0.9, 0.98),
        eps=1e-9,
    )


def fit(
    model: torch.nn.Module,
    train_data: Encoded,
    val_data: Encoded,
    opts: TrainOptions,
    run_dir: str | os.PathLike[str],
    *,
    device: torch.device | str = "cpu",
    resume: bool = False,
    dist: Dist | None = None,
    progress_bar: bool = True,
    stop_at_step: int | None = None,
) -> TrainState:
    """Train ``model`` in place; checkpoints go to ``run_dir``. Returns the final state.

    Args:
        model: a model of :mod:`attnlab.translate.models`, already on ``device``.
        train_data, val_data: encoded pairs.
        opts: budget and optimisation.
        run_dir: where checkpoints are written (process 0 only).
        resume: continue from the latest checkpoint in ``run_dir``.
        dist: distributed context (default: single process).
        progress_bar: show progress (process 0): a tqdm bar on a terminal, else one line a
            minute (:mod:`attnlab.translate.progress`).
        stop_at_step: behave as if interrupted after this step (tests of resume).
    """
    dist = dist or Dist()
    device = torch.device(device)
    run_dir = Path(run_dir)
    if dist.main:
        run_dir.mkdir(parents=True, exist_ok=True)
    net = model
    if dist.active:
        from torch.nn.parallel import DistributedDataParallel

        ids = [device.index] if device.type == "cuda" else None
        net = DistributedDataParallel(model, device_ids=ids)
    optimizer = make_optimizer(model, opts)
    schedule = Schedule(opts.lr, opts.warmup, opts.min_lr_ratio)
    state = TrainState()
    if dist.main:
        ckpt.clean_checkpoints(run_dir)  # leftovers of a crash: temporary and half-written files
    if resume:  # (each process restores its own random generators)
        found = ckpt.resume_checkpoint(run_dir, model, optimizer, rank=dist.rank, world=dist.world)
        if found is None:
            raise ValueError(f"{run_dir} has no checkpoint to resume from; train without --resume")
        _, saved = found
        state = TrainState(
            **{k: v for k, v in saved.items() if k in TrainState.__dataclass_fields__}
        )
    else:
        torch.manual_seed(opts.seed + dist.rank)
        import random

        import numpy as np

        random.seed(opts.seed)
        np.random.seed(opts.seed)  # noqa: NPY002 - seed the global generator others use

    budgets = (opts.epochs, opts.max_steps, opts.train_seconds, opts.cpu_seconds)
    if all(b is None for b in budgets):
        raise ValueError("no training budget: give epochs, max_steps, train_seconds or cpu_seconds")
    batches_cache: dict[int, list] = {}

    def batches_of(epoch: int) -> list:
        if epoch not in batches_cache:
            batches_cache.clear()
            batches_cache[epoch] = epoch_batches(
                train_data,
                seed=opts.seed,
                epoch=epoch,
                max_tokens=opts.max_tokens * dist.world,
                max_sentences=None
                if opts.max_sentences is None
                else opts.max_sentences * dist.world,
                min_sentences=dist.world,
            )
            if not batches_cache[epoch]:  # (an epoch of no step would loop without end)
                raise ValueError(
                    f"{len(train_data)} training pair(s) make no batch for {dist.world} "
                    f"processes: each needs one sentence. Fix: more data (a larger --max-len "
                    f"keeps more), or fewer processes"
                )
        return batches_cache[epoch]

    def progress() -> float:
        p = 0.0
        if opts.epochs:
            n = len(batches_of(state.epoch))
            p = max(p, (state.epoch + state.position / max(1, n)) / opts.epochs)
        if opts.max_steps:
            p = max(p, state.step / opts.max_steps)
        if opts.train_seconds:
            p = max(p, state.elapsed / opts.train_seconds)
        if opts.cpu_seconds:
            p = max(p, state.cpu_seconds / opts.cpu_seconds)
        return p

    saved_step = None  # the step of this session's last checkpoint
    lr = opts.lr  # the last step's learning rate (said when training diverges)

    def save() -> None:
        """A checkpoint, by every process at the same step: each sends its random generators'
        states to process 0, which writes them with the rest."""
        nonlocal saved_step
        if saved_step == state.step:  # nothing new since the last one: skip
            return
        # A finite loss can still end in weights, or Adam moments, of inf (an overflowing
        # gradient): never saved over a finite checkpoint. (Every process checks: their
        # weights and optimizer states are the same.)
        bad = _nonfinite(model, optimizer)
        if bad is not None:
            raise _diverged(bad, state, lr, run_dir, opts)
        state.epochs_done = epochs_now()  # (a resume's --more-epochs counts from it)
        rng = _gather_rng_states(dist)
        if dist.main:
            ckpt.save_checkpoint(run_dir, state.step, model, optimizer, state.to_dict(), rng=rng)
        saved_step = state.step

    def epochs_now() -> float:
        return round(state.epoch + state.position / max(1, len(batches_of(state.epoch))), 3)

    # the same validation pairs at every validation, in every run and resume; spread over the
    # whole split (its first pairs can be one part of it: the Bible's first books)
    chosen = fixed_sample(len(val_data), opts.val_pairs)
    subset = Encoded([val_data.src[i] for i in chosen], [val_data.tgt[i] for i in chosen])

    def validate() -> None:
        if not dist.main:
            return
        loss = validation_loss(model, subset, device)
        rec = {
            "val_pairs": len(subset),
            "step": state.step,
            "epoch": epochs_now(),
            "elapsed": round(state.elapsed, 1),
            "val_loss": round(loss, 4),
            "val_ppl": round(math.exp(min(loss, 50)), 2),
        }
        kill_point("evaluate")  # evaluated, not yet recorded
        state.history.append(rec)
        with open(run_dir / ckpt.TRAIN_LOG, "a", encoding="utf-8") as f:
            f.write(json.dumps(rec) + "\n")
        kill_point("evaluate:logged")  # train.log is ahead of the last checkpoint
        if bar is not None:
            bar.write(
                f"  step {state.step}: validation loss {loss:.3f} (perplexity {rec['val_ppl']})"
            )

    if dist.main:  # train.log holds the validations of the checkpoint's history, no more
        log_lines = "".join(json.dumps(rec) + "\n" for rec in state.history)
        ckpt.atomic_write_text(run_dir / ckpt.TRAIN_LOG, log_lines)
    from attnlab.translate.progress import progress_bar as make_bar

    bar = None
    if dist.main and progress_bar:  # a live bar on a terminal, else a line per minute
        bar = make_bar(
            total=1000,
            desc="training",
            unit="‰",
            dynamic_ncols=True,
            mininterval=0.5,
            bar_format="{l_bar}{bar}| {elapsed}<{remaining} {postfix}",
            file=sys.stderr,
        )
        bar.update(int(1000 * min(1.0, progress())))
    net.train()
    next_eval = (math.floor(progress() / opts.eval_every) + 1) * opts.eval_every
    last_ckpt = session_start = time.monotonic()
    base_elapsed, base_cpu, cpu_start = state.elapsed, state.cpu_seconds, time.process_time()
    interrupted = False
    smooth_loss = None
    with StopFlag() as stop:
        while True:
            if opts.epochs is not None and state.epoch >= math.ceil(opts.epochs - 1e-9):
                break
            batches = batches_of(state.epoch)
            finished = False
            while state.position < len(batches):
                # --- agree on stopping: budget, interruption (all processes, same step)
                state.elapsed = base_elapsed + time.monotonic() - session_start  # wall clock
                state.cpu_seconds = base_cpu + time.process_time() - cpu_start
                flags = torch.tensor(  # (on the device: NCCL reduces CUDA tensors only)
                    [float(stop.requested), state.elapsed, state.cpu_seconds],
                    dtype=torch.float64,
                    device=device if dist.active else "cpu",
                )
                if dist.active:
                    import torch.distributed as tdist

                    if not dist.main:
                        flags[1:] = 0.0
                    tdist.all_reduce(flags, op=tdist.ReduceOp.MAX)  # rank 0's clocks for all
                    state.elapsed, state.cpu_seconds = float(flags[1]), float(flags[2])
                if flags[0] > 0 or (stop_at_step is not None and state.step >= stop_at_step):
                    interrupted = True
                    break
                p = progress()
                if p >= 1.0 - 1e-12:
                    finished = True
                    break
                # --- one optimizer step
                lr = schedule(state.step, p)
                for group in optimizer.param_groups:
                    group["lr"] = lr
                full = batches[state.position]
                n_tokens = sum(len(train_data.tgt[i]) + 1 for i in full)  # whole batch
                b = collate(train_data, shard(full, dist.rank, dist.world)).to(device)
                with gpu.autocast(device, opts.precision):
                    logits = net(b.src, b.src_lengths, b.tgt_in)
                    loss_sum = token_loss(logits, b.tgt_out, opts.label_smoothing)
                (loss_sum * (dist.world / n_tokens)).backward()
                if opts.clip:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), opts.clip)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                state.step += 1
                state.position += 1
                state.tokens += n_tokens
                kill_point("step")
                state.elapsed = base_elapsed + time.monotonic() - session_start
                state.cpu_seconds = base_cpu + time.process_time() - cpu_start
                tok_loss = float(loss_sum.detach()) / max(1, b.num_tokens)
                bad = not math.isfinite(tok_loss)
                due = time.monotonic() - last_ckpt >= opts.checkpoint_seconds  # a checkpoint
                if dist.active:  # (every process stops, and saves, at the same step)
                    import torch.distributed as tdist

                    flags = torch.tensor([float(bad), float(due)], device=device)
                    tdist.all_reduce(flags, op=tdist.ReduceOp.MAX)
                    bad, due = bool(flags[0] > 0), bool(flags[1] > 0)
                if bad:  # (its weights, stepped on a NaN, are not saved: see save)
                    raise _diverged(f"the training loss is {tok_loss}", state, lr, run_dir, opts)
                smooth_loss = (
                    tok_loss if smooth_loss is None else 0.98 * smooth_loss + 0.02 * tok_loss
                )
                if bar is not None:
                    bar.update(int(1000 * min(1.0, progress())) - bar.n)
                    bar.set_postfix_str(
                        f"epoch {state.epoch + 1} step {state.step} loss {smooth_loss:.3f} "
                        f"lr {lr:.2e} {state.tokens / max(state.elapsed, 1e-9):,.0f} tok/s",
                        refresh=False,
                    )
                if progress() >= next_eval:
                    next_eval += opts.eval_every
                    validate()
                if due:
                    save()  # a kill loses at most checkpoint_seconds of training
                    last_ckpt = time.monotonic()
            if interrupted or finished:
                break
            state.epoch += 1
            state.position = 0
        if not state.history or state.history[-1]["step"] != state.step:
            validate()
        save()
    if bar is not None:
        bar.close()
    state.epochs_done = epochs_now()
    state.interrupted = interrupted  # type: ignore[attr-defined]
    return state
