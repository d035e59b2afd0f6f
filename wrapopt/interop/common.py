"""What the exports share: the result type, the class policy type, and safe text.

See [Note: plan strings in generated text]: every string of a plan file reaches the
generated Python through repr or a checked identifier, YAML through a JSON scalar, and a
comment through ``comment``.
"""

from __future__ import annotations

import keyword
import os
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from wrapopt.errors import PlanError
from wrapopt.fingerprint import module_classes
from wrapopt.plan.file import WrapPlan
from wrapopt.version import __version__

if TYPE_CHECKING:
    import torch.nn as nn

__all__ = ["ClassPolicy", "Export", "bare", "check_classes", "classes_for", "comment", "few", "header",
           "module_order", "plan_reference", "plan_path_code"]


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
    # Each plan field the plan sets -> "written", "stated" or "lost"; see [Note: every plan field is
    # written, stated or lost] in interop/fields.py.
    fields: dict[str, str] = field(default_factory=dict)
    script: tuple[str, ...] = ()  # what the training script or launch must do (TO RUN THE PLAN)

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


# [Note: the classes an export may import]
# The Lightning FSDP1 module imports the classes it wraps, by the paths in the plan file's
# model.module_classes, which anyone can edit. What can be checked without importing anything: each
# path is ``package.module.Class`` of Python identifiers (a class with no module would write
# ``from  import Class``), and its package is not of the standard library or built into Python
# (``os.system``, ``subprocess.Popen``, ``this.Block``: no model's classes come from there; importing
# them runs their code). Whether a third-party module holds the class, or what importing it does,
# only an import can tell: a plan file from elsewhere is checked by giving the model (--model), whose
# own classes then replace the file's.


def check_classes(classes: dict[str, list[str]]) -> None:
    """Every class path the plan records is ``package.module.Class`` (``<locals>`` allowed), outside the
    standard library; see [Note: the classes an export may import]."""
    fix = ("the file was edited or corrupted: make the plan again with `wrapopt search`, or give the model "
           "with --model zoo:NAME")
    for c in classes:
        path = c.replace(".<locals>.", ".")
        if not _is_dotted_identifier(path) or "." not in path:
            raise PlanError(f"the plan file's model.module_classes names the class {c[:80]!r}, which is "
                            f"not a Python class path (package.module.Class); {fix}")
        top = path.split(".", 1)[0]
        if top in sys.stdlib_module_names or top in sys.builtin_module_names:
            raise PlanError(f"the plan file's model.module_classes names the class {c[:80]!r} of the standard-library "
                            f"module {top!r}, which no model's classes come from (an export would import it); {fix}")


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


def header(plan: WrapPlan, source: str, what: str, losses: list[str], script: list[str] = ()) -> str:
    """The ``#`` comment block every export starts with: what it is, whence (``source``: the plan file
    relative to the export, ``plan_reference``), what the training script must do (TO RUN THE PLAN) and
    its LOSSES."""
    m = plan.mesh
    lines = [
        f"{what}",
        f"written by `wrapopt export` {__version__} from {source}: {len(plan.units)} units "
        f"({plan.spec.label or 'unlabelled'}) for {plan.model.get('class')} on {m.world_size} ranks",
    ]
    if script:
        lines += ["", "TO RUN THE PLAN: what the training script or launch must do (no setting of the tool says it)"]
        lines += [f"  - {x}" for x in script]
    if losses:
        lines += ["", "LOSSES: what this configuration does not reproduce of the plan", "(for the exact plan, "
                  f"use WrapPlan.load({source!r}).apply(model) in the training script)"]
        lines += [f"  - {x}" for x in losses]
    else:
        lines += ["The plan is reproduced exactly" + (", run as said above." if script else ".")]
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


def plan_reference(source: str, out: str | None) -> str:
    """The plan file's path relative to the folder the export is written to (``out``'s; the current
    folder when it is printed), which generated code resolves against its own file."""
    base = os.path.dirname(os.path.abspath(out)) if out else os.getcwd()
    return os.path.relpath(os.path.abspath(source), base)


def plan_path_code(source: str, out: str | None) -> str:
    """The lines of a generated module that find the plan file: ``$WRAPOPT_PLAN``, else the path relative to
    the module's own file (never an absolute path baked in). The path reaches the code through repr."""
    return f'''PLAN_PATH = {plan_reference(source, out)!r}  # relative to this file; WRAPOPT_PLAN=PATH overrides it


def plan_path() -> str:
    """The plan file: $WRAPOPT_PLAN, else PLAN_PATH next to this file."""
    return os.environ.get("WRAPOPT_PLAN") or os.path.join(os.path.dirname(os.path.abspath(__file__)), PLAN_PATH)
'''
