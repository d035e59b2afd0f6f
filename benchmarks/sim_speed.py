"""Simulator speed: plan evaluations per second on one core, and the simulator's
share of a real search. Writes ``results/sim_speed.md`` and ``results/sim_speed.json``.

All on zoo:llama-7b (32 blocks) on 64 ranks (8 per node), analytical H100
fabric and compute, in this process (one thread):

1. ``Simulator.simulate`` on four kinds of plan, best of 5 rounds (the machine
   is shared): a per-block plan and the size-1e8 plan (35 units, sub-block
   units), each again and again (its layout cached); random groupings of 1-4
   blocks, a new one every call (the layout built each time); random plans of
   the Optuna search space (sub-block units too: ~180 units, ~290 compute
   segments), a new one every call.
2. ``search_plan`` with 200 Optuna trials, as ``wrapopt search`` runs it: wall
   time and the time spent inside ``Simulator.simulate``.

Run: ``python benchmarks/sim_speed.py`` (about a minute).
"""

from __future__ import annotations

import datetime
import os
import platform
import random
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

from wrapopt._io import atomic_write_json, atomic_write_text  # noqa: E402

MESH = dict(world_size=64, ranks_per_node=8, shard_size=64)


class _Random:
    """A random source for ``SearchSpace.decode``: every choice uniform."""

    def __init__(self, rng: random.Random):
        self.rng = rng

    def cat(self, name, choices):
        return self.rng.choice(choices)


def _setup():
    from wrapopt import zoo
    from wrapopt.trace import trace_model

    entry = zoo.get_entry("llama-7b")
    return trace_model(entry.build("meta"), entry.inputs(), loss_fn=entry.loss, fx=False)


def _new_sim(graph):
    from wrapopt.cost import Simulator
    from wrapopt.fabric import ComputeProfile, analytical_fabric

    return Simulator(graph, analytical_fabric(world_size=MESH["world_size"]), ComputeProfile.analytical())


def simulator_speed(graph=None, rounds: int = 5) -> list[dict]:
    """Plan evaluations per second, best of ``rounds`` rounds, per kind of plan."""
    from wrapopt.search import baselines
    from wrapopt.search.space import SearchSpace
    from wrapopt.types import MeshSpec, PlanSpec, UnitSpec

    graph = graph or _setup()
    mesh = MeshSpec(**MESH)
    base = baselines(graph, mesh)
    rows = []

    def best_of(make_plans, label: str) -> None:
        best, units, segs = float("inf"), 0.0, 0.0
        for k in range(rounds):
            plans, sim = make_plans(k), _new_sim(graph)  # a fresh simulator: layouts are built, not cached
            t0 = time.perf_counter()
            for p in plans:
                sim.simulate(p)
            best = min(best, (time.perf_counter() - t0) / len(plans))
            units = sum(len(p.units) for p in plans) / len(plans)
            segs = sum(len(sim.layout(p.units).segments) for p in plans) / len(plans)
        rows.append({"case": label, "per_s": 1 / best, "units": units, "segments": segs})

    for label in ("per-block", "size-1e8"):
        plan = base[label]
        best_of(lambda k, plan=plan: [plan] * 200, f"{label} plan, the same plan again (layout cached)")
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

    best_of(groupings, "random groupings of 1-4 blocks, a new one each call (layout built)")
    space = SearchSpace(graph, mesh)
    def sampled(k: int) -> list:
        src = _Random(random.Random(100 + k))
        return [space.decode(src) for _ in range(100)]

    best_of(sampled,
            "random plans of the Optuna search space, a new one each call (layout built)")
    return rows


def search_share(graph=None, trials: int = 200) -> dict:
    """Wall time of ``search_plan`` (no budget, ``trials`` Optuna trials) and the part inside ``simulate``."""
    from wrapopt.search import SearchOptions, search_plan
    from wrapopt.types import MeshSpec

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


def main() -> int:
    t0 = time.perf_counter()
    graph = _setup()
    rows = simulator_speed(graph)
    share = search_share(graph)
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    lines = [
        "# Simulator speed",
        "",
        f"Machine: {platform.node()}, {os.cpu_count()} cores ({platform.machine()}), one thread; Python "
        f"{platform.python_version()}, torch {torch.__version__}; {date}. Regenerate: `python benchmarks/sim_speed.py` "
        f"({time.perf_counter() - t0:.0f} s). zoo:llama-7b (32 blocks) on 64 ranks, analytical fabric; best of 5 rounds "
        "(the machine is shared).",
        "",
        "| plans | units per plan | compute segments per plan | plan evaluations per second |",
        "|---|---|---|---|",
    ]
    lines += [f"| {r['case']} | {r['units']:.0f} | {r['segments']:.0f} | {r['per_s']:,.0f} |" for r in rows]
    lines += [
        "",
        f"`search_plan` with {share['trials']} Optuna trials (the DP, baselines and seeds included): {share['wall_s']:.1f} s, "
        f"of which {share['simulate_s']:.1f} s ({share['simulate_s'] / share['wall_s']:.0%}) inside `Simulator.simulate` "
        f"({share['simulate_calls']} calls). The rest is the DP and Optuna's own sampling and bookkeeping.",
        "",
    ]
    os.makedirs("results", exist_ok=True)
    atomic_write_text("results/sim_speed.md", "\n".join(lines))
    atomic_write_json("results/sim_speed.json", {"date": date, "speed": rows, "search": share})
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
