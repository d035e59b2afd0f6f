"""Where a command's ranks put their own output, and the line that says so.

By default the commands that start ranks (``demo``, ``bench``,
``profile-fabric``) send the ranks' own output (library warnings, profiler
and C++ log lines) to ``<folder>/logs/rank{r}.log`` beside what they write,
and print only wrapopt's lines; ``wrapopt -v`` leaves everything on the
terminal (``wrapopt.launch.logs_line`` is that line). See [Note: quiet ranks] in wrapopt/launch.py.
"""

from __future__ import annotations

import argparse
import os

__all__ = ["rank_log_dir", "VERBOSE_HELP"]

VERBOSE_HELP = "show everything the ranks and libraries print (default: only wrapopt's lines; the rest goes to a log)"


def rank_log_dir(args: argparse.Namespace, folder: str | os.PathLike) -> str | None:
    """``folder``/logs, or None under ``-v`` (the ranks print to the terminal)."""
    return None if getattr(args, "verbose", False) else os.path.join(os.fspath(folder), "logs")
