"""CPU offload in the search: offload plans searched beside the others, chosen only where one is
the fastest plan that fits. See [Note: CPU offload] in cost/state.py.

[Note: offload search] Offload is one choice for the whole plan (every ``fully_shard`` gets
``CPUOffloadPolicy``), so the search runs twice: as asked, and with a simulator that prices every
plan offloaded (``SimOptions.offload``), which frees the GPU of the sharded state (so less
checkpointing or larger units may fit) and adds the host-device copies and the CPU optimizer
step. The offload answer's plans are marked ``offload`` and it wins only if it fits the GPU
budget, its host memory fits the stated host memory, and it is faster than the best plan without
offload (or nothing fits without it). Either way a note says what offload gave.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, TypeVar

from wrapopt.cost.simulate import Simulator
from wrapopt.errors import InfeasibleError
from wrapopt.fileio import fmt_bytes
from wrapopt.search.driver import SearchResult
from wrapopt.search.strategy import Round, Scored

__all__ = ["offloaded", "mark_offload", "choose_offload"]

T = TypeVar("T")


def offloaded(sim: Simulator) -> Simulator:
    """``sim`` pricing every plan with CPU offload (the same graph, fabric, compute and host)."""
    return Simulator(sim.traced, sim.fabric, sim.compute, replace(sim.options, offload=True), backend=sim.backend,
                     host=sim.host)


def mark_offload(res: SearchResult) -> SearchResult:
    """Every plan of ``res`` (searched by an ``offloaded`` simulator) with ``offload`` set."""
    cache: dict[int, Scored] = {}

    def one(s: Scored | None) -> Scored | None:
        if s is None:
            return None
        if id(s) not in cache:
            cache[id(s)] = replace(s, plan=replace(s.plan, offload=True))
        return cache[id(s)]

    rounds = tuple(Round(r.strategy, tuple(replace(p, offload=True) for p in r.proposed), tuple(map(one, r.scored)),
                         r.detail) for r in res.rounds)
    return replace(res, best=one(res.best), baselines={k: one(s) for k, s in res.baselines.items()},
                   candidates=tuple(map(one, res.candidates)), pareto=tuple(map(one, res.pareto)), rounds=rounds,
                   fastest=one(res.fastest), tp_rows=tuple((k, one(s)) for k, s in res.tp_rows),
                   batch_rows=tuple(replace(r, best=one(r.best)) for r in res.batch_rows))


def choose_offload(run: Callable[[Simulator], T], sim: Simulator, result_of: Callable[[T], SearchResult]
                   ) -> tuple[T, str]:
    """``run(sim)`` and, when ``sim`` has a host, ``run(offloaded(sim))``: the answer with the
    faster fitting best (See [Note: offload search]) and a note saying what offload gave. Raises
    ``InfeasibleError`` only when neither fits."""
    if sim.host is None:
        return run(sim), ""
    plain = err = None
    try:
        plain = run(sim)
    except InfeasibleError as e:
        err = e
    try:
        off = run(offloaded(sim))
    except InfeasibleError as e:
        if plain is None:
            raise err or e from None
        return plain, f"CPU offload considered: nothing fits with it either ({str(e).splitlines()[0][:100]})"
    best = result_of(off).best
    host = sim.host
    need = sim.host_bytes_per_rank(best.plan) * host.ranks_per_node
    if need > host.memory_bytes_per_node:
        note = (f"CPU offload considered: its best plan needs {fmt_bytes(need)} of host memory per node, more than "
                f"the {fmt_bytes(host.memory_bytes_per_node)} stated (--host-memory)")
        if plain is None:
            raise InfeasibleError(f"{err} {note}") from None
        return plain, note
    if plain is not None and result_of(plain).best.fits and (
            not best.fits or result_of(plain).best.estimate.step_s <= best.estimate.step_s):
        return plain, (f"CPU offload considered: its best plan, {best.estimate.step_s * 1e3:.1f} ms per step, is "
                       f"slower than without ({result_of(plain).best.estimate.step_s * 1e3:.1f} ms): not chosen")
    if not best.fits:
        if plain is None:
            raise err from None
        return plain, "CPU offload considered: no offload plan fits either"
    why = ("nothing fits without it" if plain is None or not result_of(plain).best.fits else
           f"faster than the best plan without it ({result_of(plain).best.estimate.step_s * 1e3:.1f} ms)")
    return off, (f"CPU offload chosen: {best.estimate.step_s * 1e3:.1f} ms per step, {fmt_bytes(need)} of host memory "
                 f"per node; {why}")
