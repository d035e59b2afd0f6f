"""``estimate`` (re-exported by ``wrapopt.api``): one training step of a plan the user already has, predicted.

The same stages as ``optimize_wrap`` (``wrapopt.api``) wire here for one given plan, with no
search: trace and profile (``job.prepare``), the plan at the mesh (``search.given``), the
pipeline, batch split, context degree and knobs as the search would settle them, then the
simulator's step and ``report.estimate``'s FLOPs and MFU.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any, Callable

import torch
import torch.nn as nn

from wrapopt.errors import OptionError
from wrapopt.hardware.profiles import ComputeProfile, FabricProfile
from wrapopt.hardware.resolve import partial_node_note
from wrapopt.job import Job, default_mesh, prepare
from wrapopt.plan.check import check_plan
from wrapopt.plan.file import WrapPlan
from wrapopt.report.batch import batch_lines
from wrapopt.report.estimate import EstimateReport, step_work
from wrapopt.search.batch import recorded_scale, score_splits, train_for
from wrapopt.search.axes import given_axes
from wrapopt.search.given import CHECKPOINTS, given_spec
from wrapopt.search.pipeline import pipeline_estimate
from wrapopt.spec import MeshSpec, ParallelRequest
from wrapopt.train import TrainConfig, model_dtype


def estimate(
    model: nn.Module,
    example_inputs: tuple[Any, ...] | Any,
    *,
    plan: str | os.PathLike | WrapPlan = "per-block",
    world_size: int | None = None,
    gpus_per_node: int | None = None,
    fabric: FabricProfile | str | os.PathLike | None = None,
    compute: ComputeProfile | str | None = None,
    train: TrainConfig | None = None,
    checkpoint: str | None = None,
    memory_budget: int | float | str | None = None,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    rescale_fabric: bool = False,
    name: str = "",
    global_batch: int | None = None,
    pp: int | str | None = None,
    tp: int = 1,
    cp: int | str = 1, ep: int | str = 1,
) -> EstimateReport:
    """Predict one training step of a plan the user already has: time, throughput, MFU, memory.

    Args:
        model: the model (meta device is fine) and ``example_inputs``, one micro-batch per rank.
        plan: a baseline name (``per-block``, ``size-1e8``, ``no-shard``, ``every-leaf``,
            ``root-only``), a plan file or a ``WrapPlan``.
        world_size, gpus_per_node: the mesh (default: the plan file's, else 8 ranks on one node).
        train: the training step (default: the plan file's, else fp32, one micro-batch, AdamW).
        checkpoint: every unit but the root ``"blocks"`` (or ``"full"``), ``"selective-op"`` or
            ``"none"``; None keeps the plan's choice.
        memory_budget: as for ``optimize_wrap`` (default: 90% of the device when known).
        global_batch: sequences per optimizer step: the plan is scored at every micro-batch x
            accumulation split of it and the fastest that fits is reported (without it, a plan
            file that records its micro-batch is scored at it).
        pp: put a one-unit-per-block plan on a pipeline of this degree (an int, or "auto": the
            fastest), its stages, schedule and micro-batches chosen as the search does.
        tp: a named baseline's tensor-parallel degree ([Note: a given plan at a degree] in search/given.py).
        cp, ep: the context- and expert-parallel degrees (an int, or "auto"), as for ``optimize_wrap``.

    Example:
        >>> from wrapopt import zoo
        >>> from wrapopt.train import TrainConfig
        >>> model, x = zoo.build("gpt-tiny", "meta")
        >>> r = estimate(model, x, plan="per-block", world_size=8, train=TrainConfig.preset("bf16"))
        >>> r.step_s > 0 and 0 < r.mfu < 1
        True
    """
    from_plan = train is None
    given, mesh, train, notes = _plan_to_estimate(plan, model, world_size=world_size, gpus_per_node=gpus_per_node,
                                                  train=train, global_batch=global_batch)
    if global_batch is not None and from_plan and train is not None:  # the split is chosen again
        train = replace(train, micro_batch=None, global_batch=None, grad_accumulation=1)
    train = _scored_step(given, train or TrainConfig())
    if checkpoint is not None and checkpoint not in CHECKPOINTS:
        raise OptionError(f"unknown --checkpoint {checkpoint!r}; accepted: {', '.join(CHECKPOINTS)}")
    world = MeshSpec(world_size=mesh.world_size, ranks_per_node=mesh.ranks_per_node, shard_size=mesh.world_size)
    request = ParallelRequest(mesh=world, tp=tp, pp=pp, cp=cp, ep=ep, global_batch=global_batch,
                              memory_budget=memory_budget, train=train)
    job = prepare(request, model, example_inputs, fabric=fabric, compute=compute, loss_fn=loss_fn,
                  rescale_fabric=rescale_fabric, notes=tuple(notes))
    spec, sim, train, notes = _scored(job, given, mesh, checkpoint, global_batch)
    graph, fab, comp, budget = job.graph, job.fabric, job.compute, job.budget
    est = sim.simulate(spec)
    if train.grad_accumulation > 1:
        train = train.with_sync(est.accumulation_sync)
    work = step_work(model, example_inputs, graph, comp, accumulation=train.grad_accumulation,
                     batch_scale=sim.options.batch_scale / spec.mesh.cp_size,  # a cp rank's share of a sequence
                     compute_dtype=train.compute_dtype(model_dtype(model)), float8=train.float8)
    return EstimateReport(model=name or type(model).__name__, plan_label=spec.label or "plan",
                          num_units=len(spec.units), mesh=spec.mesh, train=train, fabric=fab.label,
                          compute=f"{comp.device} ({comp.kind})",
                          estimate=est, flops=work.flops, peak_flops_per_s=work.peak_flops_per_s,
                          peak_source=work.peak_source, memory_budget=budget, notes=tuple(notes),
                          model_dtype=model_dtype(model), budget_note=job.budget_note,
                          pipeline_microbatches=spec.pipeline.microbatches if spec.pipeline is not None else None)


def _scored(job: Job, given: WrapPlan | Any, mesh: MeshSpec, checkpoint: str | None, global_batch: int | None,
            ) -> tuple[Any, Any, TrainConfig, list[str]]:
    """The given plan at the job's mesh and context and expert degrees, its simulator, its step (the knobs,
    pipeline and batch split settled as the search would) and the notes that say how."""
    graph, budget, notes = job.graph, job.budget, [*job.notes, *job.knobs]
    request, train = job.request, job.train  # its compile settled: See [Note: knob defaults] in search/knobs.py
    spec = given_axes(graph, given_spec(given, graph, mesh, checkpoint, request=request), request)
    sim = job.simulator(train, batch_scale=recorded_scale(graph, train, spec))
    spec, sim, train, pp_notes = pipeline_estimate(graph, sim, spec, request, memory_budget=budget)
    notes += pp_notes
    if global_batch is not None and spec.pipeline is None:
        split, sim, rows = score_splits(graph, sim, spec, request, memory_budget=budget)
        train = train_for(train, split)
        notes += batch_lines(rows, split)
    return spec, sim, train, notes


def _scored_step(given: WrapPlan | Any, train: TrainConfig) -> TrainConfig:
    """The step ``estimate`` scores: ``float8`` "auto" refused (a search settles it); a plan file's
    compile as the plan applies (unsaid, as in older files: eager). See [Note: knob defaults]."""
    train.check_scorable()
    if isinstance(given, WrapPlan) and train.compile is None:
        return replace(train, compile=bool(given.train_config.compile))
    return train


def _plan_to_estimate(plan: str | os.PathLike | WrapPlan, model: nn.Module, *, world_size: int | None,
                      gpus_per_node: int | None, train: TrainConfig | None, global_batch: int | None = None,
                      ) -> tuple[WrapPlan | Any, MeshSpec, TrainConfig | None, list[str]]:
    """The plan (a loaded ``WrapPlan``, else a baseline's name), its mesh, the training step
    (the one given, else the plan file's) and notes."""
    given = WrapPlan.load(plan) if isinstance(plan, (str, os.PathLike)) and os.path.exists(os.fspath(plan)) else plan
    if not isinstance(given, WrapPlan):
        note = partial_node_note(world_size, gpus_per_node)  # a note, not an error: See its docstring
        return given, default_mesh(world_size=world_size, gpus_per_node=gpus_per_node), train, [note] if note else []
    check_plan(given, model=model, world_size=world_size, ranks_per_node=gpus_per_node)  # [Note: one plan check]
    notes = []
    differ = given.train_config.differences(train) if train is not None and given.train is not None else []
    if global_batch is not None and given.train_config.global_batch not in (None, global_batch):
        # another global batch is split again: the split is chosen, not given
        differ = [d for d in differ if not d.startswith(("grad_accumulation ", "micro_batch ", "global_batch "))]
        differ.append(f"global_batch ({given.train_config.global_batch} in the plan, {global_batch} given: "
                      "split again)")
    if differ:
        notes.append("the plan was scored for another training step (" + "; ".join(differ)
                     + "); estimated for the one given")
    return given, given.mesh, train or given.train_config, notes
