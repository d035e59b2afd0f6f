"""The step's dtypes and optimizer as the simulator sees them: activations in the
mixed-precision dtype, optimizer state per parameter element.

[Note: compute dtype] The tracer records activation bytes in the dtype the
model was traced in (its parameters' dtype, float32 for the zoo). Under
FSDP2's ``MixedPrecisionPolicy(param_dtype=...)`` the forward runs on
parameters cast to ``param_dtype`` and its floating-point inputs are cast too
(``cast_forward_inputs``), so every floating activation, saved tensor and
module output is ``param_dtype``; the model's output is ``output_dtype`` when
one is given. ``in_compute_dtype`` rescales the graph's activation figures by
(bytes of that dtype) / (bytes of the traced one) before any layout is built:
parameters, gradients and optimizer state keep their storage dtype; the bytes of
memory-bound ops scale the same way (their time follows); other time
is the compute profile's business (measure it, or state its rate, in the dtype
the step runs in). The loss is taken to compute in float32, as the
cross-entropy of the zoo, TorchTitan and Hugging Face do (they upcast the
logits): what it creates and saves stays as traced, and a lower-precision
output adds one copy of it in its own dtype, made before the upcast (the
zoo's loss slices off the last position first; the upcast copy is the one
the float32 trace already counted). A loss that upcasts the whole output
before anything else holds up to one float32 output more than this
(bf16 peaks on 2 gloo ranks: within 0.3% for gpt-, llama- and t5-tiny, 3.5% under for vit-tiny).
"""

from __future__ import annotations

import math
from dataclasses import replace
from itertools import combinations

from wrapopt.spec import ModelGraph, OptimizerKind, factored_state_numel

__all__ = ["in_compute_dtype", "optimizer_states_per_param", "trainable_tensors"]


def in_compute_dtype(graph: ModelGraph, activation_bytes: int | None, output_bytes: int | None) -> ModelGraph:
    """``graph`` with its activation figures in the step's dtypes: See [Note: compute dtype].

    ``None`` keeps a figure as traced; the graph itself is returned when nothing changes."""
    traced = graph.param_bytes / max(1, graph.num_params)  # bytes per element of the traced dtype
    act = (activation_bytes or traced) / traced
    out = (output_bytes or activation_bytes or traced) / traced
    if act == 1.0 and out == 1.0:
        return graph

    def scaled(v: int, r: float) -> int:
        return int(round(v * r))

    modules = tuple(
        replace(m, saved_bytes=scaled(m.saved_bytes, act), input_bytes=scaled(m.input_bytes, act),
                output_bytes=scaled(m.output_bytes, out if m.parent is None else act),
                # memory-bound ops move activations: in the compute dtype too ([Note: memory-bound ops])
                fwd_bytes=scaled(m.fwd_bytes, act), bwd_bytes=scaled(m.bwd_bytes, act))
        for m in graph.modules)
    tree = graph.tree.copy()
    for m in modules:
        tree.nodes[m.fqn]["info"] = m
    upcast = scaled(graph.root.output_bytes, out) if out < 1.0 else 0  # the output's copy before the upcast
    return replace(graph, modules=modules, tree=tree, input_bytes=scaled(graph.input_bytes, act),
                   loss_peak_bytes=graph.loss_peak_bytes + upcast)


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
