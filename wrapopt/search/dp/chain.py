"""The chain model: one step of a chain of blocks cut into units, window by window.

[Note: chain model] Between the root's segments a transformer is a chain of
blocks; a plan groups consecutive blocks into units and gives each unit its
own choice ``c = (reshard_after_forward, checkpoint)``. On a chain the step
time splits into windows that couple only neighbouring units:

* forward window of unit X after unit V (start of V to start of X):
  ``max(F_V + o, A_X)`` when the all-gather of X is prefetched while V
  computes (GPU, or explicit prefetch), ``F_V + o + A_X`` when it is not (CPU);
* backward window of unit V, between W (before V in forward) and X (after V):
  ``max(B_V + recompute_V + o, R_W + S_X)``: while V runs backward, the comm
  lane carries X's reduce-scatter (issued just before) and W's prefetched
  re-gather (``R_W`` = 0 when W kept its parameters, the intra-node
  all-gather when W resharded to one node), and W cannot start before both land.
  On a CPU, whose collectives block (See [Note: blocking collectives] in
  cost/step.py), the window is their sum, plus W's re-gather's overhead ``o``
  when it re-gathers.

Memory is checked in every backward window, following the simulator's
accounting (``cost/step.py``, [Note: memory]). In V's window it is

    static + A(<V) + P_V + regather_W + acts_V + G_V + G_X + SG(after X) + 2 * work

where ``A(<V) = sum over units U before V of (kept_U + act_U)`` (parameters
U keeps from forward to backward, activations U keeps for backward: all of
them, or each block's output when checkpointed), ``acts_V`` is V's own
(checkpointed: the kept outputs plus one block re-materialised), ``SG`` the
sharded gradients of the blocks whose reduce-scatter has landed (fixed by
X's end, whatever the grouping), and the rest is local to W, V, X. Terms the
chain model leaves out (the root's gradients; forward, where a unit's
all-gather output is held beside the next: See [Note: all-gather buffer]) are caught by re-scoring: ``plans.dp_plans``
re-runs the DP with a smaller allowance when the simulator's peak exceeds
the budget. The last chain also checks the loss and the head's backward:
``A(all) + loss working set + root activations after the chains + the last
group's re-gather``.

``solve.py`` minimises this model exactly; ``brute_force_chain`` scores every
grouping and choice with the same functions, for the tests.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Iterable

from wrapopt.cost.simulate import Simulator
from wrapopt.spec import ROOT, SELECTIVE_OP, MeshSpec, UnitSpec

__all__ = ["Choice", "ChainCosts", "ChainAnswer", "unit_choices", "chain_costs", "chain_model", "brute_force_chain",
           "group_figures", "sharded_grads_after"]

Choice = tuple  # (reshard_after_forward: bool | int, checkpoint: False, True or SELECTIVE_OP)


def unit_choices(mesh: MeshSpec, checkpoint_modes: tuple[bool | str, ...] = (False, True)) -> tuple[Choice, ...]:
    """Per-unit choices on ``mesh``: reshard True / False / to one node (only when
    the shard group spans nodes), each with every checkpointing of ``checkpoint_modes``."""
    rafs: list[bool | int] = [True, False]
    if 1 < mesh.ranks_per_node < mesh.shard_size:
        rafs.append(mesh.ranks_per_node)
    return tuple((r, c) for r in rafs for c in checkpoint_modes)


@dataclass(frozen=True, slots=True)
class ChainCosts:
    """Per-block figures of one chain plus the group-level collective times."""

    blocks: tuple[str, ...]
    F: tuple[float, ...]
    B: tuple[float, ...]
    P: tuple[float, ...]  # gathered bytes
    G: tuple[float, ...]  # unsharded gradient bytes
    SG: tuple[float, ...]  # sharded gradient bytes (land when the block's reduce-scatter does)
    act: tuple[float, ...]  # saved activation bytes
    inp: tuple[float, ...]  # what a checkpointed block keeps
    work: float
    overhead_s: float  # per group per forward and per backward (See [Note: shard group of one])
    ckpt_overhead_s: float  # per checkpointed block, beyond its recomputed forward
    runs_ahead: bool
    shard_size: int
    ag: dict  # (start, size) -> all-gather s
    rs: dict  # (start, size) -> reduce-scatter (+ all-reduce) s
    rag: dict  # (start, size, n) -> all-gather s over n ranks of one node (reshard to n)
    sg_tail: float = 0.0  # sharded gradients of later chains (landed during this chain's backward)
    # Set on the last chain: what the loss and the head's backward hold besides the
    # chains' memory (the working set, the root's activations after the chains);
    # the last group's re-gather is prefetched then too.
    loss_mem: float = 0.0
    # Selective-op (See [Note: selective checkpointing] in wrapopt/selective.py): per block the
    # forward seconds it recomputes, what it keeps beyond ``inp`` (its matmul and attention outputs),
    # and what torch's selective dispatch modes add to each pass (its forward, its recompute).
    sel_F: tuple[float, ...] = ()
    sel_extra: tuple[float, ...] = ()
    sel_O: tuple[float, ...] = ()
    # Per block, what full checkpointing recomputes: its forward up to the early stop (See [Note:
    # early stop] in wrapopt/trace/record.py); empty: all of ``F``.
    ck_F: tuple[float, ...] = ()
    # Of ckpt_overhead_s, what the checkpointed forward pays: See [Note: checkpoint overhead] in cost/step.py.
    ckpt_forward_s: float = 0.0


@dataclass(frozen=True, slots=True)
class ChainAnswer:
    """One DP answer: chain-model time, the groups per chain and their choices."""

    time_s: float
    act_bytes: float  # A after the last chain (kept params + activations)
    groups: tuple[tuple[int, int, int, Choice], ...]  # (chain, start, size, choice)

    def sizes(self, chain: int = 0) -> tuple[int, ...]:
        return tuple(s for c, _st, s, _ch in self.groups if c == chain)

    def choices(self, chain: int = 0) -> tuple[Choice, ...]:
        return tuple(ch for c, _st, _s, ch in self.groups if c == chain)


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
    node_rafs = [r for r, _ in unit_choices(mesh) if not isinstance(r, bool)]
    ag, rs, rag = {}, {}, {}
    for i in range(n):
        for s in range(1, min(max_group, n - i) + 1):
            p, g = sum(P[i:i + s]), sum(G[i:i + s])
            ag[(i, s)] = sim.collectives.time("all_gather", shard, rpn, p, notes)
            rs[(i, s)] = (sim.collectives.time("reduce_scatter", shard, rpn, g, notes)
                          + sim.collectives.time("all_reduce", rep, rpn_rep, g / shard, notes))
            for r in node_rafs:
                rag[(i, s, r)] = sim.collectives.time("all_gather", r, min(r, mesh.ranks_per_node), p, notes)
    # See [Note: all-gather issue]; on a CPU a prefetch blocks too: See [Note: blocking collectives] in cost/step.py
    runs_ahead = sim.compute.runs_ahead
    sel_extra = [0.0] * n
    for sgm in lay.segments:
        if sgm.unit < n:
            sel_extra[sgm.unit] += sgm.sel_keep - sgm.keep
    # A group's parameters' part of FSDP2's work is its blocks' (See [Note: per-parameter overhead]),
    # charged with their forward and their backward as the group's overhead_s is.
    poh = sim._param_overhead(per_block)[:n].tolist()
    return ChainCosts(
        blocks=chain,
        F=tuple(f + o for f, o in zip(lay.fwd_s[:n], poh)), B=tuple(b + o for b, o in zip(lay.bwd_s[:n], poh)),
        P=tuple(P), G=tuple(G),
        SG=tuple(lay.trainable_bytes[i] / shard for i in range(n)),
        act=tuple(float(x) for x in lay.saved[:n]),
        inp=tuple(float(x) for x in lay.input_bytes[:n]), work=float(max(lay.work[:n], default=0)),
        overhead_s=sim.compute.unit_overhead_s, ckpt_overhead_s=sim.compute.checkpoint_overhead_s,
        ckpt_forward_s=sim._constants.checkpoint_forward_s,
        runs_ahead=runs_ahead, shard_size=shard, ag=ag, rs=rs, rag=rag,
        sel_F=tuple(lay.times[2][:n].tolist()), sel_extra=tuple(sel_extra), sel_O=tuple(lay.times[3][:n].tolist()),
        ck_F=tuple(lay.times[4][:n].tolist()),
    )


# A group's figures (``group_figures``), as a plain tuple for speed:
# (F, B + recompute, A, R, S, P, G, act kept in forward, acts in its backward, kept params, re-gathered bytes);
# R is what the re-gather costs the backward window: on a CPU its overhead too (See [Note: chain model]).
_EMPTY = (0.0, 0.0, 0.0, 0.0, 0.0, 0, 0, 0, 0, 0, 0)


def group_figures(cc: ChainCosts, start: int, size: int, choice: Choice) -> tuple:
    if size == 0:
        return _EMPTY
    raf, ckpt = choice
    sl = slice(start, start + size)
    F = sum(cc.F[sl])
    sel = ckpt == SELECTIVE_OP
    ck_b = size * (cc.ckpt_overhead_s - cc.ckpt_forward_s)  # the recompute's part: See [Note: checkpoint overhead]
    if sel:  # recomputes its other ops only; its dispatch modes' work in both passes
        oh = sum(cc.sel_O[sl])
        B = sum(cc.B[sl]) + sum(cc.sel_F[sl]) + oh + ck_b
        F += oh + size * cc.ckpt_forward_s
    else:
        B = sum(cc.B[sl]) + ((sum(cc.ck_F[sl]) if cc.ck_F else F) + ck_b if ckpt else 0.0)
        F += size * cc.ckpt_forward_s if ckpt else 0.0
    A = cc.ag[(start, size)]
    # Memory in whole bytes, so that the DP's sums are exact.
    P = round(sum(cc.P[sl]))
    saved = round(sum(cc.act[sl]))
    # Mirrors the simulator: checkpointing keeps each block's output and
    # re-materialises one block at a time in backward; an int reshard keeps
    # P // (shard // n) and re-gathers within the node. See [Note: reshard after forward].
    if sel:  # keeps its input and its saved ops' outputs; re-materialises the rest one block at a time
        keeps = [k + x for k, x in zip(cc.inp[sl], cc.sel_extra[sl])]
        act_fwd = round(sum(keeps))
        act_bwd = act_fwd + round(max(a - k for a, k in zip(cc.act[sl], keeps)))
    elif ckpt:
        act_fwd = round(sum(cc.inp[sl]))
        act_bwd = act_fwd + round(max(a - k for a, k in zip(cc.act[sl], cc.inp[sl])))
    else:
        act_fwd = act_bwd = saved
    if raf is True:
        R, keep = A, 0
    elif raf is False:
        R, keep = 0.0, P
    else:
        R = cc.rag[(start, size, raf)] if raf > 1 else 0.0
        keep = P // max(1, raf) if raf < cc.shard_size else P  # each rank keeps 1/N
    regather = P - keep if R > 0 else 0
    if R > 0 and not cc.runs_ahead:  # a CPU's re-gather blocks, then pays its overhead
        R += cc.overhead_s
    return (F, B, A, R, cc.rs[(start, size)], P, round(sum(cc.G[sl])), act_fwd, act_bwd, keep, regather)


def _fw(cc: ChainCosts, V: tuple, X: tuple) -> float:
    o = cc.overhead_s
    return max(V[0] + o, X[2]) if cc.runs_ahead else V[0] + o + X[2]


def _bw(cc: ChainCosts, W: tuple, V: tuple, X: tuple) -> float:
    # on a CPU one after the other: See [Note: blocking collectives] in cost/step.py
    return max(V[1] + cc.overhead_s, W[3] + X[4]) if cc.runs_ahead else V[1] + cc.overhead_s + W[3] + X[4]


def sharded_grads_after(cc: ChainCosts) -> list[int]:
    """Sharded gradient bytes landed once every block from i on has been reduced."""
    out = [round(cc.sg_tail)]
    for x in reversed(cc.SG):
        out.append(out[-1] + round(x))
    return out[::-1]


def _local_mem(cc: ChainCosts, W: tuple, V: tuple, X: tuple, sg_after_x: int) -> float:
    # See [Note: chain model]: the part of V's backward window local to W, V, X.
    return V[5] + W[10] + V[8] + V[6] + X[6] + sg_after_x + 2 * int(cc.work)


def chain_model(cc: ChainCosts, groups: Iterable[tuple[int, Choice]], *, a0: float = 0.0) -> tuple[float, float, float]:
    """(time, peak of ``A + local`` over the windows, final A) of one grouping,
    given as (size, choice) pairs in chain order (for tests and brute force)."""
    groups = list(groups)
    gs, start = [], 0
    for size, choice in groups:
        gs.append(group_figures(cc, start, size, choice))
        start += size
    assert start == len(cc.blocks)  # internal invariant
    ext = [_EMPTY] + gs + [_EMPTY]
    ends = [0] + list(itertools.accumulate(size for size, _c in groups))
    sg = sharded_grads_after(cc)
    t = _fw(cc, _EMPTY, gs[0])
    acc, peak = a0, 0.0
    for k in range(1, len(ext) - 1):
        W, V, X = ext[k - 1], ext[k], ext[k + 1]
        peak = max(peak, acc + _local_mem(cc, W, V, X, sg[ends[min(k + 1, len(ends) - 1)]]))
        acc += V[9] + V[7]
        t += _bw(cc, W, V, X) + (_fw(cc, V, X) if X is not _EMPTY else V[0])
    W, V = ext[-3], ext[-2]
    last = acc - V[9] - V[7] + _local_mem(cc, W, V, _EMPTY, sg[ends[-1]])
    # The head's backward (root) prefetches the last group's re-gather.
    return t, max(peak, last, acc + round(cc.loss_mem) + V[10]), acc


def brute_force_chain(cc: ChainCosts, *, choices: tuple[Choice, ...] | None = None, reshard: bool | int = True,
                      ckpt: bool = False, max_group: int, mem_allowance: float):
    """Every composition of the chain and every per-group choice, scored by
    ``chain_model`` (for tests): (time, sizes, choices) or None."""
    ch = choices if choices is not None else ((reshard, ckpt),)
    n = len(cc.blocks)
    best = None

    def compositions(rest: int):
        if rest == 0:
            yield ()
            return
        for s in range(1, min(max_group, rest) + 1):
            for tail in compositions(rest - s):
                yield (s,) + tail

    for sizes in compositions(n):
        for picks in itertools.product(ch, repeat=len(sizes)):
            t, peak, _a = chain_model(cc, zip(sizes, picks))
            if peak <= mem_allowance and (best is None or t < best[0] - 1e-15):
                best = (t, sizes, picks)
    return best
