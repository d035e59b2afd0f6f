"""WrapPlan + model -> the FSDP2-sharded model.

``fully_shard`` is applied bottom-up (the plan's units are already ordered
innermost first, root last); a unit of several modules is one
``fully_shard([m1, m2, ...])`` call, which is also how tied parameters stay
in one unit. Activation checkpointing uses the composable ``checkpoint``,
which keeps module names unchanged; a selective-op unit passes it the selective policy's
``context_fn`` (See [Note: selective checkpointing] in wrapopt/selective.py). A tensor-parallel plan first runs
``parallelize_module`` on its blocks, then FSDP on the data-parallel axes (See
[Note: applying a 2-D plan] in ``plan/tp.py``). A context-parallel plan (``mesh.cp_size > 1``)
shards over ``dp_shard x cp`` flattened and keeps the cp sub-mesh on the model for the loop's
``train_context`` (See [Note: applying context parallelism] in ``plan/cp.py``). Every check runs
before the first collective, so a bad plan fails on every rank instead of hanging some.

Also here: ``materialize_sharded`` (initialise a model that was sharded on the
meta device, so that it equals the same model initialised unsharded; see
[Note: initialising after sharding]). The FSDP1 form of a plan is in
``wrapopt/plan/fsdp1.py``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from wrapopt.consensus import agree, every_rank
from wrapopt.errors import PlanError
from wrapopt.fingerprint import model_fingerprint
from wrapopt.launch import device_type as default_device
from wrapopt.plan.compile import compile_blocks
from wrapopt.plan.ep import shard_experts
from wrapopt.plan.cp import check_cp_model, fsdp_mesh, remember_cp_mesh
from wrapopt.plan.float8 import convert_float8, device_check, torchao_missing
from wrapopt.plan.tp import check_tp_model, data_parallel_mesh, parallelize_tp, tp_layout
from wrapopt.selective import apply_checkpoints, check_selective_precision
from wrapopt.spec import PlanSpec, UnitSpec
from wrapopt.units import check_units, user_conflict_message, user_conflicts
from wrapopt.wrapped import check_unwrapped

__all__ = ["apply_plan", "build_mesh", "materialize_sharded", "known_param_users", "mixed_precision_policy",
           "plan_digest", "set_forward_prefetch", "tied_groups", "DTYPES", "check_float8", "throughput_knobs",
           "warn_pipeline_knobs"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, None: None}


def build_mesh(spec: PlanSpec, device_type: str | None = None):
    """The ``DeviceMesh`` a plan runs on: 1-D ("shard",) for FSDP, 2-D
    ("replicate", "shard") for HSDP and for no sharding (shard size 1); a
    tensor-parallel plan adds a "tp" axis, innermost (``MeshSpec.axis_names``)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = spec.mesh
    if not dist.is_initialized():
        raise PlanError("applying a plan needs a process group: start under torchrun or call "
                        "wrapopt.launch.init_from_env()")
    world = dist.get_world_size()
    if world != mesh.world_size:
        raise PlanError(
            f"the plan is for {mesh.world_size} ranks but this job has {world}; "
            f"re-run the search with --world-size {world} or start {mesh.world_size} ranks"
        )
    dev = device_type or default_device()
    return init_device_mesh(dev, mesh.shape, mesh_dim_names=mesh.axis_names)


def known_param_users(model: nn.Module) -> tuple[tuple[str, str], ...]:
    """(module, user) pairs that hold whatever the inputs: ``nn.MultiheadAttention``
    reads its ``out_proj``'s parameters in ``F.multi_head_attention_forward`` and never
    calls ``out_proj``. A plan applied without a trace is checked against these; the
    tracer finds every such pair (``ModelGraph.param_users``)."""
    return tuple((f"{n}.out_proj" if n else "out_proj", n) for n, m in model.named_modules()
                 if isinstance(m, nn.MultiheadAttention) and isinstance(getattr(m, "out_proj", None), nn.Module))


def _check(model: nn.Module, spec: PlanSpec, mesh: Any = None,
           param_users: Iterable[Sequence[str]] | None = ()) -> dict[str, nn.Module]:
    if spec.pipeline is not None:
        raise PlanError("this plan has pipeline stages (mesh.pp_size > 1): apply it with WrapPlan.apply(model, "
                        "example_inputs=..., loss_fn=...) or wrapopt.plan.pipeline.apply_pipeline, which return "
                        "the stages and their schedule")
    check_unwrapped(model, "apply", error=PlanError)
    modules = dict(model.named_modules())
    check_units(spec, modules, tied_groups(model))  # the rules estimate runs: See [Note: unit ownership] in units.py
    # See [Note: parameter users] in units.py.
    pairs = dict.fromkeys([*((p[0], p[1]) for p in param_users or ()), *known_param_users(model)])
    conflicts = user_conflicts([p for p in pairs if p[0] in modules and p[1] in modules], spec.units)
    if conflicts:
        raise PlanError(user_conflict_message(conflicts[0], spec.units))
    if mesh is not None:
        want = spec.mesh.shape
        got = tuple(mesh.shape) if hasattr(mesh, "shape") else (mesh.size(),)
        tp = f", tensor-parallel degree {spec.mesh.tp_size}" if spec.mesh.tp_size > 1 else ""
        if got != want:
            raise PlanError(
                f"the mesh passed has shape {got} but the plan is for {want} "
                f"({spec.mesh.world_size} ranks, shard groups of {spec.mesh.shard_size}{tp}); "
                "pass a mesh of the plan's shape, or mesh=None to build it from the plan"
            )
        names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
        if (spec.mesh.tp_size > 1 or _cp_size(spec) > 1) and names != spec.mesh.axis_names:
            raise PlanError(f"the mesh passed has axes {names or 'without names'} but a {_axes_kind(spec)} plan needs "
                            f"{spec.mesh.axis_names}; build it with init_device_mesh(..., mesh_dim_names="
                            f"{spec.mesh.axis_names}), or pass mesh=None")
    dev = getattr(mesh, "device_type", None) or default_device()
    if _cp_size(spec) > 1:
        check_cp_model(model)  # See [Note: applying context parallelism] in plan/cp.py.
    if spec.tp is not None:
        check_tp_model(model, spec.tp, spec.mesh.tp_size)  # See [Note: applying a 2-D plan] in plan/tp.py.
        tp_layout(model, spec.tp, spec.mesh.tp_size, dev)  # sequence, loss and async TP: before any collective
    if spec.offload and dev != "cuda":
        raise PlanError(f"this plan offloads parameters, gradients and optimizer state to host memory (FSDP2 "
                        f"CPUOffloadPolicy), which needs GPU ranks; these ranks run on {dev}: apply a plan searched "
                        "without offload (drop --host-memory / --offload)")
    return modules


def tied_groups(model: nn.Module) -> list[tuple[str, ...]]:
    """Names of each parameter shared by several modules (``ModelGraph.tied_groups`` without a trace)."""
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return [tuple(names) for names in by_id.values() if len(names) > 1]


def apply_plan(
    model: nn.Module,
    spec: PlanSpec,
    *,
    mesh: Any = None,
    mixed_precision: dict[str, str | None] | None = None,
    param_users: Iterable[Sequence[str]] | None = (),
    train: Any = None,
) -> nn.Module:
    """Shard ``model`` in place as ``spec`` says; returns the model (now an FSDPModule).

    ``train`` (a ``TrainConfig``) brings the throughput knobs: ``float8`` converts the eligible
    linears before ``fully_shard`` (See [Note: applying float8] in plan/float8.py; the user's loop
    calls ``wrapopt.plan.float8.after_optimizer_step(model)`` after each optimizer step, as
    ``train_step`` does), ``compile`` compiles each unit's modules after it (See [Note: compiling
    per block] in plan/compile.py; ``compile_report(model)`` names a block left eager).

    ``param_users`` are the (module, user) pairs of ``ModelGraph.param_users`` (a plan
    file carries its model's); a plan that puts a module in another unit than a module
    reading its parameters is refused before any ``fully_shard``, and so is one that
    makes a unit of an ``nn.MultiheadAttention``'s ``out_proj`` (``known_param_users``).

    Example:
        >>> model = apply_plan(model, plan.spec)  # doctest: +SKIP
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    # Local checks first, no collective has run yet; then the ranks compare what they were given.
    # See [Note: every rank explains] in wrapopt/consensus.py.
    mp_policy = mixed_precision_policy(mixed_precision)
    knobs = throughput_knobs(train)
    with every_rank("checking the plan against the model"):
        modules = _check(model, spec, mesh, param_users)
        check_selective_precision(spec, mp_policy)
        if knobs["float8"] != "none":
            check_float8(knobs, getattr(mesh, "device_type", None) or default_device())
    agree("applying the plan", {"model": model_fingerprint(model)["hash"], "plan": plan_digest(spec),
                                "mixed_precision": mixed_precision or {}, **knobs})
    if mesh is None:
        mesh = build_mesh(spec)
    if knobs["float8"] != "none":  # before any sharding: See [Note: applying float8] in plan/float8.py
        convert_float8(model, knobs["float8"], all_gather=knobs["float8_all_gather"], device_type=mesh.device_type)
        modules = dict(model.named_modules())
    if spec.tp is not None:  # See [Note: applying a 2-D plan] in plan/tp.py: TP, then checkpointing, then FSDP.
        parallelize_tp(model, spec.tp, mesh["tp"], tp_layout(model, spec.tp, spec.mesh.tp_size, mesh.device_type))
    if _cp_size(spec) > 1:  # FSDP over dp_shard x cp: See [Note: applying context parallelism] in plan/cp.py
        dp_mesh = fsdp_mesh(mesh, spec.mesh)
    else:
        dp_mesh = data_parallel_mesh(mesh, spec.mesh)
    mp_for = apply_checkpoints(spec.units, modules, mp_policy)  # See [Note: selective checkpointing]
    offload = CPUOffloadPolicy() if spec.offload else OffloadPolicy()  # See [Note: CPU offload] in cost/state.py
    # See [Note: applying expert parallelism] in plan/ep.py: the experts are units of their own.
    spec = shard_experts(model, spec, dp_mesh, mp_policy=mp_policy, offload=offload)
    fsdp_units = []
    for unit in spec.units:
        targets = [modules[n] for n in unit.modules]
        raf = unit.reshard_after_forward
        if unit.is_root:
            fully_shard(model, mesh=dp_mesh, reshard_after_forward=raf, mp_policy=mp_policy, offload_policy=offload)
        else:
            fully_shard(targets if len(targets) > 1 else targets[0], mesh=dp_mesh, reshard_after_forward=raf,
                        mp_policy=mp_for(unit), offload_policy=offload)
        fsdp_units.append(targets[0])
    if spec.forward_prefetch > 0:
        set_forward_prefetch(spec.units, modules, spec.forward_prefetch)
    if knobs["compile"]:  # after fully_shard: See [Note: compiling per block] in plan/compile.py
        compile_blocks(model, [n for u in spec.units if not u.is_root for n in u.modules])
    if _cp_size(spec) > 1:
        remember_cp_mesh(model, mesh["cp"])  # for WrapPlan.train_context and train_step
    return model


def _cp_size(spec: PlanSpec) -> int:
    return getattr(spec.mesh, "cp_size", 1)


def _axes_kind(spec: PlanSpec) -> str:
    return " and ".join(k for k, on in (("tensor-parallel", spec.mesh.tp_size > 1),
                                         ("context-parallel", _cp_size(spec) > 1)) if on)


def throughput_knobs(train: Any) -> dict[str, Any]:
    """A ``TrainConfig``'s compile and float8 knobs (None, or a config without them: off)."""
    return {"compile": bool(getattr(train, "compile", False)), "float8": getattr(train, "float8", None) or "none",
            "float8_all_gather": bool(getattr(train, "float8_all_gather", False))}


def warn_pipeline_knobs(train: Any) -> None:
    """A pipeline plan's stages get neither float8 nor compile from ``apply_pipeline`` yet: one
    warning line, so that a plan scored with them does not run slower than predicted unsaid."""
    knobs = throughput_knobs(train)
    on = [k for k, v in (("compile", knobs["compile"]), (f"float8 {knobs['float8']}", knobs["float8"] != "none"))
          if v]
    if on:
        import warnings

        warnings.warn(f"wrapopt: this pipeline plan was scored with {' and '.join(on)}, which apply_pipeline does not "
                      "apply to the stages: convert (wrapopt.plan.float8.convert_float8) before and compile "
                      "(wrapopt.plan.compile.compile_blocks) after, or expect the step slower than predicted",
                      stacklevel=3)


def check_float8(knobs: dict[str, Any], device_type: str) -> None:
    """What ``convert_float8`` refuses, checked before any collective: torchao present, the recipe
    and the all-gather agree, a GPU with FP8 tensor cores."""
    missing = torchao_missing()
    if missing:
        raise PlanError(missing)
    if knobs["float8_all_gather"] and knobs["float8"] != "tensorwise":
        raise PlanError(f"the float8 all-gather (train.float8_all_gather) takes tensorwise scales, not "
                        f"{knobs['float8']}: use --float8 tensorwise, or drop --float8-all-gather")
    device_check(device_type, knobs["float8"])


def mixed_precision_policy(mixed_precision: dict[str, str | None] | None):
    """FSDP2's ``MixedPrecisionPolicy`` from a plan's ``mixed_precision`` dtypes (None: keep the model's)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mp = mixed_precision or {}
    return MixedPrecisionPolicy(param_dtype=DTYPES[mp.get("param_dtype")], reduce_dtype=DTYPES[mp.get("reduce_dtype")],
                                output_dtype=DTYPES[mp.get("output_dtype")])


def plan_digest(spec: PlanSpec) -> str:
    """A short hash of everything ``spec`` decides, for comparing plans across ranks."""
    return f"{len(spec.units)} units, " + hashlib.sha256(repr(spec).encode()).hexdigest()[:12]


def set_forward_prefetch(units: Iterable[UnitSpec], modules: dict[str, nn.Module], k: int) -> None:
    """Explicit forward prefetch: each unit prefetches the next ``k`` units in
    forward order (``set_modules_to_forward_prefetch``); order is taken from
    module registration order, which is forward order for block chains."""
    names = list(modules)
    units = sorted((u for u in units if not u.is_root), key=lambda u: names.index(u.modules[0]))
    heads = [modules[u.modules[0]] for u in units]
    for i, m in enumerate(heads):
        nxt = heads[i + 1:i + 1 + k]
        if nxt:
            m.set_modules_to_forward_prefetch(nxt)  # type: ignore[attr-defined]

# [Note: initialising after sharding]
# Large models are built on the meta device, sharded, then materialised: ``model.to_empty(device)``
# gives every parameter storage (uninitialised), and an initialiser fills it. On CUDA, DTensor's
# offset-based RNG makes ``reset_parameters()`` on the sharded parameters draw what the unsharded
# model would have drawn. On a CPU mesh DTensor has no such RNG: every rank draws its local shard
# from the same local generator state, so the shards repeat one another and the model differs from
# the unsharded one (torch warns "DTensor random operators may not have complete support on cpu
# device mesh"). ``materialize_sharded`` sidesteps the RNG question on any device: for one module at
# a time it swaps in full-size plain tensors, runs the initialiser on them exactly as it would run
# on the unsharded model (same order, same draws), and copies each rank's shard out. Peak extra
# memory is one module's full parameters. Parameters of a 2-D plan (FSDP x tensor parallel) take the
# same path: ``distribute_tensor`` cuts the full tensor by their own placements, FSDP's
# ``_StridedShard`` on the data-parallel axis included (a test checks it against the unsharded init).


def materialize_sharded(
    model: nn.Module,
    *,
    device: torch.device | str,
    init_fn: Callable[[nn.Module], None] | None = None,
) -> nn.Module:
    """Give a model sharded on the meta device storage on ``device`` and initialise it.

    Every rank must call it with the same RNG state (``torch.manual_seed``);
    no collective runs. The result equals the unsharded model initialised by
    ``init_fn`` over ``named_modules()`` in the same order, shard for shard;
    see [Note: initialising after sharding].

    Args:
        model: the model after ``apply_plan`` / ``plan.apply`` (or unsharded).
        device: where the parameters live, e.g. ``"cpu"`` or ``"cuda"``.
        init_fn: ``init_fn(module)`` initialises the module's *own* parameters
            and buffers (not its children's), like ``reset_parameters`` and
            Hugging Face's ``model._init_weights``. Default: ``reset_parameters()``
            where a module has one; a module that holds parameters but has none
            raises, naming it (pass ``init_fn``).

    Example:
        >>> with torch.device("meta"):
        ...     model = build()  # doctest: +SKIP
        >>> plan.apply(model)  # doctest: +SKIP
        >>> torch.manual_seed(0); materialize_sharded(model, device="cpu")  # doctest: +SKIP
    """
    if init_fn is None:
        bare = [n or "<root>" for n, m in model.named_modules()
                if not hasattr(m, "reset_parameters") and next(m.parameters(recurse=False), None) is not None]
        if bare:
            raise PlanError(
                f"modules with parameters but no reset_parameters(): {', '.join(bare[:6])}; "
                "pass init_fn=(a function that initialises one module's own parameters)"
            )

        def init_fn(m: nn.Module) -> None:
            if hasattr(m, "reset_parameters"):
                m.reset_parameters()

    model.to_empty(device=device)
    with torch.no_grad():
        for _, module in model.named_modules():
            _init_one(module, init_fn)
    return model


def _init_one(module: nn.Module, init_fn: Callable[[nn.Module], None]) -> None:
    from torch.distributed.tensor import DTensor, distribute_tensor

    sharded = {k: p for k, p in module._parameters.items() if isinstance(p, DTensor)}
    full = {k: nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=p.to_local().device),
                            requires_grad=p.requires_grad)
            for k, p in sharded.items()}
    module._parameters.update(full)  # the initialiser sees plain, full-size tensors
    try:
        init_fn(module)
    finally:
        module._parameters.update(sharded)
    for k, p in sharded.items():
        # src_data_rank=None: every rank holds the same full tensor, so each keeps its own shard, no collective.
        local = distribute_tensor(full[k].detach(), p.device_mesh, p.placements, src_data_rank=None).to_local()
        p.to_local().copy_(local)
