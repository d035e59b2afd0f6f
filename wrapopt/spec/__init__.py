"""What passes between the pipeline stages: frozen dataclasses, and the named
tuples the simulator makes by the thousand.

A shared package (the layering table in ``docs/design.md``): it imports no other
wrapopt module, and every stage imports it, by the names this ``__init__``
re-exports. One module per concern: the tracer makes a ``ModelGraph``
(``graph.py``; what it kept beside the figures goes in ``TraceRecord``); the
search makes ``PlanSpec``s of ``UnitSpec``s on a ``MeshSpec``, with a ``TPSpec``
on a tensor-parallel mesh (``plan.py``); the simulator turns a plan and
``SimOptions`` (``options.py``) into a ``CostEstimate`` (``estimate.py``).
"""

from __future__ import annotations

from wrapopt.spec.estimate import CostEstimate, TimelineEvent, UnitCost, UnitCosts
from wrapopt.spec.graph import ROOT, ModelGraph, ModuleInfo, TraceRecord
from wrapopt.spec.options import FLOAT8_RECIPES, SYNC_MODES, OptimizerKind, SimOptions, factored_state_numel
from wrapopt.spec.plan import (
    CHECKPOINT_MODES,
    PP_SCHEDULES,
    SELECTIVE_OP,
    TP_STYLES,
    MeshSpec,
    PipelineSpec,
    PlanSpec,
    TPSpec,
    UnitSpec,
    checkpoint_label,
)
from wrapopt.spec.request import AUTO, GlobalBatch, ParallelRequest, Shape, parse_degree

__all__ = [
    "FLOAT8_RECIPES",
    "ParallelRequest",
    "GlobalBatch",
    "Shape",
    "AUTO",
    "parse_degree",
    "ModuleInfo",
    "ModelGraph",
    "TraceRecord",
    "MeshSpec",
    "UnitSpec",
    "PlanSpec",
    "TPSpec",
    "TP_STYLES",
    "PipelineSpec",
    "PP_SCHEDULES",
    "SELECTIVE_OP",
    "CHECKPOINT_MODES",
    "checkpoint_label",
    "OptimizerKind",
    "SYNC_MODES",
    "factored_state_numel",
    "SimOptions",
    "UnitCost",
    "UnitCosts",
    "TimelineEvent",
    "CostEstimate",
    "ROOT",
]
