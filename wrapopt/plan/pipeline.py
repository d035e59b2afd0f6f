"""A pipeline plan (``PlanSpec.pipeline``, ``mesh.pp_size > 1``) applied to a live model: the
stages split off with ``torch.distributed.pipelining``, each sharded with FSDP2 on its
data-parallel ranks, the tied parameters' gradients summed across stages, and the schedule.

See [Note: applying a pipeline plan] below; the checks of the stages against the model are in
``plan/stages.py``.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from wrapopt.consensus import agree, every_rank, input_facts
from wrapopt.errors import PlanError
from wrapopt.fingerprint import model_fingerprint
from wrapopt.launch import device_type
from wrapopt.plan.apply import (
    build_mesh,
    known_param_users,
    mixed_precision_policy,
    plan_digest,
    set_forward_prefetch,
    tied_groups,
)
from wrapopt.plan.stages import StageLayout, stage_layout
from wrapopt.plan.tp import data_parallel_mesh
from wrapopt.selective import apply_checkpoints, check_selective_precision
from wrapopt.spec import PlanSpec
from wrapopt.units import check_units, user_conflict_message, user_conflicts
from wrapopt.wrapped import check_unwrapped

__all__ = ["PipelineRun", "apply_pipeline", "one_microbatch", "pipeline_kwargs"]


def pipeline_kwargs(spec: PlanSpec, inputs: Any, loss_fn: Callable[[Any, Any], torch.Tensor] | None) -> dict[str, Any]:
    """What ``WrapPlan.apply`` needs beside the model for a pipeline plan, from a whole per-rank batch
    (none for a plan without one): See [Note: applying a pipeline plan]."""
    if spec.pipeline is None:
        return {}
    return {"example_inputs": one_microbatch(inputs, spec.pipeline.microbatches), "loss_fn": loss_fn}


def one_microbatch(inputs: Any, microbatches: int) -> tuple[Any, ...]:
    """The first micro-batch of a whole batch of positional inputs (each tensor's first dimension
    split ``microbatches`` ways, as the schedule splits it); what the pipeline split traces with."""
    args = inputs if isinstance(inputs, (tuple, list)) else (inputs,)
    out = []
    for a in args:
        if isinstance(a, torch.Tensor) and a.dim() > 0:
            if a.shape[0] % microbatches:
                raise PlanError(f"a batch of {a.shape[0]} does not split into the plan's {microbatches} micro-batches; "
                                f"give a batch that is a multiple of {microbatches}")
            a = a[: a.shape[0] // microbatches]
        out.append(a)
    return tuple(out)

# [Note: applying a pipeline plan]
# A plan with ``mesh.pp_size > 1`` runs on a ``pp x replicate x shard`` DeviceMesh (pp outermost,
# ``MeshSpec.axis_names``); pipeline rank r holds stages r, r + pp, ... (looped placement, as
# torch's interleaved schedules expect). ``apply_pipeline`` works in this order:
# 1. every check, on every rank, before any collective (``every_rank``): the stages against the
#    model (``plan/stages.py``: one block chain, whole blocks in execution order, embeddings on
#    the first stage, the head on the last; t5's encoder + decoder chains are refused), the units
#    (none across two stages), the schedule against the stages per rank; then ``agree`` on the
#    model, the plan, the mixed precision and the example micro-batch's shapes;
# 2. the split, with ``torch.distributed.pipelining.pipeline(model, mb_args, split_spec=
#    {first module of stage s: SplitPoint.BEGINNING for s >= 1})``: torch.export traces the model
#    once and cuts its graph, so any model whose forward runs the pieces in registration order
#    splits without being rewritten (the manual ``PipelineStage`` route, as TorchTitan takes it,
#    needs a forward that skips the modules a stage dropped, which the zoo's and Hugging Face's
#    models do not have). The stage modules keep the model's module names (``layers.3.mlp``), so
#    the plan's units find their modules. Each rank traces the whole model and keeps its stages;
#    the rest is garbage once the ``Pipe`` goes. The model's own parameters move into the stage
#    modules (most are the same objects): do not use the model afterwards;
# 3. per stage on this rank: checkpointing and ``fully_shard`` of the plan's units inside it, then
#    ``fully_shard`` of the stage module as its root (the root unit's choices), on the stage's
#    data-parallel sub-mesh (the mesh without "pp"), with the plan's reshard_after_forward (TorchTitan
#    turns resharding off under pipelining; here the plan decides) and mixed precision; then
#    ``pipe.build_stage(s, device, group=mesh["pp"]'s group)``. Torch's stage runs FSDP's reduction
#    once per step: every micro-batch but the last backward runs without gradient sync and
#    without resharding, and ``perform_reduce_grad`` reduces and scales by 1 / micro-batches
#    (``scale_grads``), so a mean loss per micro-batch gives the mean over the batch;
# 4. tied parameters (gpt-tiny's ``wte.weight`` = ``lm_head.weight``): torch 2.13's ``pipeline()``
#    gives each stage that uses one its own copy (``multi_use_param_spec`` REPLICATE; the stage
#    that does not call a tied module still holds it, uncalled, which is dropped here) and does
#    nothing about their gradients ("investigate gradient sync for shared parameters" is a TODO in
#    ``pipelining/_IR.py``). So, as Megatron does for its word embeddings, after each step's
#    backward the copies' gradients are summed: the local shards of all the copies on this rank,
#    then an all-reduce over the pipeline ranks holding a copy at this rank's data-parallel
#    position (``mesh["pp"]``'s group when every pipeline rank holds one, else a group of those
#    ranks). Every copy then steps with the gradient of the tied parameter, and starting equal they
#    stay equal (without the sum each copy steps with its own stage's share and they drift apart).
#    ``PipelineRun.step`` does this; a caller that runs
#    ``schedule.step`` itself calls ``PipelineRun.sync_tied_grads()`` before the optimizer step;
# 5. the schedule (``ScheduleGPipe``, ``Schedule1F1B`` or ``ScheduleInterleaved1F1B``) with the
#    plan's micro-batches and ``loss_fn(output, target)``, torch's loss signature.
#    The stage modules run as generated code, not node by node: See [Note: stage modules as code].
# Not yet: pipeline and tensor parallelism together (the stage modules are ``InterpreterModule``s,
# not the block classes a TP plan names), and models with parameters on the root itself.


# [Note: stage modules as code] ``pipeline()`` unflattens the exported graph into
# ``InterpreterModule``s, which torch 2.13 runs through ``torch.fx.Interpreter``, one Python call per
# node, unless their ``_run_with_interpreter`` is off (what torch does itself under dynamo, and
# what ``torch.export.unflatten._disable_interpreter`` sets): then the same graph runs as the
# ``GraphModule``'s generated code. The ops, and so the results, are the same; the host work per op
# is not: the interpreter's Python call per node can cost more than a small block's kernels, so an
# interpreted stage would run well above the module times the plan was priced with. ``_as_code``
# turns it off on every such module of a stage (a torch without the attribute runs them as it does).
def _as_code(module: nn.Module) -> None:
    """Run ``module``'s ``InterpreterModule``s as generated code."""
    for sub in module.modules():
        if getattr(sub, "_run_with_interpreter", False):
            sub._run_with_interpreter = False


# [Note: the last stage's outputs] torch's schedule ``step`` keeps the last stage's output of every
# micro-batch (``PipelineStage.output_chunks``) to concatenate and return them when the step ends,
# unless ``return_outputs=False`` (torch 2.7+), and clears them only when the next step starts.
# ``PipelineRun.step`` returns the loss only, so it asks for no outputs. Kept, a step ends holding m
# micro-batches' logits on the last stage into the optimizer step and the next forward: memory the
# cost model does not price, which a tracker counting one step's allocations sees freed inside the
# next step (reading that step's peak low). A torch without the argument keeps them.
@functools.cache
def _return_outputs() -> bool:
    """Whether torch's schedule ``step`` takes ``return_outputs``: read at the first step, not at
    import (See [Note: torch's schedules read late] in cost/pipeline_schedule.py)."""
    from torch.distributed.pipelining import schedules

    return "return_outputs" in inspect.signature(schedules.PipelineScheduleSingle.step).parameters


@dataclass(frozen=True)
class PipelineRun:
    """This rank's part of a pipelined model: its stages, their modules and the schedule.

    ``step(inputs, target)`` runs one schedule step (the first stage feeds ``inputs``, the last
    computes the loss against ``target``), sums the tied parameters' gradients across stages
    and returns the mean loss of the micro-batches on the last stage (None on other ranks).
    The optimizer steps ``parameters()``.
    """

    schedule: Any  # a torch.distributed.pipelining schedule
    stages: tuple[Any, ...]  # this rank's PipelineStage objects
    modules: tuple[nn.Module, ...]  # their stage modules (FSDP-sharded), in stage order
    stage_indices: tuple[int, ...]
    is_first: bool
    is_last: bool
    # (local copies of one tied parameter on this rank, the process group summing them, or None)
    tied: tuple[tuple[tuple[nn.Parameter, ...], Any], ...] = field(default=())
    # The batch one step takes (micro-batches x the traced micro-batch's first dimension); 0: unchecked.
    batch: int = 0

    def parameters(self) -> Iterator[nn.Parameter]:
        for m in self.modules:
            yield from m.parameters()

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """Each stage module's parameters, under the model's names (a tied copy under its own)."""
        for m in self.modules:
            yield from m.named_parameters()

    def step(self, inputs: Sequence[Any], target: Any = None) -> torch.Tensor | None:
        """One training step of this rank's stages (the optimizer step is the caller's): the first
        stage takes ``inputs``, the last ``target``; returns the last stage's mean loss, else None."""
        given = inputs[0] if self.is_first and inputs else target if self.is_last else None
        if self.batch and isinstance(given, torch.Tensor) and given.shape[0] != self.batch:
            raise PlanError(f"this pipeline was split for batches of {self.batch} (micro-batches x the example "
                            f"micro-batch), but step got {given.shape[0]}; pass the batch the plan was made for")
        losses: list[torch.Tensor] = []
        kwargs: dict[str, Any] = {"target": target, "losses": losses} if self.is_last else {}
        if _return_outputs():  # See [Note: the last stage's outputs]
            kwargs["return_outputs"] = False
        if self.is_first:
            self.schedule.step(*inputs, **kwargs)
        else:
            self.schedule.step(**kwargs)
        self.sync_tied_grads()
        return torch.stack([x.detach() for x in losses]).mean() if self.is_last else None

    @torch.no_grad()
    def sync_tied_grads(self) -> None:
        """Sum each tied parameter's gradients over its copies, on this rank and across the stages
        holding one (See [Note: applying a pipeline plan], 4.)."""
        for copies, group in self.tied:
            grads = [_local(p.grad) if p.grad is not None else torch.zeros_like(_local(p)) for p in copies]
            total = torch.stack(grads).sum(0) if len(grads) > 1 else grads[0].clone()
            if group is not None:
                dist.all_reduce(total, group=group)
            for p in copies:
                if p.grad is None:
                    p.grad = _like(p, torch.zeros_like(_local(p)))
                _local(p.grad).copy_(total)


def _local(t: Any) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _like(p: Any, local: torch.Tensor) -> Any:
    if hasattr(p, "to_local"):
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
    return local


def _check(model: nn.Module, spec: PlanSpec, mesh: Any, param_users: Iterable[Sequence[str]] | None,
           example_inputs: Any, loss_fn: Any) -> StageLayout:
    if example_inputs is None or loss_fn is None:
        missing = " and ".join(n for n, v in (("example_inputs", example_inputs), ("loss_fn", loss_fn)) if v is None)
        raise PlanError(f"a pipeline plan needs {missing}: pass example_inputs= (one micro-batch of the model's "
                        "positional inputs, a tuple) and loss_fn= (loss_fn(output, target), as torch's schedules "
                        "call it)")
    check_unwrapped(model, "apply", error=PlanError)
    for name, degree in (("cp_size", spec.mesh.cp_size), ("ep_size", spec.mesh.ep_size)):
        if degree > 1:  # the stages are torch.export'd graphs: neither torch's ring nor plan/ep.py's dispatch is
            # checked inside them (See [Note: applying a pipeline plan])
            raise PlanError(f"this pipeline plan has mesh.{name} {degree}: wrapopt does not apply "
                            f"{'context' if name == 'cp_size' else 'expert'} parallelism inside a pipeline (its "
                            "stages are torch.export graphs); run it with TorchTitan (wrapopt export --to torchtitan), "
                            "or search with --pp 1")
    layout = stage_layout(model, spec)
    modules = dict(model.named_modules())
    # Tied parameters split over stages become copies (See [Note: applying a pipeline plan], 4.);
    # inside one stage they must share a unit, as without pipelining.
    within = [g for g in tied_groups(model) if len({layout.stage_of(n.rsplit(".", 1)[0]) for n in g}) == 1]
    check_units(spec, modules, within)
    pairs = dict.fromkeys([*((p[0], p[1]) for p in param_users or ()), *known_param_users(model)])
    conflicts = user_conflicts([p for p in pairs if p[0] in modules and p[1] in modules], spec.units)
    if conflicts:
        raise PlanError(user_conflict_message(conflicts[0], spec.units))
    if mesh is not None:
        names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
        if tuple(mesh.shape) != spec.mesh.shape or names != spec.mesh.axis_names:
            raise PlanError(f"the mesh passed has shape {tuple(mesh.shape)} and axes {names or 'without names'}, but "
                            f"the pipeline plan needs {spec.mesh.shape} with axes {spec.mesh.axis_names}; build it "
                            "with init_device_mesh(..., mesh_dim_names=...) or pass mesh=None")
    dev = getattr(mesh, "device_type", None) or device_type()
    if spec.offload and dev != "cuda":
        raise PlanError(f"this plan offloads to host memory (FSDP2 CPUOffloadPolicy), which needs GPU ranks; these "
                        f"ranks run on {dev}: apply a plan searched without offload (drop --offload)")
    return layout


def apply_pipeline(
    model: nn.Module,
    spec: PlanSpec,
    *,
    example_inputs: Sequence[Any] | None,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None,
    mesh: Any = None,
    mixed_precision: dict[str, str | None] | None = None,
    param_users: Iterable[Sequence[str]] | None = (),
) -> PipelineRun:
    """Split ``model`` into the plan's pipeline stages, shard this rank's stages with FSDP2 and
    build the schedule; see [Note: applying a pipeline plan].

    ``example_inputs`` is one micro-batch of the model's positional inputs (what the split traces
    with); ``loss_fn(output, target)`` is called on the last stage per micro-batch.

    Example:
        >>> run = apply_pipeline(model, plan.spec, example_inputs=(x[:2],), loss_fn=loss)  # doctest: +SKIP
        >>> loss = run.step((x,), target=y)  # doctest: +SKIP
    """
    with every_rank("checking the pipeline plan against the model"):  # See [Note: every rank explains]
        layout = _check(model, spec, mesh, param_users, example_inputs, loss_fn)
        check_selective_precision(spec, mixed_precision_policy(mixed_precision))
    agree("applying the pipeline plan", {"model": model_fingerprint(model)["hash"], "plan": plan_digest(spec),
                                         "mixed_precision": mixed_precision or {},
                                         "example_inputs": input_facts(tuple(example_inputs))})
    with every_rank("splitting the model into pipeline stages"):
        pipe = _split(model, layout, tuple(example_inputs))
    if mesh is None:
        mesh = build_mesh(spec)
    pp_mesh, dp_mesh = mesh["pp"], data_parallel_mesh(mesh, spec.mesh)
    pp, pp_rank = spec.mesh.pp_size, pp_mesh.get_local_rank()
    assert spec.pipeline is not None
    mine = tuple(range(pp_rank, len(spec.pipeline.stages), pp))
    with every_rank("fitting the split to the plan's stages"):
        modules = tuple(_stage_module(pipe, s, layout) for s in mine)
        _untie_local(modules)
    copies = _tied_copies(model_tied := tied_groups(model), modules)
    for s, module in zip(mine, modules):
        _shard_stage(module, s, spec, layout, dp_mesh, mixed_precision)
    dev = torch.device(device_type(), torch.cuda.current_device()) if device_type() == "cuda" else torch.device("cpu")
    stages = tuple(pipe.build_stage(s, dev, group=pp_mesh.get_group()) for s in mine)
    tied = _tied_groups_across(model_tied, copies, spec, layout, mesh, pp_rank)
    return PipelineRun(schedule=_schedule(spec, stages, loss_fn), stages=stages, modules=modules, stage_indices=mine,
                       is_first=0 in mine, is_last=len(spec.pipeline.stages) - 1 in mine, tied=tied,
                       batch=_batch_of(example_inputs) * spec.pipeline.microbatches)


def _batch_of(inputs: Sequence[Any]) -> int:
    first = next((a for a in inputs if isinstance(a, torch.Tensor) and a.dim() > 0), None)
    return 0 if first is None else int(first.shape[0])


def _split(model: nn.Module, layout: StageLayout, example_inputs: tuple[Any, ...]) -> Any:
    """``pipeline()`` at the layout's split points; the model's split markers are taken off after."""
    from torch.distributed.pipelining import SplitPoint, pipeline

    try:
        return pipeline(model, mb_args=example_inputs, split_spec={p: SplitPoint.BEGINNING
                                                                   for p in layout.split_points})
    except Exception as e:  # noqa: BLE001 (torch.export raises many kinds; each is named)
        raise PlanError(f"torch.distributed.pipelining could not split {type(model).__name__} at "
                        f"{', '.join(layout.split_points)}: {type(e).__name__}: {str(e).splitlines()[0][:300]}; "
                        "the model must export with torch.export (no data-dependent control flow)") from e
    finally:
        for p in layout.split_points:
            m = model.get_submodule(p)
            m.__dict__.pop("forward", None)
            m.__dict__.pop("_orig_forward", None)


def _stage_module(pipe: Any, s: int, layout: StageLayout) -> nn.Module:
    """Stage ``s``'s module, without the modules of other stages it holds but never calls (a tied
    parameter's owner), checked against the plan: the split must give each stage its pieces."""
    module = pipe.get_stage_module(s)
    called = {n.target for n in module.graph.nodes if n.op == "call_module"}
    for piece, t in layout.piece_stage.items():
        if t == s:
            if piece not in called:
                raise PlanError(f"the split does not run {piece!r} on pipeline stage {s} as the plan says (the "
                                "model runs its modules in another order than it registers them); list the stages "
                                "in the order the forward runs them")
            continue
        if piece in called:
            raise PlanError(f"the split runs {piece!r} on pipeline stage {s}, but the plan puts it on stage {t} (the "
                            "model runs its modules in another order than it registers them); list the stages in the "
                            "order the forward runs them")
        parent, _, leaf = piece.rpartition(".")
        try:
            holder = module.get_submodule(parent) if parent else module
        except AttributeError:
            continue
        if leaf in holder._modules:
            delattr(holder, leaf)
    _as_code(module)  # See [Note: stage modules as code]
    return module


def _untie_local(modules: tuple[nn.Module, ...]) -> None:
    """A parameter object in two of this rank's stage modules gets its own copy in the later one:
    FSDP shards a parameter once (See [Note: applying a pipeline plan], 4.)."""
    seen: set[int] = set()
    for module in modules:
        for sub in module.modules():
            for name, p in list(sub._parameters.items()):
                if p is not None and id(p) in seen:
                    sub._parameters[name] = nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad)
        seen.update(id(p) for p in module.parameters())


def _tied_copies(groups: list[tuple[str, ...]], modules: tuple[nn.Module, ...]) -> list[list[tuple[nn.Module, str]]]:
    """Per tied group, the (module, parameter name) of each copy in this rank's stage modules."""
    out = []
    for g in groups:
        found = []
        for module in modules:
            names = dict(module.named_parameters(remove_duplicate=False))
            for n in g:
                if n in names:
                    found.append((module.get_submodule(n.rsplit(".", 1)[0]) if "." in n else module,
                                  n.rsplit(".", 1)[-1]))
                    break
        out.append(found)
    return out


def _tied_groups_across(groups: list[tuple[str, ...]], copies: list[list[tuple[nn.Module, str]]], spec: PlanSpec,
                        layout: StageLayout, mesh: Any, pp_rank: int) -> tuple:
    """(this rank's copies, the group summing across pipeline ranks) per tied group held by more
    than one stage. Every rank creates the same groups in the same order (``new_group`` is
    collective over the world)."""
    pp = spec.mesh.pp_size
    out = []
    ranks = mesh.mesh.reshape(pp, -1)  # pipeline rank x data-parallel position -> global rank
    for g, local in zip(groups, copies):
        stages = sorted({layout.stage_of(n.rsplit(".", 1)[0]) for n in g} - {-1})
        if len(stages) < 2:
            continue
        holders = sorted({s % pp for s in stages})
        group = None
        if len(holders) == pp:
            group = mesh["pp"].get_group()
        elif len(holders) > 1:
            for col in range(ranks.shape[1]):
                members = [int(ranks[h, col]) for h in holders]
                made = dist.new_group(members)
                if dist.get_rank() in members:
                    group = made
        if local:
            out.append((tuple(getattr(m, n) for m, n in local), group))
    return tuple(out)


def _shard_stage(module: nn.Module, s: int, spec: PlanSpec, layout: StageLayout, dp_mesh: Any,
                 mixed_precision: dict[str, str | None] | None) -> None:
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    mp = mixed_precision_policy(mixed_precision)
    offload = CPUOffloadPolicy() if spec.offload else OffloadPolicy()  # See [Note: CPU offload] in cost/state.py
    units = [u for u in spec.units if not u.is_root and layout.stage_of(u.modules[0]) == s]
    subs = dict(module.named_modules())
    mp_for = apply_checkpoints(units, subs, mp)  # See [Note: selective checkpointing] in wrapopt/selective.py
    for u in units:
        targets = [subs[n] for n in u.modules]
        fully_shard(targets if len(targets) > 1 else targets[0], mesh=dp_mesh,
                    reshard_after_forward=u.reshard_after_forward, mp_policy=mp_for(u), offload_policy=offload)
    fully_shard(module, mesh=dp_mesh, reshard_after_forward=spec.root.reshard_after_forward, mp_policy=mp,
                offload_policy=offload)
    if spec.forward_prefetch > 0:
        set_forward_prefetch(units, subs, spec.forward_prefetch)


def _schedule(spec: PlanSpec, stages: tuple[Any, ...], loss_fn: Callable[[Any, Any], torch.Tensor]) -> Any:
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    pipe = spec.pipeline
    assert pipe is not None
    match pipe.schedule:
        case "GPipe":
            return ScheduleGPipe(stages[0], n_microbatches=pipe.microbatches, loss_fn=loss_fn)
        case "1F1B":
            return Schedule1F1B(stages[0], n_microbatches=pipe.microbatches, loss_fn=loss_fn)
        case "Interleaved1F1B":
            return ScheduleInterleaved1F1B(list(stages), n_microbatches=pipe.microbatches, loss_fn=loss_fn)
        case _:
            raise PlanError(f"unknown pipeline schedule {pipe.schedule!r}")
