"""Exact dynamic programming over contiguous groupings of the block chains.

[Note: chain model] Between the root's segments a transformer is a chain of
blocks; a plan groups consecutive blocks into units. On a chain the step
time splits into windows that couple only neighbouring units:

* forward window of unit X after unit V (start of V to start of X):
  ``max(F_V + o, A_X)`` when the all-gather of X is prefetched while V
  computes (GPU, or explicit prefetch), ``F_V + o + A_X`` when it is not (CPU);
* backward window of unit V, between W (before V in forward) and X (after V):
  ``max(B_V + recompute_V + o, R_W + S_X)``: while V runs backward, the comm
  lane carries X's reduce-scatter (issued just before) and W's prefetched
  re-gather, and W cannot start before both land.

Peak memory is checked in every backward window: the additive part (static
shards, parameters kept unsharded, the activations of every block up to V)
plus the local part (V and W gathered, V's and X's unsharded gradients).

So the DP state after placing a unit is (size of that unit, size of the one
before it); with per-chain uniform choices (reshard after forward,
activation checkpointing) it is exact for this model, and runs four times,
once per choice. The event simulator re-scores every answer; the search
keeps the simulator's verdict (see ``search.search``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from wrapopt.cost.simulate import Simulator
from wrapopt.types import ROOT, MeshSpec, PlanSpec, UnitSpec

__all__ = ["ChainCosts", "chain_costs", "solve_chain", "brute_force_chain", "dp_plans"]


@dataclass(frozen=True, slots=True)
class ChainCosts:
    """Per-block figures of one chain plus the group-level collective times."""

    blocks: tuple[str, ...]
    F: tuple[float, ...]
    B: tuple[float, ...]
    P: tuple[float, ...]  # gathered bytes
    G: tuple[float, ...]  # unsharded gradient bytes
    act: tuple[float, ...]  # saved activation bytes
    inp: tuple[float, ...]  # what a checkpointed block keeps
    work: float
    overhead_s: float
    runs_ahead: bool
    ag: dict  # (start, size) -> all-gather s
    rs: dict  # (start, size) -> reduce-scatter (+ all-reduce) s


def chain_costs(sim: Simulator, mesh: MeshSpec, chain: tuple[str, ...], max_group: int) -> ChainCosts:
    per_block = tuple(UnitSpec((b,)) for b in chain) + (UnitSpec((ROOT,)),)
    lay = sim.layout(per_block)
    opt = sim.options
    gather_elem = opt.param_dtype_bytes or sim._elem
    reduce_elem = opt.reduce_dtype_bytes or gather_elem
    n = len(chain)
    P = [lay.numel[i] * gather_elem for i in range(n)]
    G = [lay.trainable_numel[i] * reduce_elem for i in range(n)]
    notes: set[str] = set()
    shard = mesh.shard_size
    rpn = min(shard, mesh.ranks_per_node)
    rep = mesh.world_size // shard
    rpn_rep = 1 if shard >= mesh.ranks_per_node else max(1, mesh.ranks_per_node // shard)
    ag, rs = {}, {}
    for i in range(n):
        for s in range(1, min(max_group, n - i) + 1):
            p, g = sum(P[i:i + s]), sum(G[i:i + s])
            ag[(i, s)] = sim._coll("all_gather", shard, rpn, p, notes)
            rs[(i, s)] = sim._coll("reduce_scatter", shard, rpn, g, notes) + sim._coll("all_reduce", rep, rpn_rep, g / shard, notes)
    return ChainCosts(
        blocks=chain,
        F=lay.fwd_s[:n], B=lay.bwd_s[:n], P=tuple(P), G=tuple(G), act=tuple(float(x) for x in lay.saved[:n]),
        inp=tuple(float(x) for x in lay.input_bytes[:n]), work=float(max(lay.work[:n], default=0)),
        overhead_s=sim.compute.unit_overhead_s, runs_ahead=not sim.compute.device.startswith("cpu"), ag=ag, rs=rs,
    )


def _group(cc: ChainCosts, start: int, size: int, reshard: bool, ckpt: bool) -> tuple:
    """(F, B+recompute, A, R, S, P, G, act, act_during_backward) of blocks [start, start+size)."""
    if size == 0:
        return (0.0,) * 9
    sl = slice(start, start + size)
    F = sum(cc.F[sl])
    B = sum(cc.B[sl]) + (F if ckpt else 0.0)
    A = cc.ag[(start, size)]
    R = A if reshard else 0.0
    S = cc.rs[(start, size)]
    act_fwd = sum(cc.inp[sl]) if ckpt else sum(cc.act[sl])
    act_bwd = act_fwd + (sum(cc.act[sl]) if ckpt else 0.0)
    return (F, B, A, R, S, sum(cc.P[sl]), sum(cc.G[sl]), act_fwd, act_bwd)


def _fw(cc: ChainCosts, V: tuple, X: tuple) -> float:
    o = cc.overhead_s
    return max(V[0] + o, X[2]) if cc.runs_ahead else V[0] + o + X[2]


def _bw(cc: ChainCosts, W: tuple, V: tuple, X: tuple) -> float:
    return max(V[1] + cc.overhead_s, W[3] + X[4])


def _mem(cc: ChainCosts, W: tuple, V: tuple, X: tuple, acts_before_V: float, reshard: bool) -> float:
    # See [Note: chain model]: local part of V's backward window.
    return acts_before_V + V[8] + V[5] + (W[5] if reshard else 0.0) + V[6] + X[6] + 2 * cc.work


def solve_chain(
    cc: ChainCosts, *, reshard: bool, ckpt: bool, max_group: int, mem_allowance: float
) -> tuple[float, tuple[int, ...]] | None:
    """Minimise the chain-model time over groupings; returns (time, group sizes) or None.

    ``mem_allowance`` is the budget left for this chain's local terms after
    everything outside the chain and the chain's additive terms.
    """
    n = len(cc.blocks)
    empty = (0.0,) * 9
    # acts of blocks [0, i) during forward (for the memory check)
    pre = [0.0]
    for i in range(n):
        pre.append(pre[-1] + (cc.inp[i] if ckpt else cc.act[i]))
    # best[(i, s_prev, s_last)] = (time, sizes) with groups ending at i, last of size s_last
    best: dict[tuple[int, int, int], tuple[float, tuple[int, ...]]] = {}
    for s in range(1, min(max_group, n) + 1):
        X = _group(cc, 0, s, reshard, ckpt)
        best[(s, 0, s)] = (_fw(cc, empty, X), (s,))
    for i in range(1, n + 1):
        for s_last in range(1, min(max_group, i) + 1):
            for s_prev in range(0, min(max_group, i - s_last) + 1):
                cur = best.get((i, s_prev, s_last))
                if cur is None:
                    continue
                t, sizes = cur
                W = _group(cc, i - s_last - s_prev, s_prev, reshard, ckpt)
                V = _group(cc, i - s_last, s_last, reshard, ckpt)
                for s_next in range(0, min(max_group, n - i) + 1):
                    if s_next == 0 and i != n:
                        continue
                    X = _group(cc, i, s_next, reshard, ckpt) if s_next else empty
                    if _mem(cc, W, V, X, pre[i - s_last], reshard) > mem_allowance:
                        continue
                    nt = t + _bw(cc, W, V, X) + (_fw(cc, V, X) if s_next else V[0])
                    key = (i + s_next, s_last, s_next) if s_next else ("end",)
                    old = best.get(key)  # type: ignore[arg-type]
                    if old is None or nt < old[0] - 1e-15 or (abs(nt - old[0]) <= 1e-15 and sizes < old[1]):
                        best[key] = (nt, sizes + ((s_next,) if s_next else ()))  # type: ignore[index]
    return best.get(("end",))  # type: ignore[call-overload]


def brute_force_chain(cc: ChainCosts, *, reshard: bool, ckpt: bool, max_group: int, mem_allowance: float):
    """Every composition of the chain scored by the same model (for tests)."""
    n = len(cc.blocks)
    empty = (0.0,) * 9
    best = None

    def compositions(rest: int):
        if rest == 0:
            yield ()
            return
        for s in range(1, min(max_group, rest) + 1):
            for tail in compositions(rest - s):
                yield (s,) + tail

    for sizes in compositions(n):
        starts = [sum(sizes[:k]) for k in range(len(sizes))]
        groups = [_group(cc, st, s, reshard, ckpt) for st, s in zip(starts, sizes)]
        ext = [empty] + groups + [empty]
        t = _fw(cc, empty, groups[0])
        ok = True
        acc = 0.0
        for k in range(1, len(ext) - 1):
            W, V, X = ext[k - 1], ext[k], ext[k + 1]
            if _mem(cc, W, V, X, acc, reshard) > mem_allowance:
                ok = False
                break
            acc += V[7]
            t += _bw(cc, W, V, X) + (_fw(cc, V, X) if X is not empty else V[0])
        if ok and (best is None or t < best[0] - 1e-15):
            best = (t, sizes)
    return best


def dp_plans(sim: Simulator, mesh: MeshSpec, chains: tuple[tuple[str, ...], ...], *, memory_budget: float,
             static_bytes: float, max_group: int = 8) -> list[tuple[str, PlanSpec, float]]:
    """One DP answer per uniform choice (reshard x checkpoint): (label, plan, chain-model time)."""
    out = []
    costs = [chain_costs(sim, mesh, c, max_group) for c in chains]
    for reshard in (True, False):
        for ckpt in (False, True):
            units: list[UnitSpec] = []
            total = 0.0
            feasible = True
            acts_other = 0.0  # activations of earlier chains, alive through this chain's backward
            for cc in costs:
                keep = 0.0 if reshard else sum(cc.P)
                res = solve_chain(cc, reshard=reshard, ckpt=ckpt, max_group=max_group,
                                  mem_allowance=memory_budget - static_bytes - keep - acts_other)
                if res is None:
                    feasible = False
                    break
                t, sizes = res
                total += t
                i = 0
                for s in sizes:
                    units.append(UnitSpec(cc.blocks[i:i + s], reshard, ckpt))
                    i += s
                acts_other += sum(cc.inp) if ckpt else sum(cc.act)
            if not feasible:
                continue
            label = f"dp(reshard={'T' if reshard else 'F'},ckpt={'T' if ckpt else 'F'})"
            plan = PlanSpec(units=tuple(units) + (UnitSpec((ROOT,), False),), mesh=mesh, label=label)
            out.append((label, plan, total if math.isfinite(total) else float("inf")))
    return out
