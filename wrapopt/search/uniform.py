"""Uniform groupings of the blocks as a search strategy: every ``k`` blocks one
unit, with one (reshard, checkpoint) choice for every unit; and one unit per block
with full checkpointing of every ``k``-th block (``ckpt-every-k``)."""

from __future__ import annotations

from wrapopt.search.baselines import make_plan
from wrapopt.search.strategy import History, Proposal, SearchProblem, Strategy
from wrapopt.spec import SELECTIVE_OP, MeshSpec, ModelGraph, PlanSpec, UnitSpec

__all__ = ["UniformGroupings", "uniform_plan", "every_kth_plan", "CHECKPOINT_EVERY"]

_CK_LABEL = {False: "", True: ",ckpt", SELECTIVE_OP: ",sac"}  # a label's checkpointing suffix

GROUP_SIZES = (1, 2, 3, 4, 6, 8, 16)  # blocks per unit; the longest chain (one unit per chain) is added
CHECKPOINT_EVERY = (2, 3)  # per block, every k-th block fully checkpointed (TorchTitan's selective "layer" AC)


class UniformGroupings(Strategy):
    """Every group size of ``GROUP_SIZES`` up to the longest chain, and the whole
    chain, each with reshard after forward on and off, with each checkpointing of
    ``SearchOptions.checkpoint_modes``, on the mesh asked for. Simple plans people try
    by hand; they also cover what the DP's chain model leaves out. When the search
    offers selective-op, also one unit per block with every k-th block (k in
    ``CHECKPOINT_EVERY``) fully checkpointed."""

    name = "uniform"

    def propose(self, problem: SearchProblem, history: History) -> Proposal:
        graph = problem.graph
        if not graph.block_chains:
            return Proposal()
        longest = max(len(c) for c in graph.block_chains)
        plans = []
        for size in sorted(set(GROUP_SIZES + (longest,)) & set(range(1, longest + 1))):
            for reshard in (True, False):
                for ckpt in problem.options.checkpoint_modes:
                    p = uniform_plan(graph, problem.mesh, size, reshard=reshard, checkpoint=ckpt)
                    if p is not None:
                        plans.append(p)
        if SELECTIVE_OP in problem.options.checkpoint_modes:  # the checkpointing choices beyond all-or-none
            for every in CHECKPOINT_EVERY:
                for reshard in (True, False):
                    p = every_kth_plan(graph, problem.mesh, every, reshard=reshard)
                    if p is not None:
                        plans.append(p)
        return Proposal(plans=tuple(plans))


def uniform_plan(graph: ModelGraph, mesh: MeshSpec, size: int, *, reshard: bool,
                 checkpoint: bool | str) -> PlanSpec | None:
    """Every ``size`` consecutive blocks of each chain one unit (the last may be
    shorter), each with the same choice; None for a model without blocks."""
    groups: list[tuple[str, ...]] = []
    for chain in graph.block_chains:
        for i in range(0, len(chain), size):
            groups.append(chain[i:i + size])
    if not groups:
        return None
    label = f"groups-of-{size}" + ("" if reshard else ",keep") + _CK_LABEL[checkpoint]
    units = tuple(UnitSpec(g, reshard, checkpoint) for g in groups)
    base = make_plan(graph, mesh, [])
    return PlanSpec(units=units + base.units, mesh=mesh, label=label)


def every_kth_plan(graph: ModelGraph, mesh: MeshSpec, every: int, *, reshard: bool) -> PlanSpec | None:
    """One unit per block, the ``every``-th, ``2 every``-th ... block of each chain fully
    checkpointed (the last of every ``every``; TorchTitan's layer-level selective
    checkpointing); None for a model without blocks. Labelled ``per-block,ckpt-every-{every}``."""
    units = tuple(UnitSpec((b,), reshard, (j + 1) % every == 0)
                  for chain in graph.block_chains for j, b in enumerate(chain))
    if not units:
        return None
    label = "per-block" + ("" if reshard else ",keep") + f",ckpt-every-{every}"
    return PlanSpec(units=units + make_plan(graph, mesh, []).units, mesh=mesh, label=label)
