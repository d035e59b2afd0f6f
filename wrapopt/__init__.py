"""wrapopt: find the best way to cut a PyTorch model into FSDP units for a cluster, and apply it.

Example:
    >>> from wrapopt import optimize_wrap, zoo
    >>> model, inputs = zoo.build("llama-7b")          # meta device: no weights
    >>> res = optimize_wrap(model, inputs, world_size=64, gpus_per_node=8)  # doctest: +SKIP
    >>> print(res.report())                            # doctest: +SKIP
"""

# [Note: a lazy root package]
# Importing any ``wrapopt.x`` first runs this file, so it imports nothing heavy:
# ``wrapopt --help`` and the light modules it reads load no torch. The public
# names of ``__all__`` resolve on first use through ``__getattr__`` (PEP 562),
# each from the module that defines it, and so do the sub-packages
# (``wrapopt.cost`` after a bare ``import wrapopt``). The import paths of the
# layout before 0.2 (``wrapopt.inspect``, ``wrapopt.types``, ...) are found by
# ``_AliasFinder``, which answers an import of the old name with the module
# that replaced it; they are kept for one release, and new code imports the
# new paths.

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import TYPE_CHECKING, Any

from wrapopt.version import __version__

if TYPE_CHECKING:  # what __getattr__ returns, for type checkers and editors
    from wrapopt.api import OptimizeResult, estimate, optimize_wrap
    from wrapopt.cost import simulate
    from wrapopt.errors import WrapoptError
    from wrapopt.hardware import ComputeProfile, FabricProfile, analytical_compute, analytical_fabric
    from wrapopt.models import zoo
    from wrapopt.plan import WrapPlan, train_step
    from wrapopt.spec import CostEstimate, MeshSpec, ModelGraph, PlanSpec, UnitSpec
    from wrapopt.tp import TPSpec
    from wrapopt.trace import trace_model
    from wrapopt.train import TrainConfig

# public name -> the module that defines it
_EXPORTS = {
    "optimize_wrap": "wrapopt.api",
    "OptimizeResult": "wrapopt.api",
    "estimate": "wrapopt.api",
    "TrainConfig": "wrapopt.train",
    "TPSpec": "wrapopt.tp",
    "train_step": "wrapopt.plan",
    "trace_model": "wrapopt.trace",
    "simulate": "wrapopt.cost",
    "WrapPlan": "wrapopt.plan",
    "FabricProfile": "wrapopt.hardware",
    "ComputeProfile": "wrapopt.hardware",
    "analytical_fabric": "wrapopt.hardware",
    "analytical_compute": "wrapopt.hardware",
    "ModelGraph": "wrapopt.spec",
    "MeshSpec": "wrapopt.spec",
    "PlanSpec": "wrapopt.spec",
    "UnitSpec": "wrapopt.spec",
    "CostEstimate": "wrapopt.spec",
    "WrapoptError": "wrapopt.errors",
    "zoo": "wrapopt.models",
}

# old import path (before 0.2) -> the module that replaced it
_ALIASES = {
    "wrapopt.inspect": "wrapopt.debug",
    "wrapopt.types": "wrapopt.spec",
    "wrapopt.fabric": "wrapopt.hardware",
    "wrapopt.zoo": "wrapopt.models.zoo",
    "wrapopt.apply": "wrapopt.plan.apply",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    """A public name, a sub-package or an old module path, imported on first use."""
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    elif f"{__name__}.{name}" in _ALIASES:
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        try:
            value = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    globals()[name] = value  # later reads skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


class _AliasLoader(importlib.abc.Loader):
    """Loads an old path as the module that replaced it (the same module object)."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.own_spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(self.target)
        self.own_spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # The module ran when it was first imported; the import system has just set its
        # ``__spec__`` to the old path's, so give it back its own (reload and pickle read it).
        module.__spec__ = self.own_spec


class _AliasFinder(importlib.abc.MetaPathFinder):
    """Finds ``_ALIASES``' old paths: ``import wrapopt.types`` gives ``wrapopt.spec``."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _ALIASES:
            return None
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(_ALIASES[fullname]))


if not any(isinstance(f, _AliasFinder) for f in sys.meta_path):
    sys.meta_path.append(_AliasFinder())
