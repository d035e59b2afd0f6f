"""What the exports share: the result type, the class policy type, and safe text.

See [Note: plan strings in generated text]: every string of a plan file reaches the
generated Python through repr or a checked identifier, YAML through a JSON scalar, and a
comment through ``comment``.
"""

from __future__ import annotations

import keyword
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from wrapopt.errors import PlanError
from wrapopt.fingerprint import module_classes
from wrapopt.plan.file import WrapPlan
from wrapopt.version import __version__

if TYPE_CHECKING:
    import torch.nn as nn

__all__ = ["ClassPolicy", "Export", "bare", "check_classes", "classes_for", "comment", "few", "header",
           "module_order"]


@dataclass(frozen=True, slots=True)
class ClassPolicy:
    """The closest class-based wrapping of a plan, and what it loses."""

    classes: tuple[str, ...]  # "package.module.Class", wrapped (every instance)
    reshard_after_forward: bool
    checkpoint: bool  # checkpoint every instance of ``classes``
    losses: tuple[str, ...]  # what differs from the plan, in words


@dataclass(frozen=True, slots=True)
class Export:
    """What ``export_plan`` returns: the file text and the same settings as data."""

    target: str
    text: str
    settings: dict[str, Any]
    losses: tuple[str, ...]

    @property
    def exact(self) -> bool:
        return not self.losses


# [Note: plan strings in generated text]
# A plan file is data from anywhere, and the export writes its strings into Python (Lightning) and
# YAML (Accelerate) that a user runs. No such string may become code or structure: class paths that
# the Python imports must be dotted identifiers (checked, else PlanError naming the field); any other
# string reaches Python through repr, YAML through a JSON (double-quoted YAML) scalar unless it is a
# plain word, and a comment through comment(), which escapes every character that could end the line.


def comment(text: object) -> str:
    """``text`` safe inside a ``#`` comment: non-printable characters (line breaks included) escaped."""
    return "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in str(text))


def _is_dotted_identifier(path: str) -> bool:
    return all(p.isidentifier() and not keyword.iskeyword(p) for p in path.split("."))


def check_classes(classes: dict[str, list[str]]) -> None:
    """Every class path the plan records is ``package.module.Class`` (``<locals>`` allowed)."""
    for c in classes:
        if not _is_dotted_identifier(c.replace(".<locals>.", ".")):
            raise PlanError(f"the plan file's model.module_classes names the class {c[:80]!r}, which is "
                            "not a Python class path (package.module.Class); the file was edited or corrupted: "
                            "make the plan again with `wrapopt search`, or give the model with --model zoo:NAME")


def bare(qualname: str) -> str:
    """``"pkg.mod.Class"`` -> ``"Class"``."""
    return qualname.rsplit(".", 1)[-1]


def module_order(classes: dict[str, list[str]]):
    """A sort key putting module names in the model's ``named_modules()`` order, class by class."""
    pos = {m: i for i, m in enumerate(m for mods in classes.values() for m in mods)}
    return lambda m: pos.get(m, 0)


def few(items: list[str], k: int = 4) -> str:
    """The first ``k`` items, then how many more."""
    return ", ".join(items[:k]) + (f" and {len(items) - k} more" if len(items) > k else "")


def header(plan: WrapPlan, source: str, what: str, losses: list[str]) -> str:
    """The ``#`` comment block every export starts with: what it is, whence, and its LOSSES."""
    m = plan.mesh
    lines = [
        f"{what}",
        f"written by `wrapopt export` {__version__} from {source}: {len(plan.units)} units "
        f"({plan.spec.label or 'unlabelled'}) for {plan.model.get('class')} on {m.world_size} ranks",
    ]
    if losses:
        lines += ["", "LOSSES: what this configuration does not reproduce of the plan", "(for the exact plan, "
                  f"use WrapPlan.load({source!r}).apply(model) in the training script)"]
        lines += [f"  - {x}" for x in losses]
    else:
        lines += ["The plan is reproduced exactly."]
    return "".join(f"# {comment(ln)}".rstrip() + "\n" for ln in lines) + "\n"


def classes_for(plan: WrapPlan, model: nn.Module | None) -> tuple[dict[str, list[str]], list[str] | None]:
    """The planned model's ``module_classes`` and parameter names (None when unknown)."""
    if model is not None:
        plan.check_model(model)
        recorded = module_classes(model)
        params = [n for n, _ in model.named_parameters()]
    else:
        recorded = plan.model.get("module_classes")
        if not isinstance(recorded, dict) or not recorded:
            raise PlanError("this plan file does not record its model's module classes (it was written by an older "
                            "wrapopt); give the model: `wrapopt export PLAN --to ... --model zoo:NAME`")
        params = plan.model.get("params")
        params = list(params) if isinstance(params, dict) else None
    check_classes(recorded)
    return recorded, params
