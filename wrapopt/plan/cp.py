"""Context parallelism applied: the meshes, the checks, and the context around a training step.

A plan with ``mesh.cp_size > 1`` splits each sequence over the ``cp`` axis of its mesh. Applying
it (``apply_plan``) builds the mesh with that axis, shards the parameters over ``dp_shard x cp``
flattened (``fsdp_mesh``: TorchTitan's ``dp_shard_cp``) and refuses, before any collective, a
model whose attention torch cannot split (``check_cp_model``). The loop then runs each
forward and backward inside ``cp_context`` (``WrapPlan.train_context``, ``train_step``), which
shards the buffers given on their sequence dim and routes ``F.scaled_dot_product_attention`` to
torch's ring attention. See [Note: applying context parallelism].
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.nn as nn

from wrapopt.errors import PlanError
from wrapopt.spec import MeshSpec

__all__ = ["ROTATE_METHODS", "fsdp_mesh", "check_cp_model", "check_cp_buffers", "cp_context", "head_tail_tokens",
           "ring_exchanges", "remember_cp_mesh", "cp_mesh_of"]

ROTATE_METHODS = ("allgather", "alltoall")  # torch's set_rotate_method; TorchTitan's default first

# [Note: applying context parallelism]
# What runs is torch's ``torch.distributed.tensor.experimental.context_parallel`` as TorchTitan used it
# (``create_context_parallel_ctx`` / ``get_train_context``; its newer ``prepare_context_parallel_input``
# shards the same way ahead of the step). On entry it reorders each buffer given (input ids, labels,
# position buffers such as ``freqs_cis``) on its sequence dim with the head-tail load balancer -- the
# sequence cut into 2 x cp chunks, cp rank r keeping chunks r and 2cp-1-r, so every rank has as much of
# the causal triangle (``head_tail_tokens``) -- and keeps the rank's part, resizing the tensor in place;
# and it patches ``F.scaled_dot_product_attention`` so that q, k and v become DTensors sharded on dim 2,
# whose SDPA kernel DTensor hands to the ring (``_templated_ring_attention``): the local q meets every
# rank's k and v, gathered at once ("allgather") or passed rank to rank ("alltoall"), the partial
# outputs merged by their log-sum-exp. Backward runs the same ring and returns the k, v gradients to
# their ranks by all-to-all (``ring_exchanges`` counts each collective; a test checks the counts
# against CommDebugMode). On exit the buffers are restored unless named in ``no_restore``.
# Three consequences for the model and the loop:
# - Only ``F.scaled_dot_product_attention`` looked up at call time is split. ``nn.MultiheadAttention``
#   calls torch._C's SDPA inside ``F.multi_head_attention_forward``, an "eager" Hugging Face model
#   computes softmax(QK^T) itself: each would attend within its own shard only, silently wrong.
#   ``check_cp_model`` refuses them at apply, naming the module.
# - Positions must come in as a buffer sharded with the tokens (TorchTitan's ``freqs_cis``, Hugging
#   Face's ``position_ids``): a forward that builds ``torch.arange(seq)`` from its local length gives
#   rank 1 the positions of rank 0 (the zoo's models do; the tests pass positions in).
# - The load balancer needs causal attention and a sequence divisible by 2 x cp; torch falls back to
#   no balancing, silently, when it is not (and shards unevenly when cp does not divide it):
#   ``check_cp_buffers`` refuses that instead, naming the buffer and the degrees that would divide.
#   Non-causal attention stops torch's ring under the balancer ("Load balancing requires
#   `is_causal=True`"), which ``cp_context`` names with its fix: ``load_balance=False``, contiguous
#   1/cp shards (no triangle to balance).
# Each rank's loss is the mean over its own tokens; FSDP's gradient average over ``dp_shard x cp``
# makes the step that of the whole sequence (equal shards), and ``train_step`` averages the
# reported loss over the cp ranks.
# [Note: context parallelism on CPU] torch 2.13 registers the ring for the CUDA kernels only
# (``_scaled_dot_product_flash_attention``, ``_efficient_attention``, ``_cudnn_attention``). On CPU,
# SDPA dispatches ``aten._scaled_dot_product_flash_attention_for_cpu``, which DTensor rejects inside the
# context: "Operator aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding
# strategy registered" (NotImplementedError, every rotate method). On a CPU mesh ``cp_context`` adds
# that kernel and its backward to the same table, each calling torch's own ring functions with the CPU
# kernel in place of flash: everything else (balancer, rotation, merge, backward ring) is torch's,
# which is what lets gloo ranks check CP against the unsharded model.


def fsdp_mesh(mesh: Any, mesh_spec: MeshSpec) -> Any:
    """The mesh FSDP shards on under context parallelism: ``shard`` and ``cp`` flattened into
    ``dp_shard_cp`` (beside ``replicate`` for HSDP), without ``tp`` and ``pp``."""
    flat = mesh["shard", "cp"]._flatten("dp_shard_cp")
    if "replicate" in mesh_spec.axis_names:
        return mesh["replicate", "dp_shard_cp"]
    return flat


_ATTENTION_WORDS = ("attention", "attn")


def check_cp_model(model: nn.Module) -> None:
    """Refuse, naming the module, a model whose attention context parallelism cannot split (See
    [Note: applying context parallelism]): ``nn.MultiheadAttention``, a Hugging Face model not
    loaded with ``attn_implementation="sdpa"``, and a module named like attention whose forward
    (and its children's) never calls ``scaled_dot_product_attention``."""
    for name, m in model.named_modules():
        where = f"module {name or '<root>'} ({type(m).__name__})"
        if isinstance(m, nn.MultiheadAttention):
            raise PlanError(f"context parallelism splits F.scaled_dot_product_attention only; {where} is an "
                            "nn.MultiheadAttention, whose attention runs inside F.multi_head_attention_forward: "
                            "write the block around F.scaled_dot_product_attention, or search with --cp 1")
        impl = getattr(getattr(m, "config", None), "_attn_implementation", None)
        if impl is not None:
            if impl != "sdpa":
                raise PlanError(f"context parallelism splits F.scaled_dot_product_attention only; {where} runs "
                                f"attention {impl!r}: load the model with attn_implementation=\"sdpa\", or search "
                                "with --cp 1")
            continue
        if any(w in type(m).__name__.lower() for w in _ATTENTION_WORDS) and _calls_sdpa(m) is False:
            raise PlanError(f"context parallelism splits F.scaled_dot_product_attention only; {where} never "
                            "calls it in its forward (nor do its children): compute attention with "
                            "F.scaled_dot_product_attention, or search with --cp 1")


def _calls_sdpa(module: nn.Module) -> bool | None:
    """Whether the source of ``module``'s forward or a child's names ``scaled_dot_product_attention``;
    None where some source cannot be read (then nothing is refused)."""
    import inspect

    unknown = False
    for m in module.modules():
        try:
            src = inspect.getsource(type(m).forward)
        except (OSError, TypeError):
            unknown = True
            continue
        if "scaled_dot_product_attention" in src:
            return True
    return None if unknown else False


def check_cp_buffers(buffers: Sequence[torch.Tensor], seq_dims: Sequence[int], cp_size: int, *,
                     load_balance: bool = True) -> None:
    """Every buffer's sequence dim divisible by ``2 x cp_size`` (the load balancer's chunks; ``cp_size``
    without it), the dims in range and as many as the buffers; ``PlanError`` naming the buffer
    and the lengths and degrees that would divide."""
    if len(buffers) != len(seq_dims):
        raise PlanError(f"context parallelism got {len(buffers)} buffers and {len(seq_dims)} sequence dims; "
                        "give one sequence dim per buffer (inputs and labels: 1, a positions buffer: 0)")
    for i, (b, d) in enumerate(zip(buffers, seq_dims)):
        if not isinstance(b, torch.Tensor) or not -b.dim() <= d < b.dim():
            shape = tuple(b.shape) if isinstance(b, torch.Tensor) else type(b).__name__
            raise PlanError(f"context-parallel buffer {i} (shape {shape}) has no sequence dim {d}; "
                            "pass tensors and the dim each one's sequence runs along")
        n, per = b.shape[d], 2 if load_balance else 1
        if n % (per * cp_size):
            works = [k for k in range(1, n // per + 1) if n % (per * k) == 0][:6]
            lo = n - n % (per * cp_size)
            sizes = " or ".join(str(m) for m in (lo, lo + per * cp_size) if m > 0)
            chunks = f"2 x cp = {2 * cp_size} (the load balancer's chunks)" if load_balance else f"cp = {cp_size}"
            raise PlanError(f"context-parallel buffer {i} (shape {tuple(b.shape)}) has {n} positions on dim {d}, "
                            f"not divisible by {chunks}: make the sequence {sizes} long, or use cp "
                            f"{', '.join(map(str, works)) or '1'}")


def remember_cp_mesh(model: nn.Module, cp_mesh: Any) -> None:
    """Keep the ``cp`` sub-mesh on the applied model, for ``cp_context`` to find (``cp_mesh_of``)."""
    model.__dict__["wrapopt_cp_mesh"] = cp_mesh


def cp_mesh_of(model: Any) -> Any:
    """The ``cp`` sub-mesh ``apply_plan`` gave ``model``; ``PlanError`` for a model applied without it."""
    mesh = getattr(model, "__dict__", {}).get("wrapopt_cp_mesh")
    if mesh is None:
        raise PlanError("the model was not sharded by a context-parallel plan (mesh.cp_size > 1): pass the model "
                        "that plan.apply returned")
    return mesh


@contextlib.contextmanager
def cp_context(cp_mesh: Any, buffers: Sequence[torch.Tensor], seq_dims: Sequence[int], *,
               no_restore: Sequence[torch.Tensor] = (), rotate_method: str = "allgather",
               load_balance: bool = True) -> Iterator[None]:
    """torch's ``context_parallel`` on ``cp_mesh``: ``buffers`` sharded on ``seq_dims`` inside (in
    place; restored after, except those in ``no_restore``), SDPA run as ring attention rotated
    by ``rotate_method`` ("allgather" or "alltoall"). ``load_balance=False`` keeps each rank's
    tokens contiguous (the only way for non-causal attention). See [Note: applying context
    parallelism].

    Example:
        >>> with cp_context(cp_mesh_of(model), [x, y, model.freqs_cis], [1, 1, 0], no_restore=[x, y]):
        ...     loss_fn(model(x), y).backward()  # doctest: +SKIP
    """
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import _cp_options, set_rotate_method

    if rotate_method not in ROTATE_METHODS:
        raise PlanError(f"unknown context-parallel rotate method {rotate_method!r}; use one of "
                        f"{', '.join(ROTATE_METHODS)}")
    check_cp_buffers(buffers, seq_dims, cp_mesh.size(), load_balance=load_balance)
    grads = [i for i, b in enumerate(buffers) if b.requires_grad]
    if grads:
        raise PlanError(f"context-parallel buffer {grads[0]} requires grad; torch resizes the buffers in place: "
                        "pass input ids, labels and position buffers, not parameters or activations")
    if cp_mesh.device_type == "cpu":
        _register_cpu_ring()  # See [Note: context parallelism on CPU]
    set_rotate_method(rotate_method)
    old = _cp_options.enable_load_balance
    _cp_options.enable_load_balance = load_balance
    keep = {id(b) for b in no_restore}
    try:
        with context_parallel(cp_mesh, buffers=list(buffers), buffer_seq_dims=list(seq_dims),
                              no_restore_buffers={b for b in buffers if id(b) in keep}):
            yield
    except RuntimeError as e:
        if "Load balancing requires" not in str(e):
            raise
        raise PlanError("context parallelism's load balancer needs causal attention (is_causal=True) and this "
                        "model calls SDPA without it: pass load_balance=False to train_context (each cp rank "
                        "keeps a contiguous 1/cp of the sequence)") from e
    finally:
        _cp_options.enable_load_balance = old


def _register_cpu_ring() -> None:
    """Add the CPU flash kernel and its backward to the SDPA kernels torch's context parallelism
    runs as a ring (See [Note: context parallelism on CPU])."""
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp

    aten = torch.ops.aten
    cp.custom_ops.setdefault(aten._scaled_dot_product_flash_attention_for_cpu.default, _cpu_ring_forward)
    cp.custom_ops.setdefault(aten._scaled_dot_product_flash_attention_for_cpu_backward.default, _cpu_ring_backward)


def _locals(args: Sequence[Any]) -> tuple[Any, list[Any]]:
    from torch.distributed.tensor import DTensor

    mesh = next(a.device_mesh for a in args if isinstance(a, DTensor))
    return mesh, [a.to_local() if isinstance(a, DTensor) else a for a in args]


def _sharded(mesh: Any, tensors: Sequence[torch.Tensor]) -> tuple[Any, ...]:
    from torch.distributed.tensor import DTensor, Shard

    return tuple(DTensor.from_local(t, mesh, [Shard(2)], run_check=False) for t in tensors)


def _cpu_ring_forward(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    # aten::_scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p=0., is_causal=False, *, attn_mask, scale)
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp

    if kwargs.get("attn_mask") is not None:
        raise PlanError("context parallelism takes no attention mask: use is_causal=True")
    mesh, (q, k, v, *rest) = _locals(args)
    dropout_p = rest[0] if rest else kwargs.get("dropout_p", 0.0)
    is_causal = rest[1] if len(rest) > 1 else kwargs.get("is_causal", False)
    out, lse = cp._templated_ring_attention(
        mesh.get_group(), 2, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu, query=q, key=k, value=v,
        is_causal=is_causal, dropout_p=dropout_p, scale=kwargs.get("scale"))
    return _sharded(mesh, (out, lse))


def _cpu_ring_backward(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    # aten::..._for_cpu_backward(grad_out, q, k, v, out, logsumexp, dropout_p, is_causal, *, attn_mask, scale)
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp

    mesh, (grad_out, q, k, v, out, lse, dropout_p, is_causal) = _locals(args)
    grads = cp._templated_ring_attention_backward(
        mesh.get_group(), 2, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
        grad_out=grad_out, grad_out_name="grad_out", query=q, key=k, value=v, out=out, logsumexp=lse,
        is_causal=is_causal, dropout_p=dropout_p, scale=kwargs.get("scale"))
    return _sharded(mesh, grads)


def head_tail_tokens(seq_len: int, cp_size: int, cp_rank: int) -> list[int]:
    """The positions cp rank ``cp_rank`` holds under the head-tail load balancer, in its order:
    chunk ``cp_rank`` then chunk ``2 cp - 1 - cp_rank`` of the ``2 cp`` equal chunks (torch-free)."""
    if seq_len % (2 * cp_size):
        raise PlanError(f"a sequence of {seq_len} does not split into 2 x cp = {2 * cp_size} chunks")
    c = seq_len // (2 * cp_size)
    head, tail = cp_rank, 2 * cp_size - 1 - cp_rank
    return [*range(head * c, (head + 1) * c), *range(tail * c, (tail + 1) * c)]


def ring_exchanges(cp_size: int, rotate_method: str = "allgather") -> dict[str, tuple[str, int, int]]:
    """The collectives torch's ring attention runs for one SDPA call on ``cp_size`` ranks (torch
    2.13), torch-free, for pricing: ``{exchange: (collective, calls, shards)}``, where ``shards``
    is what each rank receives over those calls in units of its own shard of k and v together
    (``2 x batch x kv_heads x seq/cp x head_dim`` elements, k and v after any GQA repeat). The
    exchanges: ``forward_kv`` ("allgather": one all-gather; "alltoall": ``cp - 1`` all-to-alls,
    each passing the shard to the next rank), ``backward_kv`` (the same again), and
    ``backward_grad_kv`` (the k, v gradients returned by all-to-all once per ring step, ``cp``
    times, in fp32 under torch's default ``convert_to_f32``). A checkpointed block runs
    ``forward_kv`` again in backward. 1 rank: none. A test checks these against CommDebugMode."""
    if rotate_method not in ROTATE_METHODS:
        raise PlanError(f"unknown context-parallel rotate method {rotate_method!r}; use one of "
                        f"{', '.join(ROTATE_METHODS)}")
    if cp_size <= 1:
        return {}
    n = cp_size - 1
    kv = ("all_gather_into_tensor", 1, n) if rotate_method == "allgather" else ("all_to_all_single", n, n)
    return {"forward_kv": kv, "backward_kv": kv, "backward_grad_kv": ("all_to_all_single", cp_size, cp_size)}
