"""The exact solver: dynamic programming over contiguous groupings of the block
chains, given their costs (``ChainCosts``), with a choice of (reshard after
forward, activation checkpointing) per unit, under a memory allowance. The
model it minimises is in ``chain.py`` ([Note: chain model]); ``plans.py``
turns a model on a mesh into chain costs, and the answers into plans;
``bounds.py`` holds the group tables and the lower bounds that prune.

[Note: exact DP with a prefix-additive memory term] The local terms make the
state after placing a unit ``(end, W's effect on later windows, V, c_V)``;
W enters later windows only through ``(R_W, regather_W)``, so states with the
same pair merge. ``A(<V)`` is a sum over *every* earlier unit, so no finite
state summarises it; instead each state keeps a Pareto set of labels
``(time so far, A)``. This is exact: the future of a partial plan depends on
its past only through the state and ``A``, future time adds to the label's
time, and the future is feasible for a label whenever it is feasible for a
label with larger ``A`` (every memory check is ``A + local <= budget`` and A
only grows). So a label dominated in both time and ``A`` by another label of
the same state can never lead to a better feasible plan, and dropping it
loses nothing. With no budget ``A`` is irrelevant and each state keeps one
label. Several chains (an encoder-decoder) are solved in forward order, each
starting from the previous chain's final Pareto set: the earlier chain's kept
parameters and activations are alive during the later chain's backward, and
the later chain's are gone by the earlier chain's backward. Tests compare the
DP with brute force over every grouping and every per-unit choice.

The event simulator re-scores every answer and has the last word (see
``search.driver.search_plan``).
"""

from __future__ import annotations

import math

import numpy as np

from wrapopt.search.dp.bounds import Bounds, GroupTables, grid_bounds, tuned_bounds
from wrapopt.search.dp.chain import (
    ChainAnswer,
    ChainCosts,
    Choice,
    brute_force_chain,
    chain_costs,
    chain_model,
    unit_choices,
)

__all__ = [
    "solve_chains",
    "solve_chain",
    "lower_bound",
    # from chain.py, for convenience
    "Choice",
    "ChainCosts",
    "ChainAnswer",
    "unit_choices",
    "chain_costs",
    "chain_model",
    "brute_force_chain",
]


def _prune(key: np.ndarray, t: np.ndarray, a: np.ndarray, use_mem: bool) -> np.ndarray:
    """Indices of the Pareto-minimal labels per key, fastest first within a key.
    See [Note: exact DP with a prefix-additive memory term]."""
    if key.size == 0:
        return np.zeros(0, dtype=np.int64)
    order = np.lexsort((a, t, key))
    k, aa = key[order], a[order]
    first = np.ones(k.size, dtype=bool)
    first[1:] = k[1:] != k[:-1]
    if not use_mem:
        return order[first]
    # Within each key (sorted by time), keep a label only if its A is below every
    # earlier label's: a running minimum that restarts at each key.
    span = int(aa.max() - min(0, int(aa.min()))) + 1
    shifted = aa - k * span  # later keys lie entirely below earlier ones
    run = np.minimum.accumulate(shifted)
    keep = first.copy()
    keep[1:] |= shifted[1:] < run[:-1]
    return order[keep]


class _Store:
    """Back-pointers of every label kept: (parent id, chain, start, size, choice)."""

    def __init__(self):
        self.parts: list[tuple[np.ndarray, ...]] = []
        self.size = 0

    def add(self, parent, chain, start, size, ci) -> np.ndarray:
        k = len(parent)
        full = lambda x: np.broadcast_to(np.asarray(x, dtype=np.int64), (k,))  # noqa: E731
        self.parts.append((full(parent), full(chain), full(start), full(size), full(ci)))
        ids = np.arange(self.size, self.size + k, dtype=np.int64)
        self.size += k
        return ids

    def unwind(self, label_id: int, choices: tuple[Choice, ...]) -> tuple:
        cols = [np.concatenate([p[j] for p in self.parts]) for j in range(5)]
        out = []
        i = label_id
        while i >= 0:
            parent, chain, start, size, ci = (int(c[i]) for c in cols)
            if size > 0:
                out.append((chain, start, size, choices[ci]))
            i = parent
        return tuple(reversed(out))


def _solve_front(tb: GroupTables, cc: ChainCosts, chain_index: int, start: tuple[np.ndarray, np.ndarray, np.ndarray],
                 store: _Store, *, mem_allowance: float, bounds: Bounds, ub: float = math.inf):
    """Run the DP on one chain from the labels ``start`` = (time, A, id); return the
    final Pareto set of (time, A, id). Vectorised over labels and next groups.

    Labels whose time plus a lower bound on what remains exceeds ``ub``
    are dropped: when the answer's time is at most ``ub`` no better plan was
    among them, so the answer stays exact (``solve_chains`` checks this).
    """
    n, G, C = tb.n, tb.G, tb.C
    f, m = tb.f, tb.m
    use_mem = math.isfinite(mem_allowance)
    allow = mem_allowance if use_mem else 0.0
    o = cc.overhead_s  # per group, in forward and in backward
    two_work = 2 * int(cc.work)
    ahead = cc.runs_ahead
    cis = np.arange(C)
    bound = ub * (1 + 1e-12) if math.isfinite(ub) else math.inf
    pending = _first_groups(tb, cc, start)
    final_t, final_a, final_p = [], [], []
    for i in range(1, n + 1):
        if not pending[i]:
            continue
        t, a, wid, sl, cl, par = (np.concatenate(x) for x in zip(*pending[i]))
        pending[i] = []
        if bound < math.inf:
            ok = t + bounds.at(chain_index, i, wid, sl, cl, a) <= bound
            t, a, wid, sl, cl, par = t[ok], a[ok], wid[ok], sl[ok], cl[ok], par[ok]
        keep = _prune((wid * (G + 1) + sl) * C + cl, t, a if use_mem else t, use_mem)
        t, a, wid, sl, cl, par = t[keep], a[keep], wid[keep], sl[keep], cl[keep], par[keep]
        if t.size == 0:
            continue
        st = i - sl
        ids = store.add(par, chain_index, st, sl, cl)
        FV, BV = f["F"][st, sl, cl], f["B"][st, sl, cl]
        R_W, reg_W = tb.w_R[wid], tb.w_reg[wid]
        base_mem = a + m["P"][st, sl, cl] + reg_W + m["saved"][st, sl, cl] + m["G"][st, sl, cl] + two_work
        a_next = a + m["keep"][st, sl, cl] + m["act"][st, sl, cl]
        bw_comp = BV + o
        if i == n:
            if use_mem:
                ok = (base_mem + tb.sg_after[n] <= allow)
                ok &= a_next + round(cc.loss_mem) + m["reg"][st, sl, cl] <= allow
            else:
                ok = np.ones(t.size, dtype=bool)
            final_t.append((t + (np.maximum(bw_comp, R_W) if ahead else bw_comp + R_W) + FV)[ok])
            final_a.append(a_next[ok])
            final_p.append(ids[ok])
            continue
        v_wid = tb.wid[st, sl, cl]
        fw_comp = FV + o
        L = t.size
        for s_next in range(1, min(G, n - i) + 1):
            SX, AX, GX = f["S"][i, s_next], f["A"][i, s_next], m["G"][i, s_next]
            dt = (np.maximum(bw_comp[:, None], R_W[:, None] + SX[None, :]) if ahead
                  else bw_comp[:, None] + R_W[:, None] + SX[None, :])
            dt = dt + (np.maximum(fw_comp[:, None], AX[None, :]) if ahead else fw_comp[:, None] + AX[None, :])
            nt = t[:, None] + dt
            ok = np.ones((L, C), dtype=bool)
            if use_mem:
                ok &= base_mem[:, None] + GX[None, :] + tb.sg_after[i + s_next] <= allow
            if bound < math.inf:
                ok &= nt + bounds.at(chain_index, i + s_next, v_wid[:, None], s_next, cis[None, :],
                                     a_next[:, None]) <= bound
            ok = ok.ravel()
            pending[i + s_next].append((
                nt.ravel()[ok], np.repeat(a_next, C)[ok], np.repeat(v_wid, C)[ok],
                np.full(L * C, s_next)[ok], np.tile(cis, L)[ok], np.repeat(ids, C)[ok],
            ))
    return _final_front(final_t, final_a, final_p, store, chain_index, use_mem=use_mem)


def _first_groups(tb: GroupTables, cc: ChainCosts, start: tuple[np.ndarray, np.ndarray, np.ndarray]) -> list[list]:
    """The labels after the chain's first group, of every size and choice, from the labels ``start``.

    ``pending[end]`` lists arrays (t, a, wid, s_last, ci_last, parent) of labels whose last group ends at ``end``."""
    n, G, C = tb.n, tb.G, tb.C
    o, ahead, cis = cc.overhead_s, cc.runs_ahead, np.arange(C)
    pending: list[list] = [[] for _ in range(n + 1)]
    t0, a0, id0 = start
    for s in range(1, G + 1):
        AX = tb.f["A"][0, s]
        dt = np.maximum(o, AX) if ahead else o + AX
        L = t0.size
        pending[s].append((
            (t0[:, None] + dt[None, :]).ravel(), np.repeat(a0, C), np.zeros(L * C, dtype=np.int64),
            np.full(L * C, s), np.tile(cis, L), np.repeat(id0, C),
        ))
    return pending


def _final_front(final_t: list[np.ndarray], final_a: list[np.ndarray], final_p: list[np.ndarray], store: _Store,
                 chain_index: int, *, use_mem: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The Pareto set of the labels that end the chain, each stored with an end marker."""
    if not final_t:
        return np.zeros(0), np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    t, a, p = np.concatenate(final_t), np.concatenate(final_a), np.concatenate(final_p)
    keep = _prune(np.zeros(t.size, dtype=np.int64), t, a if use_mem else t, use_mem)
    ids = store.add(p[keep], chain_index, 0, 0, 0)  # a marker: the chain's end
    return t[keep], a[keep], ids


def _run(tables, costs, bounds, *, mem_allowance: float, a0: float, ub: float):
    store = _Store()
    ids = store.add(np.array([-1]), -1, 0, 0, 0)
    front = (np.zeros(1), np.array([int(a0)], dtype=np.int64), ids)
    for k, (tb, cc) in enumerate(zip(tables, costs)):
        front = _solve_front(tb, cc, k, front, store, mem_allowance=mem_allowance, bounds=bounds, ub=ub)
        if front[0].size == 0:
            return None
    best = int(np.argmin(front[0]))
    return float(front[0][best]), float(front[1][best]), store, int(front[2][best])


def _prepare(costs, choices, max_group, cache: dict) -> list[GroupTables]:
    key = (id(costs), tuple(choices), max_group)
    if cache.get("key") != key:
        cache.clear()
        cache["key"] = key
        cache["costs"] = costs  # keeps id(costs) alive and unique
        cache["tables"] = [GroupTables(cc, choices, max_group) for cc in costs]
    return cache["tables"]


def lower_bound(costs: list[ChainCosts], *, choices: tuple[Choice, ...], max_group: int, mem_allowance: float,
                a0: float = 0.0, cache: dict | None = None, tuned: bool = True) -> float:
    """A Lagrangian lower bound on ``solve_chains``' time, its multiplier tuned to
    the allowance (see [Note: Lagrangian bound], [Note: tuned multiplier]);
    ``tuned=False``: the best multiplier of the fixed grid only (weaker)."""
    cache = cache if cache is not None else {}
    tables = _prepare(costs, choices, max_group, cache)
    if not math.isfinite(mem_allowance):
        if "free" not in cache:
            cache["free"] = Bounds(tables, costs, np.zeros(1))
        return float(cache["free"].root[0])
    if not tuned:
        return float(grid_bounds(costs, tables, cache).global_bound(a0, mem_allowance).max())
    return tuned_bounds(costs, tables, cache, a0, mem_allowance)[1]


def solve_chains(costs: list[ChainCosts], *, choices: tuple[Choice, ...], max_group: int,
                 mem_allowance: float, a0: float = 0.0, cache: dict | None = None,
                 give_up_above: float = math.inf) -> ChainAnswer | None:
    """The fastest grouping of every chain (in forward order) whose every backward
    window fits ``mem_allowance``; None when none does (or, with
    ``give_up_above``, when none is faster than that). See [Note: chain model].

    Under a budget the label sets can grow large, so with several choices the
    exact DP runs as a branch and bound: the Lagrangian lower bound LB
    (see [Note: Lagrangian bound], [Note: tuned multiplier]) gives a first cap ``ub = LB * (1 + d)``;
    labels that cannot finish under ``ub`` by their own lower bound are
    dropped. If a plan is found its time is at most ``ub``, and every dropped
    label's completions were slower than ``ub``, so the plan is optimal; if
    none is found, ``d`` grows, and the last round has no cap at all.
    ``cache`` (a dict) keeps the tables and bounds between calls on the same
    ``costs`` and ``choices`` with other allowances.
    """
    cache = cache if cache is not None else {}
    tables = _prepare(costs, choices, max_group, cache)
    if not math.isfinite(mem_allowance) or len(choices) == 1:
        # No budget, or one choice (the prefix memory then hardly varies): plain labels.
        bounds = Bounds.__new__(Bounds)
        if math.isfinite(give_up_above):
            bounds = grid_bounds(costs, tables, cache).select([0], math.inf)  # the memory-free bound
        res = _run(tables, costs, bounds, mem_allowance=mem_allowance, a0=a0, ub=give_up_above)
    else:
        bounds, lb = tuned_bounds(costs, tables, cache, a0, mem_allowance)
        res = None
        # Rounds of growing caps: a round whose cap is below the optimum fails fast.
        for d in (0.002, 0.005, 0.01, 0.015, 0.02, 0.03, 0.045, 0.065, 0.09, 0.13, 0.2, 0.3, 0.5, math.inf):
            ub = min(lb * (1 + d), give_up_above)
            if lb > give_up_above:
                break
            res = _run(tables, costs, bounds, mem_allowance=mem_allowance, a0=a0, ub=ub)
            if res is not None or ub >= give_up_above:
                break
    if res is None:
        return None
    t, a, store, label = res
    return ChainAnswer(t, a, store.unwind(label, choices))


def solve_chain(cc: ChainCosts, *, choices: tuple[Choice, ...] | None = None, reshard: bool | int = True,
                ckpt: bool = False, max_group: int,
                mem_allowance: float) -> tuple[float, tuple[int, ...], tuple[Choice, ...]] | None:
    """One chain: (time, group sizes, per-group choices), or None when nothing fits.

    ``choices`` are the per-unit options (default: the one uniform choice
    ``(reshard, ckpt)``).
    """
    ch = choices if choices is not None else ((reshard, ckpt),)
    ans = solve_chains([cc], choices=ch, max_group=max_group, mem_allowance=mem_allowance)
    if ans is None:
        return None
    return ans.time_s, ans.sizes(0), ans.choices(0)
