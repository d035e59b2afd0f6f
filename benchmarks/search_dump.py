"""Dump ``search_plan``'s answers on a fixed set of searches, to check that a
refactor of the search changes no answer (``cmp`` two dumps: they must be
byte-identical). ``estimate_dump.py`` checks the simulator; this checks what
the search picks with it.

The set: the zoo's four tiny models and llama-7b; 2 ranks on one node and 64
ranks, 8 per node (FSDP over the world, so the DP also tries HSDP groups); no
budget and 80% of the per-block baseline's predicted peak; no Optuna study and
a 40-trial study (seed 0). Per search: the chosen plan (units, mesh, prefetch,
label), its step time and peak, the DP's and the study's best, the Pareto
front, every candidate's label and step time, the study's seed and trial
counts; or the InfeasibleError's message.

``--big`` dumps instead the searches the exact DP finds hardest: llama-7b
and llama-70b on 64, 256 and 1024 ranks (8 per node), set up as ``wrapopt
search`` sets them up (the analytical fabric and its device, the default
training config), with no budget, the default (auto: 90% of the device)
and 40 and 60 GiB; no study (the study is seeded with the DP's answers, so
these pin what the DP proposes).

    python benchmarks/search_dump.py --out /tmp/search.json [--models gpt-tiny,llama-7b]
    python benchmarks/search_dump.py --big --out /tmp/search_big.json [--models llama-70b]
"""

from __future__ import annotations

import argparse
import json
import os
import time

from wrapopt import MeshSpec, analytical_compute, analytical_fabric, trace_model, zoo
from wrapopt.api import compute_for, resolve_budget, resolve_fabric
from wrapopt.cost import Simulator
from wrapopt.errors import InfeasibleError
from wrapopt.search.baselines import baselines
from wrapopt.search.driver import SearchOptions, search_plan
from wrapopt.train import TrainConfig, model_dtype

MODELS = ("gpt-tiny", "llama-tiny", "vit-tiny", "t5-tiny", "llama-7b")
WORLDS = ((2, 2), (64, 8))
TRIALS = (0, 40)
BIG_MODELS = ("llama-7b", "llama-70b")
BIG_WORLDS = (64, 256, 1024)
BIG_BUDGETS = ("none", "auto", "40GiB", "60GiB")


def _plan(plan) -> dict:
    return {"label": plan.label, "shard_size": plan.mesh.shard_size, "forward_prefetch": plan.forward_prefetch,
            "units": [[list(u.modules), u.reshard_after_forward, u.checkpoint] for u in plan.units]}


def _scored(s) -> dict | None:
    if s is None:
        return None
    return {"plan": _plan(s.plan), "step_s": repr(s.estimate.step_s), "peak_bytes": s.estimate.peak_bytes,
            "fits": s.fits}


def _result_row(res) -> dict:
    return dict(
        best=_scored(res.best), dp_best=_scored(res.dp_best), optuna_best=_scored(res.optuna_best),
        baselines={k: _scored(s) for k, s in res.baselines.items()},
        pareto=[[s.plan.label, repr(s.estimate.step_s), s.estimate.peak_bytes] for s in res.pareto],
        candidates=[[s.plan.label, repr(s.estimate.step_s), s.fits] for s in res.candidates],
        notes=list(res.notes),
        study=None if res.study is None else [res.study.num_seeds, res.study.num_trials, res.study.sampler],
    )


def run_big(models: tuple[str, ...]) -> list[dict]:
    """The ``--big`` set: every DP answer (``candidates`` holds them all, with their times)."""
    out = []
    train = TrainConfig()
    for name in models:
        model, inputs = zoo.build(name, "meta")
        graph = trace_model(model, inputs, loss_fn=zoo.ZOO[name].loss)
        for world in BIG_WORLDS:
            mesh = MeshSpec(world_size=world, ranks_per_node=8, shard_size=world)
            fabric = resolve_fabric(None, world_size=world, ranks_per_node=8)
            compute = compute_for(fabric, None, train, model_dtype(model))
            for word in BIG_BUDGETS:
                budget = resolve_budget(word, compute)
                sim = Simulator(graph, fabric, compute, train.sim_options(memory_budget=budget))
                row: dict = {"model": name, "world": world, "budget": word, "trials": 0}
                t0, c0 = time.perf_counter(), time.process_time()
                try:
                    res = search_plan(graph, sim, mesh, memory_budget=budget, options=SearchOptions(trials=0, seed=0))
                except InfeasibleError as e:
                    row["infeasible"] = str(e)
                else:
                    row.update(_result_row(res))
                print(f"{name} w{world} budget={word}: {time.perf_counter() - t0:.1f}s wall, "
                      f"{time.process_time() - c0:.1f}s CPU", flush=True)
                out.append(row)
    return out


def run(models: tuple[str, ...]) -> list[dict]:
    out = []
    for name in models:
        model, inputs = zoo.build(name, "meta")
        graph = trace_model(model, inputs, loss_fn=zoo.ZOO[name].loss)
        for world, rpn in WORLDS:
            mesh = MeshSpec(world_size=world, ranks_per_node=rpn, shard_size=world)
            sim = Simulator(graph, analytical_fabric(world_size=world, ranks_per_node=rpn), analytical_compute())
            per_block = baselines(graph, mesh).get("per-block")
            budgets: list[float | None] = [None]
            if per_block is not None:
                budgets.append(0.8 * sim.simulate(per_block).peak_bytes)
            for budget in budgets:
                for trials in TRIALS:
                    row: dict = {"model": name, "world": world, "budget": budget, "trials": trials}
                    t0 = time.perf_counter()
                    try:
                        res = search_plan(graph, sim, mesh, memory_budget=budget,
                                          options=SearchOptions(trials=trials, seed=0))
                    except InfeasibleError as e:
                        row["infeasible"] = str(e)
                    else:
                        row.update(_result_row(res))
                    print(f"{name} w{world} budget={budget} trials={trials}: {time.perf_counter() - t0:.1f}s", flush=True)
                    out.append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--models", default=None, help=f"default: {','.join(MODELS)} ({','.join(BIG_MODELS)} with --big)")
    ap.add_argument("--big", action="store_true", help="the large-model set (see the module's docstring)")
    args = ap.parse_args()
    models = tuple(args.models.split(",")) if args.models else BIG_MODELS if args.big else MODELS
    rows = run_big(models) if args.big else run(models)
    tmp = f"{args.out}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(rows, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(tmp, args.out)  # atomically: a killed run leaves no half dump


if __name__ == "__main__":
    main()
