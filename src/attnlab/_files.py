"""Files that a crash never leaves half-written.

Every file attnlab writes (checkpoints, tokenizers, results, tables, pictures, pages) goes
through :func:`atomic_write_bytes`: the bytes are written to a temporary name in the same
folder, flushed to disk and renamed over the final name with :func:`os.replace`, which POSIX
makes atomic. Whenever the process dies, a reader sees the old file or the new one, never a mix.
"""

from __future__ import annotations

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


def _read_umask() -> int:
    mask = os.umask(0o022)  # read once, at import: os.umask is process-wide
    os.umask(mask)
    return mask


_UMASK = _read_umask()
