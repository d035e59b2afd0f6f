"""The plans TorchTitan's job config can say, as the one search strategy of ``--runtime torchtitan``.

[Note: TorchTitan's plans] TorchTitan (0.2.x, ``apply_fsdp``) wraps the token embedding, every
block and [final norm, output] as FSDP units and the root last, with one ``reshard_after_forward``
for all (``parallelism.fsdp_reshard_after_forward``: "always" or "never") and one checkpointing mode
for every block (``activation_checkpoint.mode``: none, full, selective per op, or full on every N-th
block). A search for that runtime (``SearchOptions.runtime == "torchtitan"``, ``wrapopt search
--runtime torchtitan``) scores these plans only, so ``wrapopt export --to torchtitan`` of its answer
says the plan whole, and the prediction is of the job TorchTitan will run. Where the embedding and
the head share a tied weight (one parameter in two units), or the model has neither, they stay in
the root unit. A pipeline search for that runtime keeps the stages' shared FSDP shape (no per-stage
refinement: [Note: per-stage refinement] in search/pipeline_stages.py mixes choices per stage).
"""

from __future__ import annotations

from dataclasses import replace

from wrapopt.errors import PlanError
from wrapopt.search.baselines import make_plan
from wrapopt.search.strategy import History, Proposal, SearchProblem, Strategy
from wrapopt.search.uniform import CHECKPOINT_EVERY
from wrapopt.spec import SELECTIVE_OP, MeshSpec, ModelGraph, PlanSpec, UnitSpec
from wrapopt.units import validate_plan

__all__ = ["RUNTIMES", "TorchTitanLayouts", "torchtitan_layout"]

RUNTIMES = ("wrapopt", "torchtitan")  # SearchOptions.runtime: what will run the plan

_CK = {False: "", True: ",ckpt", SELECTIVE_OP: ",sac"}


def _ancestors(fqn: str) -> list[str]:
    parts = fqn.split(".")
    return [".".join(parts[:i]) for i in range(len(parts))]


def _ends(graph: ModelGraph) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(the embedding unit's modules, the [final norm, head] unit's modules) TorchTitan wraps apart:
    the embeddings called before the first block, the outermost modules with parameters called
    after the last (outside the blocks and their containers); empty where the model has none."""
    if not graph.blocks:
        return (), ()
    first = min(graph.info(b).order for b in graph.blocks)
    last = max(graph.info(b).order for b in graph.blocks)
    above = {a for b in graph.blocks for a in _ancestors(b)}  # the blocks' containers (Llama's "model")
    outside = [m for m in graph.modules if m.fqn not in above and m.order >= 0 and m.total_numel
               and not any(m.fqn == b or m.fqn.startswith(b + ".") for b in graph.blocks)]
    lead = [m for m in outside if m.cls == "Embedding" and m.order < first]
    tail = [m for m in outside if m.order > last]
    tail = [m for m in tail if not any(m.fqn.startswith(t.fqn + ".") for t in tail)]  # the outermost
    return tuple(m.fqn for m in lead), tuple(m.fqn for m in sorted(tail, key=lambda m: m.order))


def torchtitan_layout(graph: ModelGraph, mesh: MeshSpec, *, reshard: bool, checkpoint: bool | str,
                      every: int = 1) -> PlanSpec | None:
    """TorchTitan's FSDP units for ``graph`` with one reshard choice and ``checkpoint`` on every
    ``every``-th block (the last of each run of ``every``); None without blocks."""
    if not graph.block_chains:
        return None
    blocks = [UnitSpec((b,), reshard, checkpoint if (j + 1) % every == 0 else False)
              for chain in graph.block_chains for j, b in enumerate(chain)]
    label = ("torchtitan" + ("" if reshard else ",keep") + _CK[checkpoint]
             + (f"-every-{every}" if every > 1 else ""))
    root = make_plan(graph, mesh, []).units
    lead, tail = _ends(graph)
    # the [norm, output] unit is not resharded after forward (its backward runs first), as TorchTitan's "default"
    ends = [UnitSpec(lead, reshard, False)] * bool(lead) + blocks + [UnitSpec(tail, False, False)] * bool(tail)
    for units in (ends, blocks):  # the ends apart where they are legal units, else in the root
        plan = PlanSpec(units=tuple(units) + root, mesh=mesh, label=label)
        try:
            validate_plan(graph, plan)
        except PlanError:
            continue
        return plan
    return None


class TorchTitanLayouts(Strategy):
    """Every plan TorchTitan's job config can say (See [Note: TorchTitan's plans]): reshard after
    forward on and off, times no, full, full on every k-th block (k in ``CHECKPOINT_EVERY``) and,
    when the search offers it, selective-op checkpointing."""

    name = "torchtitan"
    reference = True

    def propose(self, problem: SearchProblem, history: History) -> Proposal:
        modes = [(False, 1), (True, 1), *((True, k) for k in CHECKPOINT_EVERY)]
        if SELECTIVE_OP in problem.options.checkpoint_modes:
            modes.append((SELECTIVE_OP, 1))
        mesh, plans = problem.mesh, []
        for size in problem.shard_sizes:  # HSDP: TorchTitan's data_parallel_replicate_degree
            m = mesh if size == mesh.shard_size else MeshSpec(world_size=mesh.world_size,
                                                              ranks_per_node=mesh.ranks_per_node, shard_size=size)
            for r in (True, False):
                for c, k in modes:
                    p = torchtitan_layout(problem.graph, m, reshard=r, checkpoint=c, every=k)
                    if p is not None:
                        plans.append(p if m is mesh else replace(p, label=f"{p.label},shard={size}"))
        return Proposal(plans=tuple(plans))
