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
whole reduction. Without sequence parallelism (``TPSpec.sequence_parallel``
off), norms and residuals hold the full activation on every tensor-parallel rank.

[Note: sequence parallel] TorchTitan's TP plan, which a ``TPSpec`` with
``sequence_parallel`` on (the default of ``--tp``) stands for: between the split
regions the activation is split on the sequence dimension, so the norms of a
block (``SequenceParallel``), its residual adds and the block's input and output
hold 1/tp of the tokens; each region (the attention, the MLP) all-gathers its
input on entry (``PrepareModuleInput``: Shard(1) -> Replicate) and its rowwise
projection reduce-scatters its output back onto the sequence shards
(``RowwiseParallel(output_layouts=Shard(1))``) where the all-reduce was; backward
mirrors them. Outside the blocks (``outside_roles``): the token embedding (an
``nn.Embedding`` with one row per output of the head) is split over its rows and
reduce-scatters its output onto the sequence shards; norms and other embeddings
(positions) run on the shards; the head (the last ``nn.Linear`` after the blocks)
is split column-wise, its input gathered. ``TPSpec.loss_parallel`` keeps the
logits split over the vocabulary and runs the loss on the shards (torch's
``loss_parallel``), so a tensor-parallel degree must divide the vocabulary
(``check_vocab``). ``check_sequence_parallel`` refuses a block holding a module
with parameters outside the split regions that is not one of its norms (sequence
parallelism has no placement for it), naming it and ``--no-sequence-parallel``.
Mixtures of experts are refused for tensor parallelism with the module named
(``_block_plan``): experts are never split silently.

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

__all__ = ["TPSpec", "TP_STYLES", "attention_heads", "builtin_tp_plan", "check_tp", "outside_roles", "tp_blocks",
           "tp_degrees"]

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
    stacked = [f for f in graph.subtree(block) if graph.info(f).experts]
    if experts or stacked:
        what = (f"{block}.{experts[0]}" if experts else
                f"{stacked[0]} ({graph.info(stacked[0]).experts} stacked experts)")
        raise PlanError(f"block {block} ({cls}) holds experts ({what}): wrapopt does not split experts over "
                        f"tensor-parallel ranks; use --tp 1 (--ep splits the experts over ranks), or {hint} that "
                        "leaves the experts whole")
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


def _is_norm(cls: str) -> bool:
    return cls.endswith("Norm") or cls in ("LayerNorm", "GroupNorm")


def _inside(fqn: str, prefixes: tuple[str, ...]) -> bool:
    return any(fqn == p or fqn.startswith(p + ".") for p in prefixes)


def outside_roles(graph: ModelGraph, spec: TPSpec) -> dict[str, str]:
    """The modules outside the listed blocks that sequence or loss parallelism splits, by role
    (See [Note: sequence parallel]): "head" (the last ``nn.Linear`` called after the blocks:
    column-wise, its output the logits), "vocab" (an embedding with one row per output of the
    head: split over its rows), "sequence" (norms and other embeddings: on 1/tp of the sequence).
    Empty when neither switch is on."""
    if not (spec.sequence_parallel or spec.loss_parallel):
        return {}
    blocks = tp_blocks(graph, spec)
    last = max((graph.info(b).order for b in blocks), default=-1)
    outside = [m for m in graph.modules if m.fqn != ROOT and not _inside(m.fqn, blocks) and m.order >= 0]
    heads = sorted((m for m in outside if m.cls in _LINEAR and m.order > last), key=lambda m: m.order)
    roles: dict[str, str] = {}
    if heads:
        roles[heads[-1].fqn] = "head"
    if not spec.sequence_parallel:
        return roles
    vocab = vocab_size(graph, spec)
    for m in outside:
        if m.cls == "Embedding":
            w = next((s for f, s, _d in graph.param_shapes if f == f"{m.fqn}.weight"), None)
            roles[m.fqn] = "vocab" if w is not None and vocab is not None and w[0] == vocab else "sequence"
        elif _is_norm(m.cls):
            roles[m.fqn] = "sequence"
    return roles


def vocab_size(graph: ModelGraph, spec: TPSpec) -> int | None:
    """Output features of the head ``outside_roles`` finds (its own weight or the one it is tied to)."""
    blocks = tp_blocks(graph, spec)
    last = max((graph.info(b).order for b in blocks), default=-1)
    heads = sorted((m for m in graph.modules if m.cls in _LINEAR and m.order > last and not _inside(m.fqn, blocks)),
                   key=lambda m: m.order)
    if not heads:
        return None
    name = f"{heads[-1].fqn}.weight"
    group = next((g for g in graph.tied_groups if name in g), (name,))
    shape = next((s for f, s, _d in graph.param_shapes if f in group), None)
    return int(shape[0]) if shape is not None and len(shape) == 2 else None


def check_sequence_parallel(graph: ModelGraph, spec: TPSpec) -> None:
    """``PlanError`` naming the first module of a listed block that sequence parallelism cannot
    place: one with parameters that is neither a norm nor inside a module whose projections split
    (the attention, the MLP), or a norm below another such module. See [Note: sequence parallel]."""
    for b in tp_blocks(graph, spec):
        cls = graph.info(b).cls
        split = [f"{b}.{p}" for p in spec.styles(cls)]
        regions = tuple({f.rsplit(".", 1)[0] for f in split} - {b})
        for fqn in graph.subtree(b):
            m = graph.info(fqn)
            if fqn == b or _inside(fqn, regions) or _inside(fqn, tuple(split)):
                continue
            direct = m.parent == b
            if _is_norm(m.cls) and direct:
                continue
            if m.total_numel and not any(_inside(c, regions) for c in graph.subtree(fqn) if c != fqn) or (
                    _is_norm(m.cls) and not direct):
                raise PlanError(f"block {b} ({cls}): {fqn} ({m.cls}) is neither a norm of the block nor inside the "
                                "attention or MLP that tensor parallelism splits, so sequence parallelism cannot "
                                "place it; pass --no-sequence-parallel (ParallelRequest(sequence_parallel=False)) "
                                "or a TPSpec that splits it")


def check_vocab(graph: ModelGraph, spec: TPSpec, size: int) -> None:
    """``PlanError`` unless ``size`` divides the vocabulary that loss parallelism (the head's
    outputs) or sequence parallelism (the embedding's rows) splits, naming the degrees that do."""
    if size == 1 or not (spec.loss_parallel or spec.sequence_parallel):
        return
    vocab = vocab_size(graph, spec)
    if vocab is None or vocab % size == 0:
        return
    works = [d for d in (2, 4, 8, 16) if vocab % d == 0]
    what = "loss parallel" if spec.loss_parallel else "sequence parallel's embedding split"
    flag = "--no-loss-parallel" if spec.loss_parallel else "--no-sequence-parallel"
    raise PlanError(f"tensor-parallel degree {size} does not divide the vocabulary of {vocab} (the head's output "
                    f"features) for {what}; degrees that do: {', '.join(map(str, works)) or 'none of 2, 4, 8, 16'}; "
                    f"use --tp with one of them, or pass {flag}")


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
    for b in blocks:
        _check_regions(graph, spec, b)
    check_vocab(graph, spec, size)
    if spec.sequence_parallel:
        check_sequence_parallel(graph, spec)


def _check_regions(graph: ModelGraph, spec: TPSpec, block: str) -> None:
    """``PlanError`` naming a module with parameters inside a split region (the attention, the
    MLP) that is not a split projection: each tensor-parallel rank would apply it to its own heads
    or features, and nothing sums its gradient over the ranks (Qwen3's per-head ``q_norm``)."""
    split = {f"{block}.{p}" for p in spec.styles(graph.info(block).cls)}
    for region in sorted({f.rsplit(".", 1)[0] for f in split} - {block}):
        for fqn in graph.subtree(region):
            m = graph.info(fqn)
            if fqn not in split and m.own_numel:
                raise PlanError(f"{fqn} ({m.cls}) holds parameters inside {region}, which tensor parallelism splits: "
                                "each rank would apply it to its own share of the heads and no collective sums its "
                                "gradient, so wrapopt does not tensor-parallelise this block; use --tp 1, or pass a "
                                "TPSpec without that region")


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
