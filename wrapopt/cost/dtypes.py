"""The step's dtypes and optimizer as the simulator sees them: activations in the
mixed-precision dtype, optimizer state per parameter element.

[Note: compute dtype] Under FSDP2's ``MixedPrecisionPolicy(param_dtype=...)`` the
forward runs on parameters cast to ``param_dtype`` and its floating-point inputs
are cast too (``cast_forward_inputs``): activations, saved tensors and module
outputs are ``param_dtype`` except where the model upcasts on purpose (Hugging
Face's RMSNorm and softmax, the loss on the logits keep float32 tensors); the
model's output is ``output_dtype`` when one is given. Parameters, gradients and
optimizer state keep their storage dtype. The tracer runs that step itself when
told the compute dtype ([Note: tracing in the compute dtype] in trace/record.py;
``api``, the CLI and the evaluation trace in the step's ``param_dtype``), and the
graph says which dtype it was traced in (``ModelGraph.compute_dtype``): then its
activation figures are taken as they are, upcasts, the loss's float32 work on the
low-precision logits and the memory-bound ops' bytes (their time follows: [Note:
memory-bound ops]) included. Only the model's output is rescaled, to
``output_dtype`` when one is given (a float32 output makes the loss's traced
upcast copy a no-op: up to one float32 output over).

A graph traced in another dtype than the step's (a float32 trace scored under
bf16: a ``Simulator`` built by hand, the "--precision bf16" what-if of
``search.diagnosis``) is rescaled uniformly: ``in_compute_dtype`` multiplies its
activation figures (saved, input, output and selective-op kept bytes, the
memory-bound ops' bytes) by (bytes of the step's dtype) / (bytes of the traced
one) before any layout is built. That halves float32 upcasts too (a block's
float32 norm tensors), so such a what-if reads saved bytes a little under a
trace in the step's dtype. The loss is then taken to compute in float32, as the
cross-entropy of the zoo, TorchTitan and Hugging Face do (they upcast the
logits): what it creates, saves and holds as gradients stays as traced. A loss
that upcasts the whole output before anything else holds one float32 copy of
the output more than a float32 trace shows (it was a no-op there); its
gradients are the tracer's ([Note: the loss's gradients] in trace/record.py).
Other time is the compute profile's business (measure
it, or state its rate, in the dtype the step runs in).
"""

from __future__ import annotations

import math
from dataclasses import replace
from itertools import combinations

from wrapopt.spec import ModelGraph, OptimizerKind, factored_state_numel
from wrapopt.train import DTYPE_BYTES

__all__ = ["in_compute_dtype", "traced_dtype_bytes", "optimizer_states_per_param", "trainable_tensors"]


def traced_dtype_bytes(graph: ModelGraph) -> float:
    """Bytes per element of the dtype ``graph``'s activations were traced in: its
    ``compute_dtype``, else (a graph that does not record it) its parameters'."""
    return DTYPE_BYTES.get(graph.compute_dtype) or graph.param_bytes / max(1, graph.num_params)


def in_compute_dtype(graph: ModelGraph, activation_bytes: int | None, output_bytes: int | None) -> ModelGraph:
    """``graph`` with its activation figures in the step's dtypes: See [Note: compute dtype].

    ``None`` keeps a figure as traced; the graph itself is returned when nothing changes."""
    traced = traced_dtype_bytes(graph)
    act = (activation_bytes or traced) / traced
    out = (output_bytes or activation_bytes or traced) / traced
    if act == 1.0 and out == 1.0:
        return graph

    def scaled(v: int, r: float) -> int:
        return int(round(v * r))

    modules = tuple(
        replace(m, saved_bytes=scaled(m.saved_bytes, act), input_bytes=scaled(m.input_bytes, act),
                output_bytes=scaled(m.output_bytes, out if m.parent is None else act),
                selective_kept_bytes=scaled(m.selective_kept_bytes, act),
                # memory-bound ops move activations: in the compute dtype too ([Note: memory-bound ops])
                fwd_bytes=scaled(m.fwd_bytes, act), bwd_bytes=scaled(m.bwd_bytes, act))
        for m in graph.modules)
    tree = graph.tree.copy()
    for m in modules:
        tree.nodes[m.fqn]["info"] = m
    return replace(graph, modules=modules, tree=tree, input_bytes=scaled(graph.input_bytes, act))


def optimizer_states_per_param(graph: ModelGraph, kind: OptimizerKind) -> float:
    """Optimizer state per trainable parameter element, in the parameters' dtype.

    Elementwise optimizers give their count (AdamW 2, SGD with momentum 1); Adafactor's
    factored state is summed over the graph's parameter shapes."""
    if kind is not OptimizerKind.ADAFACTOR:
        return kind.states_per_param
    numel = sum(math.prod(shape) for _fqn, shape, _dt in graph.param_shapes)
    return sum(factored_state_numel(tuple(shape)) for _fqn, shape, _dt in graph.param_shapes) / max(1, numel)


def trainable_tensors(graph: ModelGraph) -> int:
    """How many parameter tensors require gradients. Per module: all of its own, none, or
    (some frozen) the fewest whose elements add up to its trainable ones."""
    by_module: dict[str, list[int]] = {}
    for fqn, shape, _dt in graph.param_shapes:
        by_module.setdefault(fqn.rsplit(".", 1)[0] if "." in fqn else "", []).append(math.prod(shape))
    count = 0
    for m in graph.modules:
        sizes = by_module.get(m.fqn, [])
        if m.own_trainable_numel == 0 or not sizes:
            continue
        if m.own_trainable_numel >= sum(sizes) or len(sizes) > 12:
            count += len(sizes)
            continue
        count += min((k for k in range(1, len(sizes) + 1) for c in combinations(sizes, k)
                      if sum(c) == m.own_trainable_numel), default=len(sizes))
    return count
