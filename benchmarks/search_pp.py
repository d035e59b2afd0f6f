"""3-D search benchmark: the section "3-D plans" of ``results/search.md``.

For llama-70b and the Llama 3.1 405B shape (``zoo:llama3-405b``) on 512 and 1024 GPUs (nodes of
8), the analytical H100 + InfiniBand 400 fabric, bf16 mixed precision, ``--pp auto --tp auto``,
each in a fresh process (tracing included; CPU time and peak RSS from ``wait4``): the best plan
per pipeline degree (step, tokens/s/GPU, peak memory) under the default memory budget (72 GiB of
an 80 GiB H100) and with no budget, and TorchTitan's 405B layout (FSDP x TP 8 x PP 8,
Interleaved1F1B, full activation checkpointing) scored beside them. Predicted, not measured. The
section is written between markers, so ``search_bench.py`` and ``search_tp.py`` keep it.

Run: ``python -m benchmarks.search_pp`` (about 15 minutes on 2 shared cores).
"""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BEGIN, END = "<!-- search_pp.py: begin -->", "<!-- search_pp.py: end -->"
CASES = [(m, w) for m in ("llama-70b", "llama3-405b") for w in (512, 1024)]
FLAGS = ["--gpus-per-node", "8", "--gpu", "h100-sxm", "--network", "ib400", "--precision", "bf16", "--pp", "auto",
         "--tp", "auto"]
SEQ = {"llama-70b": 4096, "llama3-405b": 8192}  # tokens per sequence (the zoo's); one sequence per GPU


def fresh_search(model: str, world: int, flags: list[str]) -> tuple[float, float, float, dict | None, str]:
    """(wall s, CPU s, peak RSS bytes, the --json output or None, stderr) of one fresh
    ``wrapopt search MODEL --world-size W FLAGS --json`` (a bare name is a zoo model)."""
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    source = model if ":" in model else f"zoo:{model}"
    cmd = [sys.executable, "-m", "wrapopt.cli", "search", source, "--world-size", str(world), *flags, "--json"]
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=err, text=True)
        _pid, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        out.seek(0)
        err.seek(0)
        ok = os.waitstatus_to_exitcode(status) == 0
        return (wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss * 1024, json.loads(out.read()) if ok else None,
                err.read())


def _run(model: str, world: int, memory: str) -> tuple[float, float, float, dict | None, str]:
    return fresh_search(model, world, [*FLAGS, "--memory", memory])


def _tokens(model: str, world: int, row: dict) -> float:
    """tokens/s/GPU: every row runs one sequence per GPU per step (the same global batch)."""
    return SEQ[model] / row["step_s"]


def _cell(model: str, world: int, row: dict) -> str:
    fit = "" if row["fits"] else " (over budget)"
    return (f"{row['step_s']:.2f} s{fit} | {_tokens(model, world, row):,.0f} | {row['peak_bytes'] / 2**30:.1f} GiB | "
            f"{row['label']}; {row['stages']}")


def pp_section() -> list[str]:
    import torch

    from wrapopt.search.choose import STEP_ERROR

    lines = [BEGIN, "## 3-D plans: `--pp auto --tp auto` (pipeline stages, tensor parallel inside the node, FSDP)", "",
             f"Machine: {platform.machine()}, {os.cpu_count()} CPUs shared with other work, Python "
             f"{platform.python_version()}, torch {torch.__version__}. Command: `wrapopt search zoo:MODEL "
             "--world-size W " + " ".join(FLAGS) + " --memory auto|none --json`, a fresh process each, tracing "
             "included; CPU time (user + system) and peak RSS from `wait4`. Analytical fabric (stated numbers); "
             "every row is predicted, at the same global batch: one sequence per GPU per step (llama-70b 4096 "
             "tokens, the 405B shape 8192), so tokens/s/GPU = sequence length / step. A pipeline of pp x tp GPUs "
             "runs pp x tp sequences in m micro-batches. Per pipeline degree, the fastest plan found (*pp1* = no "
             "pipeline: today's search); the stages first share one FSDP shape (one unit per block; `keep` = not "
             "resharded after forward; `ckpt` = every block checkpointed, `ckpt-half` every other), then each "
             "stage of the best two is searched apart (*per-stage*: its units, kept units and checkpointed blocks "
             f"counted over all stages, and its gain over the shared shape; kept only beyond the {STEP_ERROR:.1%} "
             "error). TorchTitan's "
             "405B layout: tp 8, pp 8, Interleaved1F1B with 2 stages per rank, micro-batches of one sequence, one "
             "FSDP unit per block kept unsharded after forward (TorchTitan's default under pipelining), every "
             "block checkpointed, sequence and loss parallel on (TorchTitan's TP plan), async TP where the search "
             "turns it on (auto: H100); wrapopt prices it with fp32 gradient reduction (unsynchronised fp32 "
             "gradients held across micro-batches, as FSDP2 under torch's pipelining keeps them), so it is "
             "TorchTitan's layout as wrapopt models it, without torch.compile and float8 (not in wrapopt yet). "
             "Target: the 405B shape on 1024 GPUs in at "
             "most 120 s and 4 GB.", ""]
    lines += ["What drives these rows in the model (read with the numbers below): at one sequence per GPU a "
              "pipeline of pp x tp GPUs has at most pp x tp micro-batches, so its bubble ((m + pp - 1) / m for "
              "1F1B) stays large unless tensor parallelism, whose all-reduces sit on every block's critical path, "
              "multiplies the batch; every stage holds its unsharded fp32 gradients from the first micro-batch's "
              "backward to REDUCE_GRAD (torch's stage runs FSDP2 without gradient sync until then), a whole "
              "stage's worth per GPU; sequence parallelism keeps 1/tp of each block input in flight per GPU. "
              "A row marked over budget does not fit the "
              "72 GiB budget; *nothing fits* lists each degree's smallest peak.", ""]
    lines += ["| model | GPUs | budget | wall | CPU | peak RSS | row | step | tokens/s/GPU | peak | plan |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for model, world in CASES:
        for memory in ("auto", "none"):
            wall, cpu, rss, data, err = _run(model, world, memory)
            head = f"| {model} | {world} | {memory} | {wall:.0f} s | {cpu:.0f} s | {rss / 1e9:.2f} GB |"
            if data is None:
                msg = err.strip().splitlines()[-1] if err.strip() else "failed"
                per = re.findall(r"(pp\d+): (?:tp\d+: )?nothing fits: the smallest peak is ([\d.]+ GiB)", msg)
                lines.append(f"{head} nothing fits | - | - | - | " + "; ".join(f"{d}: smallest {p}" for d, p in per)
                             + " |")
                print(lines[-1], flush=True)
                continue
            pipe = data["search"]["pipeline"] or {"rows": [], "tried": []}
            for i, row in enumerate(pipe["rows"]):
                label = row["row"].split(":")[0]
                chosen = " (chosen)" if row["label"] == data["label"] else ""
                lines.append((head if i == 0 else "| | | | | | |") + f" {label}{chosen} | {_cell(model, world, row)} |")
            lines.append("| | | | | | | degrees | " + "; ".join(f"pp{t['pp']}: {t['outcome']}" for t in pipe["tried"])
                         + " | | | |")
            print("\n".join(lines[-len(pipe['rows']) - 1:]), flush=True)
    return lines + ["", END]


def main() -> int:
    path = os.path.join(REPO, "results", "search.md")
    from wrapopt.fileio import write_between

    write_between(path, "\n".join(pp_section()), BEGIN, END)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
