"""Selective activation checkpointing ("selective-op"): which ops' outputs a checkpointed
unit keeps, shared by the tracer (what it prices) and ``plan.apply`` (what runs).

[Note: selective checkpointing] A unit with ``checkpoint == "selective-op"`` is checkpointed
as a full one is (torch's non-reentrant checkpoint around each of its modules, through the
composable ``checkpoint(module, context_fn=...)``, which keeps module names), with
TorchTitan's per-op policy (``SelectiveAC`` in torchtitan/distributed/activation_checkpoint.py,
``_save_list`` and ``_custom_policy`` at 9dec370, the commit of its published benchmarks) from
``torch.utils.checkpoint.create_selective_checkpoint_contexts``:

- ``MUST_SAVE``: the compute-intensive ops of torch's partitioner (``get_default_op_list()
  .compute_intensive_ops``: ``addmm``, ``bmm``, ``_scaled_mm``, convolution, the flash and
  efficient attention kernels), the other attention kernels TorchTitan lists (cuDNN, math, the
  overridable fused op; here also the fused CPU kernel, which is what runs on CPU),
  ``aten.max`` (float8's amax), ``topk`` (MoE routing), the collectives tensor parallelism
  and expert parallelism produce (``reduce_scatter_tensor``, ``all_to_all_single``), and a
  device-to-host copy;
- ``mm`` and ``linear`` (``nn.Linear`` on 3-D input reaches the dispatcher as ``mm``): every
  *second* one is recomputed. A counter per checkpointed region and pass (forward, recompute)
  counts them; the 1st, 3rd, 5th... are kept. A Llama block's seven (q, k, v, o, gate, up,
  down) keep q, v, gate and down; k, o and up are recomputed;
- every other op (norms, activations, elementwise, views) ``PREFER_RECOMPUTE``.

Not taken from TorchTitan: its ``force_recompute_mm_shapes_by_fqns`` (the MoE router's gate,
recomputed by shape); and 9dec370's ``abs`` (TorchTitan has dropped it since: its output is a
whole activation, for a 2-byte saving in the recompute).

What this costs (the tracer's ``ModuleInfo.selective_kept_bytes``, priced in
``cost/calls.py``; ``selective_figures`` below turns the tracer's log into it): during
forward a unit keeps its input (as a full checkpoint does) and the output of every saved op,
whether autograd saves it or not (eagerly the checkpoint's cache holds each ``MUST_SAVE``
output: a down projection, which only a residual add reads, is kept too). The tracer counts
the mm parity per region as apply does when the checkpointed module is a repeated block (or
a group of them: each block is its own region): from the innermost block holding the op, else
from the top-level module holding it. A unit finer than a block counts from its own first mm,
which the model does not follow (a Llama attention's four and MLP's three count the same
either way). In backward the unit recomputes the forward time of its other ops and of the
mm it did not keep (``ModuleInfo.selective_mm_recompute``: the share of a module's matmul
FLOPs recomputed; ``cost.calls.recompute_share``).

Under torch.compile ([Note: compile keeps what backward reads]) the partitioner saves a
``MUST_SAVE`` output only where backward reads it, so what no op of its block reads but
additions is not kept (``ModuleInfo.selective_unread``: that share of a module's kept bytes).

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

[Note: compile keeps what backward reads] Compiled (TorchTitan compiles each checkpointed
block whole), the checkpoint becomes tags on the block's graph and inductor's min-cut
partitioner builds the backward: ``PREFER_RECOMPUTE`` ops are recomputed there, fused into the
backward's kernels, and a ``MUST_SAVE`` output is saved only when the backward graph reads it
(directly, or to recompute something it reads). The rule priced: a kept output that no later
forward op of its own block reads, directly or through additions (``add``: its backward needs
none of its inputs, but what reads the sum needs the sum recomputed; views only alias), is not
saved under compile. A Llama block's down projection is such an output (the residual add
reads it, and only the next block reads the sum), so compile drops it; q (read by the
rotary), v (attention), gate (the SiLU) and attention's output (the o projection) stay; a
GPT block's attention output projection stays too (its residual sum feeds the second norm).
Checked against the partitioner (``python -m benchmarks.sac_compile_check``, inductor's
min-cut partitioner without code generation): llama-tiny's and gpt-tiny's compiled first
block save exactly the bytes the model keeps.
The recomputed ops' intermediates are priced as eagerly (the block's saved activations
during its recompute), an upper bound on what the fused backward holds.

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
from typing import Any, Callable, NamedTuple

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from wrapopt.errors import PlanError
from wrapopt.spec import PlanSpec, UnitSpec

__all__ = ["SAVED_OPS", "ALTERNATE_OPS", "is_saved_op", "alternates", "selective_policy", "selective_context_fn",
           "selective_figures", "refuse_selective", "cast_inputs_hook", "check_selective_precision",
           "apply_checkpoints"]

_aten = torch.ops.aten
_SAVED_NAMES = (
    # torch's partitioner's compute-intensive ops (torch 2.13's get_default_op_list(), as TorchTitan reads it)
    "addmm", "bmm", "convolution", "convolution_backward", "_scaled_mm", "upsample_bilinear2d",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention", "_flash_attention_forward",
    "_efficient_attention_forward",
    # TorchTitan's additions: the other attention kernels (and the fused CPU one, which runs here), float8's amax,
    # MoE routing
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_attention_math",
    "_scaled_dot_product_fused_attention_overrideable", "_scaled_dot_product_flash_attention_for_cpu", "max", "topk",
)
# The op packets whose outputs selective-op keeps (those this torch build has), and the collectives TorchTitan keeps.
SAVED_OPS = frozenset([getattr(_aten, n) for n in _SAVED_NAMES if hasattr(_aten, n)]
                      + [getattr(torch.ops._c10d_functional, n) for n in ("reduce_scatter_tensor", "all_to_all_single")
                         if hasattr(torch.ops._c10d_functional, n)])
# Matmuls of which selective-op keeps every second one (the 1st, 3rd, ... of a region's pass).
ALTERNATE_OPS = frozenset((_aten.mm, _aten.linear))
_TO_COPY = _aten._to_copy


def is_saved_op(func: Any) -> bool:
    """True for an op (overload or packet) whose outputs selective-op may keep: always, or every
    second one (``alternates``)."""
    packet = getattr(func, "_overloadpacket", func)
    return packet in SAVED_OPS or packet in ALTERNATE_OPS


def alternates(func: Any) -> bool:
    """True for the matmuls of which selective-op keeps every second one."""
    return getattr(func, "_overloadpacket", func) in ALTERNATE_OPS


def _to_host(func: Any, args: tuple, kwargs: dict) -> bool:
    """A device-to-host copy (MoE's all-to-all sizes): TorchTitan keeps it rather than sync again."""
    if getattr(func, "_overloadpacket", None) is not _TO_COPY or not args or "device" not in kwargs:
        return False
    dev = getattr(args[0], "device", None)
    return dev is not None and dev.type not in ("cpu", "meta") and str(kwargs["device"]) == "cpu"


def selective_policy() -> Callable[..., Any]:
    """A fresh policy of [Note: selective checkpointing] (TorchTitan's): its counter of ``mm`` /
    ``linear`` calls, one per pass (forward, recompute), keeps the odd ones."""
    count = {False: 0, True: 0}

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
        if alternates(func):
            recompute = bool(getattr(ctx, "is_recompute", False))
            count[recompute] += 1
            return CheckpointPolicy.MUST_SAVE if count[recompute] % 2 else CheckpointPolicy.PREFER_RECOMPUTE
        if is_saved_op(func) or _to_host(func, args, kwargs):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def selective_context_fn() -> tuple[Any, Any]:
    """``context_fn`` for torch's non-reentrant checkpoint: a fresh pair of contexts (and counter)
    per call, that is per region and step, as TorchTitan's."""
    return create_selective_checkpoint_contexts(selective_policy())


class SelectiveEvent(NamedTuple):
    """One saved op of the traced forward, in order: the module stack it ran under, whether it
    alternates, the bytes of its outputs' storages not seen before, those storages, its FLOPs."""

    stack: tuple[str, ...]
    alternate: bool
    nbytes: int
    storages: tuple[Any, ...]
    flops: float


def selective_figures(log: list[SelectiveEvent], read: dict[Any, set[tuple[str, ...]]],
                      blocks: set[str]) -> dict[str, tuple[int, float, float]]:
    """Per module (the op's innermost), (kept bytes, share of them no op of the same region reads but
    additions, FLOPs of the matmuls it recomputes): See [Note: selective checkpointing]. ``read``: per kept
    storage, the module stacks of the forward ops that read it (through additions too); ``blocks``: the
    repeated blocks, each a region."""
    count: dict[str, int] = {}
    kept: dict[str, int] = {}
    unread: dict[str, int] = {}
    mm: dict[str, float] = {}
    for ev in log:
        module = ev.stack[-1]
        region = next((s for s in reversed(ev.stack) if s in blocks), ev.stack[1] if len(ev.stack) > 1 else "")
        keep = True
        if ev.alternate:
            count[region] = count.get(region, 0) + 1
            keep = count[region] % 2 == 1
            mm[module] = mm.get(module, 0.0) + (0.0 if keep else ev.flops)
        if keep:
            kept[module] = kept.get(module, 0) + ev.nbytes
            if not any(region in stack for k in ev.storages for stack in read.get(k, ())):
                unread[module] = unread.get(module, 0) + ev.nbytes
    out = {}
    for module in dict.fromkeys([*kept, *mm]):
        k = kept.get(module, 0)
        out[module] = (k, unread.get(module, 0) / k if k else 0.0, mm.get(module, 0.0))
    return out


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
