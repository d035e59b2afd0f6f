"""The headline on published rows: wrapopt's whole configuration at the row's global batch.

Used by ``benchmarks/published.py``. [Note: the configuration headline] For each usable row,
the global batch is the row's ``micro-batch x GA x GPUs``; ``global_batch_search`` chooses the
micro-batch, the accumulation, the units, resharding, checkpointing and the shard group (FSDP
or HSDP) under the row's memory budget (capacity x headroom), on the row's hardware and step
(See [Note: a published row as a simulation] in published_predict.py), each unit's checkpointing
none, full or selective-op ([Note: selective checkpointing] in wrapopt/selective.py), with every micro-batch
reducing its gradients as Composer does (``accumulation_sync="every"``; the choice of sync mode
is then not a source of gain). The row's own configuration (its plan at its micro-batch) is
scored the same way, as ``wrapopt search --current`` scores a user's (search/current.py), and
each choice that differs is scored alone on it.

The row's configuration is in the space, so wrapopt's best configuration is the faster of the
search's answer and the row's own: the speed-up is never below 1.00. (The search's answer may
be up to ``STEP_ERROR`` slower than the fastest plan it saw, by design: [Note: plans within the
error]; where that leaves it slower than the row's own, the row's own is reported.)

A gain that rests on fully checkpointing fewer blocks than a row that checkpoints every block is
marked (selective-op units count as not fully checkpointed): checkpointed rows are still predicted
slower than published on A100 80GB (results/published.md's split: median 0.94 there, 0.98-1.00 on
the other GPU types, with the recompute priced up to torch's early stop), the known miss of the
GPU issue's split.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

from benchmarks.published_predict import GPUS, GPUS_PER_NODE, Predictor, compute_profile, fabric_at, row_plan, \
    train_config
from benchmarks.published_rows import PublishedRow
from wrapopt.cost import Simulator
from wrapopt.errors import InfeasibleError
from wrapopt.hardware.budget import MEMORY_HEADROOM
from wrapopt.search.batch import global_batch_search
from wrapopt.search.choose import STEP_ERROR
from wrapopt.search.current import Current, compare_current
from wrapopt.search.driver import SearchOptions
from wrapopt.spec import SELECTIVE_OP, MeshSpec, ParallelRequest

__all__ = ["ConfigRow", "search_config", "MODES"]

MODES = (False, True, SELECTIVE_OP)  # every unit's checkpointing: none, full, selective-op


@dataclass(frozen=True, slots=True)
class ConfigRow:
    row: PublishedRow
    global_batch: int
    speedup: float  # tokens/s/GPU of wrapopt's best configuration over the row's own (>= 1; nan: nothing fits)
    chosen: str  # wrapopt's configuration, short; or why nothing was chosen
    top: str  # the choice whose change alone gains the most ("-" when none differs or none gains)
    top_gain: float  # that choice's gain alone
    gains: tuple[tuple[str, str, str, float], ...]  # (dimension, row's, wrapopt's, gain alone; nan: not alone)
    known_miss: bool  # the gain rests on checkpointing fewer blocks of a row that checkpoints every block
    own_is_best: bool  # the row's own configuration scored at least as fast as the search's answer
    row_fits: bool  # the row's own configuration within the budget
    seconds: float
    why: str = ""  # the search's one line on its choice against per-block (See [Note: plans within the error])


def _blocks_checkpointed(plan, blocks) -> int:
    """Blocks in fully checkpointed units (selective-op units recompute only the cheap ops)."""
    mods = [m for u in plan.units if not u.is_root and u.checkpoint is True for m in u.modules]
    return sum(any(m == b or m.startswith(b + ".") for m in mods) for b in blocks)


def search_config(pred: Predictor, row: PublishedRow, *, max_group: int) -> ConfigRow:
    """See [Note: the configuration headline]."""
    gpu = GPUS[row.gpu]
    g = pred.graph(row)  # traced at the row's micro-batch
    fab = fabric_at(gpu, row.num_gpus)
    train = replace(train_config(row), accumulation_sync="every")
    sim = Simulator(g, fab, compute_profile(fab, row), train.sim_options())
    mesh = MeshSpec(world_size=row.num_gpus, ranks_per_node=GPUS_PER_NODE, shard_size=row.num_gpus)
    budget = gpu.capacity_bytes * MEMORY_HEADROOM
    global_batch = row.micro_batch * row.grad_accum * row.num_gpus
    t0 = time.perf_counter()
    own = Current(row_plan(g, row), row.micro_batch, "the row's")
    try:
        request = ParallelRequest(mesh=mesh, train=train, global_batch=global_batch)
        found = global_batch_search(g, sim, request, degrees=(1,), spec=None, memory_budget=budget,
                                    options=SearchOptions(trials=0, max_group=max_group, checkpoint_modes=MODES))
    except InfeasibleError as e:
        return ConfigRow(row, global_batch, math.nan, f"nothing fits: {str(e).splitlines()[0][:80]}", "-", math.nan,
                         (), False, False, False, time.perf_counter() - t0)
    best = found.result.best.plan
    cmp = compare_current(g, sim, own, best, request=request, chosen_micro_batch=found.split.micro_batch)
    seconds = time.perf_counter() - t0
    row_fits = cmp.current.estimate.peak_bytes <= budget
    own_is_best = row_fits and cmp.speedup < 1.0
    gains = tuple((c.dimension, c.current, c.chosen,
                   c.alone.sequences_per_s_per_rank / cmp.current.sequences_per_s_per_rank if c.alone else math.nan)
                  for c in cmp.gains)
    scored = [x for x in gains if not math.isnan(x[3])]
    top = max(scored, key=lambda x: x[3]) if scored and not own_is_best else None
    ck_row, ck_best = _blocks_checkpointed(own.plan, g.blocks), _blocks_checkpointed(best, g.blocks)
    p = best.mesh
    hsdp = f", HSDP {p.replicate_size}x{p.shard_size}" if p.is_hsdp else ""
    keep = sum(u.reshard_after_forward is False for u in best.units if not u.is_root)
    sel = sum(u.checkpoint == SELECTIVE_OP for u in best.units if not u.is_root)
    chosen = ("the row's own" if own_is_best else
              f"mb {found.split.micro_batch} x GA {found.split.accumulation}: {len(best.units) - 1} units{hsdp}, "
              f"{keep} kept, {ck_best}/{len(g.blocks)} full ckpt, {sel} selective")
    speedup = 1.0 if own_is_best else cmp.speedup
    return ConfigRow(row, global_batch, speedup, chosen, top[0] if top and top[3] > 1.0 else "-",
                     top[3] if top else math.nan, gains,
                     known_miss=(not own_is_best and ck_row == len(g.blocks) and ck_best < ck_row),
                     own_is_best=own_is_best, row_fits=row_fits, seconds=seconds, why=found.result.why)


def why_kind(why: str) -> str:
    """The case of ``choose`` a search's ``why`` line names: per-block, beats per-block by more
    than the error, or per-block does not fit (See [Note: plans within the error])."""
    if why.startswith("per-block") and ": nothing beats it" in why:  # "per-block with 3 of 8 blocks checkpointed: ..."
        return "per-block"
    if why.startswith("beats per-block by"):
        return "beats per-block by " + why.split("beats per-block by ", 1)[1].split(" ", 1)[0]
    if why.startswith("per-block "):
        return "per-block does not fit"
    return why.split(":", 1)[0] or "-"


def _quantile(values: list[float], q: float) -> float:
    s = sorted(values)
    if not s:
        return math.nan
    k = (len(s) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def config_section(rows: list[ConfigRow], groups: tuple[tuple[str, str], ...], png: str | None) -> list[str]:
    """The headline section of results/published.md: See [Note: the configuration headline]."""
    if not rows:
        return ["## wrapopt's configuration on these rows", "",
                "Not run yet (`python -m benchmarks.published --search`).", ""]
    out = ["## wrapopt's configuration at each row's global batch (the headline)", "",
           "For each row: `global_batch_search` at the row's global batch (micro-batch x GA x GPUs) on the row's "
           f"mesh, fabric, compute profile and step, memory budget = the GPU's capacity x {MEMORY_HEADROOM:.0%}, "
           "`SearchOptions(trials=0)` (baselines, the exact DP with per-unit reshard and checkpointing on every "
           "shard group, uniform groupings; no Optuna study), every micro-batch reducing its gradients as Composer "
           "does. It chooses the micro-batch and accumulation with the plan. Speed-up = tokens/s/GPU of wrapopt's "
           "best configuration over the row's own configuration (its per-block plan at its micro-batch), both "
           "predicted; the row's own is in the space, so where it fits the budget wrapopt's best is the faster of "
           "the two and the speed-up is never below 1.00; where the row's own is predicted over the budget (*row "
           "fits* no: 90% of the capacity is stricter than the GPU the row ran on), the search must pick a "
           "configuration that fits, which may be slower. *Choice*: the change that gains most when applied alone to "
           "the row's configuration "
           "(as `wrapopt search --current` reports it). *Known miss*: the gain rests on checkpointing fewer blocks "
           "of a row that checkpoints every block, a term still predicted slow on A100 80GB (its checkpointed rows "
           "at a median 0.94 of published, against 0.98-1.00 on the other GPU types; see the split above), so "
           "there it is likely overstated.", ""]
    if png:
        out += [f"![speed-up distribution]({png})", ""]
    for g, name in groups:
        sel = [r for r in rows if r.row.gpu == g and not math.isnan(r.speedup)]
        if not sel:
            continue
        sp = [r.speedup for r in sel]
        clean = [r.speedup for r in sel if not r.known_miss]
        fit = [r.speedup for r in sel if r.row_fits]
        out.append(f"- **{name}**: {len(sel)} rows ({len(fit)} whose own configuration fits the budget: speed-up "
                   f"min {min(fit) if fit else math.nan:.3f}); speed-up median {_quantile(sp, 0.5):.3f}, "
                   f"90th percentile "
                   f"{_quantile(sp, 0.9):.3f}, max {max(sp):.3f}; >= 1.05 on {sum(x >= 1.05 for x in sp)} rows, "
                   f"{sum(r.known_miss for r in sel if r.speedup >= 1.05)} of them known misses; without the known "
                   f"misses: median {_quantile(clean, 0.5):.3f}, 90th percentile {_quantile(clean, 0.9):.3f}; the "
                   f"row's own configuration is the best on {sum(r.own_is_best for r in sel)}; "
                   f"search {sum(r.seconds for r in sel):.0f} s.")
    allsp = [r for r in rows if not math.isnan(r.speedup)]
    by_choice: dict[str, int] = {}
    for r in allsp:
        if r.speedup >= 1.05:
            by_choice[r.top] = by_choice.get(r.top, 0) + 1
    kinds = [why_kind(r.why) for r in allsp]
    beats = sorted(float(k.split()[-1].rstrip("%")) for k in kinds if k.startswith("beats"))
    out += ["", "Which choice produced the gains of 5% or more (the one that gains most alone): " + (
        ", ".join(f"{k} {v} rows" for k, v in sorted(by_choice.items(), key=lambda kv: -kv[1])) or "none") + ".",
        "", "Against per-block at the chosen split (*why*, the search's own line: See "
            "[Note: plans within the error] in wrapopt/search/choose.py): "
            f"per-block on {kinds.count('per-block')} rows; another cut that "
            f"beats per-block by more than the simulator's {STEP_ERROR:.1%} error on {len(beats)} rows"
            + (f" (by {beats[0]:.1f}% to {beats[-1]:.1f}%)" if beats else "")
            + f"; per-block over the budget on {kinds.count('per-block does not fit')}; any other case on "
            f"{len(kinds) - kinds.count('per-block') - len(beats) - kinds.count('per-block does not fit')}.",
        "", "| GPU | model | seq | GPUs | micro-batch | GA | AC | global batch | row fits | wrapopt's configuration | "
            "why | speed-up | choice (gain alone) | known miss | search s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in rows:
        r = c.row
        top = f"{c.top} ({c.top_gain:.3f})" if c.top != "-" else "-"
        out.append(f"| {r.gpu} | {r.model} | {r.seq_len} | {r.num_gpus} | {r.micro_batch} | {r.grad_accum} | "
                   f"{'AC' if r.checkpointing else '-'} | {c.global_batch} | {'yes' if c.row_fits else 'no'} | "
                   f"{c.chosen} | {why_kind(c.why)} | {c.speedup:.3f} | {top} | {'yes' if c.known_miss else '-'} | "
                   f"{c.seconds:.1f} |")
    return out + [""]


def plot_gains(path: str, rows: list[ConfigRow], groups: tuple[tuple[str, str], ...]) -> None:
    """The distribution of the speed-ups per GPU type (sorted, one curve each), known misses hollow."""
    import io
    import os

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    colours = {"a100_40gb": "tab:blue", "a100_80gb": "tab:orange", "h100_80gb": "tab:green"}
    for g, name in groups:
        sel = sorted((r for r in rows if r.row.gpu == g and not math.isnan(r.speedup)), key=lambda r: r.speedup)
        if not sel:
            continue
        xs = [(i + 0.5) / len(sel) for i in range(len(sel))]
        ax.plot(xs, [r.speedup for r in sel], color=colours[g], lw=1, label=f"{name} ({len(sel)} rows)")
        for x, r in zip(xs, sel):
            if not r.row_fits:  # the row's own configuration predicted over the budget
                ax.scatter([x], [r.speedup], s=18, color=colours[g], marker="x", linewidths=1)
            else:
                ax.scatter([x], [r.speedup], s=14, color=colours[g],
                           facecolors="none" if r.known_miss else colours[g])
    ax.axhline(1.0, color="0.3", lw=0.8)
    ax.set_xlabel("fraction of rows (sorted by speed-up)")
    ax.set_ylabel("predicted speed-up over the row's configuration")
    ax.set_title("wrapopt's configuration at each row's global batch\n"
                 "(hollow: gain rests on the known checkpoint miss; x: the row's own over the budget)", fontsize=9)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(buf.getvalue())
    os.replace(tmp, path)
