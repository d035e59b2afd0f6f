"""Uniform groupings of the blocks as a search strategy: every ``k`` blocks one
unit, with one (reshard, checkpoint) choice for every unit."""

from __future__ import annotations

from wrapopt.search.baselines import make_plan
from wrapopt.search.strategy import History, Proposal, SearchProblem, Strategy
from wrapopt.spec import MeshSpec, ModelGraph, PlanSpec, UnitSpec

__all__ = ["UniformGroupings", "uniform_plan"]

GROUP_SIZES = (1, 2, 3, 4, 6, 8, 16)  # blocks per unit; the longest chain (one unit per chain) is added


class UniformGroupings(Strategy):
    """Every group size of ``GROUP_SIZES`` up to the longest chain, and the whole
    chain, each with reshard after forward on and off, with and without
    checkpointing, on the mesh asked for. Simple plans people try by hand;
    they also cover what the DP's chain model leaves out."""

    name = "uniform"

    def propose(self, problem: SearchProblem, history: History) -> Proposal:
        graph = problem.graph
        if not graph.block_chains:
            return Proposal()
        longest = max(len(c) for c in graph.block_chains)
        plans = []
        for size in sorted(set(GROUP_SIZES + (longest,)) & set(range(1, longest + 1))):
            for reshard in (True, False):
                for ckpt in (False, True):
                    p = uniform_plan(graph, problem.mesh, size, reshard=reshard, checkpoint=ckpt)
                    if p is not None:
                        plans.append(p)
        return Proposal(plans=tuple(plans))


def uniform_plan(graph: ModelGraph, mesh: MeshSpec, size: int, *, reshard: bool, checkpoint: bool) -> PlanSpec | None:
    """Every ``size`` consecutive blocks of each chain one unit (the last may be
    shorter), each with the same choice; None for a model without blocks."""
    groups: list[tuple[str, ...]] = []
    for chain in graph.block_chains:
        for i in range(0, len(chain), size):
            groups.append(chain[i:i + size])
    if not groups:
        return None
    label = f"groups-of-{size}" + ("" if reshard else ",keep") + (",ckpt" if checkpoint else "")
    units = tuple(UnitSpec(g, reshard, checkpoint) for g in groups)
    base = make_plan(graph, mesh, [])
    return PlanSpec(units=units + base.units, mesh=mesh, label=label)
