"""Run directories and checkpoints that a crash can never leave half-written.

A run directory::

    RUN_DIR/
      config.json          what to build: task, tokenizer, model, training options (JSON)
      tokenizer.json       the vocabulary (Hugging Face tokenizers JSON, or attnlab's char list)
      model.safetensors    the weights used by translate / evaluate (written after training)
      results.json         the scores printed at the end of training
      checkpoint/
        LATEST             name of the newest complete checkpoint folder
        step-00001234/
          model.safetensors      parameters
          optimizer.safetensors  optimizer tensors (Adam moments) under flat names
          state.json             step, epoch, position in the epoch's batch order, elapsed
                                 seconds, scheduler, optimizer hyper-parameters, RNG states
                                 (torch, Python, NumPy), best validation score

Atomicity: every file is written to a temporary name in the same folder, flushed to disk and
renamed over its final name with :func:`os.replace`, which POSIX makes atomic. A checkpoint
folder is written whole under a temporary name, renamed, and only then named in ``LATEST``
(itself replaced atomically); older folders are deleted afterwards. Whenever the process dies,
``LATEST`` names a complete checkpoint.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

from attnlab._files import (  # noqa: F401 - part of this module's API
    atomic_write_bytes,
    atomic_write_json,
    atomic_write_text,
    fsync_path,
)

CONFIG = "config.json"
TOKENIZER = "tokenizer.json"
WEIGHTS = "model.safetensors"
RESULTS = "results.json"
CHECKPOINTS = "checkpoint"
LATEST = "LATEST"


# atomic files: attnlab._files (re-exported here, where the run directory code reads them)


def save_tensors(path: str | os.PathLike[str], tensors: dict[str, torch.Tensor], metadata=None):
    """safetensors file, written atomically. Tensors are made contiguous CPU copies first."""
    from safetensors.torch import save

    flat = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    atomic_write_bytes(path, save(flat, metadata=metadata))


def load_tensors(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state dict with tied weights stored once (safetensors refuses shared storage)."""
    state, seen = {}, {}
    for name, tensor in model.state_dict().items():
        key = (tensor.data_ptr(), tensor.shape, tensor.stride()) if tensor.numel() else None
        if key is not None and key in seen:
            continue  # tied to an earlier entry; load_state_dict(strict=False) restores it
        if key is not None:
            seen[key] = name
        state[name] = tensor
    return state


def load_model_state(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    tied = set(model.state_dict()) - set(model_state(model))
    missing = [m for m in missing if m not in tied]
    if missing or unexpected:
        raise ValueError(
            f"checkpoint does not match the model: missing {missing[:5]}, unexpected "
            f"{unexpected[:5]}; was it written by another version of attnlab?"
        )


# --------------------------------------------------------------------------------- RNG states
def rng_state() -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, json) capturing the torch, CUDA, Python and NumPy random generators."""
    tensors = {"rng.torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"rng.cuda.{i}"] = s
    version, internal, gauss = random.getstate()
    np_state = np.random.get_state()  # noqa: NPY002 - the legacy global generator's state
    info = {
        "python": [version, list(internal), gauss],
        "numpy": [np_state[0], np_state[1].tolist(), *map(_plain, np_state[2:])],
    }
    return tensors, info


def set_rng_state(tensors: dict[str, torch.Tensor], info: dict) -> None:
    torch.set_rng_state(tensors["rng.torch"])
    cuda = sorted(k for k in tensors if k.startswith("rng.cuda."))
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([tensors[k] for k in cuda])
    version, internal, gauss = info["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, *rest = info["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), *rest))  # noqa: NPY002


def _plain(x):
    return x.item() if hasattr(x, "item") else x


# --------------------------------------------------------------------------------- checkpoints
def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    sd = optimizer.state_dict()
    tensors, scalars = {}, {}
    for idx, state in sd["state"].items():
        for name, value in state.items():
            if torch.is_tensor(value):
                tensors[f"optim.{idx}.{name}"] = value
            else:
                scalars[f"{idx}.{name}"] = value
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def _optimizer_state_dict(tensors: dict[str, torch.Tensor], info: dict) -> dict:
    state: dict[int, dict] = {}
    for key, value in tensors.items():
        if key.startswith("optim."):
            _, idx, name = key.split(".", 2)
            state.setdefault(int(idx), {})[name] = value
    for key, value in info["scalars"].items():
        idx, name = key.split(".", 1)
        state.setdefault(int(idx), {})[name] = value
    return {"state": state, "param_groups": info["param_groups"]}


def save_checkpoint(
    run_dir: str | os.PathLike[str],
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    state: dict,
    *,
    keep: int = 1,
) -> Path:
    """Write a complete checkpoint folder atomically and point ``LATEST`` at it.

    Args:
        run_dir: the run directory.
        step: optimizer steps done; names the folder.
        model: the (unwrapped) model.
        optimizer: its optimizer.
        state: JSON-able training state (epoch, position, scheduler, ...). RNG states are added.
        keep: how many checkpoint folders to keep.
    """
    root = Path(run_dir) / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    name = f"step-{step:08d}"
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=root))
    try:
        save_tensors(tmp / WEIGHTS, model_state(model))
        opt_tensors, opt_info = _optimizer_tensors(optimizer)
        rng_tensors, rng_info = rng_state()
        save_tensors(tmp / "optimizer.safetensors", {**opt_tensors, **rng_tensors})
        atomic_write_json(tmp / "state.json", {**state, "optimizer": opt_info, "rng": rng_info})
        final = root / name
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_path(root)
    atomic_write_text(root / LATEST, name + "\n")
    folders = sorted(p for p in root.glob("step-*") if p.is_dir() and p.name != name)
    for old in folders[: max(0, len(folders) - (keep - 1))]:
        shutil.rmtree(old, ignore_errors=True)
    for stale in root.glob(".step-*"):  # leftovers of a crash while writing
        shutil.rmtree(stale, ignore_errors=True)
    return final


def latest_checkpoint(run_dir: str | os.PathLike[str]) -> Path | None:
    root = Path(run_dir) / CHECKPOINTS
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    folder = root / pointer.read_text(encoding="utf-8").strip()
    return folder if (folder / "state.json").is_file() else None


def load_checkpoint(
    folder: str | os.PathLike[str], model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> dict:
    """Restore model, optimizer and RNG states from a checkpoint folder; return its state."""
    folder = Path(folder)
    state = json.loads((folder / "state.json").read_text(encoding="utf-8"))
    load_model_state(model, load_tensors(folder / WEIGHTS))
    tensors = load_tensors(folder / "optimizer.safetensors")
    optimizer.load_state_dict(_optimizer_state_dict(tensors, state.pop("optimizer")))
    set_rng_state(tensors, state.pop("rng"))
    return state
