"""Progress bars that suit where they are written.

On a terminal (or in a notebook) a live tqdm bar. Anywhere else -- a log file, a pipe, CI --
a redrawn bar would pile up its redraws, so :class:`LogLines` writes one plain line per minute
instead (and a last line when it ends, if it wrote any): a 15-minute training run leaves about
15 lines in its log, and a 10-second translation none.

Both answer the part of tqdm's interface attnlab uses: iteration, ``update``, ``n``,
``set_postfix_str``, ``write`` and ``close``.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable
from typing import Any, TextIO

LOG_INTERVAL = 60.0  # seconds between two lines when the output is not a terminal


def live_output(file: TextIO) -> bool:
    """Whether a bar can redraw itself in ``file``: a terminal, or a Jupyter/IPython kernel."""
    try:
        if file.isatty():
            return True
    except (AttributeError, ValueError):  # no isatty, or closed
        return False
    return "ipykernel" in sys.modules


def progress_bar(
    iterable: Iterable | None = None,
    *,
    total: int | None = None,
    desc: str = "",
    unit: str = "it",
    file: TextIO | None = None,
    **tqdm_options: Any,
):
    """A tqdm bar when ``file`` (default stderr) is live, else a :class:`LogLines`."""
    file = file if file is not None else sys.stderr
    if live_output(file):
        from tqdm.auto import tqdm

        return tqdm(iterable, total=total, desc=desc, unit=unit, file=file, **tqdm_options)
    return LogLines(iterable, total=total, desc=desc, unit=unit, file=file)


class LogLines:
    """tqdm's counting without its redrawing: one line per ``interval`` seconds, at most."""

    def __init__(
        self,
        iterable: Iterable | None = None,
        *,
        total: int | None = None,
        desc: str = "",
        unit: str = "it",
        file: TextIO | None = None,
        interval: float = LOG_INTERVAL,
        clock=time.monotonic,
    ):
        self.iterable = iterable
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            total = len(iterable)  # type: ignore[arg-type]
        self.total, self.desc, self.unit = total, desc, unit
        self.file = file if file is not None else sys.stderr
        self.interval, self.clock = interval, clock
        self.n = 0
        self.postfix = ""
        self.lines = 0
        self.start = self.last = clock()

    def __iter__(self):
        for item in self.iterable or ():
            yield item
            self.update(1)
        self.close()

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.clock() - self.last >= self.interval:
            self._line()

    def set_postfix_str(self, text: str = "", refresh: bool = True) -> None:
        self.postfix = text

    def write(self, text: str) -> None:
        print(text, file=self.file, flush=True)

    def close(self) -> None:
        if self.lines:  # a log that said "running" also says "done"
            self._line()
            self.lines = 0

    def _line(self) -> None:
        now = self.clock()
        done = f"{100 * self.n / self.total:.0f}%" if self.total else f"{self.n} {self.unit}"
        elapsed = _clock_time(now - self.start)
        tail = f" {self.postfix}" if self.postfix else ""
        print(f"{self.desc}: {done}, {elapsed} elapsed{tail}", file=self.file, flush=True)
        self.last = now
        self.lines += 1


def _clock_time(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"
