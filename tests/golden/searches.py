"""``search_plan``'s answers on a fixed set of searches (formerly ``benchmarks/search_dump.py``).

``estimates.py`` checks the simulator; this checks what the search picks with it.

The set: the zoo's four tiny models and llama-7b; 2 ranks on one node and 64
ranks, 8 per node (FSDP over the world, so the DP also tries HSDP groups); no
budget and 80% of the per-block baseline's predicted peak; no Optuna study and
a 40-trial study (seed 0). Per search: the chosen plan (units, mesh, prefetch,
label), its step time and peak, the DP's and the study's best, the Pareto
front, every candidate's label and step time, the study's seed and trial
counts; or the InfeasibleError's message.

``test_golden.py`` compares it with ``search.golden.json``. The full dump:

    PYTHONPATH=$PWD python -m tests.golden.searches --out /tmp/search.json [--models gpt-tiny,llama-7b]

The searches the exact DP finds hardest (minutes; too slow for a test) stay a
maintainer's check: ``scripts/search_dump_big.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from tests.golden.digest import Entry, canonical_sha256
from wrapopt import MeshSpec, analytical_compute, analytical_fabric, trace_model, zoo
from wrapopt.cost import Simulator
from wrapopt.errors import InfeasibleError
from wrapopt.search.baselines import baselines
from wrapopt.search.driver import SearchOptions, search_plan

MODELS = ("gpt-tiny", "llama-tiny", "vit-tiny", "t5-tiny", "llama-7b")
WORLDS = ((2, 2), (64, 8))
TRIALS = (0, 40)


def _plan(plan) -> dict:
    return {"label": plan.label, "shard_size": plan.mesh.shard_size, "forward_prefetch": plan.forward_prefetch,
            "units": [[list(u.modules), u.reshard_after_forward, u.checkpoint] for u in plan.units]}


def _scored(s) -> dict | None:
    if s is None:
        return None
    return {"plan": _plan(s.plan), "step_s": repr(s.estimate.step_s), "peak_bytes": s.estimate.peak_bytes,
            "fits": s.fits}


def result_row(res) -> dict:
    """A ``SearchResult`` as the dump's fields."""
    return dict(
        best=_scored(res.best), dp_best=_scored(res.dp_best), optuna_best=_scored(res.optuna_best),
        baselines={k: _scored(s) for k, s in res.baselines.items()},
        pareto=[[s.plan.label, repr(s.estimate.step_s), s.estimate.peak_bytes] for s in res.pareto],
        candidates=[[s.plan.label, repr(s.estimate.step_s), s.fits] for s in res.candidates],
        notes=list(res.notes),
        study=None if res.study is None else [res.study.num_seeds, res.study.num_trials, res.study.sampler],
    )


def run(models: tuple[str, ...] = MODELS) -> list[dict]:
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
                        row.update(result_row(res))
                    print(f"{name} w{world} budget={budget} trials={trials}: {time.perf_counter() - t0:.1f}s",
                          flush=True)
                    out.append(row)
    return out


def entries(rows: list[dict]) -> list[Entry]:
    """The golden entries of ``run()``'s rows (or of a full dump read back from JSON).

    The key names the budget by its rule, not its bytes (those come from the
    simulator, and the sha256 covers them)."""
    out = []
    for row in rows:
        budget = "none" if row["budget"] is None else "80% of per-block"
        best = row.get("best") or {}
        out.append(Entry(key=f"{row['model']} x{row['world']} budget={budget} trials={row['trials']}",
                         step_s=best.get("step_s"), peak_bytes=best.get("peak_bytes"),
                         sha256=canonical_sha256(row)))
    return out


def write_dump(rows: list[dict], path: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(rows, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)  # atomically: a killed run leaves no half dump


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--models", default=None, help=f"default: {','.join(MODELS)}")
    args = ap.parse_args()
    write_dump(run(tuple(args.models.split(",")) if args.models else MODELS), args.out)


if __name__ == "__main__":
    main()
