"""The model's torch.fx graph and the dataflow between its modules, without weights.

[Note: fx export on fake tensors] ``torch.export.export(..., strict=False)``
traces the Python forward (plain ``torch.fx.symbolic_trace`` fails on Hugging
Face models) into an ATen-level fx graph whose nodes carry
``meta["nn_module_stack"]``, the modules running when each op was recorded.
Every parameter and buffer is swapped for a fake tensor of the same shape,
dtype and device for the duration of the export
(``_reparametrize_module``, one fake per tensor object so tied weights stay
tied), and the inputs are faked too: nothing is allocated, and the user's
model gets its own parameter objects back afterwards. A meta model gets fakes
on the inputs' device (CPU by default), so device-dependent code in forward
sees a real device. The model runs inside a thin wrapper that returns its
output tensors as a flat tuple: export rejects outputs it cannot flatten (the
``DynamicCache`` of Hugging Face models), and nothing downstream needs more.
Export can fail on models it cannot follow (data-dependent Python control
flow); ``export_fx`` then returns the reason instead of raising.

[Note: dataflow] The dataflow graph has one node per module that owns ops
(the innermost module on the stack when the op ran; ``""`` for ops of the
root's own forward) and an edge A -> B when a value produced by an op of A is
read by an op of B. The edge's ``bytes`` sum the sizes of the distinct values
that flow (a value read by several ops of B counts once); ``num_values``
counts them; ``first_op`` is the position (in forward order) of the first op
that read one. Nodes carry ``num_ops``. Parameters, buffers and model inputs
are produced by no op and start no edge. The same definition is computed from
the fx graph (``fx_dataflow``) and, op by op, from the tracer's own forward
(``OpDataflow``), so a model that cannot be exported still gets one. The two
see ops at different levels (export's graph is above autograd, the tracer's
dispatch mode below it, where ``linear`` is a view and an ``addmm``), but the
values crossing module boundaries are the same: on the zoo models the two
graphs have the same edges with the same bytes (tested on gpt-tiny).
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
import warnings
from typing import Any, Iterator

import networkx as nx
import torch
import torch.nn as nn
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.weak import WeakTensorKeyDictionary

from wrapopt.spec import ROOT

__all__ = ["export_fx", "fx_dataflow", "OpDataflow"]

_WRAPPED = "model"  # attribute under which the wrapper holds the model (stripped from FQNs)


class _FlatOutputs(nn.Module):
    """Calls the model and returns its output tensors as a flat tuple (see
    [Note: fx export on fake tensors])."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, ...]:
        return tuple(_tensors(self.model(*args, **kwargs)))


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):  # Hugging Face ModelOutput is an OrderedDict
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []  # caches and other objects: not part of the graph's outputs


def export_fx(
    model: nn.Module,
    example_inputs: tuple[Any, ...] | Any,
    example_kwargs: dict[str, Any] | None = None,
) -> tuple[torch.fx.GraphModule | None, nx.DiGraph, str | None]:
    """Export ``model`` to an fx graph on fake tensors and derive the module dataflow.

    Never raises for a model export cannot follow: it returns ``(None, empty
    graph, reason)`` and the caller records the reason. The model is not
    modified and no weight or activation memory is allocated.

    Args:
        model: any ``nn.Module``, with real weights or on the meta device.
        example_inputs: positional inputs (a tuple, or one tensor).
        example_kwargs: keyword inputs, if any.

    Returns:
        ``(graph_module, dataflow, failure)``: the exported ``GraphModule``
        (every ``call_function`` node has ``meta["module_fqn"]``, the FQN of
        its innermost module as in ``named_modules()``), the dataflow DiGraph
        (see [Note: dataflow]) and ``None``; or ``None``, an empty DiGraph and
        why export failed.

    Example:
        >>> from wrapopt import zoo
        >>> model, inputs = zoo.build("gpt-tiny", "meta")
        >>> gm, flow, failure = export_fx(model, inputs)
        >>> failure is None and flow.has_edge("layers.0", "layers.1.ln_1")
        True
    """
    if not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,)
    example_kwargs = example_kwargs or {}
    try:
        gm = _export(model, example_inputs, example_kwargs)
    except Exception as e:  # export's failures are many and varied; report, never raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return None, nx.DiGraph(), f"fx export failed: {type(e).__name__}: {first[:300]}"
    return gm, fx_dataflow(gm, model), None


def _export(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.fx.GraphModule:
    from torch._subclasses.fake_tensor import FakeTensorMode

    fake_mode = FakeTensorMode()
    device = _fake_device(model, args, kwargs)

    def fake(t: torch.Tensor) -> torch.Tensor:
        if not t.is_meta:
            return fake_mode.from_tensor(t)  # a fake twin; the real storage is not read
        with fake_mode:
            return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)

    # One fake per tensor object, under its first name: tied parameters stay tied.
    state: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) not in seen:
            seen.add(id(p))
            state[name] = nn.Parameter(fake(p), requires_grad=p.requires_grad)
    for name, b in model.named_buffers(remove_duplicate=False):
        if id(b) not in seen:
            seen.add(id(b))
            state[name] = fake(b)
    fake_any = lambda x: fake(x) if isinstance(x, torch.Tensor) else x  # noqa: E731
    fake_args, fake_kwargs = tree_map(fake_any, args), tree_map(fake_any, kwargs)
    with _quiet(), _reparametrize_module(model, state, tie_weights=True, strict=False):
        exported = torch.export.export(_FlatOutputs(model), fake_args, fake_kwargs, strict=False)
    return exported.graph_module


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Silence export's warnings, logs and the partial graph it prints to stderr on
    failure: the failure is reported once, in ``ModelGraph.estimates``."""
    torch_log = logging.getLogger("torch")
    level = torch_log.level
    torch_log.setLevel(logging.CRITICAL)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        torch_log.setLevel(level)


def _fake_device(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.device:
    """Where fakes of meta tensors live: the first real device among inputs and weights, else CPU."""
    for x in list(tree_leaves((args, kwargs))) + list(model.parameters()):
        if isinstance(x, torch.Tensor) and not x.is_meta:
            return x.device
    return torch.device("cpu")


# --- module attribution and dataflow -------------------------------------------------


_PREFIXES = re.compile(r"^(L\['self'\]\.?|L__self___?|self\.?)")


def _canonical_names(model: nn.Module) -> dict[str, str]:
    """Every name of every module -> its name in ``named_modules()`` (first name
    of a module registered twice), the names the tracer uses."""
    first: dict[int, str] = {}
    out: dict[str, str] = {}
    for name, m in model.named_modules(remove_duplicate=False):
        out[name] = first.setdefault(id(m), name)
    return out


def _clean_path(path: str) -> str:
    """An ``nn_module_stack`` path as a ``named_modules()`` FQN, without the wrapper."""
    path = _PREFIXES.sub("", path.split("@")[0])  # "layers.0@1": the second call of layers.0
    path = re.sub(r"\[(\d+)\]", r".\1", path).strip(".")  # "layers[0]" (older exports)
    if path == _WRAPPED:
        return ROOT
    if path.startswith(_WRAPPED + "."):
        return path[len(_WRAPPED) + 1:]
    return path


def _node_module(node: torch.fx.Node, canonical: dict[str, str]) -> str:
    """The FQN of the innermost module that ran ``node`` (``""`` for top-level ops)."""
    stack = node.meta.get("nn_module_stack") or {}
    for key, value in reversed(list(stack.items())):
        path = value[0] if isinstance(value, tuple) else str(key)
        fqn = _clean_path(path)
        # Unknown names (a renamed submodule): the longest known prefix.
        while fqn and fqn not in canonical:
            fqn = fqn.rsplit(".", 1)[0] if "." in fqn else ROOT
        if fqn in canonical:
            return canonical[fqn]
    return ROOT


def _val_bytes(val: Any) -> int:
    if isinstance(val, torch.Tensor):
        try:
            return int(val.numel()) * val.element_size()
        except (TypeError, RuntimeError):  # unbacked symbolic sizes
            return 0
    if isinstance(val, (list, tuple)):
        return sum(_val_bytes(v) for v in val)
    return 0


def fx_dataflow(gm: torch.fx.GraphModule, model: nn.Module) -> nx.DiGraph:
    """The module dataflow of an exported graph (see [Note: dataflow]); also sets
    ``node.meta["module_fqn"]`` on every ``call_function`` node."""
    canonical = _canonical_names(model)
    flow = _FlowBuilder()
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        fqn = _node_module(node, canonical)
        node.meta["module_fqn"] = fqn
        flow.op(fqn, [(inp.meta.get("module_fqn"), inp, _val_bytes(inp.meta.get("val")))
                      for inp in node.all_input_nodes if inp.op == "call_function"])
    return flow.graph


class _FlowBuilder:
    """Accumulates the dataflow graph from the ops of one forward, in order."""

    def __init__(self) -> None:
        self.graph = nx.DiGraph()
        self._counted: set[tuple[Any, str]] = set()  # (value, consumer) pairs already on an edge
        self._num_ops = 0

    def op(self, fqn: str, inputs: list[tuple[str | None, Any, int]]) -> None:
        """One op of module ``fqn`` reading ``(producer module, value key, bytes)`` inputs."""
        if fqn not in self.graph:
            self.graph.add_node(fqn, num_ops=0)
        self.graph.nodes[fqn]["num_ops"] += 1
        self._num_ops += 1
        for src, value, nbytes in inputs:
            if src is None or src == fqn or (value, fqn) in self._counted:
                continue
            self._counted.add((value, fqn))
            if self.graph.has_edge(src, fqn):
                edge = self.graph.edges[src, fqn]
                edge["bytes"] += nbytes
                edge["num_values"] += 1
            else:
                self.graph.add_edge(src, fqn, bytes=nbytes, num_values=1, first_op=self._num_ops - 1)


class OpDataflow:
    """The dataflow of one forward, recorded op by op (from the tracer's dispatch mode).

    ``record(fqn, args, kwargs, out)`` is called for every forward op with the
    innermost running module. Tensors are keyed weakly, so nothing is kept alive.
    """

    def __init__(self) -> None:
        self._flow = _FlowBuilder()
        # tensor -> (producer module, value id); an in-place op makes a new value.
        self._producer: WeakTensorKeyDictionary = WeakTensorKeyDictionary()
        self._num_values = 0

    def record(self, fqn: str, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        inputs = []
        for t in _flat_tensors(args, kwargs.values()):
            src = self._producer.get(t)
            if src is not None:
                inputs.append((src[0], src[1], t.numel() * t.element_size()))
        self._flow.op(fqn, inputs)
        for t in _flat_tensors((out,)):
            self._producer[t] = (fqn, self._num_values)
            self._num_values += 1

    @property
    def graph(self) -> nx.DiGraph:
        return self._flow.graph


def _flat_tensors(*groups: Any) -> Any:
    """Tensors among ATen op arguments: direct, or one level down in a list (``cat``)."""
    for group in groups:
        for a in group:
            if isinstance(a, torch.Tensor):
                yield a
            elif isinstance(a, (list, tuple)):
                for b in a:
                    if isinstance(b, torch.Tensor):
                        yield b
