"""Files and sizes: atomic writes, the one JSON reader, human-readable byte counts."""

from __future__ import annotations

import json
import math
import os
import re
import tempfile
from typing import Any

from wrapopt.errors import OptionError, WrapoptError

__all__ = ["atomic_write_text", "atomic_write_bytes", "atomic_write_json", "check_writable", "read_json", "JsonReader",
           "field_unit", "write_between",
           "fmt_bytes",
           "parse_bytes"]


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and ``os.replace``:
    readers see the old file or the new one, never half of one."""
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file and ``os.replace`` (as
    ``atomic_write_text``): a symlink at ``path`` is replaced, never written through."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=os.path.basename(path), dir=directory)
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; a results file should read like any other
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def write_between(path: str | os.PathLike, block: str, begin: str, end: str) -> None:
    """Put ``block`` (which starts with ``begin`` and ends with ``end``) into the text file
    ``path`` in place of what those markers held there, else append it; atomically. Benchmarks
    that each own one section of a shared results file write through this."""
    if not (block.startswith(begin) and block.rstrip("\n").endswith(end)):
        raise ValueError(f"the section for {os.fspath(path)} must start with {begin!r} and end with {end!r}")
    path = os.fspath(path)
    text = open(path, encoding="utf-8").read() if os.path.exists(path) else ""
    if begin in text and end in text[text.index(begin):]:
        start = text.index(begin)
        stop = text.index(end, start) + len(end)
        text = text[:start] + block.rstrip("\n") + text[stop:]
    else:
        text = text.rstrip("\n") + "\n\n" + block.rstrip("\n") + "\n"
    atomic_write_text(path, text)


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def check_writable(path: str | os.PathLike) -> None:
    """Raise OSError now if ``path`` cannot be written later (before long work starts)."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path)) or "."
    os.makedirs(directory, exist_ok=True)
    if not os.access(directory, os.W_OK) or (os.path.isdir(path)):
        raise OSError(f"cannot write {path}: directory not writable or path is a directory")


def read_json(path: str | os.PathLike, *, error: type[WrapoptError] = WrapoptError, hint: str = "") -> Any:
    """Parse a JSON file (never pickle or eval): the one JSON reader of wrapopt.

    Errors are ``error`` (a ``WrapoptError`` subclass) and name the file; ``hint``
    (formatted with ``path``) says what to do when the file is missing.
    """
    where = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        extra = f"; {hint.format(path=where)}" if hint else ""
        raise error(f"{where}: no such file{extra}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise error(f"{where}: not valid JSON ({e})") from None


# A numeric field's unit, read from its name's suffix (the house names carry units: ``latency_s``).
_UNIT_SUFFIXES = (("_bytes_per_s", "bytes per second"), ("flops_per_s", "FLOP per second"), ("_bytes", "bytes"),
                  ("_s", "seconds"), ("_fraction", "a fraction of 1"), ("world_size", "ranks"),
                  ("ranks_per_node", "ranks"), ("gpus_per_node", "GPUs"))


def field_unit(key: str) -> str:
    """`` (seconds)`` for ``latency_s``: the unit a numeric field is written in, or ``""``."""
    return next((f" ({unit})" for suffix, unit in _UNIT_SUFFIXES if key.endswith(suffix)), "")


class JsonReader:
    """Field access on a parsed JSON object with errors that name the file and the field."""

    def __init__(self, d: Any, where: str, *, error: type[WrapoptError] = WrapoptError):
        if not isinstance(d, dict):
            raise error(f"{where}: expected a JSON object, got {type(d).__name__}")
        self.d, self.where, self.error = d, where, error

    def get(self, key: str, typ: type | tuple[type, ...]) -> Any:
        if key not in self.d:
            raise self.error(f"{self.where}: missing field {key!r}{field_unit(key)}")
        v = self.d[key]
        if not isinstance(v, typ):
            name = typ.__name__ if isinstance(typ, type) else " or ".join(t.__name__ for t in typ)
            raise self.error(f"{self.where}: field {key!r}{field_unit(key)} must be {name}, got {type(v).__name__}")
        return v

    def num(self, key: str, default: float | None = None, *, positive: bool = False) -> float:
        """A finite number of at least 0 (above 0 with ``positive``); ``default`` when the field is
        absent (None: the field is required)."""
        if default is not None and key not in self.d:
            return default
        v = self.get(key, (int, float))
        if isinstance(v, bool) or not math.isfinite(v) or v < 0 or (positive and v == 0):
            what = "a positive number" if positive else "a non-negative number"
            raise self.error(f"{self.where}: field {key!r}{field_unit(key)} must be {what}, got {v!r}")
        return float(v)

    def count(self, key: str) -> int:
        """A positive integer (ranks, sizes)."""
        v = self.get(key, int)
        if isinstance(v, bool) or v < 1:
            raise self.error(f"{self.where}: field {key!r}{field_unit(key)} must be a positive integer, got {v!r}")
        return v

    def sub(self, dotted: str) -> "JsonReader":
        cur: Any = self.d
        for part in dotted.split("."):
            if not isinstance(cur, dict) or part not in cur:
                raise self.error(f"{self.where}: missing field {dotted!r}")
            cur = cur[part]
        return JsonReader(cur, f"{self.where}: {dotted}", error=self.error)


def fmt_bytes(n: float) -> str:
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return f"{int(n)} B"


_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    # one letter, as Slurm's --mem and `numfmt --from=iec` read it: powers of two (80G = 80GiB)
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}


def parse_bytes(text: str | int | float) -> int:
    """Parse ``80GiB``, ``80GB``, ``80G`` (= GiB), ``80 gib`` or ``85899345920`` into bytes.

    Raises ValueError with what is accepted otherwise.
    """
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        if int(text) <= 0:
            raise ValueError(f"memory budget must be at least one byte, got {text}")
        return int(text)
    m = re.fullmatch(r"\s*(-?[0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read memory size {text!r}: write bytes (85899345920) or a size such as 80GiB, "
                         "80GB or 80G (= 80GiB)")
    value = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if value <= 0:
        raise ValueError(f"memory budget must be at least one byte, got {text!r}")
    return value


_BUDGET_FORMS = ("a positive number of bytes (85899345920), a size such as 80GiB, 80GB or 80G (= 80GiB), "
                 "\"auto\" (90% of the device) or \"none\" (no limit)")


def given_budget(memory_budget: Any) -> float:
    """A memory budget the user wrote as a size, in bytes; ``OptionError`` naming the argument and
    the accepted forms (the words "auto" and "none" are read by ``hardware.budget.resolve_budget``)."""
    finite = not isinstance(memory_budget, float) or math.isfinite(memory_budget)
    try:
        value = parse_bytes(memory_budget) if finite else 0
    except (ValueError, OverflowError, TypeError):  # "abc", "1e999" (inf), a list
        value = 0
    if value <= 0:
        raise OptionError(f"memory_budget (--memory) {memory_budget!r} is not a memory size: give {_BUDGET_FORMS}")
    return float(value)
