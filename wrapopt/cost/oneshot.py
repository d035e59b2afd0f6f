"""``simulate``: the one-shot form of ``Simulator(...).simulate(plan)``, the plan validated first."""

from __future__ import annotations

from wrapopt.cost.simulate import Simulator
from wrapopt.hardware.profiles import ComputeProfile, FabricProfile
from wrapopt.spec import CostEstimate, ModelGraph, PlanSpec, SimOptions
from wrapopt.units import validate_plan

__all__ = ["simulate"]


def simulate(
    graph: ModelGraph,
    plan: PlanSpec,
    fabric: FabricProfile,
    compute: ComputeProfile,
    options: SimOptions | None = None,
    *,
    record: bool = False,
) -> CostEstimate:
    """One-shot form of ``Simulator(graph, fabric, compute, options).simulate(plan)``.

    The plan is validated first (``PlanError`` names the offending modules).

    Example:
        >>> from wrapopt import zoo, trace_model
        >>> from wrapopt.hardware import analytical_compute, analytical_fabric
        >>> from wrapopt.search.baselines import baselines
        >>> model, x = zoo.build("gpt-tiny", "meta")
        >>> g = trace_model(model, x)
        >>> from wrapopt.spec import MeshSpec
        >>> mesh = MeshSpec(world_size=8, ranks_per_node=8, shard_size=8)
        >>> plan = baselines(g, mesh)["per-block"]
        >>> est = simulate(g, plan, analytical_fabric(world_size=8), analytical_compute())
        >>> est.step_s > 0
        True
    """

    validate_plan(graph, plan)
    return Simulator(graph, fabric, compute, options).simulate(plan, record=record)

