"""Tensor parallelism inside blocks: which projections split how, and the checks.

[Note: tensor parallel] A 2-D plan runs FSDP on the data-parallel axis of a
``replicate x shard x tp`` mesh, the tensor-parallel axis innermost (inside a
node), as TorchTitan does. Inside every block of a class the ``TPSpec`` lists,
Megatron-style tensor parallelism splits the attention's query, key and value
projections and the MLP's input projections by output features
(``ColwiseParallel``: the input is replicated, each rank computes its heads /
hidden slice) and the attention's output and the MLP's output projections by
input features (``RowwiseParallel``: the partial outputs are all-reduced).
So per block, forward runs one all-reduce of the block's activation size after
attention and one after the MLP; backward one all-reduce of the input gradient
per colwise projection (the gradients of a replicated input are partial sums).
Everything else (embeddings, the output head, norms, the blocks' residual
adds) is replicated over the tensor-parallel ranks and sharded by FSDP alone;
tied weights stay tied, and their gradients are identical on every
tensor-parallel rank, so FSDP's reduction over the data-parallel ranks is the
whole reduction. No sequence parallelism: norms and residuals hold the full
activation on every tensor-parallel rank.

``builtin_tp_plan`` recognises the blocks it can parallelise from the traced
graph alone (class names, parameter shapes, attention heads): an attention
module (one with recorded heads) whose ``nn.Linear`` children are separate
query/key/value projections reading the model width and one output
projection, and an MLP of ``nn.Linear``s from the width to a hidden size and
back (plain or gated, as in Llama, Qwen2, Mistral, GPT-style blocks built from
``nn.Linear``). Fused query-key-value projections, GPT-2's ``Conv1D``,
``nn.MultiheadAttention`` and mixtures of experts are refused with the module
named: pass a ``TPSpec`` for them.
"""

from __future__ import annotations

import math
from typing import Any
from collections.abc import Iterable

from wrapopt.errors import PlanError
# TPSpec is data passed between stages, so it lives in spec; re-exported here beside the code that makes it.
from wrapopt.spec import ROOT, TP_STYLES, ModelGraph, TPSpec

__all__ = ["TPSpec", "TP_STYLES", "attention_heads", "builtin_tp_plan", "check_tp", "tp_blocks", "tp_degrees"]

_HEADS = ("n_heads", "num_heads", "num_attention_heads", "n_head")
_KV_HEADS = ("n_kv", "n_kv_heads", "num_key_value_heads", "num_kv_heads")
# Output projections of an attention module, by the names the common codebases use.
_OUT_NAMES = ("o_proj", "out_proj", "wo", "o", "c_proj", "dense", "out", "proj")
_LINEAR = ("Linear",)


def attention_heads(model) -> tuple[tuple[str, int, int], ...]:
    """(module, heads, key-value heads) for every module holding a head count attribute (or a
    ``head_dim`` and a ``config`` with the counts: ``_config_heads``) and at least one ``nn.Linear``
    child: what ``ModelGraph.attention_heads`` records, and what the degree must divide."""
    import torch.nn as nn

    out = []
    for name, m in model.named_modules():
        heads = next((getattr(m, a) for a in _HEADS if isinstance(getattr(m, a, None), int)), None)
        kv = next((getattr(m, a) for a in _KV_HEADS if isinstance(getattr(m, a, None), int)), heads)
        if heads is None:
            heads, kv = _config_heads(m)
        if heads is None or heads < 1 or not any(isinstance(c, nn.Linear) for c in m.children()):
            continue
        out.append((name, int(heads), int(kv or heads)))
    return tuple(out)


def _config_heads(m: Any) -> tuple[int | None, int | None]:
    """(heads, key-value heads) of an attention that keeps its counts in its model's config, as
    Hugging Face's Llama, Qwen, Mistral and GPT-NeoX attentions do: a module with a ``head_dim``
    (or ``head_size``) of its own and a ``config`` naming the heads; (None, None) otherwise."""
    cfg = getattr(m, "config", None)
    if not any(isinstance(getattr(m, a, None), int) for a in ("head_dim", "head_size")) or cfg is None:
        return None, None
    heads = next((getattr(cfg, a) for a in _HEADS if isinstance(getattr(cfg, a, None), int)), None)
    kv = next((getattr(cfg, a) for a in _KV_HEADS if isinstance(getattr(cfg, a, None), int)), heads)
    return heads, kv


def _linears(graph: ModelGraph, block: str) -> dict[str, tuple[int, int]]:
    """Linear submodules of ``block`` (path relative to it) -> (in, out) features."""
    shapes = {fqn: shape for fqn, shape, _dt in graph.param_shapes}
    out = {}
    for fqn in graph.subtree(block):
        if fqn != block and graph.info(fqn).cls in _LINEAR:
            w = shapes.get(f"{fqn}.weight")
            if w is not None and len(w) == 2:
                out[fqn[len(block) + 1:]] = (int(w[1]), int(w[0]))
    return out


def _block_plan(graph: ModelGraph, block: str) -> tuple[tuple[str, str], ...]:
    """The colwise / rowwise pairs of one block, or ``PlanError`` naming what stops it."""
    cls = graph.info(block).cls
    attn = [(fqn, h, kv) for fqn, h, kv in graph.attention_heads if fqn.startswith(block + ".")]
    linears = _linears(graph, block)
    hint = f"pass a TPSpec for {cls} (wrapopt.TPSpec(layers=(('{cls}', (('path.to.linear', 'colwise'), ...)),)))"
    mha = [fqn for fqn in graph.subtree(block) if graph.info(fqn).cls in ("MultiheadAttention",)]
    if mha:
        raise PlanError(f"block {block} ({cls}): {mha[0]} is an nn.MultiheadAttention (fused input projection, "
                        f"its out_proj is never called); {hint}, or use --tp 1")
    if not linears:
        raise PlanError(f"block {block} ({cls}) has no nn.Linear projections to split "
                        f"(e.g. GPT-2's Conv1D); {hint}")
    experts = [p for p in linears if ".experts." in f".{p}." or p.startswith("experts.")]
    if experts:
        raise PlanError(f"block {block} ({cls}) holds experts ({experts[0]}): wrapopt does not tensor-parallelise "
                        f"mixtures of experts; {hint}, or use --tp 1")
    if not attn:
        raise PlanError(f"block {block} ({cls}) has no attention module with a head count wrapopt can read "
                        f"(an attribute {' / '.join(_HEADS)}); {hint}")
    pairs: dict[str, str] = {}
    for fqn, heads, kv in attn:
        rel = fqn[len(block) + 1:]
        mine = {p: io for p, io in linears.items() if p.startswith(rel + ".") and "." not in p[len(rel) + 1:]}
        outs = [p for p in mine if p.rsplit(".", 1)[-1] in _OUT_NAMES]
        ins = [p for p in mine if p not in outs]
        if len(outs) != 1 or len(ins) < 3:
            raise PlanError(f"attention {fqn} ({graph.info(fqn).cls}) in block {block}: expected separate query, key "
                            f"and value projections and one output projection among its nn.Linear children, found "
                            f"{', '.join(sorted(mine)) or 'none'} (a fused query-key-value projection cannot be split "
                            f"by heads this way); {hint}")
        for p in ins:
            pairs[p] = "colwise"
        pairs[outs[0]] = "rowwise"
    width = linears[next(p for p, s in pairs.items() if s == "rowwise")][1]
    for p, (fin, fout) in linears.items():
        if p in pairs:
            continue
        if fin == width and fout != width:
            pairs[p] = "colwise"
        elif fout == width and fin != width:
            pairs[p] = "rowwise"
        else:
            raise PlanError(f"block {block} ({cls}): cannot tell how to split {p} ({fin} -> {fout} features, the model "
                            f"width is {width}); {hint}")
    return tuple(sorted(pairs.items()))


def builtin_tp_plan(graph: ModelGraph) -> TPSpec:
    """The Megatron-style ``TPSpec`` for every block class of ``graph``'s block chains;
    ``PlanError`` naming the block when one cannot be recognised. See [Note: tensor parallel]."""
    if not graph.block_chains:
        raise PlanError(f"{graph.model_class} has no repeated blocks to tensor-parallelise; "
                        "pass a TPSpec, or use --tp 1")
    layers = []
    for chain_cls in graph.block_classes:
        first = next(b for b in graph.blocks if graph.info(b).cls == chain_cls)
        layers.append((chain_cls, _block_plan(graph, first)))
    return TPSpec(layers=tuple(layers), source="builtin")


def tp_blocks(graph: ModelGraph, spec: TPSpec) -> tuple[str, ...]:
    """The modules ``spec`` parallelises: every module of a listed class."""
    listed = {c for c, _ in spec.layers}
    return tuple(m.fqn for m in graph.modules if m.cls in listed and m.fqn != ROOT)


def check_tp(graph: ModelGraph, spec: TPSpec, size: int) -> None:
    """``PlanError`` (one line, naming the module and what to pass) unless ``size`` splits
    every listed projection and every attention's heads of the blocks ``spec`` parallelises."""
    if size == 1:
        return
    blocks = tp_blocks(graph, spec)
    missing = [c for c, _ in spec.layers if not any(graph.info(b).cls == c for b in blocks)]
    if missing:
        raise PlanError(f"the TP plan names block class {missing[0]}, which the model does not have; "
                        f"its classes with blocks: {', '.join(graph.block_classes) or 'none'}")
    for b in blocks:
        lin = _linears(graph, b)
        for path, style in spec.styles(graph.info(b).cls).items():
            if path not in lin:
                raise PlanError(f"the TP plan for {graph.info(b).cls} names {path}, but {b}.{path} is not an nn.Linear "
                                "with a 2-D weight; list the block's nn.Linear submodules")
            fin, fout = lin[path]
            n = fout if style == "colwise" else fin
            if n % size:
                raise PlanError(f"tensor-parallel degree {size} does not divide the {n} "
                                f"{'output' if style == 'colwise' else 'input'} features of {b}.{path}; "
                                f"use --tp with a divisor of {n}")
    for fqn, heads, kv in graph.attention_heads:
        if any(fqn.startswith(b + ".") for b in blocks) and (heads % size or kv % size):
            raise PlanError(f"tensor-parallel degree {size} does not divide the heads of {fqn} ({heads} heads, "
                            f"{kv} key-value heads); use --tp with a divisor of {math.gcd(heads, kv)}")


def tp_degrees(graph: ModelGraph, spec: TPSpec | None, ranks_per_node: int, world_size: int,
               asked: Iterable[int] | None = None) -> tuple[int, ...]:
    """The degrees ``--tp auto`` tries: 1, and every power of two dividing the ranks per
    node and the world that ``check_tp`` accepts (``asked``: the user's list, checked)."""
    cands = list(asked) if asked is not None else [d for d in (1, 2, 4, 8, 16)
                                                   if ranks_per_node % d == 0 and world_size % d == 0]
    out = []
    for d in cands:
        if d == 1:
            out.append(1)
            continue
        if spec is None:
            continue
        try:
            check_tp(graph, spec, d)
        except PlanError:
            if asked is not None:
                raise
            continue
        out.append(d)
    return tuple(out)
