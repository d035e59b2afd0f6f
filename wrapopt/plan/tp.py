"""Tensor parallelism applied to a live model: the checks, ``parallelize_module`` of
every block of a class the ``TPSpec`` lists (with sequence, loss and async TP: of the
model around them too, ``plan/sp.py``), the data-parallel sub-mesh FSDP runs on, and
the ``tp`` field of the plan file.

What is split and why is [Note: tensor parallel] in ``wrapopt/tp.py``; how a 2-D
plan is applied is [Note: applying a 2-D plan] and [Note: applying sequence parallel] below.
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from wrapopt.errors import PlanError
from wrapopt.plan.sp import SPLayout, check_async_tp, check_vocab, parallelize_sp, sp_layout
from wrapopt.spec import ROOT, MeshSpec
from wrapopt.tp import TP_STYLES, TPSpec, attention_heads

__all__ = ["TP_SOURCES", "check_tp_model", "data_parallel_mesh", "parallelize_blocks", "parallelize_tp",
           "tp_from_json", "tp_layout", "tp_modules"]

TP_SOURCES = ("builtin", "user")

# [Note: applying a 2-D plan]
# A plan with ``mesh.tp_size > 1`` runs on a ``replicate x shard x tp`` DeviceMesh (axes named
# as ``MeshSpec.axis_names``; tp innermost, so a tensor-parallel group is consecutive ranks of
# one node). ``apply_plan`` works in TorchTitan's order:
# 1. every check below, on every rank, before any collective (the mesh is built after them):
#    ``check_tp_model`` (the listed Linears, the heads) and ``tp_layout`` (async TP on GPUs only;
#    where sequence or loss parallelism goes, the vocabulary divisible by the degree);
# 2. ``parallelize_module`` on the "tp" axis. Without sequence or loss parallelism,
#    ``{path: ColwiseParallel() / RowwiseParallel()}`` for every module of a listed class: the
#    listed Linears' parameters become DTensors on the tp axis, with the default layouts (input
#    and output Replicate, plain local tensors out), so the code around them (norms, residuals,
#    the embeddings and the head) is unchanged. With them, the whole model in one call: See
#    [Note: applying sequence parallel];
# 3. activation checkpointing of the plan's checkpointed units, as for a 1-D plan;
# 4. ``fully_shard`` of every unit, the root last, on the data-parallel sub-mesh
#    (``mesh["shard"]``, or ``mesh["replicate", "shard"]`` for HSDP): FSDP2 shards the TP
#    DTensors again on dim 0 (2-D parameters: a ``_StridedShard`` on the dp axis where TP
#    split dim 0 too) and the replicated parameters as usual.
# Every rank of one tensor-parallel group must be fed the same batch (they compute one
# replica's step between them); the data-parallel rank that picks the batch is
# ``wrapopt.launch.dp_rank_size(mesh)``: ``rank // tp_size`` of ``world_size // tp_size``.
# ``materialize_sharded`` works on 2-D parameters unchanged: ``distribute_tensor`` with
# ``src_data_rank=None`` cuts the full tensor by the parameter's own (strided) placements.

# [Note: applying sequence parallel]
# TorchTitan's ``apply_tp``, on any model of one stack of listed blocks (``plan/sp.py``). Between
# the blocks the activation is a plain local tensor holding 1/tp of the sequence (dim 1, batch
# first), so residual adds and dropout run on the shard. The live model is read as wrapopt/tp.py
# reads the graph: the head is the last ``nn.Linear`` outside the blocks, the token embedding the
# ``nn.Embedding`` with one row per head output, the final norm the last norm (class name ending
# in "Norm", or ``nn.LayerNorm``) outside the blocks; other embeddings are positional.
# - Inside a block: its direct-child norms ``SequenceParallel()`` (input taken as Shard(1), weight
#   a Replicate DTensor, so its gradient, a partial sum over the shards, is all-reduced on tp);
#   the attention and MLP modules (parents of the colwise projections) get their first input
#   Shard(1) -> Replicate(): ``PrepareModuleInput``'s mechanism in a forward pre-hook of
#   ``plan/sp.py`` that takes the input by position or by the keyword of ``forward``'s first
#   parameter (Hugging Face calls attention with ``hidden_states=...``); one all-gather, output kept
#   a DTensor, so the query, key and value projections' input gradients sum as
#   Partial and backward runs one reduce-scatter for all three; the rowwise projections
#   ``RowwiseParallel(output_layouts=Shard(1))``: a reduce-scatter replaces the all-reduce. So a
#   block runs 2 all-gathers and 2 reduce-scatters forward and the mirror backward
#   (tests/plan/test_tp_ranks.py counts them).
# - Outside: the token embedding ``RowwiseParallel(input Replicate, output Shard(1))`` (rows split
#   over the vocabulary; the masked lookups reduce-scatter onto the sequence); a positional
#   embedding keeps its replicated weight and a forward hook cuts its output on the sequence dim
#   (the dim before the features), whose backward all-gathers the gradient so the weight's is whole
#   on every rank; the final norm ``SequenceParallel()``; the head ``ColwiseParallel(input
#   Shard(1), output Shard(-1) with loss parallel, else Replicate)``.
# - Hugging Face decoders (a ``transformers`` module calls the blocks: Llama, Qwen2, Mistral): their
#   ``LlamaModel.forward`` reads the embedding's output for ``position_ids``, the causal mask and the
#   rotary ``(cos, sin)``, so that output stays whole: the embedding is ``RowwiseParallel(input
#   Replicate, output Replicate)`` (an all-reduce where the others reduce-scatter), and the first
#   block's first input (``hidden_states``, positional) is cut Replicate -> Shard(1) on entry by the
#   same pre-hook (a local chunk, no collective; backward all-gathers its gradient, so everything
#   before it has whole gradients on every rank). The mask, the position ids and ``(cos, sin)``
#   passed to every block cover the whole sequence, and are only read inside the attention, after
#   its all-gather, where the sequence is whole too. The rest is as above; the final norm's output
#   is a Shard(1) DTensor, which ``LlamaForCausalLM`` slices (``logits_to_keep``) before the head.
# - Loss parallel: the logits stay a DTensor split over the vocabulary; the loss and its backward
#   must run under ``torch.distributed.tensor.parallel.loss_parallel()`` (``WrapPlan.loss_context``).
#   Without sequence parallel the head takes a Replicate input, and a tied embedding is split
#   over its rows too (output Replicate), so the tie has one layout.
# - Ties: ``parallelize_module`` gives each use of a tied weight its own DTensor; both are Shard(0)
#   on tp (an embedding's rows, a head's output features), so every use is pointed back at the
#   first, and FSDP sees one parameter.
# Refused in one line, naming the module and ``sequence_parallel=False``: a norm that is not a
# direct child of its block (nor inside the attention or MLP), any other module with parameters
# outside the attention and MLP (its gradient would be a partial sum no one reduces), parameters
# outside the blocks that are not the embeddings, final norm or head, several block stacks, and
# Hugging Face models with a positional embedding (GPT-2 style: not covered by the rule above) or
# whose first block takes no named first input. The degree must divide the vocabulary. Async TP
# (``tp.async_tp``) is GPU-only: on CUDA it sets ``torch._inductor.config._micro_pipeline_tp``
# and enables symmetric memory for the tp group, as TorchTitan does; it only takes effect in a
# ``torch.compile``d model (Inductor fuses the collectives with the matmuls); on other devices
# ``tp_layout`` refuses it.


def tp_modules(model: nn.Module, spec: TPSpec) -> list[tuple[str, nn.Module]]:
    """(name, module) of every module whose class ``spec`` lists, the root excepted."""
    listed = {c for c, _ in spec.layers}
    return [(n, m) for n, m in model.named_modules() if n != ROOT and type(m).__name__ in listed]


def _linears(block: nn.Module) -> list[str]:
    return [n for n, m in block.named_modules() if isinstance(m, nn.Linear)]


def check_tp_model(model: nn.Module, spec: TPSpec, size: int) -> None:
    """``PlanError`` (one line, naming the module and what to pass) unless every listed path
    of every module of a listed class is an ``nn.Linear`` whose split features ``size``
    divides, and ``size`` divides the heads and key-value heads of every attention module
    in those blocks. Local: no collective."""
    blocks = tp_modules(model, spec)
    have = {type(m).__name__ for _, m in blocks}
    missing = [c for c, _ in spec.layers if c not in have]
    if missing:
        classes = sorted({type(m).__name__ for _, m in model.named_modules()} - {type(model).__name__})
        raise PlanError(f"the TP plan names block class {missing[0]}, which this {type(model).__name__} does not have "
                        f"(its module classes: {', '.join(classes[:8])}{' ...' if len(classes) > 8 else ''}); "
                        "pass a TPSpec for this model's blocks")
    for name, block in blocks:
        cls = type(block).__name__
        for path, style in spec.styles(cls).items():
            hint = f"list the block's nn.Linear submodules ({', '.join(_linears(block)[:8]) or 'it has none'})"
            try:
                sub = block.get_submodule(path)
            except AttributeError:
                raise PlanError(f"the TP plan for {cls} names {path}, but {name} has no submodule {path}; "
                                f"{hint}") from None
            if not isinstance(sub, nn.Linear):
                raise PlanError(f"the TP plan for {cls} names {path}, but {name}.{path} is a {type(sub).__name__}, "
                                f"not an nn.Linear; {hint}")
            n = sub.out_features if style == "colwise" else sub.in_features
            if n % size:
                raise PlanError(f"tensor-parallel degree {size} does not divide the {n} "
                                f"{'output' if style == 'colwise' else 'input'} features of {name}.{path}; "
                                f"use a tensor-parallel degree dividing {n}")
        split = set(spec.styles(cls))
        for region in sorted({p.rpartition(".")[0] for p in split} - {""}):
            for rel, sub in block.get_submodule(region).named_modules(prefix=region):
                if rel not in split and next(sub.parameters(recurse=False), None) is not None:
                    raise PlanError(f"{name}.{rel} ({type(sub).__name__}) holds parameters inside {name}.{region}, "
                                    "which tensor parallelism splits: each rank would apply it to its own share of "
                                    "the heads and no collective sums its gradient; use a tensor-parallel degree "
                                    "of 1, or a TPSpec without that region")
    prefixes = tuple(n + "." for n, _ in blocks)
    for fqn, heads, kv in attention_heads(model):
        if fqn.startswith(prefixes) and (heads % size or kv % size):
            raise PlanError(f"tensor-parallel degree {size} does not divide the heads of {fqn} ({heads} heads, "
                            f"{kv} key-value heads); use a tensor-parallel degree dividing both")


def parallelize_blocks(model: nn.Module, spec: TPSpec, tp_mesh: Any) -> None:
    """``parallelize_module`` every module of a listed class on ``tp_mesh`` (the mesh's "tp"
    axis): its listed Linears become ``ColwiseParallel`` / ``RowwiseParallel``."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    for _name, block in tp_modules(model, spec):
        styles = spec.styles(type(block).__name__)
        parallelize_module(block, tp_mesh, {path: ColwiseParallel() if style == "colwise" else RowwiseParallel()
                                            for path, style in styles.items()})


def tp_layout(model: nn.Module, spec: TPSpec, size: int, device_type: str) -> SPLayout | None:
    """The checks of ``spec``'s switches (``PlanError``, one line): async TP only on ``"cuda"``;
    where sequence and loss parallelism put each module, and ``size`` dividing the vocabulary.
    None when neither is on. Local: no collective. See [Note: applying sequence parallel]."""
    check_async_tp(spec, device_type)
    if not (spec.sequence_parallel or spec.loss_parallel):
        return None
    layout = sp_layout(model, spec, tp_modules(model, spec))
    check_vocab(model, spec, layout, size)
    return layout


def parallelize_tp(model: nn.Module, spec: TPSpec, tp_mesh: Any, layout: SPLayout | None) -> None:
    """Tensor parallelism as ``spec`` says, on ``tp_mesh``: the listed blocks alone
    (``parallelize_blocks``), or with sequence / loss / async TP the whole model (``layout`` from
    ``tp_layout``)."""
    if layout is None and not spec.async_tp:
        parallelize_blocks(model, spec, tp_mesh)
    else:
        parallelize_sp(model, spec, layout or SPLayout(None, None, (), None, (), ()), tp_mesh)


def data_parallel_mesh(mesh: Any, mesh_spec: MeshSpec) -> Any:
    """The sub-mesh FSDP shards on: the whole mesh for a 1-D plan, else its data-parallel
    axes (``"shard"``, or ``("replicate", "shard")`` for HSDP and for no sharding), without
    the "tp" and "pp" axes (a pipeline stage's ranks at one pipeline position)."""
    axes = tuple(a for a in mesh_spec.axis_names if a in ("replicate", "shard"))
    if axes == mesh_spec.axis_names:
        return mesh
    return mesh[axes] if len(axes) > 1 else mesh[axes[0]]


def tp_from_json(raw: Any, *, source: str) -> TPSpec:
    """The plan file's ``tp`` field as a ``TPSpec``; ``PlanError`` naming the file and the field."""
    def fail(fld: str, msg: str) -> PlanError:
        return PlanError(f"{source}: field {fld!r} {msg}")

    if not isinstance(raw, dict):
        raise fail("tp", "must be an object {source, layers} (the tensor-parallel plan)")
    src = raw.get("source", "user")
    if src not in TP_SOURCES:
        raise fail("tp.source", f"must be one of {', '.join(TP_SOURCES)}, got {src!r}")
    layers = raw.get("layers")
    if not isinstance(layers, dict) or not layers:
        raise fail("tp.layers",
                   "must be a non-empty object: block class -> {submodule path: \"colwise\" | \"rowwise\"}")
    out = []
    for cls, pairs in layers.items():
        if not isinstance(pairs, dict) or not pairs:
            raise fail(f"tp.layers.{cls}", "must be a non-empty object: submodule path (relative to the block) -> "
                                           "\"colwise\" | \"rowwise\"")
        for path, style in pairs.items():
            if style not in TP_STYLES:
                raise fail(f"tp.layers.{cls}.{path}", f"style must be {' or '.join(TP_STYLES)}, got {style!r}")
        out.append((cls, tuple(pairs.items())))
    flags = {}
    for key in ("sequence_parallel", "loss_parallel", "async_tp"):
        flags[key] = raw.get(key, False)
        if not isinstance(flags[key], bool):
            raise fail(f"tp.{key}", f"must be true or false, got {flags[key]!r}")
    return TPSpec(layers=tuple(out), source=src, **flags)
