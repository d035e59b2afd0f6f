"""The plan ``wrapopt estimate`` scores: a baseline by name or a plan file's, at a tensor-parallel
degree and with a checkpointing choice.

[Note: a given plan at a degree] ``estimate --tp N`` scores the named baseline as the search
scores its 2-D plans (See [Note: 2-D search] in search/tp.py): built on the data-parallel mesh
(``world / N`` ranks, FSDP over them), split by the TP plan wrapopt recognises in the model
(``tp.builtin_tp_plan``; a model it cannot split is refused naming the block) with the request's
sequence-parallel and loss-parallel switches (on by default, as TorchTitan's TP plan) and async
TP where asked, and lifted onto the whole mesh. A plan file brings its own degree; ``--tp`` then
must say the same, and so must ``--pp`` for a plan file with pipeline stages (a plan without stages
is put on a pipeline as a baseline is). ``--checkpoint`` sets every unit but the root: ``blocks`` (or ``full``)
checkpointed whole, ``selective-op`` keeping the matmul and attention outputs and recomputing the
rest (the search's selective-op mode), ``none`` not at all.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from wrapopt.errors import OptionError, PlanError
from wrapopt.search.baselines import baselines
from wrapopt.search.tp import dp_mesh, lift_plan, request_spec
from wrapopt.spec import SELECTIVE_OP, MeshSpec, ModelGraph, ParallelRequest, PlanSpec
from wrapopt.tp import check_tp
from wrapopt.units import validate_plan

__all__ = ["CHECKPOINTS", "given_spec"]

# --checkpoint's words -> UnitSpec.checkpoint for every unit but the root
CHECKPOINTS = {"none": False, "blocks": True, "full": True, SELECTIVE_OP: SELECTIVE_OP}


def given_spec(given: Any, graph: ModelGraph, mesh: MeshSpec, checkpoint: str | None, *,
               request: ParallelRequest | None = None) -> PlanSpec:
    """The plan's spec (``given``: a loaded ``WrapPlan``'s ``spec`` attribute, or a baseline's
    name built on ``mesh``, the whole mesh without tensor parallelism) at the request's
    tensor-parallel degree with ``checkpoint`` applied (None: as the plan says); validated. See
    [Note: a given plan at a degree]."""
    tp = request.tp if request is not None else 1
    if checkpoint is not None and checkpoint not in CHECKPOINTS:
        raise OptionError(f"unknown --checkpoint {checkpoint!r}; accepted: {', '.join(CHECKPOINTS)}")
    if isinstance(given, str):
        dp = dp_mesh(mesh, tp) if tp > 1 else mesh
        base = baselines(graph, dp)
        if given not in base:
            raise OptionError(f"unknown --plan {given!r}; accepted: {', '.join(base)}, or a plan file (plan.json)")
        spec = base[given]
        if tp > 1:
            if spec.mesh.shard_size == 1:
                raise OptionError(f"--plan {given} --tp {tp}: a plan that does not shard has no data-parallel mesh "
                                  "to put under tensor parallelism; use per-block or size-1e8")
            split = request_spec(graph, request)  # async only where asked outright: a plan the user runs
            check_tp(graph, split, tp)
            spec = lift_plan(spec, tp, split)
    else:
        spec = given.spec
        if tp > 1 and spec.mesh.tp_size != tp:
            raise PlanError(f"the plan file is for tensor-parallel degree {spec.mesh.tp_size}, --tp says {tp}; "
                            "re-run the search with --tp, or drop --tp")
        pp = request.pp if request is not None else 1
        if spec.pipeline is not None and pp != 1 and pp != spec.mesh.pp_size:
            raise PlanError(f"{getattr(given, 'source', '') or 'the plan file'} is a pipeline of degree "
                            f"{spec.mesh.pp_size} (its own stages, schedule and micro-batches), --pp says {pp}; "
                            f"drop --pp, or re-run the search with --pp {pp}")
    if checkpoint is not None:
        ck = CHECKPOINTS[checkpoint]
        spec = replace(spec, units=tuple(u if u.is_root else replace(u, checkpoint=ck) for u in spec.units))
    validate_plan(graph, spec)
    return spec

