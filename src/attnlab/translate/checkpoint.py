"""Run directories and checkpoints that a crash can never leave unusable, read as untrusted input.

A run directory::

    RUN_DIR/
      config.json          what to build: task, tokenizer, model, training options (JSON)
      tokenizer.json       the vocabulary (Hugging Face tokenizers JSON, or attnlab's char list)
      model.safetensors    the weights used by translate / evaluate (written after training)
      results.json         the scores printed at the end of training
      train.log            one JSON line per validation (rewritten to the checkpoint on resume)
      checkpoint/
        LATEST             name of the newest complete checkpoint folder
        step-00001234/
          model.safetensors      parameters
          optimizer.safetensors  optimizer tensors (Adam moments) under flat names, RNG states
                                 (torch, CUDA) of every process
          state.json             step, epoch, position in the epoch's batch order, elapsed
                                 seconds, optimizer hyper-parameters, RNG states (Python, NumPy)
                                 of every process, validation history
          manifest.json          written last: the step, and the size and SHA-256 of each file

**Crashes.** Every file is written to a temporary name, flushed to disk and renamed over its
final name with :func:`os.replace` (atomic on POSIX). A checkpoint is written whole in a
temporary folder (``.step-00001234.<random>.tmp``), ``manifest.json`` last; the folder is renamed
to a name no other folder has (``step-00001234``, or ``step-00001234.1`` when a checkpoint of
the same step exists: a resumed finished run saves its step again), then ``LATEST`` is replaced
to name it, and only then are older folders deleted (each loses its manifest first). So at every
instant, a ``kill -9`` included, the folder ``LATEST`` names is complete, and a folder without a
manifest is never mistaken for one. Readers do not trust ``LATEST`` alone: a missing ``LATEST``,
or one that names a missing or incomplete folder, falls back to the newest folder with a
manifest. Leftovers (temporary files and folders, folders without a manifest) are removed when
training starts or resumes, and after every checkpoint. A complete folder can still be damaged
later (a disk, a hand): whoever picks a checkpoint (:func:`resume_checkpoint`,
:func:`intact_checkpoint`) skips a damaged one for the next, naming it on stderr.

**Processes.** Under ``torchrun`` every process has its own random generators (its own dropout
masks); a checkpoint keeps each process's (:func:`pack_rng_states`) and each restores its own
(:func:`set_rng_state`).

**Untrusted input.** Everything read from a run directory is checked before it is used:
JSON and UTF-8, the keys and types of each JSON file, the tensor names, shapes and dtypes of
each safetensors file against the model the config builds, finite values, and the checksums
(``manifest.json``; a SHA-256 of the tensors in the metadata of every safetensors file attnlab
writes). A problem raises :class:`RunFileError`, a ``ValueError`` whose one-line message names
the file and what is wrong with it. Nothing is unpickled: safetensors and JSON only.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from attnlab._files import (  # noqa: F401 - part of this module's API
    atomic_write_bytes,
    atomic_write_json,
    atomic_write_text,
    fsync_path,
    kill_point,
    make_temp_dir,
)

CONFIG = "config.json"
TOKENIZER = "tokenizer.json"
WEIGHTS = "model.safetensors"
RESULTS = "results.json"
TRAIN_LOG = "train.log"
CHECKPOINTS = "checkpoint"
LATEST = "LATEST"
OPTIMIZER = "optimizer.safetensors"
STATE = "state.json"
MANIFEST = "manifest.json"
CHECKPOINT_FILES = (WEIGHTS, OPTIMIZER, STATE)
_FOLDER_NAME = re.compile(r"step-(\d{8,})(?:\.(\d{1,6}))?")
_DIGEST_KEY = "attnlab_sha256"  # safetensors metadata: SHA-256 of the tensors (see _digest)


class UsageError(ValueError):
    """A run directory that cannot be used, with the fix in the message."""


class RunFileError(UsageError):
    """A file of a run directory that is missing, damaged or not what it should be.

    The message is one line: ``PATH: problem``.
    """

    def __init__(self, path: str | os.PathLike[str], problem: str):
        self.path, self.problem = Path(path), problem
        super().__init__(f"{path}: {problem}")


def _one_line(error: BaseException | str, limit: int = 160) -> str:
    text = " ".join(str(error).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


# --------------------------------------------------------------------------------- reading
def read_bytes(path: str | os.PathLike[str]) -> bytes:
    """The bytes of a run file; a missing, unreadable or empty file raises :class:`RunFileError`."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        raise RunFileError(path, "missing") from None
    except IsADirectoryError:
        raise RunFileError(path, "is a folder, expected a file") from None
    except OSError as e:
        raise RunFileError(path, f"cannot be read ({_one_line(e.strerror or e)})") from None
    if not data:
        raise RunFileError(path, "empty file (0 bytes)")
    return data


def read_json(path: str | os.PathLike[str], data: bytes | None = None) -> Any:
    """Parse a JSON run file (UTF-8); any problem raises :class:`RunFileError` naming it."""
    data = read_bytes(path) if data is None else data
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RunFileError(
            path, f"not UTF-8 text (byte {e.start} is {data[e.start]:#04x})"
        ) from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise RunFileError(
            path, f"not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})"
        ) from None
    except RecursionError:
        raise RunFileError(path, "not valid JSON (nested too deeply)") from None


def read_json_object(path: str | os.PathLike[str], required: tuple[str, ...] = ()) -> dict:
    """A JSON run file that must hold an object with the ``required`` keys."""
    obj = read_json(path)
    if not isinstance(obj, dict):
        raise RunFileError(path, f"expected a JSON object {{...}}, found {_json_kind(obj)}")
    missing = [k for k in required if k not in obj]
    if missing:
        raise RunFileError(path, f"missing key(s) {', '.join(map(repr, missing))}")
    return obj


def _json_kind(obj: Any) -> str:
    kinds = {list: "a list", str: "a string", bool: "a boolean", type(None): "null"}
    return kinds.get(type(obj), "a number")


def is_number(x: Any) -> bool:
    """A finite int or float (not a bool): what a numeric JSON setting must be."""
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


# --------------------------------------------------------------------------------- tensors
def _digest(tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 over the names, dtypes, shapes and bytes of ``tensors`` (in name order)."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}\n".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def _tensor_bytes(tensors: dict[str, torch.Tensor], metadata: dict | None = None) -> bytes:
    from safetensors.torch import save

    flat = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    return save(flat, metadata={**(metadata or {}), _DIGEST_KEY: _digest(flat)})


def save_tensors(path: str | os.PathLike[str], tensors: dict[str, torch.Tensor], metadata=None):
    """safetensors file, written atomically, with a SHA-256 of its tensors in its metadata.

    Tensors are made contiguous CPU copies first."""
    atomic_write_bytes(path, _tensor_bytes(tensors, metadata))


def load_tensors(
    path: str | os.PathLike[str], data: bytes | None = None
) -> dict[str, torch.Tensor]:
    """Read a safetensors file (or its ``data``, already read); a damaged or foreign file raises
    :class:`RunFileError`.

    Checks the header, that every tensor lies inside the file, and the checksum that
    :func:`save_tensors` stores (files written elsewhere have none; they pass unchecked).
    """
    from safetensors.torch import load

    data = read_bytes(path) if data is None else data
    if len(data) < 8:
        raise RunFileError(path, f"truncated or not a safetensors file ({len(data)} bytes)")
    n = int.from_bytes(data[:8], "little")
    if n > len(data) - 8:
        raise RunFileError(
            path,
            f"truncated or not a safetensors file (its header says {n:,} bytes, "
            f"the file has {len(data) - 8:,} after the length)",
        )
    try:
        header = json.loads(data[8 : 8 + n].decode("utf-8"))
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
        tensors = load(data)
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
        raise RunFileError(path, f"not a readable safetensors file ({_one_line(e)})") from None
    metadata = header.get("__metadata__") or {}
    expected = metadata.get(_DIGEST_KEY) if isinstance(metadata, dict) else None
    if expected is not None and expected != _digest(tensors):
        raise RunFileError(
            path, "damaged: its tensors do not match the SHA-256 checksum stored in it"
        )
    return tensors


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


def _names(names, limit: int = 4) -> str:
    names = sorted(names)
    return ", ".join(names[:limit]) + (
        f" and {len(names) - limit} more" if len(names) > limit else ""
    )


def _check_values(path, name: str, t: torch.Tensor, like: torch.Tensor, what: str) -> None:
    """``t`` must have ``like``'s shape and dtype and, if floating point, finite values."""
    if tuple(t.shape) != tuple(like.shape):
        raise RunFileError(
            path,
            f"tensor {name!r} has shape {tuple(t.shape)}, {what} needs {tuple(like.shape)}; "
            "the file belongs to another model, or config.json / tokenizer.json changed",
        )
    if t.dtype != like.dtype:
        raise RunFileError(
            path, f"tensor {name!r} is {str(t.dtype)[6:]}, expected {str(like.dtype)[6:]}"
        )
    if t.is_floating_point() or t.is_complex():
        bad = int((~torch.isfinite(t)).sum())
        if bad:
            raise RunFileError(
                path,
                f"tensor {name!r} has {bad:,} NaN or infinite value(s) of {t.numel():,}; "
                "the weights are unusable (training diverged, or the file was altered)",
            )


def check_model_tensors(
    model: torch.nn.Module, tensors: dict[str, torch.Tensor], path: str | os.PathLike[str]
) -> None:
    """Raise :class:`RunFileError` unless ``tensors`` are exactly a state of ``model``: the same
    names (tied weights once), shapes and dtypes, and finite values."""
    expected = model_state(model)
    missing, unexpected = set(expected) - set(tensors), set(tensors) - set(expected)
    if missing or unexpected:
        detail = []
        if missing:
            detail.append(f"missing {_names(missing)}")
        if unexpected:
            detail.append(f"unexpected {_names(unexpected)}")
        raise RunFileError(
            path,
            f"its tensors are not the weights of this model ({'; '.join(detail)}); was it "
            "written for another model or by another program?",
        )
    for name, like in expected.items():
        _check_values(path, name, tensors[name], like, "the model")


def load_model_state(
    model: torch.nn.Module,
    tensors: dict[str, torch.Tensor],
    path: str | os.PathLike[str] = "the checkpoint",
) -> None:
    """Check ``tensors`` (:func:`check_model_tensors`) and load them into ``model``."""
    check_model_tensors(model, tensors, path)
    model.load_state_dict(tensors, strict=False)  # tied entries are restored through their twin


def load_weights(model: torch.nn.Module, path: str | os.PathLike[str]) -> None:
    """Read, check and load a weights file into ``model``."""
    load_model_state(model, load_tensors(path), path)


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


def pack_rng_states(states: list[tuple[dict[str, torch.Tensor], dict]]) -> tuple[dict, dict]:
    """(tensors, json) of a checkpoint from the :func:`rng_state` of every process, by rank.

    Process 0's keep the names a single process's have (tensors ``rng.torch``, ``rng.cuda.I``;
    ``python`` and ``numpy`` in the json); process R's tensors are ``rng.rankR.torch`` and
    ``rng.rankR.cuda.I``, its json ``ranks[R - 1]``; ``world_size`` is the number of processes.
    """
    tensors, info = states[0]
    tensors, info = dict(tensors), {**info, "world_size": len(states), "ranks": []}
    for rank, (own_tensors, own_info) in enumerate(states[1:], start=1):
        tensors.update({f"rng.rank{rank}.{k[4:]}": t for k, t in own_tensors.items()})
        info["ranks"].append(own_info)
    return tensors, info


def _rng_of(tensors: dict[str, torch.Tensor], info: dict, rank: int) -> tuple[dict, Any]:
    """The :func:`rng_state` of process ``rank`` in a checkpoint's (tensors, json)."""
    if rank == 0:
        own = {k: t for k, t in tensors.items() if k.startswith("rng.")}
        return {k: t for k, t in own.items() if not k.startswith("rng.rank")}, info
    prefix = f"rng.rank{rank}."
    own = {"rng." + k[len(prefix) :]: t for k, t in tensors.items() if k.startswith(prefix)}
    return own, info["ranks"][rank - 1]


def _saved_world(info: dict) -> int:
    return info.get("world_size", 1)  # (checkpoints before it: one process's states)


def _python_state(info: dict):
    version, internal, gauss = info["python"]
    return version, tuple(internal), gauss


def _numpy_state(info: dict):
    name, keys, *rest = info["numpy"]
    return (name, np.array(keys, dtype=np.uint32), *rest)


def _check_rng(tensors: dict[str, torch.Tensor], info: Any, tensor_path, json_path) -> None:
    """Raise unless the saved generator states of every process can be restored (tried on
    throwaway generators)."""
    for name, t in tensors.items():
        if name.startswith("rng."):
            if t.dtype != torch.uint8 or t.dim() != 1:
                raise RunFileError(tensor_path, f"tensor {name!r} is not a generator state")
    if not isinstance(info, dict):
        raise RunFileError(json_path, "'rng' must be an object")
    world, ranks = _saved_world(info), info.get("ranks", [])
    if not (is_int(world) and world >= 1 and isinstance(ranks, list) and len(ranks) == world - 1):
        raise RunFileError(
            json_path,
            f"'rng' must hold 'world_size' (an integer >= 1, got {world!r}) and, in 'ranks', the "
            "generator states of the processes other than process 0 (one each)",
        )
    for rank in range(world):
        own_tensors, own_info = _rng_of(tensors, info, rank)
        name = "rng.torch" if rank == 0 else f"rng.rank{rank}.torch"
        if "rng.torch" not in own_tensors:
            raise RunFileError(
                tensor_path,
                f"has no {name!r} tensor (the random generator state of process {rank})",
            )
        try:
            torch.Generator().set_state(own_tensors["rng.torch"])
        except Exception as e:  # noqa: BLE001
            raise RunFileError(
                tensor_path, f"{name!r} is not a generator state ({_one_line(e)})"
            ) from None
        try:
            random.Random().setstate(_python_state(own_info))
            np.random.RandomState().set_state(_numpy_state(own_info))
            if not all(is_int(x) for x in own_info["python"][1]):
                raise TypeError("the Python state must be integers")
        except Exception as e:  # noqa: BLE001 - whatever the generators reject
            raise RunFileError(
                json_path,
                f"'rng' does not hold valid Python / NumPy generator states of process {rank} "
                f"({_one_line(e)})",
            ) from None


def set_rng_state(
    tensors: dict[str, torch.Tensor], info: dict, *, rank: int = 0, world: int = 1
) -> str | None:
    """Restore process ``rank``'s generators (of ``world`` processes) from a checkpoint's
    (checked) states; None, or a note saying what was done instead.

    A checkpoint of as many processes gives each its own states back. One of another number
    of processes cannot (whose would process 2 of 3 take, from a checkpoint of 2?); then, as
    at the start of a run, every process restores the Python and NumPy generators of process
    0 (seeded alike on every process) and seeds torch's (CPU and CUDA) with a number drawn from
    the checkpoint and its rank: reproducible, different on each process, but not the
    generators an uninterrupted run would have had. The note says so.
    """
    saved = _saved_world(info)
    same = saved == world
    own_tensors, own_info = _rng_of(tensors, info, rank if same else 0)
    torch.set_rng_state(own_tensors["rng.torch"])
    cuda = sorted(k for k in own_tensors if k.startswith("rng.cuda."))
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([own_tensors[k] for k in cuda])
    random.setstate(_python_state(own_info))
    np.random.set_state(_numpy_state(own_info))  # noqa: NPY002
    if same:
        return None
    h = hashlib.sha256(own_tensors["rng.torch"].numpy().tobytes() + b"rank %d" % rank)
    torch.manual_seed(int.from_bytes(h.digest()[:8], "little"))  # (CPU and every CUDA device)
    return (
        f"its random generators are those of {saved} process(es) and this run has {world}: "
        "each process starts fresh ones, seeded from the checkpoint and its rank (dropout "
        "masks differ between processes, as they should, but not as in an uninterrupted run)"
    )


def _plain(x):
    return x.item() if hasattr(x, "item") else x


# --------------------------------------------------------------------------------- optimizer
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


def _same_kind(saved: Any, current: Any) -> bool:
    if isinstance(current, bool) or current is None:
        return saved is None or isinstance(saved, bool)
    if is_number(current):
        return is_number(saved)
    if isinstance(current, list | tuple):
        return (
            isinstance(saved, list)
            and len(saved) == len(current)
            and all(_same_kind(s, c) for s, c in zip(saved, current, strict=True))
        )
    return type(saved) is type(current)


def _check_optimizer(
    optimizer: torch.optim.Optimizer, tensors: dict, info: Any, tensor_path, json_path
) -> None:
    """Raise unless the saved optimizer state fits ``optimizer``: its parameter groups, and
    per parameter moments of the parameter's shape and dtype, finite."""
    current = optimizer.state_dict()["param_groups"]
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if not isinstance(info, dict) or not isinstance(info.get("param_groups"), list):
        raise RunFileError(json_path, "'optimizer' must hold 'param_groups' (a list)")
    groups, scalars = info["param_groups"], info.get("scalars", {})
    if len(groups) != len(current) or not all(isinstance(g, dict) for g in groups):
        raise RunFileError(
            json_path,
            f"'optimizer' has {len(groups)} parameter groups, the model needs {len(current)}",
        )
    for i, (saved, now) in enumerate(zip(groups, current, strict=True)):
        if saved.get("params") != now["params"]:
            raise RunFileError(
                json_path, f"optimizer group {i} lists other parameters than the model has"
            )
        for key, value in now.items():
            if key != "params" and (key not in saved or not _same_kind(saved[key], value)):
                raise RunFileError(
                    json_path,
                    f"optimizer group {i}: setting {key!r} is missing or of the wrong type",
                )
    if not isinstance(scalars, dict) or not all(
        re.fullmatch(r"\d+\.\w+", str(k)) and int(k.split(".")[0]) < len(params) and is_number(v)
        for k, v in scalars.items()
    ):
        raise RunFileError(json_path, "'optimizer' has malformed 'scalars'")
    names_by_param: dict[int, set] = {}
    for key, t in tensors.items():
        if key.startswith("rng."):
            continue
        m = re.fullmatch(r"optim\.(\d+)\.(\w+)", key)
        if m is None or int(m.group(1)) >= len(params):
            raise RunFileError(tensor_path, f"unexpected tensor {key!r} (not an optimizer state)")
        idx, name = int(m.group(1)), m.group(2)
        names_by_param.setdefault(idx, set()).add(name)
        if name == "step":  # Adam's step count: one finite number >= 0
            if t.numel() != 1 or not t.is_floating_point() or not bool(torch.isfinite(t).all()):
                raise RunFileError(tensor_path, f"tensor {key!r} is not a step count")
            continue
        _check_values(tensor_path, key, t, params[idx].detach(), f"parameter {idx}")
    if len({frozenset(v) for v in names_by_param.values()}) > 1:
        raise RunFileError(tensor_path, "the parameters have different optimizer states")


# --------------------------------------------------------------------------------- checkpoints
def save_checkpoint(
    run_dir: str | os.PathLike[str],
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    state: dict,
    *,
    keep: int = 1,
    rng: list[tuple[dict[str, torch.Tensor], dict]] | None = None,
) -> Path:
    """Write a complete checkpoint folder, point ``LATEST`` at it, then delete older ones.

    No checkpoint is deleted before its replacement is complete and named by ``LATEST``: a
    ``kill -9`` at any point leaves a run that resumes from its last complete checkpoint.

    Args:
        run_dir: the run directory.
        step: optimizer steps done; names the folder.
        model: the (unwrapped) model.
        optimizer: its optimizer.
        state: JSON-able training state (epoch, position, history, ...). RNG states are added.
        keep: how many checkpoint folders to keep (>= 1).
        rng: the :func:`rng_state` of every process, by rank (default: this process's alone).
    """
    root = Path(run_dir) / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    name = f"step-{step:08d}"
    tmp = make_temp_dir(root, prefix=f".{name}.")
    try:
        files = {}

        def write(fname: str, data: bytes) -> None:
            # in a temporary folder nobody reads: plain writes, flushed; the folder's entries
            # are flushed once, with the manifest's
            with open(tmp / fname, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            files[fname] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}

        write(WEIGHTS, _tensor_bytes(model_state(model)))
        kill_point("checkpoint:writing")  # a half-written temporary folder
        opt_tensors, opt_info = _optimizer_tensors(optimizer)
        rng_tensors, rng_info = pack_rng_states(rng if rng is not None else [rng_state()])
        write(OPTIMIZER, _tensor_bytes({**opt_tensors, **rng_tensors}))
        state = {**state, "optimizer": opt_info, "rng": rng_info}
        write(STATE, (json.dumps(state, indent=1, ensure_ascii=False) + "\n").encode("utf-8"))
        manifest = {"step": step, "saved_ns": time.time_ns(), "files": files}
        atomic_write_json(tmp / MANIFEST, manifest)  # last: the folder is complete
        kill_point("checkpoint:complete")  # complete, not yet renamed
        final = root / name
        n = 0
        while final.exists():  # a checkpoint of this step exists: keep it until LATEST moves
            n += 1
            final = root / f"{name}.{n}"
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_path(root)
    kill_point("checkpoint:renamed")  # two complete folders; LATEST names the older
    atomic_write_text(root / LATEST, final.name + "\n")
    kill_point("checkpoint:latest")  # LATEST names the new folder; the old one is still there
    older = [f for f in checkpoint_folders(run_dir) if f != final]
    for old in older[max(0, keep - 1) :]:
        _remove_checkpoint(old)
    clean_checkpoints(run_dir)
    return final


def _remove_checkpoint(folder: Path) -> None:
    """Delete a checkpoint folder, its manifest first: killed midway, what is left of it is a
    folder without a manifest, which no reader takes for a checkpoint."""
    (folder / MANIFEST).unlink(missing_ok=True)
    fsync_path(folder)
    kill_point("checkpoint:deleting")  # a half-deleted old folder
    shutil.rmtree(folder, ignore_errors=True)


def _read_manifest(folder: Path) -> dict | None:
    """The folder's manifest when it parses and names the checkpoint files; else None."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    ok = (
        isinstance(manifest, dict)
        and is_int(manifest.get("step"))
        and isinstance(manifest.get("files"), dict)
        and set(manifest["files"]) == set(CHECKPOINT_FILES)
    )
    return manifest if ok else None


def _latest_name(root: Path) -> str | None:
    try:
        name = (root / LATEST).read_text(encoding="utf-8").strip()
    except (OSError, ValueError):
        return None
    return name if _FOLDER_NAME.fullmatch(name) else None


def _is_legacy(folder: Path) -> bool:
    """A checkpoint of attnlab before manifests (state.json was its completion mark)."""
    return all((folder / f).is_file() for f in CHECKPOINT_FILES)


def checkpoint_folders(run_dir: str | os.PathLike[str]) -> list[Path]:
    """The complete checkpoint folders of a run, the one to resume from first.

    Complete means it has its manifest (written last). ``LATEST``'s folder comes first when it
    is complete; then the others, newest first. A folder without a manifest counts only when
    ``LATEST`` names it and it has all its files (a checkpoint written before manifests).
    """
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = []
    for folder in root.iterdir():
        if _FOLDER_NAME.fullmatch(folder.name) and folder.is_dir():
            manifest = _read_manifest(folder)
            if manifest is not None:
                found.append((manifest["step"], manifest.get("saved_ns", 0), folder))
    found.sort(key=lambda x: (x[0], x[1] if is_int(x[1]) else 0), reverse=True)
    folders = [f for _, _, f in found]
    latest = _latest_name(root)
    if latest is not None:
        folder = root / latest
        if folder in folders:
            folders.remove(folder)
            folders.insert(0, folder)
        elif folder.is_dir() and not (folder / MANIFEST).exists() and _is_legacy(folder):
            folders.insert(0, folder)
    return folders


def latest_checkpoint(run_dir: str | os.PathLike[str]) -> Path | None:
    """The checkpoint to resume from (see :func:`checkpoint_folders`), or None if there is none."""
    folders = checkpoint_folders(run_dir)
    return folders[0] if folders else None


def clean_checkpoints(run_dir: str | os.PathLike[str]) -> None:
    """Remove what a crash can leave behind: temporary files and folders (``.*.tmp``) of the
    checkpoint folder and of the run files training writes, and checkpoint folders without a
    manifest (half written or half deleted) that are not the one ``LATEST`` names. Complete
    checkpoints, even damaged ones, are left alone."""
    run_dir = Path(run_dir)
    root = run_dir / CHECKPOINTS
    leftovers = list(root.glob(".*.tmp")) if root.is_dir() else []
    for name in (CONFIG, TOKENIZER, WEIGHTS, RESULTS, TRAIN_LOG):  # not others' files in RUN_DIR
        leftovers += run_dir.glob(f".{name}.*.tmp")
    for leftover in leftovers:
        if leftover.is_dir():
            shutil.rmtree(leftover, ignore_errors=True)
        else:
            leftover.unlink(missing_ok=True)
    if not root.is_dir():
        return
    keep = set(checkpoint_folders(run_dir))
    for folder in root.iterdir():
        if _FOLDER_NAME.fullmatch(folder.name) and folder.is_dir() and folder not in keep:
            if not (folder / MANIFEST).exists():
                shutil.rmtree(folder, ignore_errors=True)


def _check_state(state: Any, path: Path) -> None:
    """The training state must have the types the trainer relies on."""
    if not isinstance(state, dict):
        raise RunFileError(path, f"expected a JSON object, found {_json_kind(state)}")
    for key in ("step", "optimizer", "rng"):
        if key not in state:
            raise RunFileError(path, f"missing key {key!r}")
    for key in ("step", "epoch", "position", "tokens"):
        if key in state and not (is_int(state[key]) and state[key] >= 0):
            raise RunFileError(path, f"{key!r} must be an integer >= 0, got {state[key]!r}")
    for key in ("elapsed", "cpu_seconds", "epochs_done"):
        if key in state and not (is_number(state[key]) and state[key] >= 0):
            raise RunFileError(path, f"{key!r} must be a number >= 0, got {state[key]!r}")
    history = state.get("history", [])
    if not isinstance(history, list) or not all(
        isinstance(r, dict) and is_int(r.get("step")) for r in history
    ):
        raise RunFileError(path, "'history' must be a list of validation records")


def read_checkpoint_state(folder: str | os.PathLike[str]) -> dict:
    """The training state of a checkpoint folder (its ``state.json``: step, epoch, elapsed,
    history, ...), checked; without loading its tensors."""
    path = Path(folder) / STATE
    state = read_json(path)
    _check_state(state, path)
    return state


def load_checkpoint(
    folder: str | os.PathLike[str],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    rank: int = 0,
    world: int = 1,
) -> dict:
    """Restore model, optimizer and RNG states from a checkpoint folder; return its state.

    Everything is read and checked first (checksums, tensor names, shapes, dtypes, finite
    values, the optimizer's groups, the generator states); only then is anything restored, so
    a damaged checkpoint raises :class:`RunFileError` and leaves model and optimizer untouched.
    Process ``rank`` of ``world`` restores its own generators (:func:`set_rng_state`; what is
    done for a checkpoint of another number of processes is said on stderr, by process 0).
    """
    folder = Path(folder)
    state, weights, tensors = _read_checkpoint(folder, model)
    _check_optimizer(optimizer, tensors, state["optimizer"], folder / OPTIMIZER, folder / STATE)
    # checked: now restore
    model.load_state_dict(weights, strict=False)
    optimizer.load_state_dict(_optimizer_state_dict(tensors, state.pop("optimizer")))
    note = set_rng_state(tensors, state.pop("rng"), rank=rank, world=world)
    if note is not None and rank == 0:
        print(f"note: checkpoint {folder.name}: {note}", file=sys.stderr)
    return state


def _read_checkpoint(
    folder: Path, model: torch.nn.Module
) -> tuple[dict, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``(state, weights, optimizer and RNG tensors)`` of a checkpoint folder, every file
    checked (checksums, the state's keys, the weights against ``model``, the generator states);
    all but the optimizer's groups, which need the optimizer."""
    state, blobs = _read_files(folder)
    weights = load_tensors(folder / WEIGHTS, blobs[WEIGHTS])
    check_model_tensors(model, weights, folder / WEIGHTS)
    tensors = load_tensors(folder / OPTIMIZER, blobs[OPTIMIZER])
    _check_rng(tensors, state["rng"], folder / OPTIMIZER, folder / STATE)
    return state, weights, tensors


def _read_files(folder: Path) -> tuple[dict, dict[str, bytes]]:
    """``(state, bytes of each file)`` of a checkpoint folder: every file matches the checksum
    in its manifest (a folder from before manifests has none), and the state reads and is
    checked."""
    manifest = _read_manifest(folder)
    blobs = {}
    for fname in CHECKPOINT_FILES:
        blobs[fname] = read_bytes(folder / fname)
        if manifest is not None:
            entry = manifest["files"][fname]
            digest = hashlib.sha256(blobs[fname]).hexdigest()
            if not isinstance(entry, dict) or entry.get("sha256") != digest:
                size = entry.get("bytes") if isinstance(entry, dict) else "?"
                raise RunFileError(
                    folder / fname,
                    f"damaged: its {len(blobs[fname]):,} bytes do not match the checksum in "
                    f"{MANIFEST} (written with {size} bytes)",
                )
    state = read_json(folder / STATE, blobs[STATE])
    _check_state(state, folder / STATE)
    if manifest is not None and manifest["step"] != state["step"]:
        raise RunFileError(
            folder / STATE, f"step {state['step']} but {MANIFEST} says {manifest['step']}"
        )
    return state, blobs


def intact_checkpoint(
    run_dir: str | os.PathLike[str], *, quiet: bool = False
) -> tuple[Path, dict] | None:
    """The newest checkpoint whose files read intact, and its checked state: ``(folder,
    state)``, or None when the run has no checkpoint.

    The checkpoint :func:`resume_checkpoint` will resume from, for what needs it before a
    model exists (the step a resume starts at, the budget left) or without an optimizer (an
    unfinished run's weights): tries :func:`checkpoint_folders` in order, each file against
    its manifest's checksum; a damaged one is named on stderr (unless ``quiet``) and skipped
    for the next. When every one is damaged, the first one's :class:`RunFileError` is raised.
    (:func:`latest_checkpoint` reads no file: a damaged newest folder is still its answer.)
    """
    errors: list[RunFileError] = []
    for folder in checkpoint_folders(run_dir):
        try:
            state, _ = _read_files(folder)
        except RunFileError as e:
            errors.append(e)
            continue
        for e in errors if not quiet else ():
            print(f"note: skipped a damaged checkpoint: {e}; using {folder.name}", file=sys.stderr)
        return folder, state
    if errors:
        raise errors[0]
    return None


def check_resumable(
    run_dir: str | os.PathLike[str],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
) -> Path | None:
    """The checkpoint folder that :func:`resume_checkpoint` will load for ``model`` (and
    ``optimizer``: its parameter groups are checked too), checked without restoring anything;
    None when the run has no checkpoint.

    Called before a resumed session changes the run folder (its config.json, its final files):
    when every checkpoint is damaged, the first one's :class:`RunFileError` is raised here and
    the folder is left as it was.
    """
    errors: list[RunFileError] = []
    for folder in checkpoint_folders(run_dir):
        try:
            state, _, tensors = _read_checkpoint(folder, model)
            if optimizer is not None:
                opt_file, state_file = folder / OPTIMIZER, folder / STATE
                _check_optimizer(optimizer, tensors, state["optimizer"], opt_file, state_file)
        except RunFileError as e:
            errors.append(e)
            continue
        return folder
    if errors:
        raise errors[0]
    return None


def resume_checkpoint(
    run_dir: str | os.PathLike[str],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    rank: int = 0,
    world: int = 1,
) -> tuple[Path, dict] | None:
    """Load the newest usable checkpoint of a run: ``(folder, state)``, or None if it has none.

    Tries :func:`checkpoint_folders` in order; a damaged one is reported on stderr and skipped
    for the next. If every one is damaged, the first one's :class:`RunFileError` is raised: a
    run with checkpoints never silently starts over. ``rank`` and ``world``: see
    :func:`load_checkpoint`.
    """
    errors: list[RunFileError] = []
    for folder in checkpoint_folders(run_dir):
        try:
            state = load_checkpoint(folder, model, optimizer, rank=rank, world=world)
        except RunFileError as e:
            errors.append(e)
            continue
        for e in errors if rank == 0 else ():
            print(
                f"note: skipped a damaged checkpoint: {e}; resuming from {folder.name}",
                file=sys.stderr,
            )
        return folder, state
    if errors:
        raise errors[0]
    return None
