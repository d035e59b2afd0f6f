"""One pipeline stage's share of the model: the ``ModelGraph`` and ``ComputeProfile`` of the
modules a stage owns, which the ordinary FSDP simulator scores on the stage's mesh. See
[Note: pipeline stages] in cost/pipeline.py.

A stage's graph keeps the root, the ancestors of the stage's modules (containers such as
``layers``; their own parameters, if any, stay with them) and the subtrees of the modules the
stage lists. The root's own ops (and the model's inputs) belong to the first stage; the loss,
its saved bytes and its time to the last. A stage that is not the last ends with the
activation it sends on: its root's output is that of the stage's last module in forward order.

[Note: tied copies on stages] A parameter the model shares between two modules (a tied
embedding and head) is counted once, at the first module that registers it. When the two sit
on different stages, applying the plan gives the later stage a copy of its own and sums the
copies' gradients after each step (See [Note: applying a pipeline plan] in
``wrapopt/plan/pipeline.py``), so that stage holds the copy's parameters, gradients and
optimizer state too: its graph gives the copy's bytes to the module that uses it there. The sum
is an all-reduce of the copy's local gradient shard (its bytes over the shard group) over the
pipeline ranks holding a copy, once a step before the optimizer (``tied_sync_s``, on the
inter-node link when stages cross nodes), which the step pays after the schedule.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from wrapopt.hardware.profiles import ComputeProfile
from wrapopt.spec import ROOT, ModelGraph, ModuleInfo

__all__ = ["stage_graph", "stage_compute", "boundary_bytes", "stage_of", "tied_sync_s"]


def _kept(graph: ModelGraph, modules: tuple[str, ...]) -> set[str]:
    """The stage's modules: the listed subtrees, their ancestors and the root."""
    keep = {ROOT}
    for fqn in modules:
        keep.update(graph.subtree(fqn))
        parts = fqn.split(".")
        keep.update(".".join(parts[:i]) for i in range(1, len(parts)))
    return keep


def _module_of(param: str) -> str:
    """The module that registers parameter ``param`` (its path less the last name)."""
    return param.rsplit(".", 1)[0] if "." in param else ROOT


def stage_of(fqn: str, owner: dict[str, int]) -> int | None:
    """The stage of module ``fqn`` by ``owner`` (``PipelineSpec.stage_of()``: the listed modules),
    through its nearest listed ancestor; None when none is listed (a container)."""
    parts = fqn.split(".")
    for i in range(len(parts), 0, -1):
        s = owner.get(".".join(parts[:i]))
        if s is not None:
            return s
    return None


_Tied = tuple[int, int, str, tuple[int, ...], bool]  # elements, bytes, dtype, shape, trainable


def _tied_param(graph: ModelGraph, param: str) -> _Tied | None:
    """A shared parameter's figures, from where the model registers it (None: no shape traced)."""
    shape = next((sh for sh in graph.param_shapes if sh[0] == param), None)
    if shape is None:
        return None
    owner = graph.info(_module_of(param))
    numel = math.prod(shape[1])
    per = owner.own_bytes / owner.own_numel if owner.own_numel else 4
    return numel, round(numel * per), shape[2], tuple(shape[1]), owner.own_trainable_numel > 0


def _tied_copies(graph: ModelGraph, inside: set[str]) -> dict[str, _Tied]:
    """The tied parameters this stage holds a copy of (See [Note: tied copies on stages]), by the
    path the copy takes here (the first member the stage holds)."""
    out: dict[str, _Tied] = {}
    for group in graph.tied_groups:
        here = [p for p in group[1:] if _module_of(p) in inside]
        if _module_of(group[0]) not in inside and here and (tied := _tied_param(graph, group[0])) is not None:
            out[here[0]] = tied
    return out


def boundary_bytes(graph: ModelGraph, modules: tuple[str, ...]) -> int:
    """Bytes of the activation a stage hands on (as traced, one traced batch): the output of
    its last module in forward order."""
    called = [graph.info(m) for m in modules if graph.info(m).order >= 0]
    return max(called, key=lambda m: m.order).output_bytes if called else 0


def stage_graph(graph: ModelGraph, modules: tuple[str, ...], *, first: bool, last: bool) -> ModelGraph:
    """The graph of the stage that owns ``modules`` (module paths, none an ancestor of another).
    ``first``/``last``: whether it is the first / the last stage."""
    keep = _kept(graph, modules)
    inside = {f for fqn in modules for f in graph.subtree(fqn)}
    infos: dict[str, ModuleInfo] = {}
    for m in graph.modules:
        if m.fqn not in keep:
            continue
        if m.fqn not in inside and not first:  # a container's own ops run on the first stage only
            m = replace(m, fwd_flops=0.0, bwd_flops=0.0, saved_bytes=0, fwd_bytes=0, bwd_bytes=0, matmuls=(),
                        attention_flops=0.0, attention_run_flops=0.0, attention_kv_elements=0.0,
                        fwd_ops=0)
        infos[m.fqn] = replace(m, children=tuple(c for c in m.children if c in keep))
    copies = _tied_copies(graph, inside)
    for param, (numel, nbytes, dtype, _shape, trainable) in copies.items():  # See [Note: tied copies on stages]
        fqn = _module_of(param)
        m = infos[fqn]
        by_dtype = dict(m.own_bytes_by_dtype)
        by_dtype[dtype] = by_dtype.get(dtype, 0) + nbytes
        infos[fqn] = replace(m, own_numel=m.own_numel + numel, own_bytes=m.own_bytes + nbytes,
                             own_trainable_numel=m.own_trainable_numel + (numel if trainable else 0),
                             own_trainable_bytes=m.own_trainable_bytes + (nbytes if trainable else 0),
                             own_bytes_by_dtype=tuple(sorted(by_dtype.items())))
    # totals over what the stage holds, deepest first
    for fqn in sorted(infos, key=lambda f: -infos[f].depth):
        m = infos[fqn]
        kids = [infos[c] for c in m.children]
        infos[fqn] = replace(m, total_numel=m.own_numel + sum(k.total_numel for k in kids),
                             total_bytes=m.own_bytes + sum(k.total_bytes for k in kids))
    if not last:
        root = infos[ROOT]
        infos[ROOT] = replace(root, output_bytes=boundary_bytes(graph, modules))
    tree = graph.tree.subgraph(keep).copy()
    for fqn, m in infos.items():
        tree.nodes[fqn]["info"] = m
    chains = tuple(c for c in (tuple(b for b in chain if b in keep) for chain in graph.block_chains) if c)
    tied = tuple(g for g in (tuple(f for f in grp if _module_of(f) in keep) for grp in graph.tied_groups)
                 if len(g) > 1)
    shapes = tuple(s for s in graph.param_shapes if _module_of(s[0]) in keep) + tuple(
        (p, c[3], c[2]) for p, c in copies.items())
    heads = tuple(a for a in graph.attention_heads if a[0] in keep)
    users = tuple(pu for pu in graph.param_users if pu[0] in keep and pu[1] in keep)
    called = [graph.info(m) for m in modules if graph.info(m).order >= 0]
    # a later stage's input: the activation its first module receives
    input_bytes = graph.input_bytes if first or not called else min(called, key=lambda m: m.order).input_bytes
    return replace(graph, modules=tuple(infos[m.fqn] for m in graph.modules if m.fqn in infos), tree=tree,
                   block_chains=chains, tied_groups=tied, param_shapes=shapes, attention_heads=heads,
                   param_users=users, input_bytes=input_bytes,
                   loss_saved_bytes=graph.loss_saved_bytes if last else 0,
                   loss_peak_bytes=graph.loss_peak_bytes if last else 0,
                   loss_grad_bytes=graph.loss_grad_bytes if last else 0)


def tied_sync_s(graph: ModelGraph, plan: Any, fabric: Any) -> float:
    """Seconds a step of pipeline ``plan`` spends summing its tied copies' gradients: See [Note: tied
    copies on stages]. 0 when no tied parameter spans two pipeline ranks."""
    mesh, owner = plan.mesh, plan.pipeline.stage_of()
    total = 0.0
    for group in graph.tied_groups:
        ranks = {s % mesh.pp_size for s in (stage_of(_module_of(p), owner) for p in group) if s is not None}
        tied = _tied_param(graph, group[0]) if len(ranks) > 1 else None
        if tied is not None:
            group_rpn = 1 if mesh.stages_cross_nodes else len(ranks)
            total += fabric.collective_s("all_reduce", len(ranks), group_rpn, tied[1] / mesh.shard_size)[0]
    return total


def stage_compute(compute: ComputeProfile, graph: ModelGraph, *, last: bool) -> ComputeProfile:
    """``compute`` for one stage: measured module times of its modules only; the loss's time on
    the last stage only."""
    names = {m.fqn for m in graph.modules}
    times = tuple(t for t in compute.module_times if t[0] in names)
    return replace(compute, module_times=times, loss_s=compute.loss_s if last else 0.0)
