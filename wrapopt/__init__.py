"""wrapopt: find the best way to cut a PyTorch model into FSDP units for a cluster, and apply it.

Example:
    >>> from wrapopt import optimize_wrap, zoo
    >>> model, inputs = zoo.build("llama-7b")          # meta device: no weights
    >>> res = optimize_wrap(model, inputs, world_size=64, gpus_per_node=8)  # doctest: +SKIP
    >>> print(res.report())                            # doctest: +SKIP
"""

from __future__ import annotations

__version__ = "0.1.0"

from wrapopt import zoo
from wrapopt.api import OptimizeResult, optimize_wrap
from wrapopt.cost import simulate
from wrapopt.errors import WrapoptError
from wrapopt.fabric import ComputeProfile, FabricProfile, analytical_fabric
from wrapopt.plan import WrapPlan
from wrapopt.trace import trace_model
from wrapopt.types import CostEstimate, MeshSpec, ModelGraph, PlanSpec, UnitSpec

__all__ = [
    "__version__",
    "optimize_wrap",
    "OptimizeResult",
    "trace_model",
    "simulate",
    "WrapPlan",
    "FabricProfile",
    "ComputeProfile",
    "analytical_fabric",
    "ModelGraph",
    "MeshSpec",
    "PlanSpec",
    "UnitSpec",
    "CostEstimate",
    "WrapoptError",
    "zoo",
]
