"""``optimize_wrap``: the one place that wires the stages together.

trace -> profile (or a given / analytical profile) -> search -> WrapPlan ->
apply. Inside a process group every rank profiles, rank 0 searches, the plan
travels to every rank as JSON text, and every rank applies it. ``estimate``
(``wrapopt.predict``, re-exported here) wires the same stages for one plan the
user already has.

Only wiring lives here: the text report is ``report.choice``, the FLOPs and
MFU of an estimate ``report.estimate``, the what-if re-simulations (a given
plan scored beside the baselines) ``search.diagnosis``, the remedies priced when
nothing fits ``search.remedies``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from wrapopt.assumptions import Assumptions
from wrapopt.checks import check_count, check_seed
from wrapopt.consensus import agree, every_rank, input_facts
from wrapopt.cost import Simulator
from wrapopt.predict import estimate
from wrapopt.errors import InfeasibleError, ModelError, OptionError, PlanError, ProfileError, WrapoptError
from wrapopt.fileio import check_writable
from wrapopt.fingerprint import model_fingerprint
from wrapopt.hardware.budget import MEMORY_HEADROOM, auto_memory_budget, budget_line, budget_source, resolve_budget
from wrapopt.hardware.host import host_for
from wrapopt.hardware.measure_collectives import measure_fabric
from wrapopt.hardware.measure_device import measure_compute
from wrapopt.hardware.measure_split import with_tp_measurements
from wrapopt.hardware.profiles import ComputeProfile, FabricProfile
from wrapopt.hardware.resolve import check_fabric_fits, compute_for, resolve_fabric
from wrapopt.job import Job, default_mesh, job_mesh, prepare
from wrapopt.launch import broadcast_json
from wrapopt.launch import device_type as default_device
from wrapopt.plan.apply import plan_digest
from wrapopt.plan.file import WrapPlan
from wrapopt.plan.pipeline import PipelineRun, pipeline_kwargs
from wrapopt.report.batch import format_batch
from wrapopt.report.choice import format_report
from wrapopt.report.pipeline import format_pipeline
from wrapopt.search.batch import recorded_scale
from wrapopt.search.diagnosis import assumptions_for, score_given
from wrapopt.search.driver import DEFAULT_TRIALS, Scored, SearchOptions, SearchResult
from wrapopt.search.knobs import float8_choices, float8_hint, search_float8
from wrapopt.search.offload import choose_offload, mark_offload
from wrapopt.search.pipeline import pp_group_sizes
from wrapopt.search.remedies import find_remedies
from wrapopt.search.run import SearchRun, run_search
from wrapopt.search.shapes import tp_group_sizes
from wrapopt.spec import ModelGraph, ParallelRequest
from wrapopt.tp import TPSpec
from wrapopt.trace.meta import trace_model
from wrapopt.train import TrainConfig, model_dtype

__all__ = ["optimize_wrap", "OptimizeResult", "plan_model", "prepare", "Job", "ParallelRequest",
           "resolve_fabric", "auto_memory_budget", "resolve_budget",
           "MEMORY_HEADROOM", "budget_source", "assumptions_for", "estimate", "compute_for", "budget_line",
           "check_fabric_fits", "default_mesh"]


@dataclass
class OptimizeResult:
    """What ``optimize_wrap`` returns."""

    plan: WrapPlan
    model: nn.Module | PipelineRun | None  # the sharded model (a pipeline plan: this rank's stages) in a process group
    baselines: dict[str, Scored]
    search: SearchResult = field(repr=False)
    graph: ModelGraph = field(repr=False)
    fabric: FabricProfile = field(repr=False)
    compute: ComputeProfile = field(repr=False)
    # What the prediction rests on (loss, optimizer, precision, batch, budget, fabric).
    assumptions: Assumptions | None = field(default=None, repr=False)

    @property
    def micro_batch(self) -> int | None:
        """Sequences per data-parallel rank per micro-batch the plan was scored at (None: the traced batch)."""
        return self.plan.micro_batch

    @property
    def accumulation(self) -> int:
        """Micro-batches per optimizer step the plan was scored at."""
        return self.plan.accumulation

    def loss_context(self) -> Any:
        """The context the loss and its backward must run in (``WrapPlan.loss_context``):
        ``loss_parallel()`` where the plan keeps the logits split over the vocabulary, else a
        ``nullcontext``.

        Example:
            >>> with res.loss_context():  # doctest: +SKIP
            ...     loss_fn(res.model(x), x).backward()
        """
        return self.plan.loss_context()

    def train_context(self, *, buffers: Any = (), seq_dims: Any = (), no_restore: Any = (),
                      rotate_method: str = "allgather", load_balance: bool = True) -> Any:
        """The context each forward and backward must run in (``WrapPlan.train_context`` on this
        result's model): ``loss_context()``, and under context parallelism (``plan.mesh.cp_size >
        1``) torch's ``context_parallel``, which shards ``buffers`` (input ids, labels, position
        buffers) on their ``seq_dims`` and runs SDPA as ring attention (``load_balance=False`` for
        non-causal attention). See [Note: applying context parallelism] in plan/cp.py.

        Example:
            >>> with res.train_context(buffers=[x, y], seq_dims=[1, 1], no_restore=[x, y]):  # doctest: +SKIP
            ...     loss_fn(res.model(x), y).backward()
        """
        return self.plan.train_context(self.model, buffers=buffers, seq_dims=seq_dims, no_restore=no_restore,
                                       rotate_method=rotate_method, load_balance=load_balance)

    def report(self) -> str:
        """A text table: the chosen plan and every baseline, predicted time and memory,
        then the assumptions the prediction rests on (``report.choice.format_report``); at a fixed
        global batch, every micro-batch x accumulation split (``report.batch.format_batch``)."""
        text = format_report(self.search, self.fabric, self.compute, self.plan.mesh, assumptions=self.assumptions)
        text += "\n" + format_pipeline(self.search) if self.search.pp_rows else ""  # per pipeline degree
        return text + ("\n" + format_batch(self.search) if self.search.batch_rows else "")


def plan_model(job: Job, *, search: SearchOptions | None = None) -> tuple[WrapPlan, SearchResult]:
    """Search ``job`` (``wrapopt.job.prepare``) and package the answer as a WrapPlan (no process group needed).

    ``search`` defaults to the CLI's defaults: the exact DP on every shard group and an in-memory
    Optuna study of ``DEFAULT_TRIALS`` trials, seed 0. What is searched is the job's request: its
    tensor-parallel degree (See [Note: 2-D search]), pipeline degree (See [Note: pipeline search]),
    global batch (the micro-batch and accumulation chosen with the plan and recorded in its
    ``train``: See [Note: global batch search] in search/batch.py) and CPU offload (chosen only
    where it is the fastest plan that fits: See [Note: offload search] in search/offload.py). The
    plan records the training step with the sync mode the search chose, and its ``assumptions``
    say where the budget came from.
    """
    request, graph, budget = job.request, job.graph, job.budget
    search = search if search is not None else SearchOptions(trials=DEFAULT_TRIALS)

    def run(step: TrainConfig, screen: bool) -> tuple[SearchRun, str]:
        """The search at ``step`` (``screen``: without the study, no offload: See [Note: knob defaults])."""
        req = replace(request, train=step)

        def one(s: Simulator) -> SearchRun:
            found = run_search(graph, s, req, memory_budget=budget, options=replace(search, trials=0, progress=False)
                               if screen else search)
            return replace(found, result=mark_offload(found.result)) if s.options.offload else found

        sim = job.sim if step == request.train else job.simulator(step)  # job.sim: the step asked
        return (one(sim), "") if screen else choose_offload(one, sim, lambda f: f.result)

    steps, float8_line = float8_choices(request.train, job.compute, request.mesh, job.sim)
    try:
        chose = search_float8(steps, run, lambda f: f[0].result.best)
    except InfeasibleError as e:
        raise InfeasibleError(f"{e}\n{_remedies(job, search)}" if budget is not None else str(e)) from None
    (found, offload_note), float8_line = chose.found, chose.line or float8_line
    result, train, sim = found.result, found.train, found.sim
    if request.train.float8 == "none":  # off by default: what it would gain, or why it is not tried
        float8_line = float8_hint(sim, result.best.plan, result.best.estimate.step_s, job.compute)
    knobs = (*job.knobs, float8_line)
    notes = [*job.notes, *found.notes, *([offload_note] if offload_note else []), *knobs]
    result = replace(result, notes=(offload_note, *result.notes)) if offload_note else result
    result = replace(result, knobs=knobs)
    best = result.best
    fabric, compute = job.fabric, job.compute
    plan = WrapPlan.from_search(
        best.plan,
        job.model,
        sim.simulate(best.plan, record=True),  # the same estimate, with its timeline
        fabric={"name": fabric.name, "kind": fabric.kind, "backend": fabric.backend, "world_size": fabric.world_size,
                "ranks_per_node": fabric.ranks_per_node, "compute": compute.device, "compute_kind": compute.kind,
                "notes": notes},
        baselines={k: {"num_units": len(s.plan.units), "fits": s.fits, **s.estimate.summary_json()}
                   for k, s in result.baselines.items()},
        param_users=graph.param_users,
        assumptions=assumptions_for(graph, sim, best.plan, best.estimate, memory_budget=budget,
                                    source=job.budget_source),
        train=train.with_sync(best.estimate.accumulation_sync) if train.grad_accumulation > 1 else train,
    )
    return plan, result


def _remedies(job: Job, search: SearchOptions) -> str:
    """When nothing fits: each remedy priced on the plan of least memory (See [Note: computed
    remedies] in search/remedies.py), CPU offload on the GPU's stated host link when the job
    has no host (only the link is read: the advice says how much host memory it needs)."""
    host = job.host
    if host is None:
        try:
            host = host_for(job.fabric, host_memory_bytes=1, ranks_per_node=job.mesh.ranks_per_node)
        except OptionError:
            host = None  # a fabric with no stated host link: the advice says which flag prices it
    return find_remedies(job.graph, job.sim, job.request, float(job.budget or 0),
                         checkpoint_modes=search.checkpoint_modes, offload_host=host).text()


def optimize_wrap(
    model: nn.Module,
    example_inputs: tuple[Any, ...] | Any,
    *,
    world_size: int | None = None, gpus_per_node: int | None = None,
    fabric: FabricProfile | str | os.PathLike | None = None,
    memory_budget: int | float | str | None = None,
    seed: int = 0, trials: int | None = None,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    compute: ComputeProfile | str | None = None,
    plan: WrapPlan | str | os.PathLike | None = None,
    save_plan: str | os.PathLike | None = None, rescale_fabric: bool = False,
    train: TrainConfig | None = None,
    tp: int | str | None = None, tp_plan: TPSpec | None = None,
    global_batch: int | None = None, pp: int | str | None = None, cp: int | str | None = None,
    pipeline_loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
) -> OptimizeResult:
    """Find the best FSDP2 wrapping of ``model`` and, under a process group, apply it.

    Without a process group this only plans: for ``world_size`` ranks (default: ``gpus_per_node`` or 8) on
    ``fabric`` (default: the built-in analytical H100 + InfiniBand profile, labelled as such). Inside a job started
    by ``torchrun`` every rank measures the fabric unless one is given, rank 0 searches, and every rank applies
    the plan; ``.model`` is then the sharded model, ready for the optimizer.

    Args:
        model, example_inputs: the model (real weights or meta) and one per-rank batch of positional inputs.
        memory_budget: bytes, or "80GiB"/"80GB", "auto" (the default: 90% of the
            device's capacity when known) or "none" (no limit).
        seed, trials: the Optuna study's seed and trials (default ``DEFAULT_TRIALS``; 0: the exact DP and the
            baselines alone); the same seed gives the same plan.
        plan: a WrapPlan or plan file to apply instead of searching; ``save_plan``: where to write the plan
            (rank 0 writes, atomically).
        train: the training step (default: fp32, one micro-batch, AdamW; compile on for a stated GPU, off on
            CPU ranks; float8 off unless asked, "auto" searches it: See [Note: knob defaults]), recorded in the
            plan. ``plan.apply`` applies its precision, float8 (torchao, before ``fully_shard``; with the float8
            all-gather the loop calls ``wrapopt.plan.float8.after_optimizer_step(model)`` after each optimizer
            step, as ``train_step`` does) and compile (each block, after: See [Note: compiling per block]).
        tp: tensor-parallel degree: None or 1 (FSDP alone), an int, or "auto" (chosen with
            the units: See [Note: 2-D search]); ``tp_plan``: how blocks split (default: recognised).
        global_batch: sequences per optimizer step over all data-parallel ranks, fixed: the search
            chooses the micro-batch per rank and the accumulation with the plan (``.micro_batch``,
            ``.accumulation``; ``example_inputs`` then only need the model's shapes: any batch).
        pp: pipeline degree: None or 1, an int, or "auto" (See [Note: pipeline search]); applied, ``.model``
            is this rank's ``PipelineRun``, its last stage calling ``pipeline_loss_fn(output, target)``.
        cp: context-parallel degree: None or 1, an int, or "auto" (See [Note: context parallel search]);
            applied, each step runs in ``.train_context`` (See [Note: applying context parallelism]).

    Example:
        >>> from wrapopt import optimize_wrap, zoo
        >>> model, x = zoo.build("llama-7b")
        >>> res = optimize_wrap(model, x, world_size=64, gpus_per_node=8)  # doctest: +SKIP
        >>> print(res.report())  # doctest: +SKIP
    """
    in_group = dist.is_initialized()
    request, graph, given_plan = _start(model, example_inputs, world_size=world_size, gpus_per_node=gpus_per_node,
                                        loss_fn=loss_fn, plan=plan, seed=seed, trials=trials, train=train, request=dict(
                                            tp=tp, tp_plan=tp_plan, pp=pp, cp=cp, global_batch=global_batch,
                                            memory_budget=memory_budget))
    fab, compute = _profiles(fabric, compute, request=request, graph=graph, model=model,
                             measure=in_group and given_plan is None)
    result: SearchResult | None = None
    if given_plan is not None:
        job = prepare(request, model, graph=graph, fabric=fab, compute=compute)
        wplan = given_plan
    else:
        job = prepare(request, model, graph=graph, fabric=fab, compute=compute, rescale_fabric=rescale_fabric,
                      apply_device=default_device() if in_group else None)  # See [Note: knob defaults]
        search = SearchOptions(trials=DEFAULT_TRIALS if trials is None else trials, seed=seed)
        wplan, result = _plan_on_rank_0(job, search=search, save_plan=save_plan)
        train = wplan.train_config if request.global_batch is not None else train  # the micro-batch chosen
    if save_plan is not None and (not in_group or dist.get_rank() == 0):  # rank 0 writes
        wplan.save(save_plan)
    sharded = wplan.apply(model, train=train, **pipeline_kwargs(wplan.spec, example_inputs, pipeline_loss_fn)
                          ) if in_group else None
    if result is None:  # a given or received plan: score it beside the baselines, no search
        result, stated = _score_plan(job, wplan, train=train)
    else:
        stated = wplan.assumptions
    return OptimizeResult(plan=wplan, model=sharded, baselines=result.baselines, search=result, graph=graph,
                          fabric=job.fabric, compute=job.compute, assumptions=stated)


def _score_plan(job: Job, wplan: WrapPlan, *, train: TrainConfig | None) -> tuple[SearchResult, Assumptions]:
    """A plan not searched here, scored beside the baselines, and the assumptions of its score."""
    # a plan that records its micro-batch is scored at it; knobs left to a search: the plan's
    step = train.settled_by(wplan.train_config) if train is not None else wplan.train_config
    if step.compile is None:  # a plan file that does not say (older ones): applied eager, so priced eager
        step = replace(step, compile=False)
    sim = job.simulator(step, batch_scale=recorded_scale(job.graph, step, wplan.spec))
    result = score_given(job.graph, sim, wplan.spec, job.budget)
    stated = assumptions_for(job.graph, sim, wplan.spec, result.best.estimate, memory_budget=job.budget,
                             source=job.budget_source)
    return result, stated


def _start(model: nn.Module, example_inputs: Any, *, world_size: int | None, gpus_per_node: int | None,
           loss_fn: Callable[..., torch.Tensor] | None, plan: WrapPlan | str | os.PathLike | None, seed: int,
           trials: int | None, train: TrainConfig | None, request: dict[str, Any],
           ) -> tuple[ParallelRequest, ModelGraph, WrapPlan | None]:
    """The local work of optimize_wrap (the request, the trace, a given plan), then the ranks compare
    what they were given: a failure or a difference is raised on every rank before any collective (See
    [Note: every rank explains] in wrapopt/consensus.py)."""
    with every_rank("tracing the model and reading the plan"):
        check_seed(seed)
        if trials is not None:
            check_count(trials, "trials", minimum=0)
        mesh = job_mesh(world_size, gpus_per_node)
        given_plan = WrapPlan.load(plan) if isinstance(plan, (str, os.PathLike)) else plan
        step = train or (given_plan.train_config if given_plan is not None else TrainConfig())
        req = ParallelRequest(mesh=mesh, train=step, **request)
        # in the step's compute dtype: See [Note: tracing in the compute dtype] in trace/record.py
        graph = trace_model(model, example_inputs, loss_fn=loss_fn, compute_dtype=step.param_dtype)
        given_plan = WrapPlan.given(given_plan, model, graph)
    agree("starting optimize_wrap", {
        "model": model_fingerprint(model)["hash"], "example inputs": input_facts(example_inputs), "mesh": repr(mesh),
        "plan": None if given_plan is None else plan_digest(given_plan.spec), "options": repr((seed, trials, req))})
    return req, graph, given_plan


def _profiles(fabric: FabricProfile | str | os.PathLike | None, compute: ComputeProfile | str | None, *,
              request: ParallelRequest, graph: ModelGraph, model: nn.Module,
              measure: bool) -> tuple[FabricProfile | None, ComputeProfile]:
    """The fabric and compute profiles: given, stated (analytical), or, with ``measure`` (under a
    process group, searching), measured on every rank. The fabric stays None only under a process
    group with a plan given and no fabric: nothing is searched, nothing measured."""
    if isinstance(compute, str):
        compute = ComputeProfile.load(compute)
    mesh, train = request.mesh, request.train
    in_group = dist.is_initialized()
    fab = None if (fabric is None and in_group) else resolve_fabric(fabric, world_size=mesh.world_size,
                                                                    ranks_per_node=mesh.ranks_per_node)
    if compute is None and fab is not None and fab.kind == "analytical":
        compute = compute_for(fab, None, train or TrainConfig(), model_dtype(model))  # as `wrapopt search` does
    if measure:
        # with tensor parallelism asked for, its groups and split matmuls too (See [Note: tensor parallel costs]);
        # with a pipeline, its stages' groups (See [Note: pipeline fabric] in search/pipeline.py)
        tp_sizes = tp_group_sizes(request)
        groups = pp_group_sizes(request, also=tp_sizes)
        if fab is None:
            fab = measure_fabric(progress=dist.get_rank() == 0, group_sizes=groups)
        if compute is None:
            compute = with_tp_measurements(measure_compute(), graph, tp_sizes)
            compute = broadcast_json(compute.to_json(), ComputeProfile.from_json)
    if compute is None:
        compute = compute_for(fab, None, train or TrainConfig(), model_dtype(model))
    return fab, compute


def _plan_on_rank_0(job: Job, *, search: SearchOptions,
                    save_plan: str | os.PathLike | None) -> tuple[WrapPlan, SearchResult | None]:
    """Rank 0 searches (``plan_model``) and the plan travels to every rank as JSON text; the
    search's result stays on rank 0 (None elsewhere). Outside a process group: just the search."""
    in_group = dist.is_initialized()
    rank = dist.get_rank() if in_group else 0
    text: dict[str, Any] | None = None
    failure: Exception | None = None
    wplan, result = None, None
    if rank == 0:
        # A failure here must reach every rank (they wait in the broadcast), not hang them.
        try:
            if save_plan is not None:
                check_writable(save_plan)
            wplan, result = plan_model(job, search=search)
            text = {"plan": wplan.to_json()}
        except (WrapoptError, ValueError, OSError) as e:
            if not in_group:
                raise
            text, failure = {"error": type(e).__name__, "message": str(e)}, e
    if in_group:
        text = broadcast_json(text, lambda d, **_: d)
        if "error" in text:  # type: ignore[operator]
            if failure is not None:
                raise failure
            kinds = {c.__name__: c for c in (InfeasibleError, ModelError, ProfileError, PlanError)}
            raise kinds.get(text["error"], WrapoptError)(  # type: ignore[index]
                f"rank 0 could not make a plan: {text['message']}")  # type: ignore[index]
        if rank != 0:
            wplan = WrapPlan.from_json(text["plan"])  # type: ignore[index]
    return wplan, result  # type: ignore[return-value]
