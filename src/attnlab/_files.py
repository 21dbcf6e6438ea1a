"""Files that a crash never leaves half-written.

Every file attnlab writes (checkpoints, tokenizers, results, tables, pictures, pages) goes
through :func:`atomic_write_bytes`: the bytes are written to a temporary name in the same
folder, flushed to disk and renamed over the final name with :func:`os.replace`, which POSIX
makes atomic. Whenever the process dies, a reader sees the old file or the new one, never a mix.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tempfile
from pathlib import Path
from typing import Any


def fsync_path(path: str | os.PathLike[str]) -> None:
    """Flush a file or a folder (after a rename in it) to disk; a no-op where unsupported."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write ``data`` to ``path`` so that readers see the old file or the new one, never a mix."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp makes 0600; a plain file is what users expect
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_path(path.parent)
    return path


def make_temp_dir(parent: str | os.PathLike[str], prefix: str) -> Path:
    """A new, uniquely named folder in ``parent`` (``PREFIX<random>.tmp``), with the permissions
    of a folder made by ``mkdir`` (:func:`tempfile.mkdtemp` makes it private to the user)."""
    path = Path(tempfile.mkdtemp(prefix=prefix, suffix=".tmp", dir=parent))
    os.chmod(path, 0o777 & ~_UMASK)
    return path


def atomic_write_text(path: str | os.PathLike[str], text: str) -> Path:
    """UTF-8 text, written atomically."""
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike[str], obj: Any, *, indent: int = 1) -> Path:
    """JSON (UTF-8, non-ASCII kept readable, trailing newline), written atomically."""
    return atomic_write_text(path, json.dumps(obj, indent=indent, ensure_ascii=False) + "\n")


def atomic_save_png(fig: Any, path: str | os.PathLike[str], **savefig_kwargs: Any) -> Path:
    """A matplotlib figure as PNG, rendered in memory and then written atomically."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", **savefig_kwargs)
    return atomic_write_bytes(path, buffer.getvalue())


def kill_point(label: str) -> None:
    """A test hook: ``ATTNLAB_TEST_KILL_AT=LABEL`` (or ``LABEL@N``, the N-th time) makes the
    process kill itself with SIGKILL when it reaches the point named ``label``, as a power cut
    or ``kill -9`` would. Fault tests use it to stop a run at an exact point (inside a checkpoint
    write, say); unset, it costs one dictionary lookup."""
    wanted = os.environ.get("ATTNLAB_TEST_KILL_AT")
    if not wanted:
        return
    name, _, nth = wanted.partition("@")
    if name != label:
        return
    _KILL_COUNTS[label] = _KILL_COUNTS.get(label, 0) + 1
    if _KILL_COUNTS[label] >= int(nth or 1):
        import signal

        os.kill(os.getpid(), signal.SIGKILL)


_KILL_COUNTS: dict[str, int] = {}


def _read_umask() -> int:
    mask = os.umask(0o022)  # read once, at import: os.umask is process-wide
    os.umask(mask)
    return mask


_UMASK = _read_umask()


def file_sha256(path: str | os.PathLike[str]) -> str:
    """The SHA-256 of a file's bytes (hex), read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
