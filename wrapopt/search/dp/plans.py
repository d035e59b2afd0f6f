"""The exact DP for a model on a mesh: chain costs and static memory from the
simulator, the solver's answers (``solve.py``) as plans, re-scored while the
chain model's peak misses the budget. See [Note: chain model] in ``chain.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable

from wrapopt.cost.simulate import Simulator
from wrapopt.search.dp.chain import ChainAnswer, chain_costs, unit_choices
from wrapopt.search.dp.solve import lower_bound, solve_chains
from wrapopt.spec import ROOT, SELECTIVE_OP, MeshSpec, PlanSpec, UnitSpec

__all__ = ["ChainDP", "DPAnswer", "dp_plans", "chain_static_bytes"]

# [Note: chain model slack] The chain model's memory is a bound: it counts two working sets and both
# neighbours' unsharded gradients in every backward window (See [Note: chain model]), where the
# simulator's peak holds less. Where that bound binds, the DP answers below what the budget allows:
# it can find no plan on a shard-group size where the simulator puts one well under the budget, and
# settle for a slower plan. So a per-unit answer that fits with more than ``SLACK_MIN`` of the
# budget to spare is solved again with the allowance raised by the spare, and kept while it is
# faster and the simulator says it fits (at most ``SLACK_TRIES`` times). The allowance it ends with
# carries to the next shard-group size as a negative shrink (See [Note: carried shrink] in
# strategy.py), so a size whose bound the model over-counts starts from where the last size's answer
# ended.
SLACK_MIN = 0.02
SLACK_TRIES = 3


@dataclass(frozen=True, slots=True)
class DPAnswer:
    """One answer of the DP: its plan, its time in the chain model, and whether
    it is the per-unit optimum (each unit its own choice) or the optimum under
    one uniform choice for every unit."""

    plan: PlanSpec
    time_s: float
    per_unit: bool
    shrink: float = 0.0  # bytes the allowance was lowered by (raised by, when negative) until the simulator agreed


def _root_activations(sim: Simulator, chains: tuple[tuple[str, ...], ...]) -> tuple[float, float]:
    """Activations the root unit saves before the first block and after the last one."""
    blocks = [b for c in chains for b in c]
    units = tuple(UnitSpec((b,)) for b in blocks) + (UnitSpec((ROOT,), False),)
    lay = sim.layout(units)
    root = len(units) - 1
    segs = lay.segments
    firsts = [i for i, sg in enumerate(segs) if sg.unit != root]
    if not firsts:
        return 0.0, 0.0
    before = sum(sg.saved for sg in segs[:firsts[0]] if sg.unit == root)
    after = sum(sg.saved for sg in segs[firsts[-1] + 1:] if sg.unit == root)
    return float(before), float(after)


def chain_static_bytes(sim: Simulator, mesh: MeshSpec, chains: tuple[tuple[str, ...], ...]) -> float:
    """Memory outside the chains' terms on ``mesh`` (see [Note: memory] in the
    simulator): sharded parameters and optimizer state (none under offload), gradients kept for
    accumulation and the root unit's parameters (gathered all step)."""
    g, opt = sim.graph, sim.options
    shard = mesh.shard_size
    blocks = [b for c in chains for b in c]
    units = tuple(UnitSpec((b,)) for b in blocks) + (UnitSpec((ROOT,), False),)
    est = sim.simulate(PlanSpec(units, mesh))
    trainable = g.trainable_bytes
    # under CPU offload the sharded state lives in host memory: See [Note: CPU offload] in cost/state.py
    static = 0.0 if opt.offload else g.param_bytes / shard + trainable * opt.optimizer.states_per_param / shard
    if opt.grad_accumulation > 1 and opt.accumulation_sync == "last":  # See [Note: accumulation sync]
        static += sum(u.param_bytes for u in est.units) * (opt.reduce_dtype_bytes or 1) / (opt.param_dtype_bytes or 1)
    static += est.units[-1].param_bytes
    return static


class ChainDP:
    """The DP for one model on one mesh: chain costs, static memory and the
    cached tables and bounds, so that a lower bound can be asked for before
    (and cheaply beside) the exact answer."""

    def __init__(self, sim: Simulator, mesh: MeshSpec, chains: tuple[tuple[str, ...], ...], *, max_group: int = 8,
                 forward_prefetch: int = 0, static_bytes: float | None = None,
                 checkpoint_modes: tuple[bool | str, ...] = (False, True)):
        self.sim, self.mesh, self.chains = sim, mesh, chains
        self.max_group, self.forward_prefetch = max_group, forward_prefetch
        self.static_bytes = chain_static_bytes(sim, mesh, chains) if static_bytes is None else static_bytes
        costs = [chain_costs(sim, mesh, c, max_group) for c in chains]  # a prefetch changes no window's time
        tail = 0.0
        for k in range(len(costs) - 1, -1, -1):  # later chains' sharded gradients land before this one's backward
            costs[k] = replace(costs[k], sg_tail=tail)
            tail += sum(costs[k].SG)
        before, after = _root_activations(sim, chains)
        self.static_bytes += before  # the root's activations saved before the first block live through backward
        g, scale = sim.graph, sim.options.batch_scale  # See [Note: loss] in the simulator
        grads = max(2 * g.root.output_bytes, g.loss_grad_bytes)  # its backward's gradients
        loss = (max(g.root.output_bytes + g.loss_peak_bytes, grads + g.loss_saved_bytes) * scale + after)
        costs[-1] = replace(costs[-1], loss_mem=loss)
        self.costs = costs
        self.choices = unit_choices(mesh, checkpoint_modes)
        self._cache: dict = {}
        tag = "" if mesh.shard_size == mesh.world_size else f",shard={mesh.shard_size}"
        self.tag = tag + (f",prefetch={forward_prefetch}" if forward_prefetch else "")

    def lower_bound(self, memory_budget: float, *, tuned: bool = True) -> float:
        """A lower bound on the chain-model time of the per-unit optimum under the budget
        (``tuned=False``: the fixed grid's weaker one; see [Note: tuned multiplier])."""
        return lower_bound(self.costs, choices=self.choices, max_group=self.max_group,
                           mem_allowance=memory_budget - self.static_bytes, cache=self._cache, tuned=tuned)

    def _plan(self, ans: ChainAnswer, label: str) -> PlanSpec:
        units = [UnitSpec(self.chains[c][st:st + s], ch[0], ch[1]) for c, st, s, ch in ans.groups]
        return PlanSpec(units=tuple(units) + (UnitSpec((ROOT,), False),), mesh=self.mesh,
                        forward_prefetch=self.forward_prefetch, label=label)

    def answers(self, memory_budget: float, *, uniform: bool = True, rescore: bool = True,
                give_up_above: float = math.inf, shrink: float = 0.0) -> list[DPAnswer]:
        """The per-unit optimum, then (with ``uniform``) the optimum under each
        uniform choice; see ``dp_plans``. ``give_up_above``: skip the per-unit
        answer when it cannot be faster than this (chain-model seconds). ``shrink``:
        start the per-unit re-scoring with the allowance lowered by this much (what
        another mesh's answer needed: See [Note: carried shrink] in strategy.py)."""
        allowance = memory_budget - self.static_bytes
        runs = [("dp", self.choices, True)]
        if uniform:
            runs += [(f"dp(reshard={_raf_tag(r)},ckpt={_ck_tag(k)})", ((r, k),), False) for r, k in self.choices]
        check = rescore and math.isfinite(memory_budget)
        out = []
        for label, choices, per_unit in runs:
            allow = allowance - (shrink if check and per_unit else 0.0)
            cache = self._cache if per_unit else {}
            cap = give_up_above if per_unit else math.inf

            def solve(allowed: float, cap: float = cap) -> ChainAnswer | None:
                return solve_chains(self.costs, choices=choices, max_group=self.max_group, mem_allowance=allowed,
                                    cache=cache, give_up_above=cap)

            ans, plan, peak = None, None, 0.0
            for attempt in range(8 if check and per_unit else 1):
                ans = solve(allow)
                if ans is None:
                    break
                plan = self._plan(ans, label + self.tag)
                if not (check and per_unit):
                    break
                peak = self.sim.simulate(plan).peak_bytes
                over = peak - memory_budget
                if over <= 0:
                    break
                allow -= over * (1 + attempt) + 1e-4 * memory_budget
                ans = None
            if ans is not None and check and per_unit:
                ans, plan, allow = self._use_slack(solve, ans, plan, allow, peak, memory_budget)
            if ans is not None:
                out.append(DPAnswer(plan, ans.time_s, per_unit, allowance - allow))
        return out

    def _use_slack(self, solve: Callable[[float, float], ChainAnswer | None], ans: ChainAnswer, plan: PlanSpec,
                   allow: float, peak: float, memory_budget: float) -> tuple[ChainAnswer, PlanSpec, float]:
        """The per-unit answer again with the allowance raised by what the simulator left under the
        budget, while that is faster and the simulator says it fits: See [Note: chain model slack]."""
        for _ in range(SLACK_TRIES):
            slack = memory_budget - peak
            if slack <= SLACK_MIN * memory_budget:
                break
            more = solve(allow + slack, ans.time_s)  # only a faster answer is of use
            if more is None or more.time_s >= ans.time_s:
                break
            more_plan = self._plan(more, plan.label)
            more_peak = self.sim.simulate(more_plan).peak_bytes
            if more_peak > memory_budget:
                break
            ans, plan, allow, peak = more, more_plan, allow + slack, more_peak
        return ans, plan, allow

    def plans(self, memory_budget: float, *, uniform: bool = True, rescore: bool = True,
              give_up_above: float = math.inf) -> list[tuple[str, PlanSpec, float]]:
        """``answers`` as (label, plan, chain-model time)."""
        return [(a.plan.label, a.plan, a.time_s)
                for a in self.answers(memory_budget, uniform=uniform, rescore=rescore, give_up_above=give_up_above)]


def dp_plans(sim: Simulator, mesh: MeshSpec, chains: tuple[tuple[str, ...], ...], *, memory_budget: float,
             static_bytes: float | None = None, max_group: int = 8, uniform: bool = True,
             forward_prefetch: int = 0, rescore: bool = True,
             checkpoint_modes: tuple[bool | str, ...] = (False, True)) -> list[tuple[str, PlanSpec, float]]:
    """DP answers on ``mesh``: (label, plan, chain-model time).

    The first is the per-unit optimum (each unit its own reshard and
    checkpointing choice); with ``uniform`` one answer per uniform choice
    follows. ``static_bytes`` defaults to ``chain_static_bytes``. With
    ``rescore`` (and a budget) the per-unit answer is re-scored by the
    simulator, and while its predicted peak exceeds the budget the DP runs
    again with the allowance lowered by the excess (a few times at most): the
    chain model leaves a few terms out (see [Note: chain model]).
    """
    if not chains:
        return []
    dp = ChainDP(sim, mesh, chains, max_group=max_group, forward_prefetch=forward_prefetch, static_bytes=static_bytes,
                 checkpoint_modes=checkpoint_modes)
    return dp.plans(memory_budget, uniform=uniform, rescore=rescore)


def _ck_tag(k: bool | str) -> str:
    return "S" if k == SELECTIVE_OP else "T" if k else "F"


def _raf_tag(r: bool | int) -> str:
    return "T" if r is True else "F" if r is False else str(r)
