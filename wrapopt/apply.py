"""WrapPlan + model -> the FSDP2-sharded model.

``fully_shard`` is applied bottom-up (the plan's units are already ordered
innermost first, root last); a unit of several modules is one
``fully_shard([m1, m2, ...])`` call, which is also how tied parameters stay
in one unit. Activation checkpointing uses the composable ``checkpoint``,
which keeps module names unchanged. Every check runs before the first
collective, so a bad plan fails on every rank instead of hanging some.

Also here: ``materialize_sharded`` (initialise a model that was sharded on the
meta device, so that it equals the same model initialised unsharded; see
[Note: initialising after sharding]) and ``fsdp1_policy`` (the plan as an
FSDP1 ``auto_wrap_policy``; see [Note: what FSDP1 can express]).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp.wrap import CustomPolicy

from wrapopt.errors import PlanError
from wrapopt.types import PlanSpec
from wrapopt.units import user_conflict_message, user_conflicts

__all__ = ["apply_plan", "build_mesh", "materialize_sharded", "fsdp1_policy", "fsdp1_checkpoint_fn", "PlanPolicy",
           "known_param_users"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, None: None}


def build_mesh(spec: PlanSpec, device_type: str | None = None):
    """The ``DeviceMesh`` a plan runs on: 1-D ("shard",) for FSDP, 2-D
    ("replicate", "shard") for HSDP and for no sharding (shard size 1)."""
    from torch.distributed.device_mesh import init_device_mesh

    from wrapopt.launch import device_type as default_device

    mesh = spec.mesh
    if not dist.is_initialized():
        raise PlanError("applying a plan needs a process group: start under torchrun or call wrapopt.launch.init_from_env()")
    world = dist.get_world_size()
    if world != mesh.world_size:
        raise PlanError(
            f"the plan is for {mesh.world_size} ranks but this job has {world}; "
            f"re-run the search with --world-size {world} or start {mesh.world_size} ranks"
        )
    dev = device_type or default_device()
    if mesh.is_hsdp:
        return init_device_mesh(dev, (mesh.replicate_size, mesh.shard_size), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh(dev, (mesh.shard_size,), mesh_dim_names=("shard",))


def known_param_users(model: nn.Module) -> tuple[tuple[str, str], ...]:
    """(module, user) pairs that hold whatever the inputs: ``nn.MultiheadAttention``
    reads its ``out_proj``'s parameters in ``F.multi_head_attention_forward`` and never
    calls ``out_proj``. A plan applied without a trace is checked against these; the
    tracer finds every such pair (``ModelGraph.param_users``)."""
    return tuple((f"{n}.out_proj" if n else "out_proj", n) for n, m in model.named_modules()
                 if isinstance(m, nn.MultiheadAttention) and isinstance(getattr(m, "out_proj", None), nn.Module))


def _check(model: nn.Module, spec: PlanSpec, mesh: Any = None,
           param_users: Iterable[Sequence[str]] | None = ()) -> dict[str, nn.Module]:
    from torch.distributed.fsdp import FSDPModule

    modules = dict(model.named_modules())
    sharded = [n or "<root>" for n, m in modules.items() if isinstance(m, FSDPModule)]
    if sharded:
        raise PlanError(
            f"the model is already sharded (fully_shard was applied to {', '.join(sharded[:4])}); "
            "apply a plan to a fresh, unsharded model"
        )
    wrapped = [n or "<root>" for n, m in modules.items() if type(m).__name__ == "FullyShardedDataParallel"]
    if wrapped:
        raise PlanError(
            f"the model is already wrapped by FSDP1 (FullyShardedDataParallel at {', '.join(wrapped[:4])}); "
            "apply a plan to a fresh, unwrapped model"
        )
    missing = sorted({m for u in spec.units for m in u.modules} - set(modules))
    if missing:
        raise PlanError(f"the plan names modules the model does not have: {', '.join(missing[:6])}")
    # See [Note: parameter users] in units.py.
    pairs = dict.fromkeys([*((p[0], p[1]) for p in param_users or ()), *known_param_users(model)])
    conflicts = user_conflicts([p for p in pairs if p[0] in modules and p[1] in modules], spec.units)
    if conflicts:
        raise PlanError(user_conflict_message(conflicts[0], spec.units))
    if mesh is not None:
        want = (spec.mesh.replicate_size, spec.mesh.shard_size) if spec.mesh.is_hsdp else (spec.mesh.shard_size,)
        got = tuple(mesh.shape) if hasattr(mesh, "shape") else (mesh.size(),)
        if got != want:
            raise PlanError(
                f"the mesh passed has shape {got} but the plan is for {want} "
                f"({spec.mesh.world_size} ranks, shard groups of {spec.mesh.shard_size}); "
                "pass a mesh of the plan's shape, or mesh=None to build it from the plan"
            )
    return modules


def apply_plan(
    model: nn.Module,
    spec: PlanSpec,
    *,
    mesh: Any = None,
    mixed_precision: dict[str, str | None] | None = None,
    param_users: Iterable[Sequence[str]] | None = (),
) -> nn.Module:
    """Shard ``model`` in place as ``spec`` says; returns the model (now an FSDPModule).

    ``param_users`` are the (module, user) pairs of ``ModelGraph.param_users`` (a plan
    file carries its model's); a plan that puts a module in another unit than a module
    reading its parameters is refused before any ``fully_shard``, and so is one that
    makes a unit of an ``nn.MultiheadAttention``'s ``out_proj`` (``known_param_users``).

    Example:
        >>> model = apply_plan(model, plan.spec)  # doctest: +SKIP
    """
    from torch.distributed._composable import checkpoint
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    modules = _check(model, spec, mesh, param_users)  # local checks first: no collective has run yet
    if mesh is None:
        mesh = build_mesh(spec)
    mp = mixed_precision or {}
    mp_policy = MixedPrecisionPolicy(param_dtype=_DTYPES[mp.get("param_dtype")], reduce_dtype=_DTYPES[mp.get("reduce_dtype")])
    for unit in spec.units:
        if unit.checkpoint and not unit.is_root:
            for name in unit.modules:
                checkpoint(modules[name])
    fsdp_units = []
    for unit in spec.units:
        targets = [modules[n] for n in unit.modules]
        raf = unit.reshard_after_forward
        if unit.is_root:
            fully_shard(model, mesh=mesh, reshard_after_forward=raf, mp_policy=mp_policy)
        else:
            fully_shard(targets if len(targets) > 1 else targets[0], mesh=mesh, reshard_after_forward=raf, mp_policy=mp_policy)
        fsdp_units.append(targets[0])
    if spec.forward_prefetch > 0:
        _set_forward_prefetch(model, spec, modules)
    return model


def _set_forward_prefetch(model: nn.Module, spec: PlanSpec, modules: dict[str, nn.Module]) -> None:
    """Explicit forward prefetch: each unit prefetches the next ``k`` units in
    forward order (``set_modules_to_forward_prefetch``); order is taken from
    module registration order, which is forward order for block chains."""
    names = list(modules)
    units = [u for u in spec.units if not u.is_root]
    units.sort(key=lambda u: names.index(u.modules[0]))
    heads = [modules[u.modules[0]] for u in units]
    k = spec.forward_prefetch
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
# memory is one module's full parameters.


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
    full = {k: nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=p.to_local().device), requires_grad=p.requires_grad)
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


# [Note: what FSDP1 can express]
# FSDP1 (FullyShardedDataParallel) wraps one module per instance, so a unit of several modules has
# no equivalent: it raises, or with split_groups=True becomes one unit per module (a group whose
# modules share a parameter, such as tied embeddings, is left to the enclosing unit instead, since
# FSDP1 cannot split a shared parameter either). Per unit, FSDP1 takes constructor arguments through
# CustomPolicy: reshard_after_forward=True is FULL_SHARD (HYBRID_SHARD on an HSDP mesh), False is
# SHARD_GRAD_OP (_HYBRID_SHARD_ZERO2), a no-shard mesh is NO_SHARD; reshard_after_forward=N (reshard
# to groups of N ranks) has no FSDP1 form and becomes FULL_SHARD. Explicit forward prefetch of k
# units becomes forward_prefetch=True, one unit ahead. Activation checkpointing is not a wrapping
# argument in FSDP1: apply_activation_checkpointing(model, check_fn=fsdp1_checkpoint_fn(...)) after
# wrapping. Whatever is lost is said in a warning when the policy is made, and kept in
# ``policy.notes``.


def _fsdp1_strategy(raf: bool | int, mesh: Any):
    from torch.distributed.fsdp import ShardingStrategy

    if mesh.shard_size == 1:
        return ShardingStrategy.NO_SHARD
    if raf is False:
        return ShardingStrategy._HYBRID_SHARD_ZERO2 if mesh.is_hsdp else ShardingStrategy.SHARD_GRAD_OP
    return ShardingStrategy.HYBRID_SHARD if mesh.is_hsdp else ShardingStrategy.FULL_SHARD


def fsdp1_policy(
    spec: PlanSpec,
    *,
    mixed_precision: dict[str, str | None] | None = None,
    split_groups: bool = False,
) -> "PlanPolicy":
    """The plan as an FSDP1 ``auto_wrap_policy`` wrapping exactly its units, with per-unit arguments.

    See [Note: what FSDP1 can express]. Pass ``policy.root_kwargs`` to
    ``FullyShardedDataParallel`` as well: they carry the root's sharding
    strategy, mixed precision and prefetch.

    Example:
        >>> policy = fsdp1_policy(plan.spec)  # doctest: +SKIP
        >>> model = FSDP(model, auto_wrap_policy=policy, device_id=dev, **policy.root_kwargs)  # doctest: +SKIP
    """
    from torch.distributed.fsdp import MixedPrecision

    mesh = spec.mesh
    notes: list[str] = []
    mp = mixed_precision or {}
    mp_kwargs: dict[str, Any] = {}
    if mp.get("param_dtype") or mp.get("reduce_dtype"):
        mp_kwargs["mixed_precision"] = MixedPrecision(param_dtype=_DTYPES[mp.get("param_dtype")],
                                                      reduce_dtype=_DTYPES[mp.get("reduce_dtype")])
    prefetch_kwargs = {"forward_prefetch": True} if spec.forward_prefetch > 0 else {}
    singles: dict[str, dict[str, Any]] = {}
    groups: list[tuple[tuple[str, ...], dict[str, Any]]] = []
    hpz = []
    for unit in spec.units:
        if unit.is_root:
            continue
        raf = unit.reshard_after_forward
        if not isinstance(raf, bool):
            hpz.append(f"{unit.name} ({raf})")
        kwargs = {"sharding_strategy": _fsdp1_strategy(raf, mesh), **mp_kwargs, **prefetch_kwargs}
        if len(unit.modules) == 1:
            singles[unit.modules[0]] = kwargs
        else:
            groups.append((unit.modules, kwargs))
    if groups and not split_groups:
        raise PlanError(
            f"FSDP1 cannot wrap a group of modules as one unit ({', '.join(' + '.join(g) for g, _ in groups[:4])}); "
            "use plan.apply() (FSDP2), search with single-module units, or pass split_groups=True "
            "to wrap each module of a group on its own"
        )
    if groups:
        notes.append("grouped units become one FSDP1 unit per module: "
                     + ", ".join(" + ".join(g) for g, _ in groups[:4]) + (" ..." if len(groups) > 4 else ""))
    if hpz:
        notes.append("reshard_after_forward=N (reshard to groups of N ranks) has no FSDP1 equivalent; "
                     f"these units use FULL_SHARD instead: {', '.join(hpz[:4])}")
    if spec.forward_prefetch > 1:
        notes.append(f"FSDP1 prefetches one unit ahead at most: forward prefetch depth {spec.forward_prefetch} becomes 1")
    ckpt = [n for u in spec.units if u.checkpoint and not u.is_root for n in u.modules]
    if ckpt:
        notes.append("activation checkpointing is not part of an FSDP1 wrap policy: after FSDP(...), call "
                     "apply_activation_checkpointing(model, checkpoint_wrapper_fn=checkpoint_wrapper, "
                     f"check_fn=plan.fsdp1_checkpoint_fn(model)) to checkpoint {', '.join(ckpt[:4])}"
                     + (" ..." if len(ckpt) > 4 else ""))
    if mesh.is_hsdp and mesh.shard_size > 1:
        notes.append(f"HSDP: pass device_mesh=init_device_mesh(device, ({mesh.replicate_size}, {mesh.shard_size}), "
                     "mesh_dim_names=('replicate', 'shard')) to FullyShardedDataParallel")
    root_kwargs = {"sharding_strategy": _fsdp1_strategy(True, mesh), "use_orig_params": True, **mp_kwargs, **prefetch_kwargs}
    policy = PlanPolicy(singles, groups, root_kwargs=root_kwargs, notes=tuple(notes), world_size=mesh.world_size)
    if notes:
        warnings.warn("FSDP1 cannot express all of this plan: " + "; ".join(notes), stacklevel=3)
    return policy


class PlanPolicy(CustomPolicy):
    """FSDP1 ``auto_wrap_policy`` wrapping the modules a plan names, each with its own arguments.

    FSDP1 hands a policy module objects, not names: the names are resolved
    against the root FSDP1 is given (wrapper prefixes looked through).
    It is also the older callable form ``policy(module, recurse, numel)``,
    which resolves the names on its first call, made on the root.
    """

    def __init__(self, singles: dict[str, dict[str, Any]], groups: list[tuple[tuple[str, ...], dict[str, Any]]],
                 *, root_kwargs: dict[str, Any], notes: tuple[str, ...], world_size: int):
        super().__init__(self._kwargs_for)
        self.world_size = world_size  # the plan's; checked against the job's before FSDP1 wraps anything
        self.singles = singles  # module name -> FSDP1 kwargs of its unit
        self.groups = groups  # grouped units, split per module when resolved
        self.names = frozenset(singles) | frozenset(n for g, _ in groups for n in g)
        self.root_kwargs = root_kwargs  # pass to FullyShardedDataParallel(...) for the root unit
        self.notes = notes  # what FSDP1 could not express, in words
        self._by_id: dict[int, dict[str, Any]] | None = None

    def resolve(self, root: nn.Module) -> None:
        from wrapopt.plan import _is_wrapper, strip_wrapper_prefixes

        found = {strip_wrapper_prefixes(n): m for n, m in root.named_modules() if not _is_wrapper(type(m))}
        missing = sorted(self.names - set(found))
        if missing:
            raise PlanError(f"the plan names modules this model does not have: {', '.join(missing[:6])}")
        by_id = {id(found[n]): kw for n, kw in self.singles.items()}
        for names, kw in self.groups:
            params = [{id(p) for p in found[n].parameters()} for n in names]
            shared = any(a & b for i, a in enumerate(params) for b in params[i + 1:])
            if shared:  # FSDP1 cannot split a shared parameter: leave the group to the enclosing unit
                warnings.warn(f"FSDP1: the grouped unit {' + '.join(names)} shares parameters between its "
                              "modules; they are left to the enclosing unit", stacklevel=4)
                continue
            by_id.update({id(found[n]): kw for n in names})
        self._by_id = by_id

    def _run_policy(self, root_module: nn.Module, ignored_modules: set[nn.Module], root_kwargs: dict[str, Any]):
        # FSDP1 runs the policy before its first collective: a wrong plan fails on every rank alike.
        if dist.is_initialized() and dist.get_world_size() != self.world_size:
            raise PlanError(f"the plan is for {self.world_size} ranks but this job has {dist.get_world_size()}; "
                            f"re-run the search with --world-size {dist.get_world_size()}")
        self.resolve(root_module)
        return super()._run_policy(root_module, ignored_modules, root_kwargs)

    def _kwargs_for(self, module: nn.Module) -> bool | dict[str, Any]:
        assert self._by_id is not None  # resolved in _run_policy
        kw = self._by_id.get(id(module))
        return False if kw is None else dict(kw)

    def __call__(self, module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
        if self._by_id is None:  # the first call is on the root
            self.resolve(module)
        return True if recurse else id(module) in self._by_id  # type: ignore[operator]




def fsdp1_checkpoint_fn(spec: PlanSpec, model: nn.Module) -> Callable[[nn.Module], bool]:
    """``check_fn`` for FSDP1's ``apply_activation_checkpointing``: true for the modules of
    the plan's checkpointed units. Works before or after wrapping (FSDP1's and
    checkpoint_wrapper's name prefixes are looked through)."""
    from wrapopt.plan import _is_wrapper, strip_wrapper_prefixes

    names = {n for u in spec.units if u.checkpoint and not u.is_root for n in u.modules}
    found = {strip_wrapper_prefixes(n): m for n, m in model.named_modules() if not _is_wrapper(type(m))}
    missing = sorted(names - set(found))
    if missing:
        raise PlanError(f"the plan checkpoints modules this model does not have: {', '.join(missing[:6])}")
    ids = {id(found[n]) for n in names}
    return lambda module: id(module) in ids
