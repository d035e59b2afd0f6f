"""Global-batch search benchmark: the section "The whole configuration at a fixed global batch"
of ``results/search.md``.

llama-70b on 512 and 1024 GPUs (nodes of 8), analytical H100 + InfiniBand 400 fabric, bf16
mixed precision, ``--global-batch 2048 --seq 4096 --tp auto`` (every micro-batch x accumulation
split over tp 1, 2, 4, 8: See [Note: global batch search] in wrapopt/search/batch.py), each run
``REPEATS`` times in a fresh process, tracing included; CPU time (user + system) and peak RSS from
``wait4``, the median reported with the range. Predicted, not measured: the chosen split, plan,
step and peak beside the search's cost. The section is written between markers, so
``search_bench.py`` keeps it.

Run: ``python -m benchmarks.search_batch`` (about 5 minutes on 2 shared cores).
"""

from __future__ import annotations

import os
import platform
import statistics

from benchmarks.search_pp import REPO, fresh_search

BEGIN, END = "<!-- search_batch.py: begin -->", "<!-- search_batch.py: end -->"
REPEATS = 3
WORLDS = (512, 1024)
FLAGS = ["--gpus-per-node", "8", "--gpu", "h100-sxm", "--network", "ib400", "--precision", "bf16",
         "--global-batch", "2048", "--seq", "4096", "--tp", "auto"]


def _load() -> str:
    try:
        return open("/proc/loadavg").read().split()[0]
    except OSError:
        return "?"


def batch_section() -> list[str]:
    import torch

    lines = [BEGIN, "## The whole configuration at a fixed global batch: `--global-batch 2048 --tp auto`", "",
             f"Machine: {platform.machine()}, {os.cpu_count()} CPUs shared with other work, Python "
             f"{platform.python_version()}, torch {torch.__version__}. Command: `wrapopt search zoo:llama-70b "
             "--world-size W " + " ".join(FLAGS) + " --json`, a fresh process each, tracing included, "
             f"{REPEATS} runs per row; CPU time (user + system) and peak RSS from `wait4`, median (range). "
             "Analytical fabric (stated numbers), every figure predicted. Target: llama-70b at 1024 GPUs in "
             "at most 60 s and 3 GB. Before [Note: carried shrink] (wrapopt/search/dp/strategy.py) the 1024-GPU "
             "row took 70 s of CPU (73 s wall, 0.67 GB) on this machine, at commit d7e467c.", "",
             "| GPUs | CPU time | wall | peak RSS | load (start/end) | chosen split | plan | step | tokens/s/GPU "
             "| peak memory | splits (screened / searched whole) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for world in WORLDS:
        runs, load0 = [], _load()
        for _ in range(REPEATS):
            wall, cpu, rss, out, err = fresh_search("llama-70b", world, [*FLAGS, "--memory", "auto"])
            if out is None:
                raise SystemExit(f"llama-70b at {world} GPUs failed:\n{err[-2000:]}")
            runs.append((wall, cpu, rss, out))
        walls, cpus, rsss = ([r[k] for r in runs] for k in range(3))
        out = runs[-1][3]
        train, pred = out["train"], out["prediction"]
        rows = out["search"]["batch"]
        whole = sum(r["searched"] == "whole search" for r in rows)
        screened = sum(r["searched"] in ("screen", "whole search") for r in rows)
        split = f"{train['micro_batch']} x {train['grad_accumulation']} x {world // out['mesh'].get('tp_size', 1)}"
        lines.append(f"| {world} | {statistics.median(cpus):.0f} s ({min(cpus):.0f}-{max(cpus):.0f}) | "
                     f"{statistics.median(walls):.0f} s ({min(walls):.0f}-{max(walls):.0f}) | "
                     f"{statistics.median(rsss) / 1e9:.2f} GB | {load0}/{_load()} | {split}, tp "
                     f"{out['mesh'].get('tp_size', 1)} | {out['label']} | {pred['step_s']:.2f} s | "
                     f"{2048 * 4096 / (pred['step_s'] * world):,.0f} | {pred['peak_bytes'] / 2**30:.1f} GiB | "
                     f"{screened} / {whole} of {len(rows)} |")
        print(lines[-1], flush=True)
    return lines + ["", END]


def main() -> int:
    from wrapopt.fileio import write_between

    path = os.path.join(REPO, "results", "search.md")
    write_between(path, "\n".join(batch_section()), BEGIN, END)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
