"""``wrapopt`` command line: argparse sub-commands, ``main(argv) -> int``.

Library errors (``WrapoptError``) become exit code 1 and one line on stderr;
argument errors exit 2 (argparse's convention).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from wrapopt.api import (budget_line, budget_source, check_fabric_fits, compute_for, format_report, plan_model,
                         resolve_budget, resolve_fabric)
from wrapopt.cli.bench import add_bench_parser
from wrapopt.cli.estimate import add_estimate_parser
from wrapopt.cli.export import add_export_parser
from wrapopt.cli.fabric import add_fabric_parser
from wrapopt.cli.options import add_mesh_arguments, add_model_arguments, add_train_arguments, train_from_args
from wrapopt.cli.sync_report import format_sync, sync_json
from wrapopt.cli.logs import VERBOSE_HELP
from wrapopt.cli.profile_fabric import add_cli_arguments, run_cli
from wrapopt.cost.simulate import Simulator
from wrapopt.errors import PlanError, WrapoptError
from wrapopt.evaluation.demo import DEMO_OUT_DIR, run_demo
from wrapopt.evaluation.pictures import PICTURES, pictures_json, write_pictures
from wrapopt.fileio import check_writable, fmt_bytes, read_json
from wrapopt.hardware.profiles import FabricProfile
from wrapopt.models.sources import resolve_model
from wrapopt.plan.file import WrapPlan
from wrapopt.plan.tp import tp_from_json
from wrapopt.report.fabric import format_fabric
from wrapopt.report.plots import draw_timeline, require_matplotlib
from wrapopt.report.text import format_graph, format_plan, graph_to_json
from wrapopt.search.driver import DEFAULT_TRIALS, SearchOptions
from wrapopt.search.study.space import shard_sizes
from wrapopt.spec import MeshSpec
from wrapopt.trace.meta import trace_model
from wrapopt.train import model_dtype
from wrapopt.version import __version__

__all__ = ["main"]


def _cmd_trace(args: argparse.Namespace) -> int:
    src = resolve_model(args.model, batch=args.batch, seq=args.seq)
    graph = trace_model(src.build("meta"), src.inputs, loss_fn=src.loss)
    if args.json:
        print(json.dumps(graph_to_json(graph), indent=1))
    else:
        print(format_graph(graph, depth=args.depth))
    return 0


def _mesh(args: argparse.Namespace):
    gpn = args.gpus_per_node or min(args.world_size, 8)
    if args.world_size < 1:
        raise ValueError(f"--world-size must be positive, got {args.world_size}")
    if args.world_size > gpn and args.world_size % gpn:
        raise ValueError(f"--world-size {args.world_size} is not a multiple of --gpus-per-node {gpn}")
    return MeshSpec(world_size=args.world_size, ranks_per_node=min(gpn, args.world_size), shard_size=args.world_size)


def _search_options(args: argparse.Namespace, mesh):
    shard = None
    if args.shard_size is not None:
        legal = shard_sizes(mesh)
        if args.shard_size > mesh.world_size:
            raise ValueError(f"--shard-size {args.shard_size} is larger than the world of {mesh.world_size} ranks")
        if args.shard_size not in legal:
            raise ValueError(
                f"--shard-size {args.shard_size} must divide the world of {mesh.world_size} ranks and be a part of one "
                f"node or whole nodes of {mesh.ranks_per_node}; choose one of {', '.join(map(str, legal))}"
            )
        shard = (args.shard_size,)
    if args.trials < 0:
        raise ValueError(f"--trials must be >= 0, got {args.trials}")
    if args.timeout is not None and args.timeout <= 0:
        raise ValueError(f"--timeout must be positive, got {args.timeout}")
    progress = args.progress if args.progress is not None else sys.stderr.isatty()
    return SearchOptions(trials=args.trials, seed=args.seed, storage=args.storage, study_name=args.study_name,
                         sampler=args.sampler, shard_sizes=shard, max_group=args.max_group, timeout_s=args.timeout,
                         progress=progress)


def _cmd_search(args: argparse.Namespace) -> int:
    from dataclasses import replace

    train = train_from_args(args)  # bad training flags fail before anything runs
    tp_plan = _tp_plan(args.tp_plan)
    mesh = _mesh(args)
    options = _search_options(args, mesh)
    if options.shard_sizes:
        mesh = replace(mesh, shard_size=options.shard_sizes[0])
    if args.out:
        check_writable(args.out)
    if args.plot:
        require_matplotlib()  # before the search, not after it
        os.makedirs(args.plot, exist_ok=True)
    fabric = resolve_fabric(args.fabric, world_size=mesh.world_size, ranks_per_node=mesh.ranks_per_node)
    notes = check_fabric_fits(fabric, mesh, rescale=args.rescale_fabric)
    src = resolve_model(args.model, batch=args.batch, seq=args.seq)
    notes = [*src.notes, *notes]
    model = src.build("meta")
    compute = compute_for(fabric, args.compute, train, model_dtype(model))
    budget = resolve_budget(args.memory, compute)  # before tracing: a bad budget fails at once
    budget_note = budget_line(args.memory, compute, budget)
    graph = trace_model(model, src.inputs, loss_fn=src.loss)
    plan, result = plan_model(graph, model, mesh=mesh, fabric=fabric, compute=compute, memory_budget=budget, notes=notes,
                              search=options, memory_budget_source=budget_source(args.memory, compute), train=train,
                              tp=args.tp, tp_plan=tp_plan)
    if args.out:
        plan.save(args.out)
    if args.plot:
        pics = pictures_json(Simulator(graph, fabric, compute), result, result.best.plan)
        write_pictures(args.plot, pics, title=f"{args.model} on {mesh.world_size} ranks ({mesh.ranks_per_node} per node), "
                       f"{fabric.name} ({fabric.kind})")
    if args.json:
        out = plan.to_json()
        out.pop("model", None)
        out["model"] = {k: v for k, v in plan.model.items() if k not in ("params", "module_classes")}
        out["search"] = _search_json(result, budget_note)
        out["search"]["sync"] = sync_json(result, graph, fabric, compute, train, budget)
        print(json.dumps(out, indent=1))
    else:
        print(budget_note)
        print(f"training: {plan.train_config.describe(model_dtype(model))}")
        print("".join(f"note: {n}\n" for n in src.notes), end="")
        print(format_report(result, fabric, compute, mesh, assumptions=plan.assumptions))
        print(_format_search(result))
        print(format_sync(result, graph, fabric, compute, train, budget))
        if args.out:
            print(f"wrote {args.out}")
        if args.plot:
            print(f"wrote {', '.join(os.path.join(args.plot, name) for name in PICTURES)}")
    return 0


def _tp_plan(path: str | None):
    """A user's tensor-parallel plan: a JSON file {"layers": {block class: {path: "colwise" | "rowwise"}}}."""
    if path is None:
        return None
    data = read_json(path)
    if not isinstance(data, dict):
        raise PlanError(f"{path}: a tensor-parallel plan is a JSON object {{\"layers\": {{block class: {{path: style}}}}}}")
    return tp_from_json({"source": "user", **data}, source=path)


def _search_json(result, budget_line: str | None) -> dict[str, Any]:
    study = result.study
    pick = lambda s: None if s is None else {  # noqa: E731
        "label": s.plan.label, "shard_size": s.plan.mesh.shard_size, "tp_size": s.plan.mesh.tp_size,
        "num_units": len(s.plan.units), "step_s": s.estimate.step_s, "peak_bytes": s.estimate.peak_bytes, "fits": s.fits}
    return {
        "memory_budget": None if result.memory_budget == float("inf") else result.memory_budget,
        "memory_budget_note": budget_line,
        "dp_best": pick(result.dp_best),
        "optuna_best": pick(result.optuna_best),
        "pareto": [pick(s) for s in result.pareto],
        "tp_chosen": result.tp_chosen,
        "tp_rows": [{"row": label, **pick(s)} for label, s in result.tp_rows],
        "study": None if study is None else {"name": study.study_name, "storage": study.storage,
                                             "sampler": study.sampler,
                                             "finished_trials": study.num_trials, "run_here": study.num_run_here,
                                             "seeds": study.num_seeds},
    }


def _format_search(result) -> str:
    best = result.best.plan
    mesh = best.mesh
    kind = ("FSDP over the world" if mesh.shard_size == mesh.world_size else "no sharding" if mesh.shard_size == 1
            else f"HSDP: {mesh.replicate_size} replicas of a shard group of {mesh.shard_size}")
    if mesh.tp_size > 1:
        kind += f", tensor parallel {mesh.tp_size} inside each node ({mesh.dp_size} data-parallel ranks)"
    lines = [f"wrapopt's choice: {len(best.units)} units, {kind}, forward prefetch {best.forward_prefetch}"]
    if result.tp_rows:
        lines.append("tensor parallelism (the same global batch; See [Note: 2-D search]):")
        ref = result.best.estimate.step_s
        for label, s in result.tp_rows:
            e = s.estimate
            lines.append(f"  {label:<44} {e.step_s * 1e3:10.2f}ms {fmt_bytes(e.peak_bytes):>11} "
                         f"{'fits' if s.fits else 'does not fit':<12} chosen/this {ref / e.step_s:5.3f}  {s.plan.label}")
    if result.dp_best is not None:
        lines.append(f"exact DP best: {result.dp_best.plan.label} {result.dp_best.estimate.step_s * 1e3:.2f}ms")
    study = result.study
    if study is not None:
        best = result.optuna_best
        where = f" in {study.storage}" if study.storage else ""
        lines.append(f"optuna study {study.study_name!r}{where} ({study.sampler}): {study.num_trials} finished trials "
                     f"({study.num_run_here} run now, {study.num_seeds} seeds); best fitting: "
                     + (f"{best.estimate.step_s * 1e3:.2f}ms" if best else "none"))
    if result.pareto:
        lines.append("time-memory Pareto front (plans that fit; none is both faster and smaller than another):")
        for s in result.pareto[:10]:
            lines.append(f"  {s.estimate.step_s * 1e3:9.2f}ms {fmt_bytes(s.estimate.peak_bytes):>11}  shard {s.plan.mesh.shard_size:<5d}"
                         f" {len(s.plan.units):4d} units  {s.plan.label}")
        if len(result.pareto) > 10:
            lines.append(f"  ... {len(result.pareto) - 10} more")
    return "\n".join(lines)


def _cmd_show(args: argparse.Namespace) -> int:
    data: Any = read_json(args.file)
    fmt = data.get("format") if isinstance(data, dict) else None
    if isinstance(fmt, str) and fmt.startswith("wrapopt.fabric/"):
        prof = FabricProfile.from_json(data, source=args.file)
        if args.json:
            print(json.dumps(prof.to_json(), indent=1))
        else:
            print(format_fabric(prof))
        return 0
    plan = WrapPlan.from_json(data, source=args.file)
    if args.json:
        print(json.dumps(plan.to_json(), indent=1))
    else:
        print(format_plan(plan))
    if args.timeline:
        draw_timeline(plan, args.timeline)
        print(f"wrote {args.timeline}")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    train = train_from_args(args) if (args.precision is not None or args.accumulation != 1 or args.optimizer != "adamw"
                                      or args.sync != "auto") else None
    return run_demo(out_dir=args.out, model=args.model, world_size=args.world_size, repeats=args.repeats,
                    memory_budget=args.memory, train=train, verbose=args.verbose)


def _cmd_profile(args: argparse.Namespace) -> int:
    return run_cli(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="wrapopt", description="Find and apply the best FSDP wrapping plan.")
    parser.add_argument("--version", action="version", version=f"wrapopt {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help=VERBOSE_HELP)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("profile-fabric", help="measure collective latency per size on each mesh axis")

    add_cli_arguments(p)
    p.set_defaults(func=_cmd_profile)

    p = sub.add_parser("trace", help="print the module tree with parameters, FLOPs and activations")
    add_model_arguments(p)
    p.add_argument("--depth", type=int, default=2, help="fold the tree below this depth (default 2)")
    p.add_argument("--json", action="store_true", help="print the graph as JSON")
    p.set_defaults(func=_cmd_trace)

    p = sub.add_parser("search", help="search the best plan for a model on a mesh")
    add_model_arguments(p)
    add_mesh_arguments(p)
    add_train_arguments(p)
    p.add_argument("--out", default=None, help="write the plan here (JSON)")
    p.add_argument("--json", action="store_true", help="print the plan and baselines as JSON")

    p.add_argument("--trials", type=int, default=DEFAULT_TRIALS,
                   help=f"Optuna trials in total, seeds included (default {DEFAULT_TRIALS}; 0: baselines and exact DP only)")
    p.add_argument("--seed", type=int, default=0, help="sampler seed: the same seed gives the same search (default 0)")
    p.add_argument("--storage", default=None,
                   help="make the study resumable and shareable by several workers: a file path (SQLite; a path "
                        "ending in .journal is an Optuna journal file, faster per trial) or any Optuna storage URL")
    p.add_argument("--study-name", default=None, help="study name in --storage (default: from model, mesh, budget, fabric)")
    p.add_argument("--sampler", choices=("auto", "tpe", "nsga2"), default="auto",
                   help="Optuna sampler (default auto: TPE on small spaces, NSGA-II past 64 parameters)")
    p.add_argument("--shard-size", type=int, default=None,
                   help="fix the shard group (default: search FSDP over the world and HSDP per node / nodes)")
    p.add_argument("--max-group", type=int, default=8, help="the DP's largest number of blocks in one unit (default 8)")
    p.add_argument("--tp", default="1", metavar="auto|1|2|4|8",
                   help="tensor-parallel degree inside each node, FSDP across the data-parallel ranks (2-D, as "
                        "TorchTitan); auto: every degree dividing --gpus-per-node and the heads, chosen with the "
                        "units (default 1: FSDP alone)")
    p.add_argument("--tp-plan", default=None, metavar="FILE",
                   help='how blocks split for --tp, instead of the recognised one: a JSON file '
                        '{"layers": {"MyBlock": {"attn.q": "colwise", ..., "mlp.out": "rowwise"}}}')
    p.add_argument("--timeout", type=float, default=None, help="stop the study after this many seconds")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="a progress bar on stderr (default: when stderr is a terminal)")
    p.add_argument("--plot", default=None, metavar="DIR",
                   help=f"draw {' and '.join(PICTURES)} (predicted; needs matplotlib) into DIR")
    p.set_defaults(func=_cmd_search)

    p = sub.add_parser("show", help="print a plan or fabric profile")
    p.add_argument("file")
    p.add_argument("--json", action="store_true")
    p.add_argument("--timeline", default=None, help="draw the predicted step timeline of a plan to this PNG")
    p.set_defaults(func=_cmd_show)

    p = sub.add_parser("demo", help="the whole job end to end on 2 local gloo ranks")
    p.add_argument("--out", default=DEMO_OUT_DIR,
                   help=f"the folder to write (default {DEMO_OUT_DIR}, ignored by git; results/demo/ is the "
                        "recorded run)")
    p.add_argument("--model", default="gpt-tiny", help="a trainable zoo model")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--memory", default=None, help="budget (default: midway between the baselines' peaks)")
    add_train_arguments(p)
    p.set_defaults(func=_cmd_demo, batch=None, seq=None)

    add_bench_parser(sub)
    add_export_parser(sub)
    add_estimate_parser(sub)
    add_fabric_parser(sub)
    for p in sub.choices.values():  # -v after the sub-command too; SUPPRESS keeps one given before it
        p.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help=VERBOSE_HELP)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (WrapoptError, ValueError, OSError) as e:
        print(f"wrapopt {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130

