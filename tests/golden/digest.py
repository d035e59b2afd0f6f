"""The compact golden format, and the comparison that names what changed.

A full dump is large (the estimates' is 25 MB), so a golden file keeps per entry
its stable key, its headline numbers at full precision (``repr`` of ``step_s``,
``peak_bytes``) and the sha256 of the entry's canonical JSON (``sort_keys``):
byte-identity of everything is still checked, and a failure names the entries
that changed and how their headline numbers moved.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass

GOLDEN_DIR = os.path.dirname(os.path.abspath(__file__))
REGEN_COMMAND = "PYTHONPATH=$PWD python -m tests.golden.regen"


@dataclass(frozen=True, slots=True)
class Entry:
    """One entry of a golden file (``step_s`` as its ``repr``; None where the entry has none)."""

    key: str
    step_s: str | None
    peak_bytes: int | None
    sha256: str


def canonical_sha256(entry: object) -> str:
    """sha256 of ``json.dumps(entry, sort_keys=True)``: equal for an entry and its JSON round trip."""
    return hashlib.sha256(json.dumps(entry, sort_keys=True).encode()).hexdigest()


def golden_path(name: str) -> str:
    return os.path.join(GOLDEN_DIR, f"{name}.golden.json")


def write_golden(name: str, entries: list[Entry]) -> str:
    """Write ``entries`` (one a line, for readable diffs); return the path."""
    keys = [e.key for e in entries]
    if len(set(keys)) != len(keys):
        raise ValueError(f"{name}: duplicate golden keys; make each entry's key unique")
    lines = [json.dumps([e.key, e.step_s, e.peak_bytes, e.sha256]) for e in entries]
    path = golden_path(name)
    with open(path, "w") as f:
        f.write("[\n" + ",\n".join(lines) + "\n]\n")
    return path


def read_golden(name: str) -> list[Entry]:
    with open(golden_path(name)) as f:
        return [Entry(*row) for row in json.load(f)]


def differences(expected: list[Entry], actual: list[Entry]) -> list[str]:
    """One line per entry that changed, appeared or disappeared (empty when all are identical)."""
    old = {e.key: e for e in expected}
    new = {e.key: e for e in actual}
    out = [f"missing: {k}" for k in old if k not in new]
    out += [f"new: {k}" for k in new if k not in old]
    for key, e in old.items():
        a = new.get(key)
        if a is None or a.sha256 == e.sha256:
            continue
        if (a.step_s, a.peak_bytes) == (e.step_s, e.peak_bytes):
            out.append(f"changed: {key}: same step and peak, other fields differ")
        else:
            out.append(f"changed: {key}: step_s {e.step_s} -> {a.step_s}, peak_bytes {e.peak_bytes} -> {a.peak_bytes}")
    return out


def failure_message(name: str, diffs: list[str], *, shown: int = 30) -> str:
    head = "\n  ".join(diffs[:shown]) + (f"\n  ... and {len(diffs) - shown} more" if len(diffs) > shown else "")
    return (f"{len(diffs)} {name} entries differ from {golden_path(name)}:\n  {head}\n"
            f"Regenerate (`{REGEN_COMMAND}`) only when this change of numbers is intended, "
            "and explain it in the commit message; otherwise the change is a regression.")
