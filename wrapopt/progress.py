"""wrapopt's own lines on the terminal, and progress bars, apart from the libraries' noise.

``console()`` is where wrapopt's own lines go: stderr, or, in a rank whose
output goes to a log file (``launch.spawn(log_dir=...)``, See [Note: quiet
ranks] in launch.py), the terminal the rank was started from. ``say(msg)``
prints one line there.

``Progress`` counts the steps of a long loop (profiling, the search's trials,
benchmark rounds). Three ways to show it, chosen once:

- a tqdm bar, when tqdm is installed (``pip install 'wrapopt[progress]'``) and
  the console is a terminal that knows its width;
- one self-overwriting line (``\\r``) on a terminal without tqdm;
- plain lines when the console is not a terminal (a log file, CI): one every
  ``every_s`` seconds at most, and one at the end with the count and the time,
  so that a log holds a few lines, never one per step.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, TextIO

__all__ = ["console", "set_console", "say", "Progress", "PLAIN_EVERY_S"]

PLAIN_EVERY_S = 10.0  # plain lines (not a terminal): at most one per this many seconds, and the last

_console: TextIO | None = None  # set in a quiet rank: the terminal it was started from


def console() -> TextIO:
    """Where wrapopt's own lines go: stderr, unless ``set_console`` chose another stream."""
    return _console if _console is not None else sys.stderr


def set_console(stream: TextIO | None) -> None:
    """Send wrapopt's own lines to ``stream`` (None: back to stderr). ``launch`` calls this in a
    rank whose stdout and stderr go to a log file."""
    global _console
    _console = stream


def say(msg: str) -> None:
    """One line of wrapopt's own on the console."""
    print(msg, file=console(), flush=True)


def _is_tty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed file
        return False


def _has_width(stream: Any) -> bool:
    """A terminal that knows its width (a pseudo-terminal may say 0 columns, where tqdm draws nothing)."""
    try:
        return os.get_terminal_size(stream.fileno()).columns > 0
    except (AttributeError, ValueError, OSError):
        return False


def _tqdm() -> Any:
    """tqdm's class, or None when the extra is not installed (an optional dependency: loaded here only)."""
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm


class Progress:
    """A progress display over ``total`` steps: ``update()`` after each, ``close()`` at the end.

    Args:
        total: the number of steps expected.
        desc: what is counted, first on the line ("profile", "search", "bench").
        unit: the name of one step, for the final plain line ("trial", "round").
        enabled: False shows nothing (rank > 0, ``--no-progress``).
        stream: default ``console()``.
        every_s: plain lines only: the least time between two lines before the last.

    Example:
        >>> with Progress(3, desc="bench", unit="round", stream=io.StringIO()) as bar:  # doctest: +SKIP
        ...     for _ in range(3):
        ...         bar.update(note="fastest 61.2 ms")
    """

    def __init__(self, total: int, *, desc: str, unit: str = "step", enabled: bool = True,
                 stream: TextIO | None = None, every_s: float = PLAIN_EVERY_S):
        self.total, self.desc, self.unit, self.every_s = max(int(total), 0), desc, unit, every_s
        self.done = 0
        self.note: str | None = None
        self.stream = stream if stream is not None else console()
        self._t0 = self._last = time.monotonic()
        self._closed = not enabled
        self._bar = None
        self._drawn = False  # line mode: the first update draws at once
        self.mode = "off"
        if enabled:
            tty = _is_tty(self.stream)
            tqdm = _tqdm() if tty and _has_width(self.stream) else None
            self.mode = "tqdm" if tqdm is not None else "line" if tty else "plain"
            if tqdm is not None:
                self._bar = tqdm(total=self.total, desc=desc, unit=unit, file=self.stream, dynamic_ncols=True,
                                 leave=True)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def update(self, n: int = 1, *, note: str | None = None) -> None:
        """``n`` more steps done; ``note`` (e.g. the best so far) is shown beside the count."""
        self.set(self.done + n, note=note)

    def set(self, done: int, *, note: str | None = None) -> None:
        """``done`` steps done in all (a study's count of finished trials, which other workers add to)."""
        if self._closed:
            return
        done = min(done, self.total) if self.total else done
        step, self.done = done - self.done, done
        if note is not None:
            self.note = note
        now = time.monotonic()
        if self.mode == "tqdm":
            if note is not None:
                self._bar.set_postfix_str(note, refresh=False)
            self._bar.update(step)
        elif self.mode == "line":
            if now - self._last >= 0.1 or self.done >= self.total or not self._drawn:
                self._last, self._drawn = now, True
                self._write(f"\r{self._text()}\033[K")
        elif now - self._last >= self.every_s and self.done < self.total:
            self._last = now
            self._write(self._text() + "\n")

    def close(self, *, note: str | None = None) -> None:
        """End the display: tqdm's bar closes; the line ends; plain mode writes its last line.
        ``note`` replaces the last one ("" drops it)."""
        if self._closed:
            return
        if note is not None:
            self.note = note
            if self.mode == "tqdm":
                self._bar.set_postfix_str(note, refresh=False)
        self._closed = True
        if self.mode == "tqdm":
            self._bar.close()
        elif self.mode == "line":
            self._write(f"\r{self._text()}\033[K\n")
        else:
            self._write(f"{self._text()} in {time.monotonic() - self._t0:.1f} s\n")

    def _text(self) -> str:
        count = f"{self.done}/{self.total}" if self.total else str(self.done)
        return f"{self.desc}: {count} {self.unit}s" + (f", {self.note}" if self.note else "")

    def _write(self, text: str) -> None:
        self.stream.write(text)
        self.stream.flush()
