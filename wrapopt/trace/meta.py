"""model -> ModelGraph, without allocating weights.

One forward and backward of the model runs with every parameter, buffer and
input replaced by a meta tensor of the same shape (``torch.func.functional_call``
leaves the user's model untouched). Module hooks give the execution order and
the call counts; a dispatch mode counts FLOPs per module with PyTorch's own
FLOP formulas (``torch.utils.flop_counter``); ``saved_tensors_hooks`` measure
the activations autograd keeps for backward, per module.

[Note: self figures] FLOPs and saved bytes are attributed to the innermost
module running when the op runs ("self" figures); a unit's cost is the sum
over the modules it owns. Backward FLOPs are attributed from forward FLOPs
(2x where the module's own parameters are trained, 1x where only the input
gradient is needed) and then scaled so the total equals the backward FLOPs
actually counted; the per-op backward attribution is unreliable under
autograd.

[Note: tracer fallback] Ops with data-dependent output (``.item()``,
``nonzero``) cannot run on meta tensors. Then the step runs again with the
integer inputs kept real ([Note: integer inputs stay real]); if that fails
too and the model has real weights, the step runs once on the real tensors
(``torch.autograd.grad``, so no ``.grad`` is written). ``ModelGraph.estimates``
says which; a meta model that needs more raises a ``TraceError`` that says
what to pass.

[Note: integer inputs stay real] Token ids, masks and labels are small and
models read their values: BART's decoder asks ``.item()`` whether its
attention mask is all ones. In the second attempt those inputs stay real CPU
tensors while the weights and floating inputs are meta; an op on real
tensors alone runs for real (so values derived from the inputs exist), and
an op that also takes a meta tensor runs on meta with its real operands
moved there (``Recorder.meta_wins``). FLOPs and saved bytes are the same as
on meta: they depend on shapes only.

[Note: fx graph and dataflow] ``trace.fx.export_fx`` keeps the model's fx
graph (``torch.export`` on fake tensors) when it is cheap: export's time grows
with the op count (seconds on a 7B model), so by default (``fx=None``) only
models of at most ``_FX_AUTO_MAX_MODULES`` modules are exported, and
``estimates`` says when it was skipped or failed. The module dataflow (who
feeds whom, see [Note: dataflow] in trace/fx.py) comes from the fx graph when
there is one, else from the ops the tracer's own forward ran, which is free
and follows the same definition.

[Note: who reads a parameter] The dispatch mode also sees every parameter
that a forward op takes as input, and which module is innermost on the stack
then. A read by a module that does not register the parameter (under any of
its tied names) is recorded in ``ModelGraph.param_users`` as (the module that
registers it, the reader): ``nn.MultiheadAttention`` reads its ``out_proj``'s
weight through ``F.multi_head_attention_forward`` and ``out_proj`` never runs;
a head may read a sibling embedding's weight through ``F.linear``. The module
pre-hooks are prepended, as FSDP2's are, so ops in the model's own pre-hooks
count for the module they hook, the same moment FSDP2 has gathered it.

[Note: loss inside forward] A model that computes its own loss (Hugging Face
with ``labels``) runs it in the root's forward, after its last child (the LM
head) returned. The tracer follows the root's own ops after each child
returns (a later child's start discards them); when the trace's loss is the
model's own, what those trailing ops saved moves from the root's activations
to ``loss_saved_bytes`` and their live bytes become ``loss_peak_bytes``, so
the report and the simulator see the model's loss as they see a user's.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import replace
from typing import Any, Callable

import networkx as nx
import torch
import torch.nn as nn

from wrapopt.errors import ModelError, OptionError
from wrapopt.losses import DefaultLoss, labels_for, user_loss_choice
from wrapopt.selective import selective_figures
from wrapopt.spec import ROOT, ModelGraph, ModuleInfo, TraceRecord
from wrapopt.trace import ops
from wrapopt.trace.fx import export_fx
from wrapopt.tp import attention_heads
from wrapopt.train import TORCH_DTYPES, dtype_name
from wrapopt.wrapped import check_unwrapped
from wrapopt.trace.ops import nbytes, tensors_in
from wrapopt.trace.record import StepRecord, record_step

__all__ = ["trace_model"]

# fx=None exports the fx graph only for models this small; see [Note: fx graph and dataflow].
_FX_AUTO_MAX_MODULES = 200

def trace_model(
    model: nn.Module,
    example_inputs: tuple[Any, ...] | Any,
    *,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    example_kwargs: dict[str, Any] | None = None,
    fx: bool | None = None,
    compute_dtype: torch.dtype | str | None = None,
) -> ModelGraph:
    """Trace ``model`` on meta tensors and return its ``ModelGraph``.

    Args:
        model: any ``nn.Module``, with real weights or built under ``torch.device("meta")``;
            it is not modified and no weight memory is allocated.
        example_inputs: positional inputs of one per-rank batch (a tuple, or one tensor).
        loss_fn: ``loss_fn(output, inputs) -> scalar``; default: the model's own loss, else
            cross-entropy for logits-shaped outputs, else the mean square of the outputs
            (``ModelGraph.loss`` names the one used; see [Note: the assumed loss] in losses.py).
        example_kwargs: keyword inputs, if the model takes any.
        fx: keep the model's fx graph (``torch.export`` on fake tensors) and take the
            dataflow from it: True always, False never, None (default) when the model has
            at most 200 modules. A failed export is recorded in ``estimates``, never raised.
        compute_dtype: the step's, FSDP2's ``MixedPrecisionPolicy.param_dtype``: the floating
            parameters and forward inputs are cast to it (activations as that step makes them, float32
            upcasts included; parameters keep their storage dtype); None (default): the model's own.
            See [Note: tracing in the compute dtype] in trace/record.py.

    Example:
        >>> from wrapopt import zoo
        >>> model, inputs = zoo.build("gpt-tiny", "meta")
        >>> graph = trace_model(model, inputs)
        >>> graph.num_params > 0
        True
    """
    if not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,)
    example_kwargs = example_kwargs or {}
    check_unwrapped(model, "trace")  # See wrapopt/wrapped.py
    run_kwargs, loss_fn, choice = _loss_to_run(model, example_inputs, example_kwargs, loss_fn)
    t0 = time.perf_counter()

    by_id, params = _parameters_by_identity(model)
    tied_groups = tuple(tuple(names) for names in by_id.values() if len(names) > 1)
    named_modules = list(model.named_modules(remove_duplicate=False))
    modules_by_name: dict[str, nn.Module] = {}
    for fqn, m in named_modules:
        modules_by_name.setdefault(fqn, m)

    compute_name, compute = _compute_dtype(model, compute_dtype)
    estimates: list[str] = []
    rec = record_step(model, example_inputs, run_kwargs, loss_fn, by_id, params, estimates, compute=compute)
    choice = choice or loss_fn.choice  # type: ignore[attr-defined]
    loss = _loss_figures(rec, choice.kind)
    graph = _build_graph(model, named_modules, by_id, params, rec)
    infos: tuple[ModuleInfo, ...] = tuple(graph.nodes[fqn]["info"]
                                          for fqn in dict.fromkeys(f for f, _ in named_modules))
    infos, chains = _with_selective(infos, graph, rec, _block_chains(modules_by_name, infos, graph))
    shapes = tuple((names[0], tuple(params[i].shape), ops.dtype_name(params[i].dtype))
                   for i, names in by_id.items())
    fx_graph, dataflow = _fx_and_dataflow(model, example_inputs, example_kwargs, rec.flow, len(modules_by_name),
                                          fx=fx, estimates=estimates)
    estimates.append(f"traced in {time.perf_counter() - t0:.2f} s")
    return ModelGraph(
        model_class=type(model).__name__,
        modules=infos,
        tree=graph,
        tied_groups=tied_groups,
        block_chains=chains,
        param_shapes=tuple(sorted(shapes)),
        input_bytes=nbytes(example_inputs, floating=compute) + nbytes(example_kwargs, floating=compute),
        estimates=tuple(estimates[:-1]),
        trace=TraceRecord(fx_graph=fx_graph, dataflow=dataflow),
        **loss,
        param_users=_param_users(by_id, rec.param_reads),
        loss=choice.name,
        loss_kind=choice.kind,
        **_batch_and_seq(example_inputs, example_kwargs),
        attention_heads=attention_heads(model),
        compute_dtype=compute_name,
    )


def _loss_figures(rec: StepRecord, kind: str) -> dict[str, int]:
    """The loss's figures for ``ModelGraph``; a model's own loss takes the root's trailing ops
    from its activations (See [Note: loss inside forward])."""
    if kind == "model":
        rec.saved[ROOT] -= rec.tail_saved
        rec.loss_saved, rec.loss_peak = rec.loss_saved + rec.tail_saved, max(rec.loss_peak, rec.tail_peak)
    return {"loss_saved_bytes": rec.loss_saved, "loss_peak_bytes": rec.loss_peak, "loss_grad_bytes": rec.loss_grads}


def _compute_dtype(model: nn.Module, given: torch.dtype | str | None) -> tuple[str, torch.dtype | None]:
    """The name of the dtype the traced step computes in, and the dtype its floating parameters and
    inputs are cast to (None: none is, the model's own): See [Note: tracing in the compute dtype]
    in trace/record.py."""
    if given is None:
        own = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
        return (ops.dtype_name(own) if own is not None else ""), None
    try:
        name = dtype_name(given, what="compute_dtype")
    except OptionError as e:
        raise OptionError(f"trace_model: {e}") from None
    return name, TORCH_DTYPES[name]  # type: ignore[index]


def _loss_to_run(model: nn.Module, example_inputs: tuple[Any, ...], example_kwargs: dict[str, Any],
                 loss_fn: Callable[..., torch.Tensor] | None) -> tuple[dict[str, Any], Callable[..., Any], Any]:
    """The keyword inputs to run with, the loss to run and the user's loss choice (None: assumed)."""
    run_kwargs, choice = example_kwargs, user_loss_choice(loss_fn) if loss_fn is not None else None
    if loss_fn is None:  # See [Note: the assumed loss] in losses.py
        run_kwargs = labels_for(model, example_inputs, example_kwargs) or example_kwargs
        loss_fn = DefaultLoss.for_model(model, labelled=run_kwargs is not example_kwargs)
    return run_kwargs, loss_fn, choice


def _parameters_by_identity(model: nn.Module) -> tuple[dict[int, list[str]], dict[int, nn.Parameter]]:
    """Every parameter FQN grouped by identity (tied parameters share one object), and the
    parameter of each group; raises ``ModelError`` for a model with none."""
    by_id: dict[int, list[str]] = defaultdict(list)
    params: dict[int, nn.Parameter] = {}
    for fqn, p in model.named_parameters(remove_duplicate=False):
        by_id[id(p)].append(fqn)
        params[id(p)] = p
    if not params:
        raise ModelError(f"{type(model).__name__} has no parameters: there is nothing for FSDP to shard")
    return by_id, params


def _fx_and_dataflow(
    model: nn.Module,
    example_inputs: tuple[Any, ...],
    example_kwargs: dict[str, Any],
    flow: nx.DiGraph,
    num_modules: int,
    *,
    fx: bool | None,
    estimates: list[str],
) -> tuple[Any, nx.DiGraph]:
    """The fx graph, when kept, and the dataflow: the fx graph's, else ``flow`` (the traced
    forward's). See [Note: fx graph and dataflow]."""
    fx_graph, dataflow = None, flow
    if fx is None and num_modules > _FX_AUTO_MAX_MODULES:
        estimates.append(
            f"fx graph not kept: {num_modules} modules > {_FX_AUTO_MAX_MODULES} (export takes seconds "
            "at this size; pass fx=True to keep it); dataflow from the traced forward's ops"
        )
    elif fx or fx is None:
        fx_graph, fx_flow, failure = export_fx(model, example_inputs, example_kwargs)
        if fx_graph is None:
            estimates.append(f"fx graph not kept: {failure}; dataflow from the traced forward's ops")
        else:
            dataflow = fx_flow
    return fx_graph, dataflow


def _batch_and_seq(inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, int]:
    """The first input's leading dim, and the length of 2-D integer token inputs (0: none)."""
    tensors = [t for t in tensors_in((inputs, kwargs)) if t.dim() >= 1]
    seq = next((t.shape[1] for t in tensors if t.dim() == 2 and not t.is_floating_point() and t.dtype != torch.bool), 0)
    return {"batch_size": int(tensors[0].shape[0]) if tensors else 0, "seq_len": int(seq)}


def _param_users(by_id: dict[int, list[str]], reads: dict[tuple[int, str], None]) -> tuple[tuple[str, str], ...]:
    """(module registering a parameter, another module whose forward read it), in the
    order of first read; reads by a module under one of the parameter's tied names are
    its own. See [Note: who reads a parameter]."""
    out: dict[tuple[str, str], None] = {}
    for key, user in reads:
        names = by_id[key]
        modules = [n.rsplit(".", 1)[0] if "." in n else ROOT for n in names]
        if user not in modules:
            out.setdefault((modules[0], user), None)
    return tuple(out)


def _build_graph(
    model: nn.Module,
    named_modules: list[tuple[str, nn.Module]],
    by_id: dict[int, list[str]],
    params: dict[int, nn.Parameter],
    rec: StepRecord,
) -> nx.DiGraph:
    # Own parameters: each parameter object is counted once, at its first FQN's module.
    own: dict[str, list[nn.Parameter]] = defaultdict(list)
    for i, names in by_id.items():
        owner = names[0].rsplit(".", 1)[0] if "." in names[0] else ROOT
        own[owner].append(params[i])

    # Backward attribution: see [Note: self figures].
    trained_here = {n: any(p.requires_grad for p in own.get(n, [])) for n, _ in named_modules}
    raw_bwd = {n: f * (2.0 if trained_here.get(n) or not own.get(n) else 1.0) for n, f in rec.fwd.items()}
    total_raw = sum(raw_bwd.values())
    scale = rec.bwd_total / total_raw if total_raw > 0 else 0.0
    # Backward bytes of memory-bound ops, in proportion to forward bytes: See [Note: memory-bound ops]
    # in op_bytes.py.
    total_fwd_bytes = sum(rec.fwd_bytes.values())
    bytes_scale = rec.bwd_bytes_total / total_fwd_bytes if total_fwd_bytes > 0 else 0.0

    names = list(dict.fromkeys(n for n, _ in named_modules))
    children: dict[str, list[str]] = defaultdict(list)
    for n in names:
        if n != ROOT:
            children[n.rsplit(".", 1)[0] if "." in n else ROOT].append(n)
    # Totals bottom-up: parameters de-duplicated by object.
    total_ids: dict[str, set[int]] = {}
    for n in sorted(names, key=lambda s: -s.count(".") if s else 1):
        ids = {id(p) for p in own.get(n, [])}
        for c in children.get(n, []):
            ids |= total_ids[c]
        total_ids[n] = ids

    g = nx.DiGraph()
    for n in names:
        ps = own.get(n, [])
        by_dtype: dict[str, int] = defaultdict(int)
        for p in ps:
            by_dtype[ops.dtype_name(p.dtype)] += p.numel() * p.element_size()
        tot = [params[i] for i in total_ids[n]]
        parent = None if n == ROOT else (n.rsplit(".", 1)[0] if "." in n else ROOT)
        info = ModuleInfo(
            fqn=n,
            cls=type(model.get_submodule(n)).__name__,
            parent=parent,
            children=tuple(children.get(n, [])),
            depth=0 if n == ROOT else n.count(".") + 1,
            own_numel=sum(p.numel() for p in ps),
            own_bytes=sum(p.numel() * p.element_size() for p in ps),
            own_trainable_numel=sum(p.numel() for p in ps if p.requires_grad),
            own_trainable_bytes=sum(p.numel() * p.element_size() for p in ps if p.requires_grad),
            own_bytes_by_dtype=tuple(sorted(by_dtype.items())),
            total_numel=sum(p.numel() for p in tot),
            total_bytes=sum(p.numel() * p.element_size() for p in tot),
            fwd_flops=rec.fwd.get(n, 0.0),
            bwd_flops=raw_bwd.get(n, 0.0) * scale,
            saved_bytes=rec.saved.get(n, 0),
            output_bytes=rec.out_bytes.get(n, 0),
            order=rec.order.get(n, -1),
            num_calls=rec.calls.get(n, 0),
            input_bytes=rec.in_bytes.get(n, 0),
            fwd_bytes=rec.fwd_bytes.get(n, 0),
            bwd_bytes=int(rec.fwd_bytes.get(n, 0) * bytes_scale),
            experts=rec.experts.get(n, 0),
            matmuls=rec.matmuls.get(n, ()),
            attention_flops=rec.attention.get(n, (0.0, 0.0, 0.0))[0],
            attention_run_flops=rec.attention.get(n, (0.0, 0.0, 0.0))[1],
            attention_kv_elements=rec.attention.get(n, (0.0, 0.0, 0.0))[2],
            fwd_ops=rec.fwd_ops.get(n, 0),
            early_stop=rec.early_stop.get(n, ()),
        )
        g.add_node(n, info=info)
        if parent is not None:
            g.add_edge(parent, n)
    return g


def _with_selective(infos: tuple[ModuleInfo, ...], g: nx.DiGraph, rec: Any,
                    chains: tuple[tuple[str, ...], ...]) -> tuple[tuple[ModuleInfo, ...], tuple[tuple[str, ...], ...]]:
    """(``infos`` (and the tree's) with what selective-op keeps and recomputes of each module, from the
    tracer's log of saved ops, its mm parity counted per block: See [Note: selective checkpointing]; ``chains``)."""
    figures = selective_figures(rec.selective_log, rec.selective_read, {b for c in chains for b in c})
    out = []
    for m in infos:
        if m.fqn in figures:
            kept, unread, mm = figures[m.fqn]
            total = sum(row[0] * row[-1] for row in m.matmuls)
            m = replace(m, selective_kept_bytes=kept, selective_unread=unread,
                        selective_mm_recompute=min(1.0, mm / total) if total else 0.0)
            g.nodes[m.fqn]["info"] = m
        out.append(m)
    return tuple(out), chains


def _block_chains(
    modules_by_name: dict[str, nn.Module], infos: tuple[ModuleInfo, ...], g: nx.DiGraph
) -> tuple[tuple[str, ...], ...]:
    """Runs of >= 2 same-class children of a ModuleList/Sequential that hold parameters
    and ran in forward; outermost runs only, ordered by execution."""
    chains: list[tuple[str, ...]] = []
    for info in infos:
        container = modules_by_name[info.fqn]
        if not isinstance(container, (nn.ModuleList, nn.Sequential)):
            continue
        by_cls: dict[str, list[ModuleInfo]] = defaultdict(list)
        for c in info.children:
            ci = g.nodes[c]["info"]
            if ci.total_numel > 0 and ci.order >= 0:
                by_cls[ci.cls].append(ci)
        for members in by_cls.values():
            if len(members) >= 2:
                chains.append(tuple(m.fqn for m in sorted(members, key=lambda m: m.order)))
    # Drop chains nested inside a member of another chain (experts inside a block).
    outer = [
        c for c in chains
        if not any(c is not o and any(c[0].startswith(m + ".") for m in o) for o in chains)
    ]
    return tuple(sorted(outer, key=lambda c: g.nodes[c[0]]["info"].order))
