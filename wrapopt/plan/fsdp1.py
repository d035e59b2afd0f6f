"""A plan as FSDP1 sees it: an ``auto_wrap_policy`` that wraps exactly the plan's
units, and the ``check_fn`` for FSDP1's activation checkpointing.

See [Note: what FSDP1 can express] for what is kept and what is lost.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Callable

import torch.distributed as dist
import torch.nn as nn

from wrapopt.errors import PlanError
from wrapopt.fingerprint import is_wrapper, strip_wrapper_prefixes
from wrapopt.plan.apply import DTYPES
from wrapopt.selective import refuse_selective
from wrapopt.spec import PlanSpec

__all__ = ["fsdp1_policy", "fsdp1_checkpoint_fn", "plan_policy_class"]  # and PlanPolicy, made on first use


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


def _caller_notes(spec: Any, mesh: Any) -> list[str]:
    """What the caller does besides wrapping: checkpointing and the HSDP mesh."""
    notes = []
    ckpt = [n for u in spec.units if u.checkpoint and not u.is_root for n in u.modules]
    if ckpt:
        notes.append("activation checkpointing is not part of an FSDP1 wrap policy: after FSDP(...), call "
                     "apply_activation_checkpointing(model, checkpoint_wrapper_fn=checkpoint_wrapper, "
                     f"check_fn=plan.fsdp1_checkpoint_fn(model)) to checkpoint {', '.join(ckpt[:4])}"
                     + (" ..." if len(ckpt) > 4 else ""))
    if mesh.is_hsdp and mesh.shard_size > 1:
        notes.append(f"HSDP: pass device_mesh=init_device_mesh(device, ({mesh.replicate_size}, {mesh.shard_size}), "
                     "mesh_dim_names=('replicate', 'shard')) to FullyShardedDataParallel")
    return notes


def fsdp1_policy(
    spec: PlanSpec,
    *,
    mixed_precision: dict[str, str | None] | None = None,
    split_groups: bool = False,
) -> Any:  # a PlanPolicy
    """The plan as an FSDP1 ``auto_wrap_policy`` wrapping exactly its units, with per-unit arguments.

    See [Note: what FSDP1 can express]. Pass ``policy.root_kwargs`` to
    ``FullyShardedDataParallel`` as well: they carry the root's sharding
    strategy, mixed precision and prefetch.

    Example:
        >>> policy = fsdp1_policy(plan.spec)  # doctest: +SKIP
        >>> model = FSDP(model, auto_wrap_policy=policy, device_id=dev, **policy.root_kwargs)  # doctest: +SKIP
    """
    from torch.distributed.fsdp import CPUOffload, MixedPrecision

    mesh = spec.mesh
    if spec.pipeline is not None:
        raise PlanError(f"this plan runs {len(spec.pipeline.stages)} pipeline stages on {mesh.pp_size} pipeline ranks; "
                        "wrapopt's FSDP1 export does not support pipeline parallelism: apply it with "
                        "plan.apply(model) (FSDP2 + torch.distributed.pipelining)")
    if spec.tp is not None:
        raise PlanError(f"this plan runs tensor parallelism (degree {mesh.tp_size}) under FSDP; wrapopt's FSDP1 export "
                        "does not support FSDP1 + tensor parallelism: apply it with plan.apply(model) (FSDP2)")
    refuse_selective(spec, "an FSDP1 policy")
    losses: list[str] = []  # what FSDP1's wrapping cannot reproduce of the plan
    mp = mixed_precision or {}
    mp_kwargs: dict[str, Any] = {}
    if mp.get("param_dtype") or mp.get("reduce_dtype"):
        mp_kwargs["mixed_precision"] = MixedPrecision(param_dtype=DTYPES[mp.get("param_dtype")],
                                                      reduce_dtype=DTYPES[mp.get("reduce_dtype")])
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
        losses.append("grouped units become one FSDP1 unit per module: "
                      + ", ".join(" + ".join(g) for g, _ in groups[:4]) + (" ..." if len(groups) > 4 else ""))
    if hpz:
        losses.append("reshard_after_forward=N (reshard to groups of N ranks) has no FSDP1 equivalent; "
                      f"these units use FULL_SHARD instead: {', '.join(hpz[:4])}")
    if spec.forward_prefetch > 1:
        losses.append(f"FSDP1 prefetches one unit ahead at most: forward prefetch depth {spec.forward_prefetch} "
                      "becomes 1")
    notes = list(losses) + _caller_notes(spec, mesh)  # and what the caller does besides wrapping
    root_kwargs = {"sharding_strategy": _fsdp1_strategy(True, mesh), "use_orig_params": True, **mp_kwargs,
                   **prefetch_kwargs}
    if spec.offload:  # the plan's CPU offload; FSDP1 gives every unit the root's cpu_offload
        root_kwargs["cpu_offload"] = CPUOffload(offload_params=True)
    policy = plan_policy_class()(singles, groups, root_kwargs=root_kwargs, notes=tuple(notes), losses=tuple(losses),
                        world_size=mesh.world_size)
    if notes:
        warnings.warn("FSDP1 cannot express all of this plan: " + "; ".join(notes), stacklevel=3)
    return policy


# [Note: FSDP1 imported late] ``PlanPolicy`` is FSDP1's ``CustomPolicy`` with the plan's units in it.
# Importing ``torch.distributed.fsdp`` (FSDP1, with DTensor and sympy behind it) takes over half a
# second, paid by every process that reads a plan (a search, an estimate) though few export one to
# FSDP1. So the policy's methods live in ``_PlanPolicyBody`` and the class is made, once, the first
# time it is asked for: ``plan_policy_class()``, or ``wrapopt.plan.fsdp1.PlanPolicy`` (PEP 562).
class _PlanPolicyBody:
    """FSDP1 ``auto_wrap_policy`` wrapping the modules a plan names, each with its own arguments.

    FSDP1 hands a policy module objects, not names: the names are resolved
    against the root FSDP1 is given (wrapper prefixes looked through).
    It is also the older callable form ``policy(module, recurse, numel)``,
    which resolves the names on its first call, made on the root.
    """

    def __init__(self, singles: dict[str, dict[str, Any]], groups: list[tuple[tuple[str, ...], dict[str, Any]]],
                 *, root_kwargs: dict[str, Any], notes: tuple[str, ...], losses: tuple[str, ...] = (),
                 world_size: int):
        super().__init__(self._kwargs_for)
        self.world_size = world_size  # the plan's; checked against the job's before FSDP1 wraps anything
        self.singles = singles  # module name -> FSDP1 kwargs of its unit
        self.groups = groups  # grouped units, split per module when resolved
        self.names = frozenset(singles) | frozenset(n for g, _ in groups for n in g)
        self.root_kwargs = root_kwargs  # pass to FullyShardedDataParallel(...) for the root unit
        self.notes = notes  # what FSDP1 could not express, and what to call besides (checkpointing, HSDP mesh)
        self.losses = losses  # the notes on what the wrapping itself loses (what `wrapopt export --to fsdp1` lists)
        self._by_id: dict[int, dict[str, Any]] | None = None

    def resolve(self, root: nn.Module) -> None:
        found = {strip_wrapper_prefixes(n): m for n, m in root.named_modules() if not is_wrapper(type(m))}
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


@functools.cache
def plan_policy_class() -> type:
    """``PlanPolicy``: FSDP1's ``CustomPolicy`` with the plan's methods (See [Note: FSDP1 imported late])."""
    from torch.distributed.fsdp.wrap import CustomPolicy

    return type("PlanPolicy", (_PlanPolicyBody, CustomPolicy), {"__module__": __name__,
                                                                "__doc__": _PlanPolicyBody.__doc__})


def __getattr__(name: str) -> Any:
    if name == "PlanPolicy":
        return plan_policy_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def fsdp1_checkpoint_fn(spec: PlanSpec, model: nn.Module) -> Callable[[nn.Module], bool]:
    """``check_fn`` for FSDP1's ``apply_activation_checkpointing``: true for the modules of
    the plan's checkpointed units. Works before or after wrapping (FSDP1's and
    checkpoint_wrapper's name prefixes are looked through)."""
    refuse_selective(spec, "FSDP1's apply_activation_checkpointing")
    names = {n for u in spec.units if u.checkpoint and not u.is_root for n in u.modules}
    found = {strip_wrapper_prefixes(n): m for n, m in model.named_modules() if not is_wrapper(type(m))}
    missing = sorted(names - set(found))
    if missing:
        raise PlanError(f"the plan checkpoints modules this model does not have: {', '.join(missing[:6])}")
    ids = {id(found[n]) for n in names}
    return lambda module: id(module) in ids
