"""wrapopt's choice as text and JSON: the plan beside the baselines (``format_report``,
what ``OptimizeResult.report()`` prints), the search behind it (``format_search``,
``search_json``) and, under gradient accumulation, both sync modes (``format_sync``,
``sync_json``). The numbers come from the search and the simulator; nothing here
simulates."""

from __future__ import annotations

from typing import Any, Sequence

from wrapopt.assumptions import Assumptions
from wrapopt.fileio import fmt_bytes
from wrapopt.hardware.profiles import ComputeProfile, FabricProfile
from wrapopt.report.estimate import StepWork, format_breakdown
from wrapopt.report.pipeline import describe_stages
from wrapopt.search.driver import ERROR_SOURCE, Scored, SearchResult
from wrapopt.spec import CostEstimate, MeshSpec, PlanSpec, UnitSpec
from wrapopt.train import TrainConfig

__all__ = ["format_report", "format_search", "search_json", "format_sync", "sync_json", "units_summary", "rates_json",
           "sync_lines", "choice_why"]

_SYNC_MODE = {"last": "last (no-sync until the last micro-batch)", "every": "every micro-batch"}


def _fabric_lines(result: SearchResult, fabric: FabricProfile, compute: ComputeProfile, mesh: MeshSpec) -> list[str]:
    budget = "none" if result.memory_budget == float("inf") else fmt_bytes(result.memory_budget)
    stated = "  <- ANALYTICAL: stated numbers, not measured" if fabric.kind == "analytical" else ""
    return [
        f"fabric: {fabric.label}" + stated,
        f"compute: {compute.device} ({compute.kind})   mesh: {mesh.world_size} ranks, {mesh.ranks_per_node} per node, "
        f"shard group {mesh.shard_size}   memory budget: {budget} per rank",
    ]


def _sync(s: Scored) -> str:
    """A row's gradient sync mode under accumulation ("every" / "last"); "" without accumulation."""
    return s.estimate.accumulation_sync or ""


def sync_lines(rows: Sequence[Scored], indent: str = "", *, legend: bool = True) -> list[str]:
    """Under gradient accumulation, what the rows' sync column means (``legend``), and which rows
    differ from the first (the chosen plan's): their steps and peaks are not at the same mode."""
    modes = [(s.plan.label or "wrapopt", _sync(s)) for s in rows if _sync(s)]
    if not modes:
        return []
    out = [] if not legend else [
        f"{indent}sync: every = reduce-scatter after each micro-batch (a plain FSDP2 loop); last = no-sync until the "
        "last micro-batch, holding unsharded gradients; each row in the faster mode that fits unless --sync fixes one"]
    ref = modes[0][1]
    differ = [label for label, m in modes if m != ref]
    if differ:
        out.append(f"{indent}! rows not at the first row's sync ({ref}): {', '.join(differ[:6])}"
                   + (f" (+{len(differ) - 6} more)" if len(differ) > 6 else "")
                   + "; their step and peak are at the other mode (compare at one with --sync every or --sync last)")
    return out


def format_report(result: SearchResult, fabric: FabricProfile, compute: ComputeProfile, mesh: MeshSpec,
                  measured: dict[str, Any] | None = None, *, assumptions: Assumptions | None = None,
                  work: StepWork | None = None) -> str:
    """A text table: the chosen plan and every baseline, predicted time and memory (and the
    ``measured`` ones, by plan label, when given), then the assumptions the prediction rests on.
    With ``work`` (See [Note: one step's work] in report/estimate.py), each row's throughput
    and MFU beside its step; under gradient accumulation, each row's sync mode."""
    lines = _fabric_lines(result, fabric, compute, mesh)
    rows = [("*", result.best)] + [(" ", s) for s in result.baselines.values() if s.plan != result.best.plan]
    syncs = any(_sync(s) for _, s in rows)
    head = f"{'':2}{'plan':34} {'units':>5} {'pred step':>10}"
    head += f" {work.rate_head()}" if work is not None else ""
    head += f" {'exposed':>9} {'pred peak':>11} {'fits':>4}" + (f" {'sync':>5}" if syncs else "")
    if measured:
        head += f" {'meas step':>10} {'meas peak':>11}"
    lines += [head, "-" * len(head)]
    for mark, s in rows:
        e = s.estimate
        row = f"{mark:2}{(s.plan.label or 'wrapopt')[:34]:34} {len(s.plan.units):5d} {e.step_s * 1e3:8.2f}ms"
        row += f" {work.rate(e.step_s)}" if work is not None else ""
        row += (f" {e.exposed_comm_s * 1e3:7.2f}ms {fmt_bytes(e.peak_bytes):>11} {'yes' if s.fits else 'NO':>4}"
                + (f" {_sync(s):>5}" if syncs else ""))
        if measured:
            m = measured.get(s.plan.label)
            row += f" {m['step_s'] * 1e3:8.2f}ms {fmt_bytes(m['peak_bytes']):>11}" if m else f" {'-':>10} {'-':>11}"
        lines.append(row)
    why = choice_why(result)
    lines.append("* = wrapopt's choice" + (f": {why}" if why else ""))
    if work is not None:
        lines.append(f"  {work.legend()}")
    lines += sync_lines([s for _, s in rows], "  ")
    if result.notes:
        lines.append("notes: " + "; ".join(result.notes[:3]))
    lines += list(result.knobs)  # compile and float8, each with why: See [Note: knob defaults] in search/knobs.py
    if assumptions is not None:
        lines += assumptions.lines()
    return "\n".join(lines)


def rates_json(result: SearchResult, work: StepWork | None) -> dict[str, Any] | None:
    """Throughput and MFU of the choice and of each baseline, by label ("wrapopt" for the
    choice); None without ``work``."""
    if work is None:
        return None
    out = {"wrapopt": work.to_json(result.best.estimate.step_s)}
    out.update({label: work.to_json(s.estimate.step_s) for label, s in result.baselines.items()})
    return {"rows": out, "peak_flops_per_s": work.peak_flops_per_s, "peak_source": work.peak_source,
            "flops_formula": work.flops.formula}


def search_json(result: SearchResult, budget_line: str | None) -> dict[str, Any]:
    """The search behind the choice: the DP's and the study's bests, the Pareto front, the
    tensor-parallel rows and the study."""
    study = result.study
    pick = lambda s: None if s is None else {  # noqa: E731
        "label": s.plan.label, "shard_size": s.plan.mesh.shard_size, "tp_size": s.plan.mesh.tp_size,
        "cp_size": s.plan.mesh.cp_size, "ep_size": s.plan.mesh.ep_size,
        "num_units": len(s.plan.units), "step_s": s.estimate.step_s, "peak_bytes": s.estimate.peak_bytes,
        "fits": s.fits, "sync": s.estimate.accumulation_sync}
    return {
        "memory_budget": None if result.memory_budget == float("inf") else result.memory_budget,
        "memory_budget_note": budget_line,
        "why": choice_why(result),
        "knobs": list(result.knobs),
        "units_summary": units_summary(result.best.plan, result.blocks),
        "fastest": pick(result.fastest),
        "dp_best": pick(result.dp_best),
        "optuna_best": pick(result.optuna_best),
        "pareto": [pick(s) for s in result.pareto],
        "tp_chosen": result.tp_chosen,
        "tp_tried": [{"tp": d, "outcome": what} for d, what in result.tp_tried],
        "tp_rows": [{"row": label, **pick(s)} for label, s in result.tp_rows],
        "study": None if study is None else {"name": study.study_name, "storage": study.storage,
                                             "sampler": study.sampler,
                                             "finished_trials": study.num_trials, "run_here": study.num_run_here,
                                             "seeds": study.num_seeds},
    }


def _unit_kind(u: UnitSpec, blocks: set[str]) -> str:
    if u.is_root:
        return "root"
    if all(m in blocks for m in u.modules):
        return "blocks" if len(u.modules) == 1 else "grouped blocks"
    if all(any(m.startswith(b + ".") for b in blocks) for m in u.modules):
        return "sub-block modules"
    return "other modules"


def _unit_how(u: UnitSpec) -> str:
    r = u.reshard_after_forward
    how = "keep" if r is False else "reshard" if r is True else f"reshard to {r}"
    return how + (", selective-op checkpointed" if u.selective_checkpoint else ", checkpointed" if u.checkpoint else "")


def units_summary(plan: PlanSpec, blocks: Sequence[str]) -> str:
    """The plan's units by kind (blocks, grouped blocks, sub-block modules, other modules,
    root), each with its reshard and checkpointing: "32 blocks (reshard, checkpointed), root (keep)"."""
    block_set = set(blocks)
    counts: dict[tuple[str, str], list[int]] = {}  # (kind, how) -> the number of modules of each unit
    for u in plan.units:
        counts.setdefault((_unit_kind(u, block_set), _unit_how(u)), []).append(len(u.modules))
    order = ("blocks", "grouped blocks", "sub-block modules", "other modules", "root")
    parts = []
    for (kind, how), sizes in sorted(counts.items(), key=lambda kv: (order.index(kv[0][0]), -len(kv[1]))):
        n = len(sizes)
        if kind == "root":
            parts.append(f"root ({how})")
        elif kind == "grouped blocks":
            span = f"{min(sizes)}" if min(sizes) == max(sizes) else f"{min(sizes)}-{max(sizes)}"
            parts.append(f"{n} group{'s' if n > 1 else ''} of {span} blocks ({how})")
        elif kind == "blocks":
            parts.append(f"{n} block{'s' if n > 1 else ''} ({how})")
        else:
            parts.append(f"{n} unit{'s' if n > 1 else ''} of {kind} ({how})")
    return ", ".join(parts)


def choice_why(result: SearchResult) -> str:
    """``result.why`` with the tensor-parallel degree of the choice: the search chose the cut on
    the data-parallel ranks' view ("per-block: nothing beats it ...") and the degree beside it
    (``tp_tried``), so the line names both ("per-block + tp4: nothing beats it ...")."""
    why, tp = result.why, result.best.plan.mesh.tp_size
    if not why or tp == 1 or f"tp{tp}" in why:
        return why
    head, sep, rest = why.partition(": ")
    if head.startswith("per-block") and rest.startswith("nothing beats it"):
        return f"{head} + tp{tp}{sep}{rest}"
    return f"{why} (at tp{tp})"


def _sharding_kind(result: SearchResult) -> str:
    mesh = result.best.plan.mesh
    kind = ("FSDP over the world" if mesh.shard_size == mesh.world_size else "no sharding" if mesh.shard_size == 1
            else f"FSDP over each stage's {mesh.dp_size} data-parallel ranks"
            if mesh.pp_size > 1 and mesh.shard_size == mesh.dp_size
            else f"FSDP over the {mesh.dp_size} data-parallel ranks" if mesh.shard_size == mesh.dp_size
            else f"HSDP: {mesh.replicate_size} replicas of a shard group of {mesh.shard_size}")
    if mesh.pp_size > 1:
        kind = f"pipeline of {mesh.pp_size} ranks ({describe_stages(result.best.plan)}); " + kind
    if mesh.cp_size > 1:
        kind += (f", context parallel {mesh.cp_size} (each sequence split over {mesh.cp_size} ranks, "
                 f"{mesh.batch_size} data-parallel ranks; FSDP over dp_shard x cp)")
    if mesh.ep_size > 1:
        kind += (f", expert parallel {mesh.ep_size} (each mixture's experts split over {mesh.ep_size} ranks, "
                 f"each expert sharded over {mesh.efsdp_size}; tokens moved by all-to-all)")
    if mesh.tp_size > 1:
        kind += f", tensor parallel {mesh.tp_size} inside each node ({mesh.dp_size} data-parallel ranks)"
        if result.best.plan.tp is not None:
            kind += f" with {result.best.plan.tp.switches()}"
    if result.best.plan.offload:
        kind += ", CPU offload (parameters, gradients and optimizer state in host memory)"
    return kind


def _tp_lines(result: SearchResult) -> list[str]:
    per_token = not result.batch_rows  # at a fixed global batch every row's step covers the same sequences
    # the search says what its rows compare (cp, ep: search/axes.py); else tensor-parallel degrees
    lines = [result.rows_head or "tensor parallelism (the same global batch; See [Note: 2-D search]):"]
    # per token: a cp degree's step runs 1/cp of the tokens per GPU (See [Note: context parallel search])

    def work(s: Scored) -> float:
        return s.estimate.step_s * (s.plan.mesh.cp_size if per_token else 1)

    for label, s in result.tp_rows:
        e = s.estimate
        lines.append(f"  {label:<44} {e.step_s * 1e3:10.2f}ms {fmt_bytes(e.peak_bytes):>11} "
                     f"{'fits' if s.fits else 'does not fit':<12} chosen/this "
                     f"{work(result.best) / work(s):5.3f}{_sync_cell(s)}  {s.plan.label}")
    return lines + sync_lines([result.best] + [s for _, s in result.tp_rows], "  ", legend=False)


def _sync_cell(s: Scored) -> str:
    """`` sync every`` / `` sync last`` under gradient accumulation, else nothing."""
    return f" sync {_sync(s):<5}" if _sync(s) else ""


def _tp_tried_line(tried: Sequence[tuple[int, str]]) -> str:
    """What ``--tp auto`` tried, the degrees with the same outcome together ("tp 2, 4: dropped: ...")."""
    groups: dict[str, list[int]] = {}
    for d, what in tried:
        groups.setdefault(what, []).append(d)
    return "--tp auto: " + "; ".join(f"tp {', '.join(map(str, ds))}: {what}" for what, ds in groups.items())


def _pareto_lines(result: SearchResult) -> list[str]:
    lines = ["time-memory Pareto front (plans that fit; none is both faster and smaller than another):"]
    for s in result.pareto[:10]:
        lines.append(f"  {s.estimate.step_s * 1e3:9.2f}ms {fmt_bytes(s.estimate.peak_bytes):>11}  "
                     f"shard {s.plan.mesh.shard_size:<5d} {len(s.plan.units):4d} units{_sync_cell(s)}  {s.plan.label}")
    if len(result.pareto) > 10:
        lines.append(f"  ... {len(result.pareto) - 10} more")
    return lines + sync_lines([result.best, *result.pareto[:10]], "  ", legend=False)


def format_search(result: SearchResult) -> str:
    """The search behind the choice, as ``wrapopt search`` prints it under the table."""
    best = result.best.plan
    n = len(best.units)
    lines = [f"wrapopt's choice: {n} unit{'s' if n > 1 else ''}: {units_summary(best, result.blocks)}; "
             f"{_sharding_kind(result)}, forward prefetch {best.forward_prefetch}"]
    if result.why:
        lines.append(f"why: {choice_why(result)}")
        fast = result.fastest
        if fast is not None and fast.plan != best:
            e = fast.estimate
            lines.append(f"fastest fitting plan: {fast.plan.label} {e.step_s * 1e3:.2f}ms {fmt_bytes(e.peak_bytes)}, "
                         f"{len(fast.plan.units)} units: {units_summary(fast.plan, result.blocks)}")
        lines.append(f"  ({ERROR_SOURCE}; See [Note: plans within the error])")
    if result.tp_tried:
        lines.append(_tp_tried_line(result.tp_tried))
    if result.tp_rows:
        lines += _tp_lines(result)
    if result.dp_best is not None:
        lines.append(f"exact DP best: {result.dp_best.plan.label} {result.dp_best.estimate.step_s * 1e3:.2f}ms")
    study = result.study
    if study is not None:
        found = result.optuna_best
        where = f" in {study.storage}" if study.storage else ""
        lines.append(f"optuna study {study.study_name!r}{where} ({study.sampler}): {study.num_trials} finished trials "
                     f"({study.num_run_here} run now, {study.num_seeds} seeds); best fitting: "
                     + (f"{found.estimate.step_s * 1e3:.2f}ms" if found else "none"))
    if result.pareto:
        lines += _pareto_lines(result)
    return "\n".join(lines)


def format_sync(result: SearchResult, train: TrainConfig, budget: float | None,
                syncs: dict[str, CostEstimate] | None) -> str:
    """The peak of the choice, broken down, and, under gradient accumulation, the choice
    under each sync mode (``syncs``: ``search.diagnosis.both_syncs``)."""
    best = result.best.estimate
    lines = [f"peak memory of wrapopt's choice: {fmt_bytes(best.peak_bytes)} per rank"]
    lines += format_breakdown(best)
    if train.grad_accumulation > 1 and syncs is not None:
        limit = budget if budget is not None else float("inf")
        lines.append(f"gradient sync over {train.grad_accumulation} micro-batches, wrapopt's choice scored both ways:")
        for m, e in syncs.items():
            mark = "*" if m == best.accumulation_sync else " "
            lines.append(f" {mark} {_SYNC_MODE[m]:42} {e.step_s * 1e3:10.2f}ms {fmt_bytes(e.peak_bytes):>11} "
                         f"{'fits' if e.peak_bytes <= limit else 'does NOT fit'}")
            if m == "last":
                held = dict(e.peak_breakdown).get("accumulated_grads", 0)
                lines.append(f"    holds {fmt_bytes(held)} of unsharded gradients across micro-batches")
        lines.append("  * = chosen: " + ("as asked (--sync)" if train.accumulation_sync else "the faster that fits"))
    return "\n".join(lines)


def sync_json(result: SearchResult, syncs: dict[str, CostEstimate] | None) -> dict[str, Any] | None:
    """Both sync modes of the choice as JSON; None without gradient accumulation (``syncs`` None)."""
    if syncs is None:
        return None
    out: dict[str, Any] = {"chosen": result.best.estimate.accumulation_sync}
    for m, e in syncs.items():
        out[m] = {"step_s": e.step_s, "peak_bytes": e.peak_bytes, "peak_breakdown": dict(e.peak_breakdown)}
    return out
