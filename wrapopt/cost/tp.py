"""The tensor-parallel view of a model: what one rank of a tensor-parallel group holds
and computes, as a ``ModelGraph`` and a ``ComputeProfile`` the FSDP simulator scores
on the data-parallel mesh.

[Note: tensor parallel costs] A 2-D plan (See [Note: tensor parallel] in tp.py) is
scored as FSDP on ``mesh.data_parallel()`` of a model that is the tensor-parallel
rank's share of the real one. ``tp_view`` makes that model from the traced graph,
per module of every block the ``TPSpec`` parallelises:

- a colwise projection holds 1/tp of its weight and bias, does 1/tp of the FLOPs
  and makes 1/tp of the output; it saves its input, which is whole (replicated);
- a rowwise projection holds 1/tp of its weight (its bias is replicated), does
  1/tp of the FLOPs, and saves and reads 1/tp of its input; its output is whole;
- the module around them (the attention, with its score and softmax ops; the
  MLP, with its activation and gating) does 1/tp of its own ops and saves 1/tp;
- everything else (norms, residual adds, embeddings, the head, the loss) is
  unchanged: replicated.

Time per module is the profile's (measured per module, or FLOPs and bytes over
the stated rates), split modules' time divided by ``tp * efficiency``, where the
efficiency is the profile's measured throughput of the model's largest
projection split ``tp`` ways over unsplit (``ComputeProfile.split_efficiency``;
without a measurement it is taken as 1 and the estimate says so), plus, per call
of a split projection, what tensor parallelism costs beyond the matmul and the
collective (DTensor's dispatch and its input and output hooks:
``ComputeProfile.tp_overhead_s``, measured by ``measure_tp_overhead``; on a CPU,
where nothing runs ahead, it is of the order of the small matmuls themselves). The
tensor-parallel collectives are on the critical path of every block (the next
op needs their result), so they are time of the module that issues them, on the
compute lane, not overlapped with anything: forward, one all-reduce of the
rowwise projection's output per call; backward, one all-reduce of the colwise
projection's input gradient per call (the gradients of a replicated input are
partial sums on each rank). They run on a group of ``tp`` consecutive ranks
inside one node: ``FabricProfile.collective_s("all_reduce", tp, tp, bytes)``.
These counts are torch's (``CommDebugMode`` on 2-D plans, tests/plan/test_tp_ranks.py:
forward 2, backward 5 for a Llama block and 4 for a GPT block, each of the block's
activation size). A checkpointed unit is charged its whole forward again, both
all-reduces included; torch's non-reentrant checkpoint stops its recompute once
every tensor backward needs is back, which skips the MLP's output projection and
its all-reduce (measured: one all-reduce per checkpointed block, not two), so a
checkpointed 2-D plan is predicted slow by about that much.
Left out: contention between the tensor-parallel collectives and FSDP's on the
same links, and the faster fused kernels some codebases use for the
all-reduce; both are small next to the per-block collectives at the sizes
where tensor parallelism pays.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from wrapopt.cost.calls import module_time
from wrapopt.cost.dtypes import traced_dtype_bytes
from wrapopt.hardware.profiles import ComputeProfile, FabricProfile
from wrapopt.spec import ModelGraph, ModuleInfo
from wrapopt.tp import TPSpec, tp_blocks

__all__ = ["tp_roles", "tp_view"]


def tp_roles(graph: ModelGraph, spec: TPSpec) -> dict[str, str]:
    """Module -> "colwise", "rowwise", or "region" (the module around split projections)."""
    roles: dict[str, str] = {}
    for b in tp_blocks(graph, spec):
        for rel, style in spec.styles(graph.info(b).cls).items():
            fqn = f"{b}.{rel}"
            roles[fqn] = style
            parent = fqn.rsplit(".", 1)[0]
            if parent != b:
                roles.setdefault(parent, "region")
    return roles


def _split_shapes(graph: ModelGraph, roles: dict[str, str], size: int) -> tuple[tuple, dict[str, tuple[int, int]]]:
    """The parameter shapes one tensor-parallel rank holds, and (elements, bytes) removed per module."""
    shapes, removed = [], {}
    for fqn, shape, dt in graph.param_shapes:
        owner, name = fqn.rsplit(".", 1) if "." in fqn else ("", fqn)
        role, new = roles.get(owner), tuple(shape)
        if role == "colwise" and len(shape) >= 1:
            new = (shape[0] // size, *shape[1:])
        elif role == "rowwise" and name == "weight" and len(shape) == 2:
            new = (shape[0], shape[1] // size)
        n_old, n_new = _numel(shape), _numel(new)
        if n_new != n_old:
            n, b = removed.get(owner, (0, 0))
            removed[owner] = (n + n_old - n_new, b + (n_old - n_new) * getattr(torch, dt).itemsize)
        shapes.append((fqn, new, dt))
    return tuple(shapes), removed


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _scaled(m: ModuleInfo, role: str | None, size: int, removed: tuple[int, int]) -> ModuleInfo:
    n, nb = removed
    if n and m.own_numel:
        keep = (m.own_numel - n) / m.own_numel
        m = replace(m, own_numel=m.own_numel - n, own_bytes=m.own_bytes - nb,
                    own_trainable_numel=round(m.own_trainable_numel * keep),
                    own_trainable_bytes=round(m.own_trainable_bytes * keep),
                    own_bytes_by_dtype=tuple((d, round(b * keep)) for d, b in m.own_bytes_by_dtype))
    if role is None:
        return m
    common = dict(fwd_flops=m.fwd_flops / size, bwd_flops=m.bwd_flops / size,
                  fwd_bytes=m.fwd_bytes // size, bwd_bytes=m.bwd_bytes // size)
    if role == "colwise":
        return replace(m, output_bytes=m.output_bytes // size, selective_kept_bytes=m.selective_kept_bytes // size,
                       **common)
    if role == "rowwise":
        return replace(m, saved_bytes=m.saved_bytes // size, input_bytes=m.input_bytes // size, **common)
    return replace(m, saved_bytes=m.saved_bytes // size, selective_kept_bytes=m.selective_kept_bytes // size,
                   **common)


def tp_view(graph: ModelGraph, compute: ComputeProfile, fabric: FabricProfile, spec: TPSpec, size: int, *,
            batch_scale: float = 1.0, activation_dtype_bytes: int | None = None,
            ) -> tuple[ModelGraph, ComputeProfile, frozenset[str]]:
    """One tensor-parallel rank's graph and compute profile, and the caveats of the view.
    ``graph`` is the traced one (activations in the traced dtype); ``activation_dtype_bytes``
    sizes the tensor-parallel messages as the step runs them. See [Note: tensor parallel costs]."""
    roles = tp_roles(graph, spec)
    shapes, removed = _split_shapes(graph, roles, size)
    notes: set[str] = set()
    eff = dict(compute.split_efficiency).get(size)
    if eff is None:
        eff = 1.0
        notes.add(f"tensor-parallel matmuls split {size} ways taken as fast per FLOP as whole ones: "
                  "the compute profile measured no split efficiency")
    traced = traced_dtype_bytes(graph)
    act = (activation_dtype_bytes or traced) / traced

    def all_reduce(nbytes: float) -> float:
        t, caveat = fabric.collective_s("all_reduce", size, size, nbytes)
        if caveat:
            notes.add(caveat)
        return t

    measured = {fqn: (f, b) for fqn, f, b in compute.module_times}
    oh_f, oh_b = compute.tp_overhead_s
    times = []
    for m in graph.call_order():
        f, b = module_time(m, compute, batch_scale, measured)
        role = roles.get(m.fqn)
        if role is not None:
            f, b = f / (size * eff), b / (size * eff)
        if role in ("colwise", "rowwise"):  # DTensor's dispatch and hooks, per call
            f += m.num_calls * oh_f
            b += m.num_calls * oh_b
        if role == "rowwise":  # the partial outputs are summed: See [Note: tensor parallel costs]
            f += m.num_calls * all_reduce(m.output_bytes * act * batch_scale)
        elif role == "colwise":  # the replicated input's partial gradients are summed
            b += m.num_calls * all_reduce(m.input_bytes * act * batch_scale)
        times.append((m.fqn, f / batch_scale, b / batch_scale))

    modules = {m.fqn: _scaled(m, roles.get(m.fqn), size, removed.get(m.fqn, (0, 0))) for m in graph.modules}
    for owner, (n, nb) in removed.items():  # totals: the module and its ancestors hold that much less
        parts = owner.split(".") if owner else []
        for i in range(len(parts) + 1):
            fqn = ".".join(parts[:i])
            m = modules[fqn]
            modules[fqn] = replace(m, total_numel=m.total_numel - n, total_bytes=m.total_bytes - nb)
    tree = graph.tree.copy()
    for fqn, m in modules.items():
        tree.nodes[fqn]["info"] = m
    view = replace(graph, modules=tuple(modules[m.fqn] for m in graph.modules), tree=tree, param_shapes=shapes)
    # the times are at batch_scale already (module_time): See [Note: batch scaling] in calls.py
    return view, replace(compute, module_times=tuple(times), batch_fixed_share=0.0), frozenset(notes)
