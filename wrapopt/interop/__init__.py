"""interop: a plan in the formats of the tools that train with it (Accelerate, Lightning, plain FSDP1).

The targets' table (``registry``) loads no torch, so ``TARGETS`` is read at once; the exporters
load when first used (See [Note: the exporter table] in wrapopt/interop/registry.py).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from wrapopt.interop.registry import EXPORTERS, TARGETS, Exporter

if TYPE_CHECKING:
    from wrapopt.interop.export import ClassPolicy, Export, class_policy, export_plan

_LAZY = {"Export": "wrapopt.interop.export", "ClassPolicy": "wrapopt.interop.export",
         "class_policy": "wrapopt.interop.export", "export_plan": "wrapopt.interop.export"}

__all__ = ["TARGETS", "EXPORTERS", "Exporter", "Export", "ClassPolicy", "class_policy", "export_plan"]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value
