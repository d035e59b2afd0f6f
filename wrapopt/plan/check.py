"""One check of a plan file against itself and against what the command knows.

[Note: one plan check] Every command that reads a plan file (``show``, ``estimate``,
``search --current``, ``export``, ``WrapPlan.apply`` and through it ``train_step``) runs the
same checks, here, and the first mismatch is one ``PlanError`` line naming the file, the field
and what to do:

1. the file against itself (``check_plan_fields``, run by ``read_plan_fields`` on every load,
   so no reader can skip it): every module the units and pipeline stages name is a module of
   the model the file records (``model.module_classes``; files written before classes were
   recorded skip this), no module is listed twice, the units are legal (``check_units``:
   root last, no unit nesting its own modules, ``reshard_after_forward`` dividing the shard
   group), and the recorded batch split multiplies out to the recorded global batch:
   ``train.micro_batch x train.grad_accumulation x pipeline.microbatches (1 without a
   pipeline) x mesh data-parallel ranks == train.global_batch`` ([Note: global batch search]
   in search/batch.py, [Note: pipeline global batch] in search/pipeline_batch.py). A split
   edited by hand would otherwise be trained on (``train_step`` takes its accumulation) and
   priced at a batch the file does not state;
2. the file against the command (``check_plan``): the live model's fingerprint
   (``WrapPlan.check_model``), its traced graph (``validate_plan``: tied parameters and
   parameter users in one unit), and the world size and ranks per node the command was
   given. A different global batch is not refused: ``estimate --global-batch`` and
   ``--current`` choose the split again at the batch given. With a live model, its
   fingerprint is compared first and its module names replace the recorded ones in step 1,
   so the message names what differs from the model at hand (``PlanMismatchError``), and
   ``apply(strict=False)`` still applies a plan by the live model's names.
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from wrapopt.errors import PlanError, PlanMismatchError
from wrapopt.spec import ROOT, ModelGraph, PlanSpec
from wrapopt.train import TrainConfig
from wrapopt.units import check_units, validate_plan

__all__ = ["check_plan_fields", "check_plan"]


def check_plan_fields(spec: PlanSpec, model: dict[str, Any], train: TrainConfig | None, *, source: str,
                      names: bool = True) -> None:
    """The checks a plan file passes on its own (See [Note: one plan check], step 1);
    ``PlanError`` naming ``source`` (the file; "" for a plan made in memory) and the field.
    ``names=False``: the module names are left to a live model's check (``check_plan``)."""
    recorded = model.get("module_classes") if names else None
    known = ({m for mods in recorded.values() if isinstance(mods, list) for m in mods}
             if isinstance(recorded, dict) else None)
    if known is not None:
        known.add(ROOT)
    where = source or "the plan"
    if known is not None:
        for i, u in enumerate(spec.units):
            for m in u.modules:
                if m not in known:
                    raise PlanError(f"{where}: field 'units[{i}].modules' names {m!r}, which the model the file "
                                    f"records ({model.get('class')}, field 'model.module_classes') does not have; "
                                    "fix the name or drop it, or re-run `wrapopt search` for this model")
        for s, stage in enumerate(spec.pipeline.stages if spec.pipeline is not None else ()):
            for m in stage:
                if m not in known:
                    raise PlanError(f"{where}: field 'pipeline.stages[{s}]' names {m!r}, which the model the file "
                                    f"records ({model.get('class')}) does not have; fix the name or drop it")
    try:  # a module listed twice, nested in its own unit, the root not last: the message estimate gives
        check_units(spec, known if known is not None else _AnyName(), ())
    except PlanError as e:
        if not source:
            raise
        raise PlanError(f"{source}: field 'units': {e}") from None
    if train is not None:
        _check_batch(spec, train, where)


def _check_batch(spec: PlanSpec, train: TrainConfig, source: str) -> None:
    """The recorded split multiplies out to the recorded global batch (See [Note: one plan check])."""
    if train.global_batch is None:
        return
    dp, k = spec.mesh.batch_size, train.grad_accumulation  # the ranks that read sequences (dp / cp)
    m = spec.pipeline.microbatches if spec.pipeline is not None else 1
    pipe = f" x pipeline.microbatches {m}" if spec.pipeline is not None else ""
    if train.micro_batch is None:
        if train.global_batch % (k * m * dp) == 0:
            return
        raise PlanError(f"{source}: field 'train.global_batch' is {train.global_batch}, not a multiple of "
                        f"train.grad_accumulation {k}{pipe} x {dp} data-parallel ranks (field 'mesh'); correct it, "
                        f"or re-run `wrapopt search --global-batch N`")
    got = train.micro_batch * k * m * dp
    if got != train.global_batch:
        raise PlanError(f"{source}: field 'train.global_batch' is {train.global_batch}, but train.micro_batch "
                        f"{train.micro_batch} x train.grad_accumulation {k}{pipe} x {dp} data-parallel ranks "
                        f"(field 'mesh') is {got}; correct the split, or re-run `wrapopt search --global-batch "
                        f"{train.global_batch}` for this mesh")


class _AnyName:
    """Every module name: for plan files that do not record the model's modules."""

    def __contains__(self, name: object) -> bool:
        return True


def check_plan(plan: Any, *, model: nn.Module | None = None, strict: bool = True, graph: ModelGraph | None = None,
               world_size: int | None = None, ranks_per_node: int | None = None,
               given: str = "--world-size") -> None:
    """Check ``plan`` (a ``WrapPlan``; this module sits below plan/file.py) against itself and what
    the command knows (See [Note: one plan check]); the first mismatch raises one ``PlanError``
    line naming the plan's file and the field.

    Args:
        model: the live model: its parameters and the modules the units name must be the plan's
            (``PlanMismatchError``); it is checked first, and its module names stand in for those
            the file records.
        strict: False (``apply(strict=False)``): ``model``'s fingerprint is not compared; the
            names are then checked against it by ``apply_plan``.
        graph: its trace: tied parameters and parameter users must share a unit.
        world_size, ranks_per_node: the mesh the command runs or prices (None: not known).
        given: what set ``world_size`` in messages ("--world-size", "this job").

    Example:
        >>> check_plan(WrapPlan.load("plan.json"), model=model, world_size=8)  # doctest: +SKIP
    """
    source = plan.source or "the plan"
    try:
        if model is not None and strict:
            plan.check_model(model)
    except PlanMismatchError as e:
        raise PlanMismatchError(f"{plan.source}: {e}" if plan.source else str(e)) from None
    check_plan_fields(plan.spec, plan.model, plan.train, source=plan.source, names=model is None)
    mesh = plan.spec.mesh
    if world_size is not None and world_size != mesh.world_size:
        raise PlanError(f"{source}: field 'mesh.world_size' is {mesh.world_size}, but {given} is {world_size}; "
                        f"re-run `wrapopt search --world-size {world_size}` for this mesh, or give "
                        f"{mesh.world_size} ranks")
    # a world below its node is one partial node (``default_mesh``): 2 ranks at --gpus-per-node 8 are 2 per node
    if ranks_per_node is not None and min(ranks_per_node, mesh.world_size) != mesh.ranks_per_node:
        raise PlanError(f"{source}: field 'mesh.ranks_per_node' is {mesh.ranks_per_node}, but --gpus-per-node is "
                        f"{ranks_per_node}; re-run `wrapopt search --gpus-per-node {ranks_per_node}`, or pass "
                        f"--gpus-per-node {mesh.ranks_per_node}")
    try:
        if graph is not None:
            validate_plan(graph, plan.spec)
    except PlanError as e:
        if not plan.source:  # a plan made in memory: the message estimate and apply give
            raise
        raise PlanError(f"{plan.source}: field 'units': {e}") from None
