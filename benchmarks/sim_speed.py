"""Simulator speed: plan evaluations per second on one core, and the simulator's
share of a real search. Writes ``results/sim_speed.md`` and ``results/sim_speed.json``.

All on zoo:llama-7b (32 blocks) on 64 ranks (8 per node), analytical H100
fabric and compute, in this process (one thread):

1. ``Simulator.simulate`` on four kinds of plan: a per-block plan and the
   size-1e8 plan (35 units, sub-block units), each again and again (its layout
   cached); random groupings of 1-4 blocks, a new one every call (the layout
   built each time); random plans of the Optuna search space (sub-block units
   too: ~180-190 units, ~270-290 compute segments), a new one every call.
2. ``search_plan`` with 200 Optuna trials, as ``wrapopt search`` runs it: wall
   time and the time spent inside ``Simulator.simulate``.

Each case runs compiled (numba: the step loop, the layout kernel and the
collective-time lookup) and as Python, alternately (See [Note: compiled step
loop], [Note: layout kernel]); best and median of 9 rounds, each round all
kinds both ways (the machine's speed drifts). Run:
``python -m benchmarks.sim_speed`` (about a minute). Loading the compiled code
from numba's disk cache happens once, before the timed rounds, and is reported
on its own, as is compiling it from a cold cache (in a subprocess with an
empty ``NUMBA_CACHE_DIR``).
"""

from __future__ import annotations

import datetime
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from wrapopt.evaluation.stats import cpu_steal, cpu_times, fmt_steal
from wrapopt.fileio import atomic_write_json, atomic_write_text

MESH = dict(world_size=64, ranks_per_node=8, shard_size=64)


class _Random:
    """A random source for ``SearchSpace.decode``: every choice uniform."""

    def __init__(self, rng: random.Random):
        self.rng = rng

    def cat(self, name, choices):
        return self.rng.choice(choices)


def _setup():
    from wrapopt.models import zoo
    from wrapopt.trace.meta import trace_model

    entry = zoo.get_entry("llama-7b")
    return trace_model(entry.build("meta"), entry.inputs(), loss_fn=entry.loss, fx=False)


def _new_sim(graph, backend: str | None = None):
    """A fresh simulator; ``backend``: 'compiled' (numba: the step loop, the layout build and the
    collective-time lookup), 'python', or None for the default. See [Note: compiled step loop]
    and [Note: layout kernel]."""
    from wrapopt.cost import Simulator
    from wrapopt.hardware.presets import analytical_compute, analytical_fabric

    return Simulator(graph, analytical_fabric(world_size=MESH["world_size"]), analytical_compute(), backend=backend)


def simulator_speed(graph=None, rounds: int = 9) -> list[dict]:
    """Plan evaluations per second, best and median of ``rounds`` rounds, per kind of
    plan, compiled and as Python (when numba is installed). Every round measures
    every kind both ways, so that all rows see the same drift of the machine."""
    from wrapopt.search.baselines import baselines
    from wrapopt.search.study.space import SearchSpace
    from wrapopt.spec import MeshSpec, PlanSpec, UnitSpec

    graph = graph or _setup()
    mesh = MeshSpec(**MESH)
    base = baselines(graph, mesh)
    compiled = _new_sim(graph).backend.name == "compiled"
    root, blocks = base["root-only"].units[-1], graph.blocks

    def groupings(k: int) -> list:
        rng, plans = random.Random(k), []
        for _ in range(200):
            groups, i = [], 0
            while i < len(blocks):
                size = rng.randint(1, 4)
                groups.append(UnitSpec(blocks[i:i + size], rng.random() < 0.5, rng.random() < 0.3))
                i += size
            plans.append(PlanSpec(tuple(groups) + (root,), mesh))
        return plans

    space = SearchSpace(graph, mesh)

    def sampled(k: int) -> list:
        src = _Random(random.Random(100 + k))
        return [space.decode(src) for _ in range(100)]

    cases = [(f"{label} plan, the same plan again (layout cached)", lambda k, plan=base[label]: [plan] * 200)
             for label in ("per-block", "size-1e8")]
    cases += [("random groupings of 1-4 blocks, a new one each call (layout built)", groupings),
              ("random plans of the Optuna search space, a new one each call (layout built)", sampled)]
    loops = ("compiled", "python") if compiled else ("python",)
    rates: dict[tuple[str, str], list[float]] = {(c, lp): [] for c, _ in cases for lp in loops}
    shape: dict[str, tuple[float, float]] = {}
    for k in range(rounds):
        for label, make_plans in cases:
            plans = make_plans(k)
            for loop in loops:  # interleaved: the machine is shared
                sim = _new_sim(graph, loop)  # a fresh simulator: layouts are built, not cached
                t0 = time.perf_counter()
                for p in plans:
                    sim.simulate(p)
                rates[(label, loop)].append(len(plans) / (time.perf_counter() - t0))
            shape[label] = (sum(len(p.units) for p in plans) / len(plans),
                            sum(sim.layout(p.units).num_segments for p in plans) / len(plans))
    rows = []
    for label, _ in cases:
        main = rates[(label, loops[0])]
        rows.append({"case": label, "per_s": max(main), "median_per_s": statistics.median(main),
                     "python_per_s": max(rates[(label, "python")]), "rounds": {lp: rates[(label, lp)] for lp in loops},
                     "units": shape[label][0], "segments": shape[label][1]})
    return rows


def search_share(graph=None, trials: int = 200) -> dict:
    """Wall time of ``search_plan`` (no budget, ``trials`` Optuna trials) and the part inside ``simulate``."""
    from wrapopt.search.driver import SearchOptions, search_plan
    from wrapopt.spec import MeshSpec

    graph = graph or _setup()
    sim = _new_sim(graph)
    inner = sim.simulate
    spent = [0.0, 0]

    def timed(plan, **kw):
        t0 = time.perf_counter()
        try:
            return inner(plan, **kw)
        finally:
            spent[0] += time.perf_counter() - t0
            spent[1] += 1

    sim.simulate = timed  # type: ignore[method-assign]
    t0 = time.perf_counter()
    search_plan(graph, sim, MeshSpec(**MESH), options=SearchOptions(trials=trials, seed=0))
    wall = time.perf_counter() - t0
    return {"trials": trials, "wall_s": wall, "simulate_s": spent[0], "simulate_calls": spent[1]}


def cold_compile_s() -> float:
    """Seconds to compile the simulator from an empty numba cache, in a subprocess."""
    code = ("import time, sys; from benchmarks import sim_speed as s; g = s._setup(); "
            "from wrapopt.search import baselines; from wrapopt.spec import MeshSpec; "
            "p = baselines(g, MeshSpec(**s.MESH))['per-block']; t = time.perf_counter(); s._new_sim(g).simulate(p); "
            "print(time.perf_counter() - t)")
    with tempfile.TemporaryDirectory() as cache:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, check=True,
                             cwd=os.path.join(os.path.dirname(__file__), ".."),
                             env={**os.environ, "NUMBA_CACHE_DIR": cache})
    return float(out.stdout.strip().splitlines()[-1])


def main() -> int:
    t0 = time.perf_counter()
    graph = _setup()
    from wrapopt.search.baselines import baselines
    from wrapopt.spec import MeshSpec

    t1 = time.perf_counter()  # the first simulate compiles (or loads from numba's cache)
    sim = _new_sim(graph)
    sim.simulate(baselines(graph, MeshSpec(**MESH))["per-block"])
    compile_s = time.perf_counter() - t1
    cold_s = None
    if sim.backend.kernels is not None:
        import numba

        loop = f"compiled with numba {numba.__version__}"
        cold_s = cold_compile_s()
    else:
        loop = "Python (numba is not installed: `pip install wrapopt[fast]`)"
    cpu0 = cpu_times()
    load0 = os.getloadavg()[0]
    rows = simulator_speed(graph)
    steal = cpu_steal(cpu0, cpu_times())
    load1 = os.getloadavg()[0]
    busy = max(load0, load1) > 1.5  # this benchmark is one busy process
    share = search_share(graph)
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    lines = [
        "# Simulator speed",
        "",
        f"Machine: {platform.node()}, {os.cpu_count()} cores ({platform.machine()}), one thread; Python "
        f"{platform.python_version()}, torch {torch.__version__}; {date}. Regenerate: `python -m benchmarks.sim_speed` "
        f"({time.perf_counter() - t0:.0f} s). zoo:llama-7b (32 blocks) on 64 ranks, analytical fabric; best and "
        "median of 9 rounds (the machine is shared and its speed drifts: compare rows within one run).",
        "",
        f"Simulator: {loop} (step loop, layout kernel, collective-time lookup). Loading it from numba's disk cache "
        f"took {compile_s:.1f} s, once per process"
        + (f"; compiling it from a cold cache took {cold_s:.1f} s (once per machine)" if cold_s else "")
        + f". CPU steal while the rates were measured: {fmt_steal(steal)} (the share of CPU time the hypervisor "
        "gave to other guests). Load average (1 min) before and after the rates: "
        f"{load0:.1f} and {load1:.1f} on {os.cpu_count()} cores"
        + (": the machine was shared with other processes, so the rates are lower and noisier than on an idle one; "
           "`scripts/sim_speed_ab.py` compares versions in paired CPU time." if busy else "."),
        "",
        "| plans | units per plan | compute segments per plan | plan evaluations per second: best | median "
        "| as Python (no numba): best |",
        "|---|---|---|---|---|---|",
    ]
    lines += [f"| {r['case']} | {r['units']:.0f} | {r['segments']:.0f} | {r['per_s']:,.0f} | {r['median_per_s']:,.0f} "
              f"| {r['python_per_s']:,.0f} |" for r in rows]
    lines += [
        "",
        f"`search_plan` with {share['trials']} Optuna trials (the DP, baselines and seeds included): "
        f"{share['wall_s']:.1f} s, of which {share['simulate_s']:.1f} s ({share['simulate_s'] / share['wall_s']:.0%}) "
        f"inside `Simulator.simulate` ({share['simulate_calls']} calls). The rest is the DP and Optuna's own sampling "
        f"and bookkeeping.",
        "",
    ]
    os.makedirs("results", exist_ok=True)
    atomic_write_text("results/sim_speed.md", "\n".join(lines))
    atomic_write_json("results/sim_speed.json", {"date": date, "step_loop": loop, "compile_s": compile_s,
                                                  "cold_compile_s": cold_s, "steal": steal,
                                                  "load_average": [load0, load1], "speed": rows, "search": share})
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
