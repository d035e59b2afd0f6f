"""wrapopt: find the best way to cut a PyTorch model into FSDP units for a cluster, and apply it.

Example:
    >>> from wrapopt import optimize_wrap, zoo
    >>> model, inputs = zoo.build("llama-7b")          # meta device: no weights
    >>> res = optimize_wrap(model, inputs, world_size=64, gpus_per_node=8)  # doctest: +SKIP
    >>> print(res.report())                            # doctest: +SKIP
"""

from __future__ import annotations

import sys as _sys

from wrapopt import debug, hardware, spec
from wrapopt.api import OptimizeResult, estimate, optimize_wrap
from wrapopt.cost import simulate
from wrapopt.errors import WrapoptError
from wrapopt.hardware import ComputeProfile, FabricProfile, analytical_compute, analytical_fabric
from wrapopt.models import zoo
from wrapopt.plan import WrapPlan, train_step
from wrapopt.plan import apply as _apply
from wrapopt.spec import CostEstimate, MeshSpec, ModelGraph, PlanSpec, UnitSpec
from wrapopt.trace import trace_model
from wrapopt.train import TrainConfig
from wrapopt.tp import TPSpec
from wrapopt.version import __version__

# Import paths of the layout before 0.2 (wrapopt.inspect, wrapopt.types, ...), kept for one
# release as aliases of the modules that replaced them; new code imports the new paths.
for _old, _new in (("inspect", debug), ("types", spec), ("fabric", hardware), ("zoo", zoo), ("apply", _apply)):
    _sys.modules.setdefault(f"wrapopt.{_old}", _new)
del _old, _new, _sys, _apply

__all__ = [
    "__version__",
    "optimize_wrap",
    "OptimizeResult",
    "estimate",
    "TrainConfig",
    "TPSpec",
    "train_step",
    "trace_model",
    "simulate",
    "WrapPlan",
    "FabricProfile",
    "ComputeProfile",
    "analytical_fabric",
    "analytical_compute",
    "ModelGraph",
    "MeshSpec",
    "PlanSpec",
    "UnitSpec",
    "CostEstimate",
    "WrapoptError",
    "zoo",
]
