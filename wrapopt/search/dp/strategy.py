"""The exact DP as a search strategy: its answers on every shard-group size."""

from __future__ import annotations

import math
from dataclasses import replace

from wrapopt.search.dp.plans import ChainDP
from wrapopt.search.strategy import History, Proposal, SearchProblem, Strategy
from wrapopt.spec import MeshSpec, PlanSpec

__all__ = ["ExactDP", "PerBlockDP"]


class ExactDP(Strategy):
    """Per-unit reshard and checkpointing over contiguous groupings of the block
    chains, solved exactly in the chain model (see [Note: chain model]) on each
    shard-group size of the problem, plus the optimum under each uniform choice
    on the mesh asked for. The simulator has the last word over the chain model:
    the driver re-scores every answer."""

    name = "dp"
    seed_every_plan = True

    def propose(self, problem: SearchProblem, history: History) -> Proposal:
        if not problem.graph.block_chains:
            return Proposal()
        return Proposal(plans=tuple(_dp_candidates(problem)))


class PerBlockDP(Strategy):
    """The exact DP with one block per unit on the mesh asked for: the fastest conventional
    cut under the budget, each block choosing its reshard and checkpointing (so no more
    blocks are checkpointed than the budget needs). ``choose`` measures every other plan
    against the per-block cuts: See [Note: plans within the error] in search/choose.py."""

    name = "per-block-dp"

    def propose(self, problem: SearchProblem, history: History) -> Proposal:
        if not problem.graph.block_chains:
            return Proposal()
        sim, mesh, budget = problem.sim, problem.mesh, problem.memory_budget
        # No explicit prefetch: a GPU's all-gathers run ahead by themselves, and a CPU's prefetch blocks as its
        # other collectives do (See [Note: blocking collectives] in cost/step.py): it would gain nothing.
        dp = ChainDP(sim, mesh, problem.graph.block_chains, max_group=1,
                     checkpoint_modes=problem.options.checkpoint_modes)
        if dp.static_bytes >= budget:
            return Proposal()
        return Proposal(plans=tuple(replace(a.plan, label="per-block,dp") for a in dp.answers(budget, uniform=False)))


def _dp_candidates(problem: SearchProblem) -> list[PlanSpec]:
    """DP answers per shard-group size (the uniform-choice ones on ``mesh`` only).

    Sizes are solved in the order of their lower bound under the budget (the
    fixed grid's: see [Note: tuned multiplier]); a size whose (tuned) bound is
    already slower than an answer found (that the simulator says fits) is
    skipped, since its answer can only be slower still in the DP's model.

    [Note: carried shrink] The chain model leaves some memory out (See [Note:
    chain model]), so a per-unit answer is re-scored by the simulator and the DP
    re-run with a smaller allowance while it does not fit (``ChainDP.answers``).
    The terms it leaves out (large groups' backward working set, reduce-scatters
    queued behind a slow fabric) change little with the shard-group size, so each
    size starts from the shrink the previous size's answer needed rather than
    from none: one solve instead of two or three where each costs seconds. An
    answer found this way may sit a little below the budget where the
    re-scoring loop would have landed a little higher, so a size's answer can
    be a little slower in the chain model. The requested mesh always starts
    from none.
    """
    sim, mesh, budget = problem.sim, problem.mesh, problem.memory_budget
    chains = problem.graph.block_chains
    jobs = []
    for s in problem.shard_sizes:  # no explicit prefetch: See PerBlockDP.propose
        m = MeshSpec(world_size=mesh.world_size, ranks_per_node=mesh.ranks_per_node, shard_size=s)
        dp = ChainDP(sim, m, chains, max_group=problem.options.max_group,
                     checkpoint_modes=problem.options.checkpoint_modes)
        if dp.static_bytes < budget:
            jobs.append((dp.lower_bound(budget, tuned=False), s == mesh.shard_size, dp))
    jobs.sort(key=lambda j: (not j[1], j[0]))  # the requested mesh first: its uniform answers always come
    plans: list[PlanSpec] = []
    best_t, shrink = math.inf, 0.0
    for _order, main, dp in jobs:
        if not main and dp.lower_bound(budget - min(shrink, 0.0)) >= best_t:  # a raised allowance: a lower bound
            continue
        for answer in dp.answers(budget, uniform=main, give_up_above=math.inf if main else best_t, shrink=shrink):
            plans.append(answer.plan)
            if answer.per_unit:
                best_t = min(best_t, answer.time_s)
                shrink = answer.shrink  # See [Note: carried shrink]
    return plans
