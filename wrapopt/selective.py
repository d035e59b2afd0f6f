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

Where this differs from TorchTitan's op-level SAC (``apply_ac``, ``mode = "selective"``,
``selective_ac_option = "op"``): TorchTitan saves every *second* ``mm`` (it recomputes the
odd ones to halve the memory of the matmul outputs) and also saves ``aten.max`` and the
reduce-scatter of tensor parallelism (``_c10d_functional.reduce_scatter_tensor``). Here every
matmul is saved, so the choice between none, selective-op and full is a clean
memory/recompute trade per unit, and a plan that needs more memory back checkpoints more
units fully; ``max`` (a few bytes per row) and reduce-scatter (no tensor parallelism under
selective-op yet) are recomputed.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from wrapopt.errors import PlanError
from wrapopt.spec import PlanSpec

__all__ = ["SAVED_OPS", "is_saved_op", "selective_policy", "selective_context_fn", "refuse_selective"]

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


def refuse_selective(spec: PlanSpec, target: str) -> None:
    """Raise ``PlanError`` naming the first unit with selective-op checkpointing, which ``target``
    (an export that checkpoints whole modules) cannot express."""
    sel = [u.name for u in spec.units if u.selective_checkpoint]
    if sel:
        raise PlanError(f"unit {sel[0]!r}{f' (and {len(sel) - 1} more)' if len(sel) > 1 else ''} uses selective-op "
                        f"checkpointing, which {target} cannot express: set its \"checkpoint\" to true (full) or "
                        "false in the plan file, or apply the plan with FSDP2 (plan.apply(model), or "
                        "--to lightning-fsdp2)")
