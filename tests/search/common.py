"""Helpers shared by the search tests: traced zoo graphs (cached), the conformance
check every strategy's plans must pass, random points of the Optuna space, and a
simulator on an analytical fabric."""

from __future__ import annotations

import functools
import random

from wrapopt.cost import Simulator
from wrapopt.hardware.presets import analytical_compute, analytical_fabric
from wrapopt.hardware.profiles import ComputeProfile
from wrapopt.models.sources import zoo
from wrapopt.search.study.space import SearchSpace
from wrapopt.spec import PlanSpec
from wrapopt.trace.meta import trace_model
from wrapopt.units import owner_index, owner_of, validate_plan


@functools.lru_cache(maxsize=None)
def zoo_graph(name: str):
    e = zoo.get_entry(name)
    return trace_model(e.build("meta"), e.inputs(), loss_fn=e.loss)


def check_conforms(g, plan: PlanSpec, budget: float | None, est=None) -> None:
    """Every parameter in exactly one unit, tied groups together, within budget."""
    validate_plan(g, plan)
    idx = owner_index(plan.units)
    owners = {}
    for fqn, _shape, _dt in g.param_shapes:
        mod = fqn.rsplit(".", 1)[0] if "." in fqn else ""
        owners[fqn] = owner_of(mod, idx)
    assert len(owners) == len(g.param_shapes)
    for group in g.tied_groups:
        units = {owner_of(p.rsplit(".", 1)[0], idx) for p in group}
        assert len(units) == 1, group
    listed = [m for u in plan.units for m in u.modules]
    assert len(listed) == len(set(listed))
    if budget is not None and est is not None:
        assert est.peak_bytes <= budget


def random_plans(g, mesh, n: int, seed: int) -> list[PlanSpec]:
    """Plans from uniformly random points of the Optuna space (legal by construction)."""
    space = SearchSpace(g, mesh)
    rng = random.Random(seed)
    names = space.complete({})
    plans = []
    for _ in range(n):
        params = {}
        for name in names:
            choices = _choices_of(space, name)
            params[name] = rng.choice(choices)
        plans.append(space.from_params(params))
    return plans


def _choices_of(space: SearchSpace, name: str) -> tuple:
    seen = {}

    class _Rec:
        def cat(self, n, choices):
            seen[n] = choices
            return choices[0]

    space.decode(_Rec())
    return seen[name]


def make_sim(g, world: int, *, cpu: bool = False):
    compute = analytical_compute()
    if cpu:
        compute = ComputeProfile(kind="measured", device="cpu", runs_ahead=False,
                                 flops_per_s=5e10, memory_bandwidth_bytes_per_s=1e10,
                                 unit_overhead_s=1e-3)
    return Simulator(g, analytical_fabric(world_size=world), compute)
