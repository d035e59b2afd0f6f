"""Pipeline stages from the traced graph: which models can be split, and the balanced split.

[Note: stage split] Stages are contiguous runs of the model's one block chain
(``ModelGraph.block_chains``): the modules that run before the first block (embeddings) go to
the first stage, those after the last block (final norm, head) to the last. A model whose
blocks are not one chain (an encoder and a decoder), or with a module running between blocks, is
refused for pipelining, saying why. Tied parameters that sit on two stages (a tied embedding and
head) give the later stage a copy, whose memory and the gradient sum each step are priced ([Note:
tied copies on stages] in cost/stage_view.py) and which applying the plan keeps in step. The split
minimises the slowest stage: each block and each end module
weighs its forward and backward compute as the simulator prices it (one unit per block and per
end module, ``weights``; the loss on the last stage), and an exact DP over the block boundaries
(``balanced_split``) finds the cut with the smallest maximum; every stage gets at least one block.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from wrapopt.errors import PlanError
from wrapopt.spec import ROOT, MeshSpec, ModelGraph, PlanSpec, UnitSpec

__all__ = ["PipelineLayout", "pipeline_layout", "balanced_split", "stage_modules", "weights", "check_stage_count"]


@dataclass(frozen=True, slots=True)
class PipelineLayout:
    """The parts a pipeline splits: the blocks in order, and the modules before and after them."""

    blocks: tuple[str, ...]
    before: tuple[str, ...]  # on the first stage (embeddings)
    after: tuple[str, ...]  # on the last stage (final norm, head)


def pipeline_layout(graph: ModelGraph) -> PipelineLayout:
    """The model's pipeline layout, or ``PlanError`` saying why it cannot be pipelined."""
    if len(graph.block_chains) != 1:
        found = "no block chain" if not graph.block_chains else (
            f"{len(graph.block_chains)} block chains ({', '.join(c[0].rsplit('.', 1)[0] for c in graph.block_chains)})")
        raise PlanError(f"{graph.model_class}: pipeline parallelism needs the blocks to be one sequential chain; "
                        f"the model has {found}; search without it (--pp 1)")
    chain = graph.block_chains[0]
    parts = chain[0].split(".")
    holders = {ROOT} | {".".join(parts[:i]) for i in range(1, len(parts))}
    others = [m for m in graph.modules if m.parent in holders and m.fqn not in holders and m.fqn not in chain]
    lo, hi = graph.info(chain[0]).order, graph.info(chain[-1]).order
    between = [m.fqn for m in others if lo < m.order < hi]
    if between:
        raise PlanError(f"{graph.model_class}: {', '.join(between)} run(s) between the blocks of {parts[0]}; pipeline "
                        "stages must be contiguous runs of blocks; search without pipelining (--pp 1)")
    before = tuple(m.fqn for m in others if m.order < lo)
    after = tuple(m.fqn for m in others if m.order > hi)
    return PipelineLayout(tuple(chain), before, after)


def check_stage_count(layout: PipelineLayout, pp_size: int, virtual: int, world_size: int) -> None:
    """``PlanError`` when ``pp_size x virtual`` stages cannot each get a block, naming the counts that work."""
    n, stages = len(layout.blocks), pp_size * virtual
    if stages <= n:
        return
    degrees = [d for d in range(2, n + 1) if world_size % d == 0 and d * virtual <= n]
    if virtual == 1:
        raise PlanError(f"--pp {pp_size}: {n} blocks cannot give each of {pp_size} stages a block; pipeline degrees "
                        f"that work on {world_size} ranks: {', '.join(map(str, degrees)) or 'none'}")
    fits = [v for v in range(1, n // pp_size + 1)]
    raise PlanError(f"--pp {pp_size} with {virtual} virtual stages per rank needs {stages} stages, more than the {n} "
                    f"blocks; virtual stages that fit: {', '.join(map(str, fits)) or 'none'}")


def weights(graph: ModelGraph, sim: Any, mesh: MeshSpec, layout: PipelineLayout) -> tuple[np.ndarray, float, float]:
    """Per block its forward + backward compute, and the first and last stage's extra (the end
    modules; the loss on the last) as ``sim`` prices them on ``mesh``: See [Note: stage split]."""
    units = tuple(UnitSpec((m,)) for m in (*layout.before, *layout.blocks, *layout.after))
    est = sim.simulate(PlanSpec(units=(*units, UnitSpec((ROOT,), False)), mesh=mesh))
    t = np.array([c.fwd_s + c.bwd_s for c in est.units], dtype=np.float64)
    nb, nblocks = len(layout.before), len(layout.blocks)
    loss = sim.compute.loss_s * sim.options.batch_scale
    first = float(t[:nb].sum() + t[-1])  # the root's own ops run on the first stage
    return t[nb:nb + nblocks], first, float(t[nb + nblocks:-1].sum() + loss)


def balanced_split(block_s: np.ndarray, first_s: float, last_s: float, num_stages: int) -> tuple[int, ...]:
    """Blocks per stage (each >= 1) minimising the slowest stage (first and last with their
    extras): an exact DP over the boundaries. Ties go to the split with earlier boundaries."""
    n = len(block_s)
    if num_stages > n:
        raise ValueError(f"{num_stages} stages for {n} blocks")
    prefix = np.concatenate(([0.0], np.cumsum(block_s)))
    seg = prefix[None, :] - prefix[:, None]  # seg[i, j]: blocks i..j-1
    inf = np.inf
    best = np.full(n + 1, inf)
    best[1:] = seg[0, 1:] + first_s  # one stage over blocks 0..j-1
    choice = []
    for s in range(1, num_stages):
        extra = last_s if s == num_stages - 1 else 0.0
        cand = np.maximum(best[:, None], seg + extra)  # cand[i, j]: stage s over blocks i..j-1
        cand[np.tril_indices(n + 1)] = inf  # a stage holds >= 1 block
        arg = np.argmin(cand, axis=0)
        best = cand[arg, np.arange(n + 1)]
        choice.append(arg)
    if num_stages == 1:
        return (n,)
    cuts, j = [], n
    for arg in reversed(choice):
        i = int(arg[j])
        cuts.append(j - i)
        j = i
    cuts.append(j)
    return tuple(reversed(cuts))


def stage_modules(layout: PipelineLayout, sizes: tuple[int, ...]) -> tuple[tuple[str, ...], ...]:
    """Each stage's modules for ``sizes`` blocks per stage."""
    out, at = [], 0
    for s, k in enumerate(sizes):
        mods = layout.blocks[at:at + k]
        at += k
        if s == 0:
            mods = (*layout.before, *mods)
        if s == len(sizes) - 1:
            mods = (*mods, *layout.after)
        out.append(tuple(mods))
    return tuple(out)
