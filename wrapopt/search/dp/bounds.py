"""Lower bounds for the exact DP's branch and bound: the group figures as
arrays (``GroupTables``) and Lagrangian bounds on the time still to come
(``Bounds``), with the multiplier tuned per memory allowance
(``tuned_bounds``). The solver is in ``solve.py``; the model in ``chain.py``.

[Note: tuned multiplier] Any multiplier ``lam >= 0`` gives a valid bound
(see [Note: Lagrangian bound]), so which ones are used changes how much the
branch and bound prunes, never its answer. The global bound
``g(lam) = root(lam) + lam * (a0 - allowance)`` is a minimum over
completions of functions linear in ``lam``, hence concave, and its maximum
sits at the exchange rate of time for memory at that allowance; it moves
with the allowance and with the costs. A fixed factor-4 grid can miss it
by far, and a loose bound prunes little: every label near the optimum
survives. So the grid only brackets the maximum (extended upwards while its
largest multiplier is the best); the bracket around the best point is then
zoomed into (a few interior points per round; by concavity the maximum stays
between the best point's neighbours), and labels are pruned with the tuned
multiplier and ``lam = 0`` (the better of the two per label; more multipliers
per label cost more work than they prune). Whether a shard-group size can
beat an answer found (``strategy.py``) is judged on the tuned bound too; a
size skipped so would have been solved under a cap below its optimum and
given nothing. The order in which the sizes are solved stays the fixed
grid's bound: which slower sizes still get an answer (each is one more
candidate for the simulator, which has the last word) depends on that
order, and keeping it keeps the proposals the same.
"""

from __future__ import annotations

import math

import numpy as np

from wrapopt.search.dp.chain import ChainCosts, Choice, group_figures, sharded_grads_after

__all__ = ["GroupTables", "Bounds", "grid_bounds", "tuned_bounds"]


class GroupTables:
    """Every group's figures as arrays indexed [start, size, choice] (see ``group_figures``)."""

    def __init__(self, cc: ChainCosts, choices: tuple[Choice, ...], max_group: int):
        n, C = len(cc.blocks), len(choices)
        G = min(max_group, n)
        shape = (n + 1, G + 1, C)
        f = {k: np.zeros(shape) for k in ("F", "B", "A", "R", "S")}
        m = {k: np.zeros(shape, dtype=np.int64) for k in ("P", "G", "act", "saved", "keep", "reg")}
        self.valid = np.zeros(shape, dtype=bool)
        wid = np.zeros(shape, dtype=np.int64)
        pairs: dict[tuple[float, int], int] = {(0.0, 0): 0}  # W's effect (R, re-gathered bytes) -> id
        for st in range(n):
            for s in range(1, min(G, n - st) + 1):
                for ci, ch in enumerate(choices):
                    g = group_figures(cc, st, s, ch)
                    self.valid[st, s, ci] = True
                    for k, j in (("F", 0), ("B", 1), ("A", 2), ("R", 3), ("S", 4)):
                        f[k][st, s, ci] = g[j]
                    for k, j in (("P", 5), ("G", 6), ("act", 7), ("saved", 8), ("keep", 9), ("reg", 10)):
                        m[k][st, s, ci] = g[j]
                    wid[st, s, ci] = pairs.setdefault((g[3], g[10]), len(pairs))
        # A group's collectives and gradient bytes do not depend on its choice; the bounds rely on it.
        assert all((f[k] == f[k][..., :1]).all() for k in ("A", "S")) and (m["G"] == m["G"][..., :1]).all()
        self.f, self.m, self.wid = f, m, wid
        self.sg_after = np.array(sharded_grads_after(cc), dtype=np.int64)
        self.w_R = np.array([r for r, _ in pairs])
        self.w_reg = np.array([b for _, b in pairs], dtype=np.int64)
        self.n, self.G, self.C = n, G, C


def _lower_bounds(tb: GroupTables, cc: ChainCosts, tails: np.ndarray, lams: np.ndarray, last: bool) -> np.ndarray:
    """H[l, i, w, s, c], one slice per multiplier ``lams[l]`` >= 0 (seconds per byte).

    [Note: Lagrangian bound] From the state (end i, W's effect w, last group
    of size s with choice c) with prefix memory A, any completion that fits
    the budget has remaining time at least ``H + lam * (A - allowance)``:
    H is the least over *all* completions of remaining time plus ``lam``
    times the memory of the final windows beyond A (the kept parameters and
    activations still to be added, plus the larger of the last backward
    window's local terms and the loss window's), and for a fitting
    completion both final windows are at most the allowance. ``lam = 0`` is
    the memory-free bound. Later chains enter through ``tails``; a chain
    that is not the last passes its whole increase of A on to them. Which
    ``lam`` to use: [Note: tuned multiplier].
    """
    n, G, C = tb.n, tb.G, tb.C
    f, m = tb.f, tb.m
    nw = tb.w_R.size
    L = lams.size
    o = cc.overhead_s  # per group, in forward and in backward
    H = np.full((L, n + 1, nw, G + 1, C), np.inf)
    # The cheapest next choice from each state, per next size: a group's
    # collectives (A, S) and gradient bytes do not depend on its choice (see
    # GroupTables), so only H's own term does.
    Hmin = np.full((L, n + 1, nw, G + 1), np.inf)
    lam = lams[:, None, None, None]  # (l, w, s, c)
    R_W = tb.w_R[:, None, None]
    ahead = cc.runs_ahead
    reg_W = tb.w_reg[:, None, None].astype(float)
    cs = np.arange(C)[None, :]
    for i in range(n, 0, -1):
        smax = min(G, i)
        sl = np.arange(1, smax + 1)[:, None]
        st = i - sl
        FV, BV = f["F"][st, sl, cs], f["B"][st, sl, cs]  # (s, c)
        grow = (m["keep"][st, sl, cs] + m["act"][st, sl, cs]).astype(float)
        if i == n:
            if last:
                # Both final checks of _solve_front hold for a fitting completion: the last
                # backward window and the loss window.
                local = (m["P"][st, sl, cs] + m["saved"][st, sl, cs] + m["G"][st, sl, cs] + 2 * int(cc.work)
                         + tb.sg_after[n]).astype(float)
                loss = (grow + round(cc.loss_mem) + m["reg"][st, sl, cs]).astype(float)
                mem = np.maximum(local[None] + reg_W, loss[None])
            else:
                mem = np.broadcast_to(grow[None], (nw,) + grow.shape)
            base = (np.maximum(BV[None] + o, R_W) if ahead else BV[None] + o + R_W) + FV[None]  # (w, s, c)
            H[:, i, :, 1:smax + 1, :] = base[None] + tails[:, None, None, None] + lam * mem[None]
            Hmin[:, i] = H[:, i].min(axis=-1)
            continue
        vw = tb.wid[st, sl, cs]  # (s, c)
        best = np.full((L, nw, smax, C), np.inf)
        for s_next in range(1, min(G, n - i) + 1):
            SX, AX = f["S"][i, s_next, 0], f["A"][i, s_next, 0]
            bw = np.maximum(BV[None] + o, R_W + SX) if ahead else BV[None] + o + R_W + SX  # (w, s, c)
            fw = np.maximum(FV + o, AX) if ahead else FV + o + AX  # (s, c)
            rest = Hmin[:, i + s_next, vw, s_next]  # (l, s, c)
            np.minimum(best, bw[None] + (fw[None] + rest)[:, None], out=best)
        H[:, i, :, 1:smax + 1, :] = best + lam * grow[None, None]
        Hmin[:, i] = H[:, i].min(axis=-1)
    return H


def _start_value(tb: GroupTables, cc: ChainCosts, H: np.ndarray) -> np.ndarray:
    """The bound at the chain's start (before its first group), per multiplier, without the A term."""
    AX = tb.f["A"][0, 1:tb.G + 1, :]
    fw = np.maximum(cc.overhead_s, AX) if cc.runs_ahead else cc.overhead_s + AX
    s = np.arange(1, tb.G + 1)
    return (fw[None] + H[:, s, 0, s, :]).min(axis=(1, 2))


class Bounds:
    """Lower bounds for pruning: per chain, H for every multiplier (see [Note: Lagrangian bound])."""

    def __init__(self, tables: list[GroupTables], costs: list[ChainCosts], lams: np.ndarray):
        self.lams = lams
        self.allowance = 0.0
        self.H: list[np.ndarray] = [np.zeros(0)] * len(tables)
        tails = np.zeros(lams.size)
        for k in range(len(tables) - 1, -1, -1):
            self.H[k] = _lower_bounds(tables[k], costs[k], tails, lams, last=k == len(tables) - 1)
            tails = _start_value(tables[k], costs[k], self.H[k])
        self.root = tails

    def select(self, idx: list[int], allowance: float) -> "Bounds":
        out = object.__new__(Bounds)
        out.lams = self.lams[idx]
        out.allowance = allowance if math.isfinite(allowance) else 0.0
        out.H = [Hk[idx] for Hk in self.H]
        out.root = self.root[idx]
        return out

    def at(self, k: int, i, wid, s, c, a) -> np.ndarray:
        """The best bound on the remaining time of labels with prefix memory ``a``."""
        v = self.H[k][:, i, wid, s, c] + self.lams.reshape((-1,) + (1,) * np.ndim(a)) * (a - self.allowance)
        return v.max(axis=0)

    def global_bound(self, a0: float, allowance: float) -> np.ndarray:
        return self.root + self.lams * (a0 - allowance)


def grid_bounds(costs: list[ChainCosts], tables: list[GroupTables], cache: dict) -> Bounds:
    """Bounds for a log grid of multipliers around the exchange rate of time
    for memory (the chains' time over their bytes), cached in ``cache``."""
    if "bounds" not in cache:
        free = Bounds(tables, costs, np.zeros(1))
        span = sum(sum(cc.act) + sum(cc.P) for cc in costs) or 1.0
        scale = float(free.root[0]) / span
        cache["bounds"] = Bounds(tables, costs, np.array([0.0] + [scale * 4.0 ** k for k in range(-3, 6)]))
    return cache["bounds"]


# The grid's extension upwards (factors of 4) and the zoom: rounds of
# interior points each; the zoom stops early once a round gains nothing.
_EXTEND, _ZOOM_ROUNDS, _ZOOM_POINTS = 6, 6, 6


def tuned_bounds(costs: list[ChainCosts], tables: list[GroupTables], cache: dict, a0: float,
                 allowance: float) -> tuple[Bounds, float]:
    """Bounds for pruning under a finite ``allowance`` and the best global
    bound found. See [Note: tuned multiplier]. ``cache`` keeps the grid and
    the last allowance's answer (``ChainDP`` asks for a bound, then solves)."""
    key = a0 - allowance  # the global bound depends on nothing else
    if cache.get("tuned", (None,))[0] == key:
        return cache["tuned"][1]
    grid = grid_bounds(costs, tables, cache)
    lams, vals = [float(x) for x in grid.lams], [float(x) for x in grid.global_bound(a0, allowance)]
    j = int(np.argmax(vals))
    for _ in range(_EXTEND):  # the largest multiplier is the best: extend the grid upwards
        if j < len(lams) - 1:
            break
        lams.append(lams[-1] * 4.0)
        vals.append(float(Bounds(tables, costs, np.array(lams[-1:])).global_bound(a0, allowance)[0]))
        j = int(np.argmax(vals))
    around = sorted({0, max(0, j - 1), j, min(len(lams) - 1, j + 1)})
    xs, ys = np.array([lams[i] for i in around]), np.array([vals[i] for i in around])
    k = int(np.argmax(ys))
    for _ in range(_ZOOM_ROUNDS if math.isfinite(ys[k]) else 0):
        # By concavity the maximum lies between the best point's neighbours.
        lo, hi = xs[max(0, k - 1)], xs[min(xs.size - 1, k + 1)]
        new = np.linspace(lo, hi, _ZOOM_POINTS + 2)[1:-1]
        got = Bounds(tables, costs, new).global_bound(a0, allowance)
        before = ys[k]
        xs, ys = np.concatenate([xs, new]), np.concatenate([ys, got])
        order = np.argsort(xs, kind="stable")
        xs, ys = xs[order], ys[order]
        k = int(np.argmax(ys))
        if ys[k] - before <= 1e-9 * abs(ys[k]):
            break
    use = sorted({0.0, float(xs[k])})
    bounds = Bounds(tables, costs, np.array(use))
    bounds.allowance = allowance
    cache["tuned"] = (key, (bounds, max(float(ys[k]), float(bounds.global_bound(a0, allowance).max()))))
    return cache["tuned"][1]
