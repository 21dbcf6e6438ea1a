"""The blocked CPU kernel in C++ (``cpu_flash.cpp``), built on this machine at first use.

:mod:`attnlab.kernels.cpu_flash` computes each block with ~20 torch ops, each a pass over the
block's scores: Python and the passes cost it 1.3-1.8x torch's own fused kernel. The C++ file
is the same algorithm with each row's passes fused into loops over one row in cache (products
through ``at::bmm``: oneDNN/MKL), and the blocks spread over torch's threads with one parallel
region per call. bfloat16 on a CPU whose oneDNN packs for it (AMX or AVX512-BF16: see
:func:`brgemm`) takes a path of its own: blocks of 64 query rows kept key-major, each product
one or two calls of oneDNN's brgemm micro-kernel (``at::native::cpublas``), scores and sums in
float32, the softmax down columns 16 rows to a vector, and the backward over key chunks of 512
(as FlashAttention-2's); 0.44-0.5x torch's bfloat16 forward+backward on one thread.

Build: :func:`module` compiles it with ``torch.utils.cpp_extension.load`` the first time a
process needs it (~1 minute on 2 cores, once per machine: torch caches the build under
``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``), for this CPU
(``-march=native``; the build's name carries the CPU's kind and torch's version, so a shared
home directory keeps one build of each). Where it cannot be built (no C++ compiler), or with
``ATTNLAB_CPU_NATIVE=0``, :func:`module` returns None and says why (:func:`unavailable`):
the torch-ops kernel serves, with the same results to rounding.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shlex
import shutil
import threading
import time
from pathlib import Path

import torch

ENV = "ATTNLAB_CPU_NATIVE"  # "0": never build or use the C++ kernel
SOURCE = Path(__file__).with_name("cpu_flash.cpp")
HEADERS = [Path(__file__).with_name("cpu_flash_brgemm.h")]  # (read in by SOURCE)
# -fopenmp: at::parallel_for is an OpenMP region compiled here (without it the blocks ran on one
# thread); the runtime is the libgomp torch ships and has loaded (one runtime, shared).
# -fno-trapping-math (as torch builds): the row loops' selects (exp2_nonpositive's clamps, a
# masked key's -inf) become vector blends; without it GCC kept them scalar, and the exp pass
# took more of a float32 forward than its two GEMMs on an AVX2 CPU. It allows no reordering.
FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=fast", "-fno-trapping-math"]

STALE_LOCK_S = 600.0
CPU_LINES = ("flags", "Features", "model name", "CPU implementer", "CPU part")
_lock = threading.Lock()
_state: dict = {}  # "module" or "why"
_forked = [False]


def _after_fork_in_child() -> None:
    _forked[0] = True


if hasattr(os, "register_at_fork"):  # (POSIX)
    os.register_at_fork(after_in_child=_after_fork_in_child)


def threads() -> int:
    """The threads a call runs on: torch's count, but 1 in a forked child.

    The blocks share an OpenMP region (``at::parallel_for``, as torch's own kernels do), and
    GNU OpenMP's threads do not survive ``fork``: a child whose parent had used them waits
    forever in its first region of 2+ threads (torch's own SDPA too; PyTorch's DataLoader
    workers run 1 thread for this reason). One thread there: slower, never stuck.
    """
    return 1 if _forked[0] else torch.get_num_threads()


def module():
    """The compiled kernel (``forward``, ``backward``), or None where it is not available."""
    if "module" in _state:
        return _state["module"]
    if "why" in _state:
        return None
    with _lock:
        if "module" not in _state and "why" not in _state:
            _build()
    return _state.get("module")


def brgemm(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether the C++ kernel's products of ``dtype`` (bfloat16 or float32) may go through
    oneDNN's brgemm here: the build has it, and for bfloat16 oneDNN packs for this CPU (AMX or
    AVX512-BF16), for float32 its float32 brgemm runs; else they are at::bmm."""
    mod = module()
    if mod is None:
        return False
    key = f"brgemm {dtype}"
    if key not in _state:
        if dtype == torch.bfloat16:
            _state[key] = bool(mod.brgemm_available())
        else:
            _state[key] = dtype == torch.float32 and bool(mod.brgemm_f32_available())
    return _state[key]


def unavailable() -> str | None:
    """None when the C++ kernel serves (it is built if need be), else why not, in one line."""
    return None if module() is not None else _state["why"]


def _build() -> None:
    if os.environ.get(ENV, "1") == "0":
        _state["why"] = f"{ENV}=0"
        return
    compiler = (shlex.split(os.environ.get("CXX", "")) or ["c++"])[0]  # ("ccache g++" too)
    if shutil.which(compiler) is None:
        _state["why"] = f"no C++ compiler ({compiler!r} not found) to build cpu_flash.cpp"
        return
    _ninja_on_path()
    name = f"attnlab_cpu_flash_{_cpu_tag()}"
    try:
        from torch.utils import cpp_extension

        folder = Path(cpp_extension._get_build_directory(name, verbose=False))
        _unlock_abandoned(folder)
        built = folder / f"{name}.so"
        if not built.exists():  # (a pause of a minute deserves a word)
            logging.getLogger("attnlab").warning(
                "attnlab: building its C++ CPU attention kernel for this machine (once, about a "
                "minute; set %s=0 to skip it)",
                ENV,
            )
        _state["module"] = cpp_extension.load(
            name=name,
            sources=[str(SOURCE)],
            extra_cflags=FLAGS,
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as error:  # a failed build leaves the torch-ops kernel serving
        lines = [line for line in str(error).splitlines() if "error" in line.lower()]
        said = (lines[-1] if lines else str(error) or type(error).__name__).strip()
        _state["why"] = f"cpu_flash.cpp did not build ({said[:300]})"


def _unlock_abandoned(folder: Path) -> None:
    """torch's builder holds a lock file while it builds, and every other process waits for it
    to go; a build killed outright (SIGKILL, out of memory) leaves it for ever. A build takes
    about a minute: a lock older than ``STALE_LOCK_S`` is an abandoned one."""
    lock = folder / "lock"
    try:
        if time.time() - lock.stat().st_mtime > STALE_LOCK_S:
            lock.unlink(missing_ok=True)
    except OSError:
        pass


def _ninja_on_path() -> None:
    """torch's builder runs ``ninja`` from PATH; the ninja wheel's binary may sit beside the
    interpreter (a virtual environment that was not activated)."""
    if shutil.which("ninja") is not None:
        return
    try:
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    except ImportError:
        pass


def _cpu_tag() -> str:
    """8 hex digits of this CPU's kind (its flags, or features and model), torch's version, the
    machine and the source (with the files it reads in): one build per kind of CPU, torch and
    source (a shared home directory keeps one of each, instead of rebuilding back and forth)."""
    try:
        with open("/proc/cpuinfo") as f:
            kind = sorted({line for line in f if line.startswith(CPU_LINES)})
    except OSError:
        kind = []
    about = [*kind, torch.__version__, platform.machine(), " ".join(FLAGS)]
    digest = hashlib.sha256("\n".join(about).encode() + SOURCE.read_bytes())
    for header in HEADERS:
        digest.update(header.read_bytes())
    return digest.hexdigest()[:8]
