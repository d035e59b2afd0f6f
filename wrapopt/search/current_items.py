"""The words of a ``--current`` description: each item's forms and the reader that turns the
items into fields (See [Note: the current configuration] in search/current.py, and [Note: one
item per field] below)."""

from __future__ import annotations

import re

from wrapopt.choices import CURRENT_FORMS
from wrapopt.errors import OptionError
from wrapopt.search.current_knobs import KNOBS
from wrapopt.search.current_pp import read_schedule

__all__ = ["current_error", "read_items"]


def current_error(text: str, why: str) -> OptionError:
    return OptionError(f"--current {text!r}: {why}. Accepted: {CURRENT_FORMS}")


# Each item's forms: (field, pattern); the first that matches the item (lower case, ``_`` as ``-``,
# spaces single) says it. A pattern's group is the field's count.
_COUNTS = (
    ("ckpt", r"(?:ac|ckpt|checkpoint(?:ing)?) every (\d+)(?:st|nd|rd|th)?(?: blocks?| layers?)?"),
    ("local", r"(?:training\.)?local[- ]batch(?:[- ]size)?\s*[=:]?\s*(\d+)|lbs\s*[=:]?\s*(\d+)"),
    ("count", r"(\d+) micro-?batches|(?:n-)?micro-?batches\s*[=:]?\s*(\d+)"),
    ("micro", r"(?:pp |pipeline(?:-parallel)? )?(?:micro-?batch|micro batch)(?:[- ]size)?\s*[=:]?\s*(\d+)"
              r"|mbs\s*[=:]?\s*(\d+)"),
    ("shard", r"shard\s*=?\s*(\d+)"),
    ("tp", r"(?:tp|tensor-parallel(?:[- ]degree)?)\s*[=:]?\s*(\d+)"),
    ("pp", r"(?:pp|pipeline(?:-parallel)?(?:[- ]degree)?)\s*[=:]?\s*(\d+)"),
    ("cp", r"(?:cp|context-parallel(?:[- ]degree)?)\s*[=:]?\s*(\d+)"),
    ("ep", r"(?:ep|expert-parallel(?:[- ]degree)?)\s*[=:]?\s*(\d+)"),
    ("virtual", r"(\d+) (?:virtual )?stages? per rank|(?:virtual )?stages per rank\s*[=:]?\s*(\d+)"),
)
# Gradient sync under accumulation: See [Note: current sync]
_SYNC = {"sync every": "every", "sync every micro-batch": "every", "sync each micro-batch": "every",
         "sync last": "last", "sync last micro-batch": "last", "sync on the last micro-batch": "last",
         "no sync": "last", "no-sync": "last", "nosync": "last"}
_NO_AC = ("no ac", "no ckpt", "no checkpointing", "ac none", "none ac", "no activation checkpointing")
_FULL_AC = ("full ac", "ac", "ckpt", "full ckpt", "checkpointing", "full checkpointing", "ac full",
            "full activation checkpointing")
_SELECTIVE_AC = ("selective ac", "selective-op", "selective-op ac", "sac", "selective checkpointing", "selective",
                 "selective op", "selective op ac", "op sac", "ac selective", "selective ac op")

# TorchTitan's tensor-parallel switches (TPSpec's fields): async TP (enable_async_tensor_parallel,
# off by default), and sequence and loss parallelism, on in TorchTitan's TP plan.
_SWITCHES = {"async tp": ("async_tp", True), "async-tp": ("async_tp", True), "no async tp": ("async_tp", False),
             "enable-async-tensor-parallel": ("async_tp", True), "no sequence parallel": ("sequence_parallel", False),
             "no sp": ("sequence_parallel", False), "sequence parallel": ("sequence_parallel", True),
             "sp": ("sequence_parallel", True), "no loss parallel": ("loss_parallel", False),
             "loss parallel": ("loss_parallel", True)}


def read_items(text: str, base: dict) -> dict:
    """The fields the description's items say (``units``, ``ckpt`` (0 none, -1 selective-op, K every
    K-th block), ``reshard``, ``schedule`` and the counts of ``_COUNTS``).

    [Note: one item per field] Each field is said once: two items that say it differently ("full
    AC, no AC", "reshard, no reshard", "tp 2, tp 4", "sp, no sp") are refused naming both, since
    either could be the job's and letting the later one win scores a configuration the user may
    not run. The same value said twice ("full AC, ckpt") is one statement. A description with no
    item (empty, or only commas) is refused: the comparison would be against FSDP2's defaults,
    which the user did not say."""
    said: dict = {}
    where: dict[str, str] = {}  # field (or switch) -> the item that said it: See [Note: one item per field]
    items = [s for s in re.split(r"[,;]", text) if s.strip()]
    if not items:
        raise current_error(text, "no item between the commas")

    def settle(field: str, value: object, raw: str) -> None:
        if field in where and said.get(field, said.get("switches", {}).get(field)) != value:
            raise current_error(text, f"{where[field]!r} and {raw.strip()!r} contradict each other: keep one")
        where.setdefault(field, raw.strip())

    for raw in items:
        item = " ".join(raw.lower().replace("_", "-").split())
        found: tuple[str, object] | None = None
        if item.replace(" ", "-") in base:  # "every leaf" as "every-leaf"
            found = ("units", item.replace(" ", "-"))
        elif item in _NO_AC or item in _FULL_AC or item in _SELECTIVE_AC:
            found = ("ckpt", 0 if item in _NO_AC else 1 if item in _FULL_AC else -1)
        elif item in _SYNC:
            found = ("sync", _SYNC[item])
        elif item in KNOBS:
            found = KNOBS[item]
        elif item in _SWITCHES:
            settle(*_SWITCHES[item], raw)
            said.setdefault("switches", {}).update([_SWITCHES[item]])
            said.setdefault("switch_words", []).append(raw.strip())
            continue
        elif item in ("reshard", "reshard after forward", "no reshard", "no reshard after forward", "zero2",
                      "zero-2"):
            found = ("reshard", item.startswith("reshard"))
        else:
            for name, pattern in _COUNTS:
                if m := re.fullmatch(pattern, item):
                    found = (name, int(next(g for g in m.groups() if g is not None)))
                    if found[1] == 0:
                        raise current_error(text, f"{raw.strip()!r} needs a positive count")
                    break
        if found is None:
            try:
                schedule = read_schedule(item)
            except ValueError as e:
                raise current_error(text, f"{raw.strip()!r}: {e}") from None
            if schedule is None:
                raise current_error(text, f"cannot read {raw.strip()!r}")
            found = ("schedule", schedule)
        settle(found[0], found[1], raw)
        said[found[0]] = found[1]
    return said
