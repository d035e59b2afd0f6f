"""Human-readable views: the traced module tree and a plan, as text and JSON."""

from __future__ import annotations

from typing import Any

from wrapopt.fileio import fmt_bytes
from wrapopt.spec import ROOT, ModelGraph

__all__ = ["format_graph", "graph_to_json", "format_plan"]


def _flops(x: float) -> str:
    for unit, div in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if x >= div:
            return f"{x / div:.2f}{unit}"
    return f"{x:.0f}"


def format_graph(graph: ModelGraph, *, depth: int = 2) -> str:
    """The module tree folded below ``depth``: parameters, FLOPs and saved activations
    per subtree, execution order and calls."""
    totals: dict[str, list[float]] = {}
    for m in reversed(graph.modules):  # children before parents in named_modules order reversed
        t = totals.setdefault(m.fqn, [0.0, 0.0, 0.0])
        t[0] += m.fwd_flops
        t[1] += m.bwd_flops
        t[2] += m.saved_bytes
        if m.parent is not None:
            p = totals.setdefault(m.parent, [0.0, 0.0, 0.0])
            for i in range(3):
                p[i] += t[i]
    head = (f"{'module':48} {'class':22} {'params':>12} {'fwd FLOPs':>10} {'bwd FLOPs':>10} {'saved act':>11} "
            f"{'order':>5} {'calls':>5}")
    lines = [f"{graph.model_class}: {graph.num_params:,} parameters ({fmt_bytes(graph.param_bytes)}), "
             f"{len(graph.modules)} modules, block chains: "
             + (", ".join(f"{len(c)} x {graph.info(c[0]).cls}" for c in graph.block_chains) or "none")
             + (f"; traced in {graph.compute_dtype}" if graph.compute_dtype else ""),
             head, "-" * len(head)]
    for m in graph.modules:
        if m.depth > depth:
            continue
        name = ("  " * m.depth + (m.fqn.rsplit(".", 1)[-1] if m.fqn else "<root>"))[:48]
        f, b, a = totals[m.fqn]
        folded = "+" if m.depth == depth and m.children else " "
        lines.append(f"{name:47}{folded} {m.cls[:22]:22} {m.total_numel:12,} {_flops(f):>10} {_flops(b):>10} "
                     f"{fmt_bytes(a):>11} {m.order:5d} {m.num_calls:5d}")
    if graph.tied_groups:
        lines.append("tied parameters (kept in one unit): " + "; ".join(" = ".join(g) for g in graph.tied_groups))
    if graph.param_users:  # See [Note: parameter users] in units.py.
        lines.append("parameters read by another module (kept in its unit): "
                     + "; ".join(f"{m} read by {u or '<root>'}" for m, u in graph.param_users[:8])
                     + (f" (+{len(graph.param_users) - 8} more)" if len(graph.param_users) > 8 else ""))
    experts = [m for m in graph.modules if m.experts]
    if experts:  # See [Note: experts on meta] in trace/ops.py.
        lines.append("experts (stacked weights, one unit's; compute counted for the routed tokens only): "
                     + ", ".join(f"{m.fqn} ({m.experts}, {m.total_numel:,} parameters)" for m in experts[:8])
                     + (f" (+{len(experts) - 8} more)" if len(experts) > 8 else ""))
    # Containers (ModuleList, ...) are never called themselves; only modules none of whose parts ran.
    never = graph.never_called
    if never:
        lines.append(f"never called: {', '.join(never[:8])}" + (f" (+{len(never) - 8} more)" if len(never) > 8 else ""))
    multi = graph.multi_called
    if multi:
        lines.append("called more than once: " + ", ".join(f"{f} ({graph.info(f).num_calls}x)" for f in multi[:8])
                     + (f" (+{len(multi) - 8} more)" if len(multi) > 8 else ""))
    lines.extend(_format_dataflow(graph, depth))
    for e in graph.estimates:
        lines.append(f"note: {e}")
    return "\n".join(lines)


def _format_dataflow(graph: ModelGraph, depth: int) -> list[str]:
    flow = graph.trace.dataflow
    fx_note = (f"fx graph kept ({len(graph.trace.fx_graph.graph.nodes)} nodes)" if graph.trace.fx_graph is not None
               else "no fx graph kept")
    if flow is None:
        return [f"dataflow: not traced; {fx_note}"]
    source = "the fx graph" if graph.trace.fx_graph is not None else "the traced ops"
    lines = [f"dataflow: {flow.number_of_edges()} edges between {flow.number_of_nodes()} modules "
             f"({fmt_bytes(sum(d['bytes'] for *_, d in flow.edges(data=True)))} passed, from {source}); {fx_note}"]
    # Folded like the table (each module stands for its subtree below ``depth``), except
    # that a block of a block chain always stands for itself: the chain stays visible.
    blocks = set(graph.blocks)

    def fold(fqn: str) -> str:
        parts = fqn.split(".")
        for i in range(len(parts), 0, -1):
            if ".".join(parts[:i]) in blocks:
                return ".".join(parts[:i])
        return ".".join(parts[:depth])

    folded: dict[tuple[str, str], int] = {}
    first: dict[tuple[str, str], int] = {}  # the first op that used the folded edge
    for a, b, d in flow.edges(data=True):
        key = (fold(a), fold(b))
        if key[0] != key[1]:
            folded[key] = folded.get(key, 0) + d["bytes"]
            first[key] = min(first.get(key, d.get("first_op", 0)), d.get("first_op", 0))
    edges = sorted(folded.items(), key=lambda kv: first[kv[0]])
    if edges:
        name = lambda f: "<root>" if f == ROOT else f  # noqa: E731
        shown = ", ".join(f"{name(a)} -> {name(b)} ({fmt_bytes(n)})" for (a, b), n in edges[:10])
        more = f" (+{len(edges) - 10} more)" if len(edges) > 10 else ""
        lines.append(f"  folded to depth {depth} (blocks kept whole): {shown}{more}")
    return lines


def graph_to_json(graph: ModelGraph) -> dict[str, Any]:
    flow = graph.trace.dataflow
    return {
        "format": "wrapopt.graph/1",
        "model_class": graph.model_class,
        "num_params": graph.num_params,
        "param_bytes": graph.param_bytes,
        "compute_dtype": graph.compute_dtype,  # the activations' (See [Note: tracing in the compute dtype])
        "tied_groups": [list(g) for g in graph.tied_groups],
        "block_chains": [list(c) for c in graph.block_chains],
        "estimates": list(graph.estimates),
        "multi_called": list(graph.multi_called),
        "never_called": list(graph.never_called),
        "param_users": [list(p) for p in graph.param_users],  # [module, the module whose forward reads its parameters]
        "fx_graph": {"kept": graph.trace.fx_graph is not None,
                     "num_nodes": len(graph.trace.fx_graph.graph.nodes) if graph.trace.fx_graph is not None else 0},
        # [src, dst, bytes, num_values]: a value produced by src's ops is read by dst's ops.
        "dataflow": None if flow is None else [
            [a, b, d["bytes"], d["num_values"]] for a, b, d in flow.edges(data=True)],
        "modules": [
            {"fqn": m.fqn, "class": m.cls, "parent": m.parent, "depth": m.depth, "own_numel": m.own_numel,
             "own_bytes": m.own_bytes, "own_trainable_numel": m.own_trainable_numel, "total_numel": m.total_numel,
             "fwd_flops": m.fwd_flops, "bwd_flops": m.bwd_flops, "saved_bytes": m.saved_bytes,
             "output_bytes": m.output_bytes, "order": m.order, "num_calls": m.num_calls, "experts": m.experts}
            for m in graph.modules
        ],
    }


def _stored_dtype(model: dict) -> str:
    """The dtype the fingerprinted model's parameters are stored in (the master weights)."""
    return next((p.get("dtype", "float32") for p in (model.get("params") or {}).values()), "float32")


def _microbatches(plan: Any) -> int | None:
    """A pipeline plan's micro-batch count (None: no pipeline)."""
    return plan.spec.pipeline.microbatches if plan.spec.pipeline is not None else None


def format_plan(plan) -> str:
    p = plan.prediction
    fab = plan.fabric
    lines = [
        f"plan {plan.spec.label or ''} for {plan.model.get('class')} ({plan.model.get('num_params', 0):,} parameters), "
        f"wrapopt {plan.wrapopt_version}, {plan.created}",
        f"mesh: {plan.mesh.world_size} ranks, {plan.mesh.ranks_per_node} per node, shard group {plan.mesh.shard_size}"
        + (f", tensor parallel {plan.mesh.tp_size} inside the node" if plan.mesh.tp_size > 1 else "")
        + (" (HSDP)" if plan.mesh.is_hsdp else ""),
        f"scored on fabric {fab.get('name')} ({str(fab.get('kind', '?')).upper()}), compute {fab.get('compute')}",
        "training: " + (plan.train.describe(_stored_dtype(plan.model), pipeline_microbatches=_microbatches(plan))
                        if plan.train is not None
                        else "not recorded (a plan file written before it was: no mixed precision, one micro-batch, "
                             "AdamW)"),
    ]
    for cls, pairs in (plan.spec.tp.layers if plan.spec.tp is not None else ()):
        split = {style: [path for path, st in pairs if st == style] for style in ("colwise", "rowwise")}
        lines.append(f"tensor parallel ({plan.spec.tp.source}) in every {cls}: colwise {', '.join(split['colwise'])}; "
                     f"rowwise {', '.join(split['rowwise'])}; {plan.spec.tp.switches()}")
    if p:
        lines.append(f"predicted: step {p.get('step_s', 0) * 1e3:.2f} ms, "
                     f"exposed comm {p.get('exposed_comm_s', 0) * 1e3:.2f} ms, "
                     f"peak {fmt_bytes(p.get('peak_bytes', 0))} per rank")
    lines.append(f"{len(plan.units)} units (applied in this order, root last):")
    for i, u in enumerate(plan.units):
        if u.is_root:
            mods = "<root>"
        elif len(u.modules) == 1:
            mods = u.modules[0]
        else:
            mods = f"[{u.modules[0]} .. {u.modules[-1]}] ({len(u.modules)} modules)"
        lines.append(f"  {i:3d}  {mods:50} reshard_after_forward={u.reshard_after_forward} checkpoint={u.checkpoint}")
    if plan.baselines:
        lines.append("baselines on the same fabric:")
        for name, b in plan.baselines.items():
            lines.append(f"  {name:14} {b.get('num_units', 0):4d} units  step {b.get('step_s', 0) * 1e3:9.2f} ms  "
                         f"peak {fmt_bytes(b.get('peak_bytes', 0)):>11}  {'fits' if b.get('fits') else 'does not fit'}")
    if plan.assumptions is not None:
        lines += plan.assumptions.lines()
    return "\n".join(lines)
