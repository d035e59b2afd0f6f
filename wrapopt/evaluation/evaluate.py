"""The fidelity bench's rank worker: predicted against measured, the loop shared by the demo and benchmarks.

[Note: confirmation round] The screening round runs every plan a few times;
the fastest of dozens of noisy medians is biased low (the winner's curse),
so a plan that merely drew lucky repeats can pose as the optimum. With
``confirm=K`` the contenders (per budget the K fastest fitting plans,
wrapopt's choice, the fastest fitting baseline, the predicted fastest) run again, interleaved with
each other, for more repeats, and the verdict compares only those times
(``evidence.judge``): figures from two rounds are not comparable on a shared
machine whose speed drifts, and the plans left out were beaten in the screen
by at least K fitting plans. Peaks come
from the screening round (memory does not vary with repeats).

[Note: A/A copy] The confirmation round also runs a second, separately built
copy of the predicted fastest plan (result ``aa``: its round times and the
original's). The two are the same plan, so any difference between them is
the bench's own resolution on this machine at this moment: a predicted
fastest that misses the measured fastest by less than the A/A difference is
a miss the bench cannot tell from noise. ``paired_ratio`` of the two is the
noise floor (``stats.noise_floor``) that ``benchmarks/fidelity.py`` reports beside its verdict.

[Note: phases] Each row also splits the step, predicted and measured (the
screening round's medians, slowest rank per phase), into forward with the
loss, backward up to the last reduce-scatter (FSDP2 waits for it before
``backward()`` returns, so the exposed tail is counted here), and the
optimizer step. A whole-step error says how far off a prediction is; the
phases say where.

``evaluate(model, world_size=2, plan_set=...)`` starts local ranks that
measure the fabric and the device, trace the model, let wrapopt choose a plan
under the budget, build the requested comparison plans, predict every plan
with the simulator, and run real steps of all of them interleaved. Rank 0
returns one row per plan with both figures, and the profiles it used. The
statistics of those rows (paired ratios, rank correlation, CPU steal) live in
``stats.py``.
"""

from __future__ import annotations

import os
import platform
import re
import sys
import time
from dataclasses import replace
from typing import Any

import torch

from wrapopt.checks import check_count
from wrapopt.errors import OptionError
from wrapopt.evaluation.bench import PHASES, measure_plans
from wrapopt.evaluation.evidence import BASELINES
from wrapopt.evaluation.pictures import pictures_json
from wrapopt.evaluation.plan_sets import PLAN_SETS
from wrapopt.evaluation.stats import cpu_steal, cpu_times, noise_floor, paired_ratio
from wrapopt.fileio import parse_bytes
from wrapopt.hardware.measure_collectives import measure_fabric
from wrapopt.hardware.measure_device import measure_compute
from wrapopt.hardware.measure_split import measure_split_efficiency, measure_tp_overhead
from wrapopt.hardware.profiles import ComputeProfile, FabricProfile
from wrapopt.job import prepare
from wrapopt.launch import broadcast_json, spawn
from wrapopt.models import zoo
from wrapopt.plan.file import WrapPlan
from wrapopt.progress import Progress, say
from wrapopt.search.driver import search_plan
from wrapopt.search.pipeline import pp_group_sizes
from wrapopt.search.tp import dp_mesh, lift_plan, request_spec, search_tp
from wrapopt.spec import MeshSpec, ModelGraph, ParallelRequest, PlanSpec, Shape
from wrapopt.train import TORCH_DTYPES, TrainConfig

# noise_floor and paired_ratio: re-exported where docs/design.md names them (evaluate.noise_floor)
__all__ = ["evaluate", "PLAN_SETS", "measure_hardware", "noise_floor", "paired_ratio"]


def _log(rank: int, quiet: bool, msg: str) -> None:
    if rank == 0 and not quiet:
        say(msg)


def _measure(rank: int, quiet: bool, rounds: int, what: str, *args: Any, **kwargs: Any) -> list[Any]:
    """``measure_plans`` with a progress bar of its rounds on rank 0."""
    with Progress(rounds, desc=what, unit="round", enabled=rank == 0 and not quiet) as bar:
        return measure_plans(*args, progress=lambda _msg: bar.update(), **kwargs)


# FSDP2's warning for a wrapped module whose output is a view (a Linear with bias on 3-D input
# returns one): harmless unless the model then modifies that output in place. See _view_note.
_VIEW_WARNING = re.compile(r"FSDP2-wrapped module \((.*?)\) returned a view tensor")


def _view_note(plans: list[PlanSpec], measured: list[Any]) -> str | None:
    """One line for the log naming the plans whose steps raised FSDP2's view-tensor warning, or None."""
    hits = []
    for p, m in zip(plans, measured):
        classes = sorted({c for w in m.warnings for c in _VIEW_WARNING.findall(w)})
        if classes:
            hits.append(f"{p.label} ({', '.join(classes)})")
    if not hits:
        return None
    return ("wrapopt: FSDP2 warned that a wrapped module returns a view tensor in plans " + "; ".join(hits)
            + ". Harmless unless the model modifies that output in place (x += y), which would skip the module's "
            "all-gather in backward. wrapopt does not check the model for such in-place ops, so it does not repeat "
            "this on the terminal.")


_BUDGET_WORDS = (None, "none", "loose", "midway", "tight")


def _given_bytes(spec: Any) -> float:
    """A budget given as a size; ``OptionError`` naming the flags and the accepted forms."""
    try:
        return float(parse_bytes(spec))
    except (ValueError, TypeError, OverflowError):
        raise OptionError(f"budget {spec!r} (--budgets, --memory): give tight, loose, midway, none, or a size such as "
                          "12MiB") from None


def _resolve_budget(spec: Any, graph: ModelGraph, sim: Any, mesh: MeshSpec) -> tuple[float, str]:
    if spec in (None, "none", "loose"):
        return float("inf"), "loose: none, every plan fits"
    if spec in ("midway", "tight"):
        probe = search_plan(graph, sim, mesh)
        peaks = {k: s.estimate.peak_bytes for k, s in probe.baselines.items()}
        if spec == "midway":
            return ((min(peaks.values()) + max(peaks.values())) / 2,
                    "midway between the smallest and largest predicted baseline peak")
        ref = peaks.get("per-block", min(peaks.values()))
        return ref * 1.02, "tight: 2% above the per-block baseline's predicted peak, so only fine-grained plans fit"
    return _given_bytes(spec), "given"


SCREEN_WARMUP = 2  # warm-up rounds of the screening round


def _worker(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any] | None:
    import torch.distributed as dist

    quiet = cfg["quiet"]
    entry = zoo.get_entry(cfg["model"])
    inputs = entry.inputs()
    train = TrainConfig.from_json(cfg["train"]) if cfg.get("train") else None
    t0 = time.perf_counter()
    tp = cfg.get("tp", 1)
    fabric, compute, dt = measure_hardware(rank, world, cfg, entry, inputs, train, backend=dist.get_backend())
    _log(rank, quiet, "[3/5] tracing on the meta device and searching ...")
    mesh = MeshSpec(world_size=world, ranks_per_node=cfg["ranks_per_node"], shard_size=world)
    # the budgets are resolved per search below (_resolve_budget): the job's own is none
    request = ParallelRequest(mesh=mesh, tp=tp, memory_budget="none", train=train)
    job = prepare(request, entry.build("meta"), inputs, fabric=fabric, compute=compute, loss_fn=entry.loss)
    graph = job.graph
    tp_spec = request_spec(graph, request) if tp > 1 else None  # sequence and loss parallel, as the search
    if tp_spec is not None:  # See [Note: tensor parallel costs] in cost/tp.py
        eff, oh = measure_split_efficiency(graph, tp_spec, (tp,), dtype=dt), measure_tp_overhead(tp)
        compute = broadcast_json(replace(compute, split_efficiency=eff, tp_overhead_s=oh).to_json(),
                                 ComputeProfile.from_json)
        job = prepare(request, job.model, graph=graph, fabric=fabric, compute=compute)
    sim = job.sim
    plans, budgets, chosen_for = _plans_to_run(cfg, graph, sim, request, tp_spec)
    preds = [sim.simulate(p) for p in plans]
    _log(rank, quiet, f"[4/5] running real steps of {len(plans)} plans, interleaved, {cfg['repeats']} repeats "
                      "after warm-up ...")
    if tp_spec is not None:  # a tensor-parallel group steps on tp ranks' batches: the same global batch
        inputs = lambda _r, n: entry.inputs(entry.batch * world // n)  # noqa: E731
    measured = _measure(rank, quiet, SCREEN_WARMUP + cfg["repeats"], "bench", lambda: entry.build("cpu", seed=0),
                        plans, inputs, entry.loss, repeats=cfg["repeats"], warmup=SCREEN_WARMUP, train=train)
    screening = list(measured)  # the confirmation round replaces contenders' times in `measured`
    confirmed: list[int] = []
    aa: dict[str, Any] | None = None
    if cfg["confirm"]:
        confirmed, aa = _confirmation_round(rank, cfg, entry, train, plans, preds, measured, budgets, chosen_for,
                                            inputs)
    _log(rank, quiet, f"[5/5] done in {time.perf_counter() - t0:.1f} s")
    if rank != 0:
        return None
    note = _view_note(plans, screening)
    if note:
        print(note, file=sys.stderr, flush=True)  # the rank's log under launch.spawn(log_dir=...)
    rows = _rows(plans, preds, measured, screening, budgets, chosen_for, confirmed, train)
    budget_bytes, budget_why = budgets[0]["bytes"], budgets[0]["why"]
    return {
        "model": f"zoo:{cfg['model']}" + (f" [{_case(train)}]" if train is not None else ""), "rows": rows, "aa": aa,
        "screen_warmup": SCREEN_WARMUP, "train": train.to_json() if train is not None else None,
        "plan_json": _plan_json(budgets[0]["result"], plans[0], graph, entry, sim, train),
        "pictures": pictures_json(sim, budgets[0]["result"], budgets[0]["result"].best.plan),
        "budgets": [{k: v for k, v in b.items() if k not in ("result", "scored")} for b in budgets],
        "fabric": fabric.to_json(), "compute": compute.to_json(), "budget_bytes": budget_bytes,
        "budget_why": budget_why,
        "machine": {"host": platform.node(), "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "torch": torch.__version__, "backend": dist.get_backend(), "world_size": world,
                    "ranks_per_node": cfg["ranks_per_node"], "threads_per_rank": torch.get_num_threads()},
    }


def measure_hardware(rank: int, world: int, cfg: dict[str, Any], entry: Any, inputs: tuple[Any, ...],
                      train: TrainConfig | None, *, backend: str) -> tuple[FabricProfile, ComputeProfile, torch.dtype]:
    """Steps 1 and 2: the fabric and the compute, measured on these ranks (the compute broadcast from rank 0),
    and the dtype the step computes in."""
    quiet = cfg["quiet"]
    tp = cfg.get("tp", 1)
    # tensor-parallel groups, and pipeline stages' (cfg "pp": See [Note: pipeline fabric] in search/pipeline.py)
    mesh = MeshSpec(world_size=world, ranks_per_node=cfg["ranks_per_node"], shard_size=world)
    groups = pp_group_sizes(ParallelRequest(mesh=mesh, pp=cfg.get("pp")), also=(tp,))
    _log(rank, quiet, f"[1/5] {cfg['model']}: measuring the fabric on {world} {backend} ranks ...")
    fabric = measure_fabric(sizes_bytes=tuple(4 ** k * 1024 for k in range(0, 7)), repeats=15, progress=not quiet,
                            ranks_per_node=cfg["ranks_per_node"], group_sizes=groups)
    _log(rank, quiet, "[2/5] measuring compute (matmul, bandwidth, FSDP2 per-unit cost, optimizer, "
                      "per-module times) ...")
    # Module times in the dtype the step computes in: See [Note: compute dtype] in cost/dtypes.py.
    dt = TORCH_DTYPES[train.compute_dtype()] if train is not None else torch.float32  # the trainable zoo is float32
    in_dt = tuple(x.to(dt) if x.is_floating_point() else x for x in inputs)
    compute = measure_compute(model=entry.build("cpu", seed=0).to(dt), example_inputs=in_dt, loss_fn=entry.loss,
                              repeats=5)
    return fabric, broadcast_json(compute.to_json(), ComputeProfile.from_json), dt


def _plans_to_run(cfg: dict[str, Any], graph: ModelGraph, sim: Any, request: ParallelRequest, tp_spec: Any,
                  ) -> tuple[list[PlanSpec], list[dict[str, Any]], dict[int, list[str]]]:
    """wrapopt's plan for each budget (first, once each), then the plan set's plans not among them
    (at the request's tensor-parallel degree too, when above 1).

    Returns the plans, the budgets (with each search's result and the plans it scored), and
    for each of wrapopt's plans the budgets it was chosen for."""
    mesh, tp = request.mesh, request.tp
    budgets = []
    plans: list[PlanSpec] = []
    index: dict[tuple, int] = {}
    chosen_for: dict[int, list[str]] = {}
    for spec in cfg["budgets"]:
        budget_bytes, budget_why = _resolve_budget(spec, graph, sim, mesh)
        result = (search_plan(graph, sim, mesh, memory_budget=budget_bytes) if tp_spec is None else
                  search_tp(graph, sim, mesh, spec=tp_spec, degrees=(1, tp), memory_budget=budget_bytes))
        best = result.best.plan
        key = (best.units, best.mesh, best.forward_prefetch)
        if key not in index:
            index[key] = len(plans)
            plans.append(replace(best, label="wrapopt:" + (best.label or "plan")))
        chosen_for.setdefault(index[key], []).append(str(spec))
        budgets.append({"name": str(spec), "bytes": budget_bytes, "why": budget_why, "chosen": plans[index[key]].label,
                        "result": result, "scored": {(s.plan.units, s.plan.mesh, s.plan.forward_prefetch)
                                                     for s in result.candidates}})
    more = [] if tp_spec is None else [
        lift_plan(p, tp, tp_spec) for p in PLAN_SETS[cfg["plan_set"]](sim.view(Shape(tp=tp), tp_spec).traced,
                                                                       dp_mesh(mesh, tp))]
    for p in PLAN_SETS[cfg["plan_set"]](graph, mesh) + more:
        key = (p.units, p.mesh, p.forward_prefetch)
        if key not in index:
            index[key] = len(plans)
            plans.append(p)
    return plans, budgets, chosen_for


def _confirmation_round(rank: int, cfg: dict[str, Any], entry: Any, train: TrainConfig | None,
                        plans: list[PlanSpec], preds: list[Any], measured: list[Any], budgets: list[dict[str, Any]],
                        chosen_for: dict[int, list[str]], inputs: Any) -> tuple[list[int], dict[str, Any]]:
    """Re-measure the contenders and an A/A copy (See [Note: confirmation round]); their times replace
    the screening's in ``measured`` (in place). Returns the confirmed plans' indices and the A/A times."""
    confirmed = _confirm_set(plans, measured, budgets, chosen_for, top=cfg["confirm"])
    fastest_pred = min(range(len(plans)), key=lambda i: preds[i].step_s)
    confirmed = sorted(set(confirmed) | {fastest_pred})
    _log(rank, cfg["quiet"], f"      confirmation round: {len(confirmed)} plans and an A/A copy, "
                             f"{cfg['confirm_repeats']} repeats ...")
    # The last entry is a second, separate copy of the predicted fastest: See [Note: A/A copy].
    again = _measure(rank, cfg["quiet"], 1 + cfg["confirm_repeats"], "confirm", lambda: entry.build("cpu", seed=0),
                     [plans[i] for i in confirmed] + [plans[fastest_pred]], inputs, entry.loss,
                     repeats=cfg["confirm_repeats"], warmup=1, measure_memory=False, train=train)
    aa = {"plan": plans[fastest_pred].label, "times_s": list(again[-1].times_s),
          "of_times_s": list(again[confirmed.index(fastest_pred)].times_s)}
    for i, m in zip(confirmed, again):
        measured[i] = replace(m, peak_bytes=measured[i].peak_bytes)
    return confirmed, aa


def _rows(plans: list[PlanSpec], preds: list[Any], measured: list[Any], screening: list[Any],
          budgets: list[dict[str, Any]], chosen_for: dict[int, list[str]], confirmed: list[int],
          train: TrainConfig | None) -> list[dict[str, Any]]:
    """One row per plan: predicted and measured step and peak, the screening's figures, the phases."""
    rows = []
    budget_bytes = budgets[0]["bytes"]
    k = train.grad_accumulation if train is not None else 1
    for i, (p, e, m) in enumerate(zip(plans, preds, measured)):
        rows.append({
            "plan": p.label, "units": len(p.units), "chosen": i == 0, "chosen_for": chosen_for.get(i, []),
            # Budgets whose search scored this plan (the diagnosis in evidence.py: not in the search space).
            "scored_for": [b["name"] for b in budgets if (p.units, p.mesh, p.forward_prefetch) in b["scored"]],
            "fits": e.peak_bytes <= budget_bytes,
            "pred_step_s": e.step_s, "meas_step_s": m.step_s, "meas_times_s": list(m.times_s),
            "meas_spread": m.spread,
            "pred_peak_bytes": e.peak_bytes, "meas_peak_bytes": m.peak_bytes, "confirmed": i in confirmed,
            "screen_step_s": screening[i].step_s, "screen_spread": screening[i].spread,
            "screen_times_s": list(screening[i].times_s),
            # Where the time goes, screening round: See [Note: phases].
            "pred_phase_s": {"fwd": k * e.fwd_s, "bwd": e.step_s - k * e.fwd_s - e.optim_s, "optim": e.optim_s},
            "meas_phase_s": dict(zip(PHASES, screening[i].phase_s)),
            "warnings": list(screening[i].warnings),
        })
    return rows


def _confirm_set(plans: list[PlanSpec], measured: list[Any], budgets: list[dict[str, Any]],
                 chosen_for: dict[int, list[str]], *, top: int) -> list[int]:
    """Plans to re-measure: per budget the ``top`` fastest that fit (by measured peak),
    wrapopt's choice and the fastest fitting baseline. Every rank computes the same
    set: the screening figures are maxima over ranks."""

    picks: set[int] = set(chosen_for)
    for b in budgets:
        fits = sorted((i for i, m in enumerate(measured) if m.peak_bytes <= b["bytes"]),
                      key=lambda i: measured[i].step_s)
        picks.update(fits[:top])
        base = [i for i in fits if plans[i].label in BASELINES]
        picks.update(base[:1])
    return sorted(picks)


def _case(train: TrainConfig) -> str:
    """A case's name in the reports: the precision, and the accumulation with its sync mode."""
    parts = [train.precision] if train.precision != "none" else []
    if train.grad_accumulation > 1:
        parts.append(f"accumulation {train.grad_accumulation}, sync {train.accumulation_sync}")
    return ", ".join(parts) or "fp32"


def _plan_json(result, chosen: PlanSpec, graph: ModelGraph, entry, sim,
               train: TrainConfig | None = None) -> dict[str, Any]:
    fab = sim.fabric
    plan = WrapPlan.from_search(
        chosen, entry.build("meta"), sim.simulate(chosen, record=True),
        fabric={"name": fab.name, "kind": fab.kind, "backend": fab.backend, "world_size": fab.world_size,
                "ranks_per_node": fab.ranks_per_node, "compute": sim.compute.device, "compute_kind": sim.compute.kind},
        baselines={k: {"num_units": len(s.plan.units), "fits": s.fits, **s.estimate.summary_json()}
                   for k, s in result.baselines.items()},
        param_users=graph.param_users,
        train=train,
    )
    return plan.to_json()


def evaluate(model: str, *, world_size: int = 2, ranks_per_node: int | None = None, plan_set: str = "baselines",
             repeats: int = 5, memory_budget: str | None = "midway", budgets: list[str] | None = None,
             confirm: int = 0, confirm_repeats: int = 15, quiet: bool = False, timeout_s: float = 900.0,
             train: TrainConfig | None = None, log_dir: str | None = None, tp: int = 1) -> dict[str, Any]:
    """Predict and measure ``plan_set`` plans of zoo ``model`` on local gloo ranks; rank 0's rows.

    ``quiet``: no progress lines. ``log_dir``: the ranks' own output (library
    warnings, profiler lines) goes to log files there, only wrapopt's lines to
    the terminal (See [Note: quiet ranks] in launch.py); None leaves it all on
    the terminal.

    ``confirm=K`` re-measures, in a second interleaved round of ``confirm_repeats``,
    the K fastest fitting plans per budget, wrapopt's choices and the fastest fitting
    baseline; their rows then carry the second round's times (``confirmed``).
    ``train`` runs every plan with that mixed precision, optimizer and accumulation
    (a sync mode left unset is ``last``: predictions and steps must agree on one),
    with the compute profile measured in its compute dtype. ``tp > 1`` adds the same plan set
    at that tensor-parallel degree (2-D plans, the same global batch) and lets the search choose it.
    """

    if plan_set not in PLAN_SETS:
        raise ValueError(f"plan_set must be one of {sorted(PLAN_SETS)}, got {plan_set!r}")
    check_count(world_size, "world_size (--world-size: local ranks; a group of one has no collective)", minimum=2)
    check_count(repeats, "repeats")
    check_count(confirm, "confirm", minimum=0)
    check_count(confirm_repeats, "confirm_repeats")
    rpn = world_size if ranks_per_node is None else check_count(ranks_per_node, "ranks_per_node")
    for spec in budgets or [memory_budget]:  # read here, not on the ranks after they start
        if spec not in _BUDGET_WORDS:
            _given_bytes(spec)
    cfg = {"model": model, "plan_set": plan_set, "repeats": repeats, "budgets": budgets or [memory_budget],
           "quiet": quiet, "ranks_per_node": rpn, "confirm": confirm, "tp": tp, "confirm_repeats": confirm_repeats,
           "train": None if train is None else (train if train.sync_chosen else train.with_sync("last")).to_json()}
    env = {"LOCAL_WORLD_SIZE": str(rpn)}
    t0 = time.perf_counter()
    cpu0 = cpu_times()
    res = spawn(_worker, world_size=world_size, args=(cfg,), timeout_s=timeout_s, env=env, log_dir=log_dir)[0]
    res["wall_s"] = time.perf_counter() - t0
    res["machine"]["steal"] = cpu_steal(cpu0, cpu_times())
    return res

