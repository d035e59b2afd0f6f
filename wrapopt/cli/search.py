"""``wrapopt search MODEL --world-size N``: the best plan for a model on a mesh, beside the
baselines, with the search behind it; the plan written with ``--out``."""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from wrapopt.choices import CURRENT_FORMS, DEFAULT_TRIALS, PICTURES
from wrapopt.cli.options import (
    add_cp_ep_arguments,
    add_mesh_arguments,
    add_model_arguments,
    add_offload_arguments,
    add_pp_argument,
    add_train_arguments,
    count_int,
    fabric_from_args,
    mesh_from_args,
    model_from_args,
    positive_float,
    positive_int,
    seed_int,
    sync_note,
    tp_degree,
    train_from_args,
    with_global_batch,
)
from wrapopt.errors import PlanError
from wrapopt.fileio import check_writable, parse_bytes, read_json
from wrapopt.spec import SELECTIVE_OP, MeshSpec, ParallelRequest
from wrapopt.tp import TPSpec

if TYPE_CHECKING:
    from wrapopt.plan.file import WrapPlan
    from wrapopt.search.driver import SearchOptions, SearchResult

__all__ = ["add_parser", "run"]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``wrapopt search`` to the CLI's sub-commands; it runs ``run``."""
    p = subparsers.add_parser("search", help="search the best plan for a model on a mesh")
    add_model_arguments(p)
    add_mesh_arguments(p)
    add_offload_arguments(p)
    add_train_arguments(p)
    p.add_argument("--out", default=None, help="write the plan here (JSON)")
    p.add_argument("--json", action="store_true", help="print the plan and baselines as JSON")

    p.add_argument("--trials", type=count_int, default=DEFAULT_TRIALS,
                   help=f"Optuna trials in total, seeds included (default {DEFAULT_TRIALS}; "
                        "0: baselines and exact DP only)")
    p.add_argument("--seed", type=seed_int, default=0,
                   help="sampler seed: the same seed gives the same search (default 0)")
    p.add_argument("--storage", default=None,
                   help="make the study resumable and shareable by several workers: a file path (SQLite; a path "
                        "ending in .journal is an Optuna journal file, faster per trial) or any Optuna storage URL")
    p.add_argument("--study-name", default=None,
                   help="study name in --storage (default: from model, mesh, budget, fabric)")
    p.add_argument("--sampler", choices=("auto", "tpe", "nsga2"), default="auto",
                   help="Optuna sampler (default auto: TPE on small spaces, NSGA-II past 64 parameters)")
    p.add_argument("--shard-size", type=positive_int, default=None,
                   help="fix the shard group (default: search FSDP over the world and HSDP per node / nodes)")
    p.add_argument("--max-group", type=positive_int, default=8,
                   help="the DP's largest number of blocks in one unit (default 8)")
    p.add_argument("--tp", type=tp_degree, default="1", metavar="auto|1|2|4|8",
                   help="tensor-parallel degree inside each node, FSDP across the data-parallel ranks (2-D, as "
                        "TorchTitan); auto: every degree dividing --gpus-per-node and the heads, chosen with the "
                        "units (default 1: FSDP alone)")
    p.add_argument("--tp-plan", default=None, metavar="FILE",
                   help='how blocks split for --tp, instead of the recognised one: a JSON file '
                        '{"layers": {"MyBlock": {"attn.q": "colwise", ..., "mlp.out": "rowwise"}}}')
    p.add_argument("--runtime", choices=("wrapopt", "torchtitan"), default="wrapopt",
                   help="what will run the plan: wrapopt (WrapPlan.apply, any plan; default) or torchtitan (only "
                        "plans its job config can say: embedding, blocks and [norm, output] as units, one reshard "
                        "and one checkpointing mode; export with `wrapopt export --to torchtitan`)")
    p.add_argument("--no-sequence-parallel", dest="sequence_parallel", action="store_false",
                   help="under --tp, hold norms, residuals and the embedding's output whole on every tensor-parallel "
                        "rank (default: TorchTitan's sequence parallelism, 1/tp of the sequence each)")
    p.add_argument("--no-loss-parallel", dest="loss_parallel", action="store_false",
                   help="under --tp, gather the logits whole before the loss (default: the loss on the vocabulary "
                        "shards, torch's loss_parallel)")
    p.add_argument("--async-tp", choices=("auto", "on", "off"), default="auto",
                   help="micro-pipeline the tensor-parallel collectives with the matmuls (torch's async TP; "
                        "default auto: on where the GPU runs it, H100 / H200 SXM)")
    p.add_argument("--checkpoint-modes", type=_checkpoint_modes, default=(False, True),
                   metavar="none,full,selective-op",
                   help="per-unit activation checkpointing the search chooses from (default none,full; add "
                        "selective-op to also try keeping matmul and attention outputs and recomputing the rest)")
    add_pp_argument(p, what="auto tries 1, 2, 4, 8 and 16 with their stages, schedule (GPipe, 1F1B, Interleaved1F1B), "
                             "micro-batches and the FSDP plan; N: that degree")
    add_cp_ep_arguments(p, cp_auto="the degrees that split the sequence into 2 x cp chunks and divide the "
                                   "data-parallel ranks, chosen with the rest of the shape",
                        ep_auto="the degrees that divide the experts and the ranks")
    p.add_argument("--timeout", type=positive_float, default=None, help="stop the study after this many seconds")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="a progress bar on stderr (default: when stderr is a terminal)")
    p.add_argument("--plot", default=None, metavar="DIR",
                   help=f"draw {' and '.join(PICTURES)} (predicted; needs matplotlib) into DIR")
    p.add_argument("--current", default=None, metavar="FILE|DESCRIPTION",
                   help="the configuration the job runs today, shown beside wrapopt's with each differing choice's "
                        f"gain: {CURRENT_FORMS}")
    return p


def _search_options(args: argparse.Namespace, mesh: MeshSpec) -> SearchOptions:
    from wrapopt.search.driver import SearchOptions
    from wrapopt.search.study.space import shard_sizes

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
    progress = args.progress if args.progress is not None else sys.stderr.isatty()
    return SearchOptions(trials=args.trials, seed=args.seed, storage=args.storage, study_name=args.study_name,
                         sampler=args.sampler, shard_sizes=shard, max_group=args.max_group, timeout_s=args.timeout,
                         progress=progress, checkpoint_modes=args.checkpoint_modes, runtime=args.runtime)


def _checkpoint_modes(text: str) -> tuple[bool | str, ...]:
    """``none,full,selective-op`` as ``SearchOptions.checkpoint_modes``."""
    names = {"none": False, "full": True, SELECTIVE_OP: SELECTIVE_OP}
    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in names]
    if bad or not modes:
        raise argparse.ArgumentTypeError(f"unknown checkpoint mode(s) {', '.join(bad) or text!r}; list some of "
                                         f"none, full, {SELECTIVE_OP}, e.g. none,full,{SELECTIVE_OP}")
    return tuple(dict.fromkeys(names[m] for m in modes))


def _tp_plan(path: str | None) -> TPSpec | None:
    """A user's tensor-parallel plan: a JSON file {"layers": {block class: {path: "colwise" | "rowwise"}}}."""
    if path is None:
        return None
    from wrapopt.plan.tp import tp_from_json

    data = read_json(path)
    if not isinstance(data, dict):
        raise PlanError(f"{path}: a tensor-parallel plan is a JSON object "
                        "{\"layers\": {block class: {path: style}}}")
    return tp_from_json({"source": "user", **data}, source=path)


def run(args: argparse.Namespace) -> int:
    """Body of ``wrapopt search``: flags are checked, and the output writable, before the search."""
    from wrapopt.api import plan_model, prepare
    from wrapopt.evaluation.pictures import pictures_json, write_pictures
    from wrapopt.report.choice import rates_json
    from wrapopt.report.estimate import step_work
    from wrapopt.plan.file import current_plan_loader
    from wrapopt.report.current import current_json
    from wrapopt.report.plots import require_matplotlib
    from wrapopt.search.batch import recorded_scale
    from wrapopt.search.current import compare_current, parse_current
    from wrapopt.search.tp import current_tp_spec
    from wrapopt.search.diagnosis import both_syncs
    from wrapopt.train import model_dtype

    mesh = mesh_from_args(args)
    options = _search_options(args, mesh)
    request = _request(args, mesh)  # bad flags fail before anything runs, each named on its own line
    if args.out:
        check_writable(args.out)
    if args.plot:
        require_matplotlib()  # before the search, not after it
        os.makedirs(args.plot, exist_ok=True)
    src = model_from_args(args)
    model = src.build("meta")
    job = prepare(request, model, src.inputs, fabric=fabric_from_args(args), compute=args.compute,
                  loss_fn=src.loss, rescale_fabric=args.rescale_fabric, notes=tuple(src.notes))
    graph, fabric, compute, budget, train = job.graph, job.fabric, job.compute, job.budget, job.request.train
    current = (parse_current(args.current, graph, mesh, tp_spec=current_tp_spec(graph, request),
                             load_plan=current_plan_loader(model, graph, mesh))
               if args.current is not None else None)  # a bad description fails before the search
    # One simulator for the search, the pictures and the sync what-ifs: the table's numbers everywhere.
    sim = job.sim
    plan, result = plan_model(job, search=options)
    if request.global_batch is not None:  # the micro-batch and accumulation chosen; the sync mode as asked
        train = replace(plan.train_config, accumulation_sync=train.accumulation_sync)
        sim = job.simulator(train, batch_scale=recorded_scale(graph, train, plan.spec))
    train, sim, request = _with_knobs(job, plan, train, sim)
    if args.out:
        plan.save(args.out)
    if args.plot:
        pics = pictures_json(sim, result, result.best.plan)
        write_pictures(args.plot, pics, title=f"{args.model} on {mesh.world_size} ranks ({mesh.ranks_per_node} per "
                                              f"node), {fabric.name} ({fabric.kind})")
    compared = None if current is None else compare_current(
        graph, sim, current, plan.spec, request=request, chosen_micro_batch=plan.train_config.micro_batch,
        chosen_estimate=result.best.estimate)
    # Throughput and MFU of every row: one step's work over its step (See [Note: one step's work]).
    work = step_work(model, src.inputs, graph, compute, accumulation=train.grad_accumulation,
                     batch_scale=sim.options.batch_scale / plan.mesh.cp_size,  # a cp rank's share of a sequence
                     compute_dtype=train.compute_dtype(model_dtype(model)), float8=train.float8)
    syncs = None  # under gradient accumulation, the choice scored with each sync mode
    if train.grad_accumulation > 1:
        syncs = both_syncs(result, graph, sim, train, budget)
    if args.json:
        out = _plan_json(plan, result, job.budget_note, syncs)
        out["search"]["rates"] = rates_json(result, work)
        if compared is not None:
            out["search"]["current"] = current_json(compared)
        print(json.dumps(out, indent=1))
    else:
        _print_text(args, job, src, model, mesh, plan, result, train, work, syncs, compared)
    return 0


def _print_text(args: argparse.Namespace, job: Any, src: Any, model: Any, mesh: MeshSpec, plan: WrapPlan,
                result: Any, train: Any, work: Any, syncs: Any, compared: Any) -> None:
    """The text output of ``wrapopt search``: the step, notes, choice, search, sync, batch, pipeline and
    ``--current`` tables, and the files written."""
    from wrapopt.report.batch import format_batch
    from wrapopt.report.choice import format_report, format_search, format_sync
    from wrapopt.report.current import format_current
    from wrapopt.report.pipeline import format_pipeline
    from wrapopt.train import model_dtype

    fabric, compute, budget = job.fabric, job.compute, job.budget
    print(job.budget_note)
    count = plan.spec.pipeline.microbatches if plan.spec.pipeline is not None else None
    print(f"training: {plan.train_config.describe(model_dtype(model), pipeline_microbatches=count)}")
    said = sync_note(args.sync, plan.train_config.grad_accumulation, pipeline=plan.spec.pipeline is not None)
    print("".join(f"note: {n}\n" for n in (*src.notes, *said)), end="")
    print(format_report(result, fabric, compute, mesh, assumptions=plan.assumptions, work=work))
    print(format_search(result))
    print(format_sync(result, train, budget, syncs))
    if result.batch_rows:
        print(format_batch(result))
    if result.pp_rows:
        print(format_pipeline(result))
    if compared is not None:
        print(format_current(compared, budget))
    if args.out:
        print(f"wrote {args.out}")
    if args.plot:
        print(f"wrote {', '.join(os.path.join(args.plot, name) for name in PICTURES)}")


def _with_knobs(job: Any, plan: WrapPlan, train: Any, sim: Any) -> tuple[Any, Any, ParallelRequest]:
    """The step, simulator and request with the knobs the search settled (``--float8 auto``: See
    [Note: knob defaults] in wrapopt/search/knobs.py), for the pictures, the sync what-ifs and ``--current``."""
    if train.with_knobs(plan.train_config) != train:
        train = train.with_knobs(plan.train_config)
        sim = job.simulator(train, batch_scale=sim.options.batch_scale)
    return train, sim, replace(job.request, train=job.request.train.with_knobs(plan.train_config))


def _request(args: argparse.Namespace, mesh: MeshSpec) -> ParallelRequest:
    """The parallel request the flags make: the shape, the batch, the budget and the step."""
    train = with_global_batch(args, train_from_args(args))
    host_memory = parse_bytes(args.host_memory) if args.host_memory else None
    if args.shard_size is not None:  # checked against the mesh by _search_options
        mesh = replace(mesh, shard_size=args.shard_size)
    return ParallelRequest(mesh=mesh, dp_shard=args.shard_size, tp=args.tp, tp_plan=_tp_plan(args.tp_plan),
                           sequence_parallel=args.sequence_parallel, loss_parallel=args.loss_parallel,
                           async_tp={"on": True, "off": False}.get(args.async_tp, "auto"),
                           pp=args.pp, cp=args.cp, ep=args.ep, global_batch=args.global_batch,
                           memory_budget=args.memory, train=train,
                           offload=bool(getattr(args, "offload", False)), host_memory=host_memory)


def _plan_json(plan: WrapPlan, result: SearchResult, budget_note: str, syncs: Any) -> dict[str, Any]:
    """What ``--json`` prints: the plan (the model without its parameter list) and the search."""
    from wrapopt.report.batch import batch_json
    from wrapopt.report.choice import search_json, sync_json
    from wrapopt.report.pipeline import pipeline_json

    out = plan.to_json()
    out.pop("model", None)
    out["model"] = {k: v for k, v in plan.model.items() if k not in ("params", "module_classes")}
    out["search"] = search_json(result, budget_note)
    out["search"]["sync"] = sync_json(result, syncs)
    out["search"]["batch"] = batch_json(result)
    out["search"]["pipeline"] = pipeline_json(result)
    return out
