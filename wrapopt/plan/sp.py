"""Sequence parallel, loss parallel and async tensor parallel on a live model: where each module
outside and inside the tensor-parallel blocks goes (``sp_layout``, local checks that name what
they cannot place), and the ``parallelize_module`` calls that put it there (``parallelize_sp``).

The mechanism is [Note: applying sequence parallel] in ``plan/tp.py``.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch.nn as nn

from wrapopt.errors import ModelError, PlanError
from wrapopt.spec import ROOT, TPSpec

__all__ = ["SPLayout", "block_layout", "check_async_tp", "check_vocab", "parallelize_sp", "sp_layout"]

_OFF = "pass sequence_parallel=False (--no-sequence-parallel)"


@dataclass(frozen=True, slots=True)
class SPLayout:
    """Where sequence and loss parallelism put a model's modules (full module names)."""

    head: str | None  # the output projection: ColwiseParallel, its output the logits
    embed: str | None  # the token embedding (rows = the head's outputs): RowwiseParallel
    positions: tuple[str, ...]  # other embeddings outside the blocks: output cut on the sequence dim
    final_norm: str | None  # the norm after the blocks: SequenceParallel
    block_norms: tuple[str, ...]  # norms that are direct children of a listed block: SequenceParallel
    gathers: tuple[str, ...]  # parents of the colwise projections: first input Shard(1) -> Replicate
    entry: str | None = None  # the first block where the embedding's output stays Replicate: input cut on entry


def _is_norm(m: nn.Module) -> bool:
    return isinstance(m, nn.LayerNorm) or type(m).__name__.endswith("Norm")


def _inside(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _own_params(m: nn.Module) -> bool:
    return next(m.parameters(recurse=False), None) is not None


def sp_layout(model: nn.Module, spec: TPSpec, blocks: list[tuple[str, nn.Module]]) -> SPLayout:
    """The ``SPLayout`` of ``model`` for ``spec`` (``blocks``: its listed blocks, ``tp_modules``);
    ``PlanError`` in one line naming a module sequence parallelism cannot place. Where a Hugging Face
    module calls the blocks, ``entry`` is the first block (its input cut, the embedding's output
    whole). Local: no collective."""
    names = tuple(n for n, _ in blocks)
    outside = [(n, m) for n, m in model.named_modules() if n != ROOT and not _inside(n, names)]
    linears = [n for n, m in outside if isinstance(m, nn.Linear)]
    head = linears[-1] if linears else None  # registered last: the output projection (as wrapopt/tp.py reads it)
    vocab = model.get_submodule(head).out_features if head else None
    embeds = [n for n, m in outside if isinstance(m, nn.Embedding)]
    embed = next((n for n in embeds if model.get_submodule(n).num_embeddings == vocab), None)
    if spec.loss_parallel and head is None:
        raise PlanError(f"loss parallel splits the output projection, but {type(model).__name__} has no nn.Linear "
                        "outside its tensor-parallel blocks; pass loss_parallel=False (--no-loss-parallel)")
    if not spec.sequence_parallel:
        tied = embed if spec.loss_parallel and _tied(model, head, embed) else None  # the tie's layout: Shard(0)
        return SPLayout(head, tied, (), None, (), ())
    cls = type(model).__name__
    hf = next((m for n, m in model.named_modules() if type(m).__module__.startswith("transformers.")
               and (n == ROOT or _inside(names[0], (n,)))), None) if names else None  # the blocks' caller
    entry = None
    if hf is not None:  # it reads the embedding's output whole: the cut moves to the first block's input
        pos = next((n for n in embeds if n != embed), None)
        if pos is not None:
            raise PlanError(f"{pos}: sequence parallel on Hugging Face's {type(hf).__name__} keeps the embeddings' "
                            f"outputs whole and cuts the first block's input, which covers decoders whose only "
                            f"embedding is the token embedding (Llama, Qwen2, Mistral), not a positional one; {_OFF}")
        if _first_param(blocks[0][1]) is None:
            raise PlanError(f"{names[0]} ({type(blocks[0][1]).__name__}): sequence parallel on Hugging Face's "
                            f"{type(hf).__name__} cuts the first block's first input, but its forward takes no named "
                            f"first input; {_OFF}")
        entry = names[0]
    if embed is None:
        raise PlanError(f"sequence parallel splits the token embedding over the vocabulary, but {cls} has no "
                        f"nn.Embedding with one row per output of {head or 'an output projection'}; {_OFF}")
    if len({n.rpartition(".")[0] for n in names}) > 1:
        raise PlanError(f"sequence parallel runs one stack of blocks, but {cls}'s tensor-parallel blocks sit in "
                        f"{len({n.rpartition('.')[0] for n in names})} containers ({names[0]}, {names[-1]}); {_OFF}")
    norms = [n for n, m in outside if _is_norm(m)]
    final_norm = norms[-1] if norms else None
    placed = {head, embed, final_norm, *embeds}
    if _own_params(model):
        own = next(n for n, _ in model.named_parameters(recurse=False))
        raise PlanError(f"{cls} holds parameters of its own ({own}), outside its blocks: sequence parallel cannot "
                        f"place them; {_OFF}")
    for n, m in outside:
        if n not in placed and _own_params(m):
            raise PlanError(f"{n} ({type(m).__name__}) holds parameters outside the tensor-parallel blocks and is "
                            f"not the embedding, the final norm or the head: sequence parallel cannot place it; {_OFF}")
    block_norms: list[str] = []
    gathers: list[str] = []
    for name, block in blocks:
        mine_norms, mine_gathers = block_layout(name, block, spec)
        block_norms += [f"{name}.{p}" for p in mine_norms]
        gathers += [f"{name}.{p}" for p in mine_gathers]
    return SPLayout(head, embed, tuple(n for n in embeds if n != embed), final_norm, tuple(block_norms),
                    tuple(gathers), entry)


def block_layout(name: str, block: nn.Module, spec: TPSpec) -> tuple[list[str], list[str]]:
    """(direct-child norms, parents of the colwise projections) of one block, relative to it."""
    styles = spec.styles(type(block).__name__)
    gathers = list(dict.fromkeys(p.rpartition(".")[0] for p, s in styles.items() if s == "colwise"))
    if "" in gathers:
        path = next(p for p, s in styles.items() if s == "colwise" and "." not in p)
        raise PlanError(f"block {name}: the colwise projection {path} is a direct child of the block, not inside an "
                        f"attention or MLP module: sequence parallel cannot gather its input; {_OFF}")
    for p, s in styles.items():
        if s == "rowwise" and p.rpartition(".")[0] not in gathers:
            raise PlanError(f"block {name}: the rowwise projection {p} is not in a module holding colwise "
                            f"projections ({', '.join(gathers)}): sequence parallel cannot place it; {_OFF}")
    norms = []
    for p, m in block.named_modules():
        if p == "" or _inside(p, tuple(gathers)) or p in styles:
            continue
        if "." not in p and _is_norm(m):
            norms.append(p)
        elif _is_norm(m):
            raise PlanError(f"block {name}: norm {p} ({type(m).__name__}) is not a direct child of the block nor "
                            f"inside {' or '.join(gathers)}: sequence parallel cannot place it; {_OFF}")
        elif _own_params(m):
            raise PlanError(f"block {name}: {p} ({type(m).__name__}) holds parameters outside the attention and MLP "
                            f"modules: sequence parallel cannot place it; {_OFF}")
    if _own_params(block):
        raise PlanError(f"block {name} holds parameters of its own, outside its attention and MLP modules: "
                        f"sequence parallel cannot place them; {_OFF}")
    return norms, gathers


def _tied(model: nn.Module, a: str | None, b: str | None) -> bool:
    if not a or not b:
        return False
    wa, wb = getattr(model.get_submodule(a), "weight", None), getattr(model.get_submodule(b), "weight", None)
    return wa is not None and wa is wb


def check_vocab(model: nn.Module, spec: TPSpec, layout: SPLayout, size: int) -> None:
    """``PlanError`` naming the degrees that work unless ``size`` divides the vocabulary (the head's
    output features), which sequence and loss parallelism split. Local: no collective."""
    if layout.head is None:
        return
    vocab = model.get_submodule(layout.head).out_features
    if vocab % size:
        ok = [d for d in range(1, min(vocab, 64) + 1) if vocab % d == 0]
        on = [(k, f"--no-{k.replace('_', '-')}") for k in ("loss_parallel", "sequence_parallel") if getattr(spec, k)]
        raise PlanError(f"tensor-parallel degree {size} does not divide the vocabulary ({vocab} output features of "
                        f"{layout.head}), which {' and '.join(k.replace('_', ' ') for k, _ in on)} split over the "
                        f"tensor-parallel ranks; use a degree dividing it ({', '.join(map(str, ok))}), or pass "
                        f"{' and '.join(f'{k}=False' for k, _ in on)} ({' '.join(f for _, f in on)})")


def check_async_tp(spec: TPSpec, device_type: str) -> None:
    """``PlanError`` when ``spec`` asks for async tensor parallelism on ranks that are not GPUs."""
    if spec.async_tp and device_type != "cuda":
        raise PlanError(f"this plan has async tensor parallelism (tp.async_tp), which is GPU-only (torch's symmetric "
                        f"memory on NVLink); these ranks run on {device_type}: plan it with async_tp off "
                        "(tp.async_tp false)")


def parallelize_sp(model: nn.Module, spec: TPSpec, layout: SPLayout, tp_mesh: Any) -> None:
    """``parallelize_module`` of the listed blocks and the modules around them as ``layout`` says,
    the ties kept; then async TP's switches where ``spec.async_tp``. See [Note: applying sequence
    parallel] in plan/tp.py."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

    sp, lp = spec.sequence_parallel, spec.loss_parallel
    ties = [names for names in _tied_params(model) if len(names) > 1]
    plan: dict[str, Any] = {}
    if sp:
        plan.update({n: SequenceParallel() for n in layout.block_norms})
    for name, block in _blocks(model, spec):
        for path, style in spec.styles(type(block).__name__).items():
            plan[f"{name}.{path}"] = (ColwiseParallel() if style == "colwise"
                                      else RowwiseParallel(output_layouts=Shard(1)) if sp else RowwiseParallel())
    if layout.embed:  # sequence parallel: its output cut on the sequence, or whole where the first block's input is
        cut = Shard(1) if sp and layout.entry is None else Replicate()  # loss parallel with a tied head: the tie's
        plan[layout.embed] = RowwiseParallel(input_layouts=Replicate(), output_layouts=cut)
    if layout.final_norm:
        plan[layout.final_norm] = SequenceParallel()
    if layout.head and (sp or lp):
        plan[layout.head] = ColwiseParallel(input_layouts=Shard(1) if sp else Replicate(),
                                            output_layouts=Shard(-1) if lp else Replicate(), use_local_output=not lp)
    if sp and layout.embed:
        model.get_submodule(layout.embed).register_forward_pre_hook(_check_sequence(layout.embed, tp_mesh.size()))
    parallelize_module(model, tp_mesh, plan)
    if sp:
        for n in layout.gathers:
            _prepare_first_input(model, n, tp_mesh, Shard(1), Replicate(), local=False)
        if layout.entry:
            _prepare_first_input(model, layout.entry, tp_mesh, Replicate(), Shard(1), local=True)
    for n in layout.positions:  # none where the embedding's output is whole (sp_layout)
        model.get_submodule(n).register_forward_hook(_sequence_cut(tp_mesh))
    for names in ties:  # parallelize_module gave each use of a tied parameter a DTensor of its own
        first = model.get_parameter(names[0])
        for n in names[1:]:
            mod, _, attr = n.rpartition(".")
            setattr(model.get_submodule(mod), attr, first)
    if spec.async_tp:
        _enable_async_tp(tp_mesh)


def _first_param(module: nn.Module) -> str | None:
    """The name of ``module.forward``'s first parameter when it can be passed by position or keyword."""
    p = next(iter(inspect.signature(module.forward).parameters.values()), None)
    return p.name if p is not None and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) else None


def _prepare_first_input(model: nn.Module, name: str, tp_mesh: Any, src: Any, dst: Any, *, local: bool) -> None:
    """``PrepareModuleInput``'s mechanism on the first input of ``name``, passed by position or by
    the keyword of ``forward``'s first parameter (Hugging Face calls attention with
    ``hidden_states=...``): taken as laid out ``src`` on ``tp_mesh`` (a DTensor as it is),
    redistributed to ``dst``; a local tensor out where ``local``, else the DTensor."""
    from torch.distributed.tensor import DTensor

    module = model.get_submodule(name)
    key = _first_param(module)

    def convert(x: Any) -> Any:
        d = x if isinstance(x, DTensor) else DTensor.from_local(x, tp_mesh, [src], run_check=False)
        d = d.redistribute(tp_mesh, [dst]) if d.placements != (dst,) else d
        return d.to_local() if local else d

    def hook(_module: nn.Module, args: tuple, kwargs: dict) -> Any:
        if args:
            return (convert(args[0]), *args[1:]), kwargs
        if key is not None and key in kwargs:
            return args, {**kwargs, key: convert(kwargs[key])}
        raise ModelError(f"{name} ({type(module).__name__}) was called without its first input ({key or 'none'}), "
                         "which sequence parallel redistributes; apply the plan with sequence_parallel=False "
                         "(--no-sequence-parallel)")

    module.register_forward_pre_hook(hook, with_kwargs=True)


def _enable_async_tp(tp_mesh: Any) -> None:
    """TorchTitan's switches for async TP: Inductor's micro-pipelining pass, and symmetric memory
    for the tp group. torch 2.13 marks ``enable_symm_mem_for_group`` deprecated ("no need to call"),
    yet the pass still skips a group ``is_symm_mem_enabled_for_group`` does not know, and only
    that call registers it; so it is called, its FutureWarning silenced."""
    import warnings

    import torch._inductor.config as inductor_config
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    inductor_config._micro_pipeline_tp = True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        enable_symm_mem_for_group(tp_mesh.get_group().group_name)


def _blocks(model: nn.Module, spec: TPSpec) -> list[tuple[str, nn.Module]]:
    listed = {c for c, _ in spec.layers}
    return [(n, m) for n, m in model.named_modules() if n != ROOT and type(m).__name__ in listed]


def _tied_params(model: nn.Module) -> list[tuple[str, ...]]:
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return [tuple(v) for v in by_id.values()]


def _check_sequence(name: str, size: int):
    """A forward pre-hook on the token embedding: ``ModelError`` unless ``size`` divides the
    sequence (dim 1 of the token ids), before the first collective of the step (every rank of a
    tensor-parallel group has the same batch, so all of them raise): the shards must be equal."""
    def hook(_module: nn.Module, args: Any) -> None:
        ids = args[0] if args else None
        if getattr(ids, "ndim", 0) >= 2 and ids.shape[1] % size:
            raise ModelError(f"sequence parallel cuts the sequence over {size} tensor-parallel ranks, but {name}'s "
                             f"input has {ids.shape[1]} positions (dim 1); feed sequences of a multiple of {size} "
                             "tokens, or apply the plan with sequence_parallel=False (--no-sequence-parallel)")

    return hook


def _sequence_cut(tp_mesh: Any):
    """A forward hook: this rank's part of a replicated output on its sequence dim (the one before
    the features); backward all-gathers the gradient, so the weight's gradient is whole on every rank."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    def hook(_module: nn.Module, _inputs: Any, out: Any) -> Any:
        whole = DTensor.from_local(out, tp_mesh, [Replicate()], run_check=False)
        return whole.redistribute(tp_mesh, [Shard(out.ndim - 2)]).to_local()

    return hook
