"""Selective activation checkpointing ("selective-op"): which ops' outputs a checkpointed
unit keeps, shared by the tracer (what it prices) and ``plan.apply`` (what runs).

[Note: selective checkpointing] A unit with ``checkpoint == "selective-op"`` is checkpointed
as a full one is (torch's non-reentrant checkpoint around each of its modules, through the
composable ``checkpoint(module, context_fn=...)``, which keeps module names), with a
policy from ``torch.utils.checkpoint.create_selective_checkpoint_contexts``: the outputs
of matmuls (``mm``, ``addmm``, ``bmm``, ``baddbmm``, grouped and scaled mm; ``nn.Linear``
reaches the dispatcher as these) and of the attention kernels (flash, efficient, cuDNN,
the fused CPU kernel, and the overridable fused op) are ``MUST_SAVE``; every other op
(norms, activations, elementwise, views) is ``PREFER_RECOMPUTE``. In backward the
recomputed forward takes the saved outputs from the cache instead of running those ops.

What this costs (the tracer's ``ModuleInfo.selective_kept_bytes``, priced in
``cost/calls.py``): during forward a unit keeps its input (as a full checkpoint does) and
the output of every saved op, whether autograd saves it or not (the checkpoint's cache
holds each ``MUST_SAVE`` output: an attention block's output projection, which only a
residual add reads, is kept too); in backward it recomputes the forward time of the
other ops.

It also costs per op: torch runs the unit's forward under a caching ``TorchDispatchMode``
and its recompute under another, each calling the Python policy for every aten op (a full
checkpoint has neither). That is microseconds of Python per op in forward and again in the
recompute; on a small block it adds up to more than the block's whole forward, so on small
CPU models selective-op is slower than full. ``ComputeProfile.selective_op_overhead_s`` is
that cost per forward op and pass (``measure_selective_overhead``: the first repeated block
checkpointed through the selective contexts with a recompute-everything policy, minus full,
over 2 x its forward ops; caching the kept outputs, one detach each, is left out); the
tracer counts each module's forward ops (``ModuleInfo.fwd_ops``, about the ops a real
forward dispatches), and the step loop charges overhead x ops to a selective-op segment's
forward and again to its recompute (``_compute_s`` and the chain DP alike). Analytical (GPU)
profiles leave it 0: it is host work, which a GPU's run-ahead hides while its kernels take
longer; it is not measured on a GPU here, so where kernels are tiny (launch-bound steps)
selective-op is priced too cheap there.

Where this differs from TorchTitan's op-level SAC (``apply_ac``, ``mode = "selective"``,
``selective_ac_option = "op"``): TorchTitan saves every *second* ``mm`` (it recomputes the
odd ones to halve the memory of the matmul outputs) and also saves ``aten.max`` and the
reduce-scatter of tensor parallelism (``_c10d_functional.reduce_scatter_tensor``). Here every
matmul is saved, so the choice between none, selective-op and full is a clean
memory/recompute trade per unit, and a plan that needs more memory back checkpoints more
units fully; ``max`` (a few bytes per row) and reduce-scatter (no tensor parallelism under
selective-op yet) are recomputed.

[Note: selective checkpointing under mixed precision] Torch 2.13's selective checkpoint
requires every op its recompute runs to have run in the checkpointed forward (its cache is
keyed by op and call count). FSDP2's pre-forward hook is registered ahead of the
checkpoint's (``prepend=True``), so in forward it casts the unit's inputs outside the
checkpointed region; in the recompute it runs again inside it, and its
``record_function("FSDP::cast_forward_inputs")`` is an aten op the cache never saw:
"profiler._record_function_enter_new.default encountered during backward but not found in
storage", on the first backward of any plan with selective-op and a ``param_dtype`` (float32
included). So ``plan.apply`` gives a selective-op unit's modules
``cast_forward_inputs=False`` and casts their floating inputs itself (``cast_inputs_hook``),
in a pre-hook registered after the checkpoint's: it runs inside the checkpointed region in
forward and in the recompute alike, and without a ``record_function``. An ``output_dtype``
cast has the same problem in the post-forward hook and no such way around it: a selective-op
unit under a policy with ``output_dtype`` is refused (no preset sets one).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from wrapopt.errors import PlanError
from wrapopt.spec import PlanSpec, UnitSpec

__all__ = ["SAVED_OPS", "is_saved_op", "selective_policy", "selective_context_fn", "refuse_selective",
           "cast_inputs_hook", "check_selective_precision", "apply_checkpoints"]

_aten = torch.ops.aten
_SAVED_NAMES = (
    # matmuls (nn.Linear lowers to mm / addmm, or to bmm through matmul on batched input)
    "mm", "addmm", "bmm", "baddbmm", "linear", "_grouped_mm", "_scaled_mm",
    # attention kernels as scaled_dot_product_attention dispatches them (torch 2.13)
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_fused_attention_overrideable", "_flash_attention_forward", "_efficient_attention_forward",
)
# The op packets whose outputs selective-op keeps (those this torch build has).
SAVED_OPS = frozenset(getattr(_aten, n) for n in _SAVED_NAMES if hasattr(_aten, n))


def is_saved_op(func: Any) -> bool:
    """True for an op (overload or packet) whose outputs selective-op keeps."""
    return getattr(func, "_overloadpacket", func) in SAVED_OPS


def selective_policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
    """The policy of [Note: selective checkpointing]: keep matmul and attention outputs,
    recompute the rest."""
    return CheckpointPolicy.MUST_SAVE if is_saved_op(func) else CheckpointPolicy.PREFER_RECOMPUTE


def selective_context_fn() -> tuple[Any, Any]:
    """``context_fn`` for torch's non-reentrant checkpoint: a fresh pair of contexts per call."""
    return create_selective_checkpoint_contexts(selective_policy)


def cast_inputs_hook(dtype: torch.dtype) -> Any:
    """A forward pre-hook (``with_kwargs=True``) casting floating tensors of the inputs to ``dtype``,
    as FSDP2's ``cast_forward_inputs`` does: See [Note: selective checkpointing under mixed precision]."""
    from torch.utils._pytree import tree_map

    def cast(x: Any) -> Any:
        return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype else x

    def hook(_module: Any, args: Any, kwargs: Any) -> tuple[Any, Any]:
        return tree_map(cast, args), tree_map(cast, kwargs)

    return hook


def check_selective_precision(spec: PlanSpec, mp_policy: Any) -> None:
    """Selective-op units cannot run under an ``output_dtype`` cast: See [Note: selective
    checkpointing under mixed precision]."""
    sel = [u.name for u in spec.units if u.selective_checkpoint and not u.is_root]
    if sel and mp_policy.output_dtype is not None:
        raise PlanError(f"unit {sel[0]!r} uses selective-op checkpointing, which torch 2.13 cannot recompute under "
                        f"the mixed-precision output_dtype {mp_policy.output_dtype}: drop output_dtype from the "
                        "training step's precision, or set the unit's \"checkpoint\" to true (full)")


def apply_checkpoints(units: Any, modules: dict[str, Any], mp_policy: Any) -> Callable[[UnitSpec], Any]:
    """Checkpoint the modules of every checkpointed unit but the root (full, or selective-op with
    its policy), before ``fully_shard``; returns each unit's ``MixedPrecisionPolicy``: a selective-op
    unit's casts its inputs itself (See [Note: selective checkpointing under mixed precision])."""
    from torch.distributed._composable import checkpoint

    own_cast = mp_policy.param_dtype is not None and mp_policy.cast_forward_inputs
    for unit in units:
        if unit.checkpoint and not unit.is_root:  # See [Note: selective checkpointing]
            kwargs = {"context_fn": selective_context_fn} if unit.selective_checkpoint else {}
            for name in unit.modules:
                checkpoint(modules[name], **kwargs)
                if unit.selective_checkpoint and own_cast:
                    modules[name].register_forward_pre_hook(cast_inputs_hook(mp_policy.param_dtype), with_kwargs=True)
    no_cast = dataclasses.replace(mp_policy, cast_forward_inputs=False) if own_cast else mp_policy
    return lambda unit: no_cast if unit.selective_checkpoint and not unit.is_root else mp_policy


def refuse_selective(spec: PlanSpec, target: str) -> None:
    """Raise ``PlanError`` naming the first unit with selective-op checkpointing, which ``target``
    (an export that checkpoints whole modules) cannot express."""
    sel = [u.name for u in spec.units if u.selective_checkpoint]
    if sel:
        raise PlanError(f"unit {sel[0]!r}{f' (and {len(sel) - 1} more)' if len(sel) > 1 else ''} uses selective-op "
                        f"checkpointing, which {target} cannot express: set its \"checkpoint\" to true (full) or "
                        "false in the plan file, or apply the plan with FSDP2 (plan.apply(model), or "
                        "--to lightning-fsdp2)")
