"""Applying expert parallelism: each rank keeps its share of every mixture's experts, tokens go to
the ranks that hold their experts and come back by all-to-all, FSDP shards the experts over the
expert-FSDP group and the dense part over every data-parallel rank.

[Note: applying expert parallelism] A plan with ``mesh.ep_size = ep > 1`` (See [Note: the cp and
ep axes of the mesh] in spec/plan.py) is applied as TorchTitan's ``ExpertParallel`` on its sparse
mesh ``efsdp x ep`` (torchtitan/distributed/expert_parallel.py), with plain tensors and
``torch.distributed.all_to_all_single`` where TorchTitan uses DTensor (the same collectives; it
runs on gloo). ``shard_experts``, called by ``apply_plan`` before the plan's units:

- finds the experts modules: a module with an integer ``num_experts`` and 3-D parameters whose
  leading dimension is that count (Hugging Face's ``MixtralExperts``, ``Qwen3MoeExperts``, ...;
  the zoo's ``MoEFFN``), and refuses a degree that does not divide a module's experts, naming
  the degrees that would;
- builds the mesh ``(efsdp, ep)`` over the data-parallel ranks, ep innermost (an ep group is
  ``ep`` consecutive ranks: inside a node while ``ep`` divides it); under HSDP (shard groups of
  ``s`` of the ``dp`` ranks) ``(replicate, efsdp, ep)``, ep inside each shard group, as
  TorchTitan's ``dp_replicate x efsdp x ep``: the experts are HSDP over ``(replicate, efsdp)``;
- keeps on each rank its ``n / ep`` experts (the slice ``[r n/ep, (r+1) n/ep)`` of each stacked
  weight, ``r`` its place in the ep group) and replaces the experts' computation by dispatch,
  local experts, combine. Two shapes of experts module are known: Hugging Face's
  ``forward(hidden_states, top_k_index, top_k_weights)`` (dropless: the (token, choice) pairs are
  sorted by expert, the counts exchanged, the tokens sent, the rank's experts run on what
  arrived as Hugging Face's own forward with one choice per row and weight 1, the outputs sent
  back, weighted and summed per token); and a module with ``experts_forward(buffer)`` over
  fixed-capacity buffers ``(n, capacity, hidden)`` (GShard: each rank sends expert ``e``'s
  buffer to the rank holding ``e``, which runs its experts over the buffers of every rank). The
  routing, and with it any capacity limit, stays per rank, as without expert parallelism;
- shards each experts module with ``fully_shard`` over ``efsdp`` (resharding after forward as
  the plan's unit of that module alone says, else after forward: ``cost/ep.py``'s
  ``expert_units`` prices the same units), after its children that hold parameters (a router
  inside the module) over the data-parallel mesh; the experts' gradients,
  summed over the tokens of every rank of the ep group, are divided by the data-parallel size
  (``set_gradient_divide_factor``, sum-reduced so that gloo runs it), so that a step equals the
  unsharded model's on the mean loss;
- returns the plan without those modules and those inside them in its units: they are units of
  their own already.

Not applied: expert parallelism under tensor or pipeline parallelism or context parallelism
(refused with the field to change), and meta-device initialisation (``materialize_sharded``
initialises the rank's expert slice as if it were the whole stack).
"""

from __future__ import annotations

import inspect
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from wrapopt.errors import PlanError
from wrapopt.spec import PlanSpec

__all__ = ["expert_modules", "check_ep", "shard_experts"]


def expert_modules(model: nn.Module) -> dict[str, tuple[nn.Module, int, tuple[str, ...]]]:
    """Name -> (module, experts, names of its stacked expert parameters), in ``named_modules`` order."""
    out = {}
    for name, m in model.named_modules():
        n = getattr(m, "num_experts", None)
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            continue
        stacked = tuple(k for k, p in m.named_parameters(recurse=False) if p.dim() == 3 and p.shape[0] == n)
        if stacked:
            out[name] = (m, n, stacked)
    return out


def _kind(m: nn.Module) -> str | None:
    if callable(getattr(m, "experts_forward", None)):
        return "capacity"
    try:
        params = inspect.signature(m.forward).parameters
    except (TypeError, ValueError):
        return None
    return "routed" if "top_k_index" in params else None


def check_ep(model: nn.Module, spec: PlanSpec) -> dict[str, tuple[nn.Module, int, tuple[str, ...]]]:
    """The experts modules ``spec``'s expert-parallel degree splits; ``PlanError`` naming the field
    or module when it cannot be applied. See [Note: applying expert parallelism]."""
    mesh, ep = spec.mesh, spec.mesh.ep_size
    for what, bad in (("mesh.tp_size", mesh.tp_size), ("mesh.pp_size", mesh.pp_size), ("mesh.cp_size", mesh.cp_size)):
        if bad > 1:
            raise PlanError(f"this plan has mesh.ep_size {ep} with {what} {bad}: wrapopt applies expert parallelism "
                            f"with FSDP or HSDP alone; search with --ep 1 or --{what.split('_')[0].split('.')[1]} 1"
                            + (", or run it with TorchTitan (wrapopt export PLAN --to torchtitan)"
                               if what != "mesh.tp_size" else ""))
    found = expert_modules(model)
    if not found:
        raise PlanError(f"this plan has mesh.ep_size {ep} but the model holds no experts module (a module with an "
                        "integer num_experts and 3-D expert weights): apply a plan searched with --ep 1")
    for name, (m, n, _stacked) in found.items():
        if n % ep:
            works = [d for d in range(2, n + 1) if n % d == 0]
            raise PlanError(f"mesh.ep_size {ep} does not divide the {n} experts of {name}; degrees that do: "
                            f"{', '.join(map(str, works)) or 'none above 1'} (or 1)")
        if _kind(m) is None:
            raise PlanError(f"{name} ({type(m).__name__}) holds {n} stacked experts but neither takes "
                            "(hidden_states, top_k_index, top_k_weights) nor has experts_forward(buffer): wrapopt "
                            "cannot dispatch its tokens; apply a plan with --ep 1")
    return found


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with its backward (the reverse exchange of the gradients)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> torch.Tensor:
        ctx.splits, ctx.group = (in_splits, out_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        back_out, back_in = ctx.splits
        out = grad.new_empty((sum(back_out), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), back_out, back_in, group=ctx.group)
        return out, None, None, None


def _routed(orig, group: Any, ep: int, local: int):
    """Hugging Face's ``forward(hidden_states, top_k_index, top_k_weights)`` over the ep group."""
    def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        k = top_k_index.shape[-1]
        expert = top_k_index.reshape(-1)
        order = torch.argsort(expert, stable=True)  # the (token, choice) pairs by expert, so by rank
        expert = expert[order]
        send = torch.bincount(expert // local, minlength=ep)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=group)
        send_l, recv_l = send.tolist(), recv.tolist()
        ids = expert.new_empty(sum(recv_l))
        dist.all_to_all_single(ids, expert % local, recv_l, send_l, group=group)
        arrived = _AllToAll.apply(hidden_states[order // k], recv_l, send_l, group)
        ones = torch.ones(ids.shape[0], 1, dtype=top_k_weights.dtype, device=arrived.device)
        done = orig(arrived, ids[:, None], ones)
        back = _AllToAll.apply(done, send_l, recv_l, group)
        weights = top_k_weights.reshape(-1)[order].to(back.dtype)
        out = torch.zeros_like(hidden_states)
        return out.index_add(0, order // k, back * weights[:, None])

    return forward


def _capacity(orig, group: Any, ep: int, local: int):
    """``experts_forward(buffer)`` over fixed-capacity buffers ``(experts, capacity, hidden)``."""
    def experts_forward(buffer: torch.Tensor) -> torch.Tensor:
        n, cap = buffer.shape[0], buffer.shape[1]
        rows = [local * cap] * ep
        arrived = _AllToAll.apply(buffer.reshape(n * cap, -1), rows, rows, group)  # (ep sources x local x cap, h)
        mine = arrived.reshape(ep, local, cap, -1).transpose(0, 1).reshape(local, ep * cap, -1)
        done = orig(mine)
        done = done.reshape(local, ep, cap, -1).transpose(0, 1).reshape(ep * local * cap, -1)
        return _AllToAll.apply(done, rows, rows, group).reshape(n, cap, -1)

    return experts_forward


def shard_experts(model: nn.Module, spec: PlanSpec, dp_mesh: Any, *, mp_policy: Any = None,
                  offload: Any = None) -> PlanSpec:
    """Expert parallelism as ``spec.mesh.ep_size`` says (``spec`` unchanged when it is 1): See
    [Note: applying expert parallelism]. Returns the plan whose units ``apply_plan`` still shards."""
    ep = spec.mesh.ep_size
    if ep <= 1:
        return spec
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    found = check_ep(model, spec)
    dp, shard = spec.mesh.dp_size, spec.mesh.shard_size
    if shard < dp:  # HSDP: ep inside each shard group, the experts' FSDP over (replicate, efsdp)
        sparse = init_device_mesh(dp_mesh.device_type, (dp // shard, shard // ep, ep),
                                  mesh_dim_names=("replicate", "efsdp", "ep"))
        experts_mesh = sparse["replicate", "efsdp"]
    else:
        sparse = init_device_mesh(dp_mesh.device_type, (dp // ep, ep), mesh_dim_names=("efsdp", "ep"))
        experts_mesh = sparse["efsdp"]
    group, rank = sparse["ep"].get_group(), sparse["ep"].get_local_rank()
    kw = {"mp_policy": mp_policy} if mp_policy is not None else {}
    if offload is not None:
        kw["offload_policy"] = offload
    owned: set[str] = set()
    alone = {u.modules[0]: u.reshard_after_forward for u in spec.units if len(u.modules) == 1}
    for name, (m, n, stacked) in found.items():
        local = n // ep
        for pname in stacked:
            p = getattr(m, pname)
            m.register_parameter(pname, nn.Parameter(p.detach()[rank * local:(rank + 1) * local].clone(),
                                                     requires_grad=p.requires_grad))
        if _kind(m) == "capacity":
            m.experts_forward = _capacity(m.experts_forward, group, ep, local)
        else:
            orig = m.forward
            m.num_experts = local  # Hugging Face's forward loops over its own experts only
            m.forward = _routed(orig, group, ep, local)
        prefix = f"{name}." if name else ""
        for child_name, child in m.named_modules():
            if child_name and next(child.parameters(recurse=False), None) is not None:
                fully_shard(child, mesh=dp_mesh, **kw)  # a router inside the experts module: dense
        raf = alone.get(name, True)  # a unit of its own in the plan: as it says; else after forward
        fully_shard(m, mesh=experts_mesh, reshard_after_forward=raf if isinstance(raf, bool) else True, **kw)
        m.set_gradient_divide_factor(float(dp))
        m.set_force_sum_reduction_for_comms(True)
        owned.add(name)
        owned.update(prefix + c for c, _ in m.named_modules() if c)
    units = []
    for u in spec.units:
        keep = tuple(x for x in u.modules if x not in owned)
        if keep:
            units.append(u if keep == u.modules else replace(u, modules=keep))
    return replace(spec, units=tuple(units))
