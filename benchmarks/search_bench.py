"""Search benchmark: writes ``results/search.md``.

1. ``wrapopt search zoo:llama-70b --world-size 1024 --gpus-per-node 8`` (the
   analytical H100 + InfiniBand fabric) in a fresh process: wall time and
   peak resident memory (``os.wait4``'s rusage of that process), tracing
   included; once with ``--memory none`` and once with ``--memory auto`` (the default). The
   chosen plan beside the baselines.
2. On every trainable zoo model, on 16 ranks (2 nodes of 8) with no budget
   and with a tight one: the exact DP's best plan (as the simulator scores
   it) against the Optuna study's best at its default budget, seeded as
   ``wrapopt search`` seeds it (baselines + DP answers), and seeded with the
   baselines only (can the study find the DP's optimum by itself?).

Run: ``python -m benchmarks.search_bench`` (about two minutes on 2 cores).
Predicted times come from the simulator; nothing here is a measured step.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

LLAMA_70B = ["zoo:llama-70b", "--world-size", "1024", "--gpus-per-node", "8"]
TRAINABLE = ("gpt-tiny", "llama-tiny", "vit-tiny", "t5-tiny")


def _timed_search(extra: list[str]) -> tuple[float, float, float, dict]:
    """(wall s, CPU s, peak RSS bytes, JSON output) of one ``wrapopt search`` in a fresh process."""
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "wrapopt.cli", "search", *LLAMA_70B, "--json", *extra]
    import tempfile

    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=err, text=True)
        _pid, status, usage = os.wait4(proc.pid, 0)  # this process's own rusage
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        if proc.returncode != 0:
            raise RuntimeError(f"search failed: {err.read()}")
        return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss * 1024, json.loads(out.read())


def _fmt_gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def _search_section() -> list[str]:
    lines = ["## llama-70b on 1024 GPUs (128 nodes of 8), analytical H100 + IB fabric", ""]
    lines += ["`wrapopt search zoo:llama-70b --world-size 1024 --gpus-per-node 8 --memory none|auto`, fresh process, "
              "tracing included; CPU time (user + system) and peak RSS from `wait4` (CPU time is the steadier "
              "figure on a shared machine). Target: at most 30 s and under 3 GB.", ""]
    rows = []
    outputs = {}
    for label, extra in (("--memory "
                          "none", ["--memory", "none"]), ("--memory auto (the default)", ["--memory", "auto"])):
        load = os.getloadavg()[0]
        wall, cpu, rss, data = _timed_search(extra)
        outputs[label] = data
        rows.append(f"| {label} | {wall:.1f} s | {cpu:.1f} s | {rss / 1e9:.2f} GB | "
                    f"{data['search']['study']['finished_trials']} | {load:.1f} |")
    lines += ["| search | wall time | CPU time | peak RSS | Optuna trials | load average before |",
              "|---|---|---|---|---|---|", *rows, ""]
    for label, data in outputs.items():
        pred = data["prediction"]
        lines += [f"### Chosen plan vs baselines ({label})", ""]
        if data["search"]["memory_budget_note"]:
            lines += [data["search"]["memory_budget_note"], ""]
        lines += ["| plan | shard group | units | predicted step | predicted peak | fits "
                  "|", "|---|---|---|---|---|---|"]
        lines.append(f"| **wrapopt: {data['label']}** | {data['mesh']['shard_size']} | {len(data['units'])} | "
                     f"{pred['step_s'] * 1e3:.0f} ms | {_fmt_gib(pred['peak_bytes'])} | yes |")
        for name, b in data["baselines"].items():
            lines.append(f"| {name} | {'1' if name == 'no-shard' else '1024'} | {b['num_units']} | "
                         f"{b['step_s'] * 1e3:.0f} ms | {_fmt_gib(b['peak_bytes'])} | {'yes' if b['fits'] else 'no'} |")
        fitting = [b["step_s"] for b in data["baselines"].values() if b["fits"]]
        if fitting:
            lines += ["", f"Speed-up over the best fitting baseline: {min(fitting) / pred['step_s']:.2f}x."]
        front = data["search"]["pareto"]
        lines += ["", f"Pareto front ({len(front)} plans that fit, fastest first): " + ", ".join(
            f"{p['step_s'] * 1e3:.0f} ms / {_fmt_gib(p['peak_bytes'])} (shard {p['shard_size']})" for p in front[:6])
            + (" ..." if len(front) > 6 else ""), ""]
    return lines


def _zoo_section() -> list[str]:
    from wrapopt.cost import Simulator
    from wrapopt.hardware.presets import analytical_compute, analytical_fabric
    from wrapopt.models import zoo
    from wrapopt.search.driver import DEFAULT_TRIALS, SearchOptions, search_plan
    from wrapopt.search.study.run import run_study
    from wrapopt.search.study.space import SearchSpace
    from wrapopt.spec import MeshSpec
    from wrapopt.trace.meta import trace_model

    lines = ["## DP optimum vs Optuna best on the trainable zoo models", ""]
    lines += [f"16 ranks (2 nodes of 8), analytical H100 + IB fabric. *DP best*: the fastest fitting answer of "
              "the exact DP (per-unit choices, every shard group), as the simulator scores it. *Optuna*: the "
              f"study at its defaults ({DEFAULT_TRIALS} trials, sampler `auto` = multi-objective TPE on these "
              "small spaces, seed 0) over the whole space (groupings, per-unit reshard and checkpointing, "
              "submodule and tied-group units, shard group, prefetch); *seeded* as `wrapopt search` runs it "
              "(baselines, DP answers and the best candidates enqueued first), *baselines only* with the DP "
              "answers withheld. Ratio = Optuna / DP (<= 1: Optuna found the DP optimum or better). *chosen*: "
              "what `wrapopt search` returns. The tight budget is 1.2x the smallest peak any candidate "
              "reaches. *time*: the whole seeded search.", ""]
    lines += ["| model | budget | DP best | Optuna seeded | ratio | Optuna, baselines only | ratio | chosen | time |",
              "|---|---|---|---|---|---|---|---|---|"]
    for name in TRAINABLE:
        e = zoo.get_entry(name)
        g = trace_model(e.build("meta"), e.inputs(), loss_fn=e.loss)
        mesh = MeshSpec(world_size=16, ranks_per_node=8, shard_size=16)
        sim = Simulator(g, analytical_fabric(world_size=16), analytical_compute())
        probe = search_plan(g, sim, mesh)
        tight = 1.2 * min(s.estimate.peak_bytes for s in probe.candidates)
        for blabel, budget in (("none", math.inf), (f"{tight / 2**20:.1f} MiB", tight)):
            t0 = time.perf_counter()
            res = search_plan(g, sim, mesh, memory_budget=budget, options=SearchOptions(trials=DEFAULT_TRIALS, seed=0))
            took = time.perf_counter() - t0
            dp = res.dp_best.estimate.step_s
            seeded = res.optuna_best.estimate.step_s
            space = SearchSpace(g, mesh)
            alone = run_study(g, sim, space, memory_budget=budget, seeds=[s.plan for s in res.baselines.values()],
                              trials=DEFAULT_TRIALS, seed=0)
            a = (f"{alone.best.estimate.step_s * 1e3:.3f} ms | {alone.best.estimate.step_s / dp:.3f}" if alone.best
                 else "nothing fits | -")
            chosen = (f"{res.best.estimate.step_s * 1e3:.3f} ms ({res.best.plan.label}, "
                      f"shard {res.best.plan.mesh.shard_size})")
            lines.append(f"| {name} | {blabel} | {dp * 1e3:.3f} ms | {seeded * 1e3:.3f} ms | {seeded / dp:.3f} | "
                         f"{a} | {chosen} | {took:.1f} s |")
    return lines + [""]


# benchmarks/search_tp.py, search_pp.py and search_batch.py write their sections of results/search.md
# between these markers; they are kept.
KEPT = (("<!-- search_tp.py: begin -->", "<!-- search_tp.py: end -->"),
        ("<!-- search_pp.py: begin -->", "<!-- search_pp.py: end -->"),
        ("<!-- search_batch.py: begin -->", "<!-- search_batch.py: end -->"))


def _kept_section(path: str) -> list[str]:
    """The sections other scripts wrote between their markers in ``path``, to keep."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        return []
    out = []
    for begin, end in KEPT:
        if begin in text and end in text:
            out += ["", text[text.index(begin):text.index(end) + len(end)], ""]
    return out


def main() -> int:
    import optuna
    import torch

    head = [
        "# Search benchmark",
        "",
        f"Date: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}. "
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs ({platform.processor() or platform.platform()}), "
        f"Python {platform.python_version()}, torch {torch.__version__}, optuna {optuna.__version__}. "
        "Written by `benchmarks/search_bench.py`; predicted figures come from the simulator with an analytical "
        "fabric (stated numbers, not measured).",
        "",
    ]
    body = _search_section() + _zoo_section()
    path = os.path.join(REPO, "results", "search.md")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    body += _kept_section(path)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write("\n".join(head + body))
    os.replace(tmp, path)  # atomically: a failed run leaves the last results
    print("\n".join(head + body))
    return 0


if __name__ == "__main__":
    sys.exit(main())
