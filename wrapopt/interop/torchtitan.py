"""``wrapopt export --to torchtitan``: a TorchTitan job config (TOML) for a 1-D, 2-D or 3-D plan.

[Note: the TorchTitan job config]
TorchTitan 0.2.x reads a TOML job config (``torchrun ... -m torchtitan.train --job.config_file
THIS``; ``torchtitan.config.ConfigManager`` parses it into ``JobConfig``). TorchTitan 0.3.0 (PyPI,
Feb 2026) dropped TOML for Python config functions; its ``--parallelism.*`` and ``--training.*``
command-line keys are the same names, so the file's values carry over, but the file itself is for
0.2.x (0.2.0-0.2.2). TorchTitan builds the mesh ``pp x dp_replicate x dp_shard x tp`` as wrapopt's
``MeshSpec`` lays it out, so the degrees are the plan's. What it does to the model is fixed: TP
with sequence parallel on every block (loss parallel unless disabled), one FSDP unit each for
``tok_embeddings``, every block, ``[norm, output]`` and the root, one ``reshard_after_forward`` for
all ("default": blocks reshard, ``[norm, output]`` not, nothing under PP), one checkpointing
mode for every block ("full", "selective" per op or every N-th block, "none"). Whatever of the
plan that cannot say is listed under LOSSES (in the file and on stderr), never silently dropped;
See [Note: every plan field is written, stated or lost] in wrapopt/interop/fields.py. TorchTitan's
trainer reduce-scatters every micro-batch's gradients (it never disables FSDP2's gradient sync), so
a plan scored with sync last loses that. The throughput knobs are TorchTitan's own: ``[compile]
enable`` (each block compiled, fullgraph, and the loss) and the float8 converter
(``[model] converters = ["quantize.linear.float8"]``, the section ``[quantize.linear.float8]``: the
float8 all-gather and its precomputed scales, ``recipe_name`` for rowwise, ``filter_fqns =
["output", "auto_filter_small_kn"]``: the head, and torchao's small-shape filter, as the plan was
priced), which apply as wrapopt's apply does (plan/float8.py, plan/compile.py).

Batch sizes follow TorchTitan's trainer: ``training.local_batch_size`` is the sequences one
data-parallel rank takes per gradient-accumulation step (a pipeline splits it into micro-batches
of ``pipeline_parallel_microbatch_size``), and the accumulation steps are ``global_batch_size /
(local_batch_size x data-parallel degree)``. So ``local_batch_size`` is the plan's micro-batch,
times its pipeline micro-batches under a pipeline plan; the plan's accumulation is carried by
``global_batch_size``.

Stages are written as ``module_fqns_per_model_part`` in TorchTitan's module names (``tok_embeddings``,
``layers.N``, ``norm``, ``output``, which all its LLMs use), block ``i`` of the plan's block chain
being ``layers.i``: the stage boundaries are the plan's, on a TorchTitan model with as many layers.
Strings reach the file as JSON strings (valid TOML) or through ``comment``; see [Note: plan strings
in generated text] in ``interop/common.py``.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from wrapopt.interop.common import Export, classes_for, comment, few, header, plan_reference
from wrapopt.interop.fields import Accounting
from wrapopt.interop.policy import block_chains
from wrapopt.plan.file import WrapPlan
from wrapopt.spec import SELECTIVE_OP

if TYPE_CHECKING:
    import torch.nn as nn

__all__ = ["TORCHTITAN_VERSIONS", "export_torchtitan", "toml_text"]

TORCHTITAN_VERSIONS = "0.2.x"  # the releases whose ConfigManager reads --job.config_file (TOML)

_PARAM_DTYPES = {None: "float32", "float32": "float32", "bfloat16": "bfloat16"}  # training.mixed_precision_param
_OPTIMIZERS = {"adamw": "AdamW", "adam": "Adam"}  # wrapopt's name -> optimizer.name


def export_torchtitan(plan: WrapPlan, *, model: nn.Module | None, source: str, out: str | None = None) -> Export:
    """The plan as a TorchTitan job config (TOML): degrees, schedule, checkpointing, batch sizes."""
    classes, params = classes_for(plan, model)
    acc = Accounting(plan, "torchtitan")
    losses = acc.losses
    layout = _BlockLayout(classes, params if params is not None else _params_of(plan), ordered=model is not None)
    sections: dict[str, dict[str, Any]] = {
        "parallelism": _parallelism(plan, layout, losses),
        "activation_checkpoint": _checkpointing(plan, layout, losses),
        "training": _training(plan, losses),
    }
    if layout.num_chains != 1:
        losses.append(f"the model has {layout.num_chains} chains of blocks; TorchTitan's models have one (layers): "
                      "the plan's units and checkpointing are not written")
    layout.unit_losses(plan, losses)
    sections["optimizer"] = _optimizer(plan, losses)
    sections.update(_knobs(plan))
    _account(acc, sections)
    what = (f"TorchTitan job config (torchtitan {TORCHTITAN_VERSIONS}): torchrun ... -m torchtitan.train "
            "--job.config_file THIS_FILE")
    text = header(plan, plan_reference(source, out), what, losses, acc.script)
    text += _guidance(plan, layout) + toml_text(sections)
    return Export("torchtitan", text, sections, tuple(losses), dict(acc.status), tuple(acc.script))


def _account(acc: Accounting, sections: dict[str, dict[str, Any]]) -> None:
    """Each plan field's status: the sections write most (their losses are listed as they are made)."""
    plan = acc.plan
    acc.write("units", "reshard", "checkpoint", "selective_checkpoint", "mesh", "hsdp", "offload", "mixed_precision",
              "seq_len", "optimizer", "tp", "sequence_parallel", "loss_parallel", "async_tp", "pipeline", "compile",
              "float8", "cp", "ep")
    if "local_batch_size" in sections["training"]:
        acc.write("micro_batch", "accumulation")
    acc.state("multi_node", f"launch on {plan.mesh.num_nodes} machines: torchrun --nnodes {plan.mesh.num_nodes} "
                            f"--nproc-per-node {plan.mesh.ranks_per_node} --node-rank R --rdzv-endpoint HOST:PORT")
    k, sync = plan.accumulation, plan.train_config.accumulation_sync
    if sync == "last":
        acc.lose("sync", f"SYNC MODE: the plan holds gradients unsharded until the last of its {k} micro-batches "
                         "(sync last); TorchTitan reduce-scatters every micro-batch, so each step communicates more "
                         "than predicted (it holds less); re-run the search with --sync every for its prediction",
                 first=True)
    elif sync == "every":
        acc.write("sync")
    else:
        acc.state("sync", "the plan records no sync mode; TorchTitan reduce-scatters every micro-batch")
    acc.lose("prefetch", f"explicit forward prefetch of {plan.spec.forward_prefetch} unit(s) has no TorchTitan "
                         "setting; FSDP2's implicit prefetch applies")
    acc.finish()


# -- the model's blocks ----------------------------------------------------------------------------


class _BlockLayout:
    """The planned model's block chain and what lies before and after it, as TorchTitan sees a model:
    ``tok_embeddings``, ``layers``, ``norm`` + ``output``."""

    def __init__(self, classes: dict[str, list[str]], params: list[str], *, ordered: bool = True) -> None:
        # ``ordered``: ``params`` in the model's registration order (a live model's); a plan file's are
        # sorted by name, so there the two ends are told apart by class: embeddings before the blocks,
        # every other module outside them (the final norm, the head) after
        self.ordered = ordered
        self.embeddings = {m for c, mods in classes.items() if c.rsplit(".", 1)[-1].endswith("Embedding")
                           for m in mods}
        chains = block_chains(classes, params or None)
        self.num_chains = len(chains)
        self.blocks: tuple[str, ...] = chains[0] if len(chains) == 1 else ()
        self.index = {b: i for i, b in enumerate(self.blocks)}
        first = {}  # module -> index of its first parameter
        for i, p in enumerate(params):
            parts = p.split(".")
            for k in range(len(parts)):
                first.setdefault(".".join(parts[:k]), i)
        self.first = first
        self.lo = min((first.get(b, 0) for b in self.blocks), default=0)
        self.hi = max((first.get(b, 0) for b in self.blocks), default=0)

    def before(self, module: str) -> bool:
        """Whether ``module``'s parameters come before the blocks' (an embedding's side)."""
        if not self.ordered:
            return module in self.embeddings
        return self.first.get(module, self.lo) < self.lo

    def after(self, module: str) -> bool:
        """Whether ``module``'s parameters come after the blocks' (the final norm and head's side)."""
        if not self.ordered:
            return self.block_of(module) is None and module not in self.embeddings and not any(
                b.startswith(module + ".") for b in self.blocks)
        return self.first.get(module, self.hi) > self.hi

    def block_of(self, module: str) -> str | None:
        """The block ``module`` is or lies in; None outside the blocks."""
        return next((b for b in self.blocks if module == b or module.startswith(b + ".")), None)

    def titan_names(self, modules: tuple[str, ...]) -> list[str] | None:
        """A stage's modules in TorchTitan's names; None when one has no TorchTitan counterpart."""
        out: list[str] = []
        for m in modules:
            b = self.block_of(m)
            name = (f"layers.{self.index[b]}" if b == m else None) if b else (
                "tok_embeddings" if self.before(m) else None)
            if b is None and self.after(m):
                out += [n for n in ("norm", "output") if n not in out]
                continue
            if name is None:
                return None
            if name not in out:
                out.append(name)
        return out

    def unit_losses(self, plan: WrapPlan, losses: list[str]) -> None:
        """What of the plan's units TorchTitan's fixed units (embedding, each block, [norm, output],
        root) do not reproduce; see [Note: the TorchTitan job config]."""
        if not self.blocks:
            return
        units = [u for u in plan.units if not u.is_root]
        covered = {m for u in units for m in u.modules}
        groups = [u.name for u in units if len(u.modules) > 1 and all(m in self.index for m in u.modules)]
        if groups:
            losses.append(f"grouped units of several blocks ({few(groups)}) become one unit per block: "
                          "TorchTitan wraps each block on its own")
        inside = [u.name for u in units if any(self.block_of(m) not in (None, m) for m in u.modules)]
        if inside:
            losses.append(f"units inside blocks ({few(inside)}) become part of their block's unit: TorchTitan "
                          "wraps whole blocks")
        loose = [b for b in self.blocks if b not in covered]
        if loose:
            losses.append(f"{len(loose)} block(s) the plan leaves to the root unit ({few(loose)}) are wrapped "
                          "each on its own: TorchTitan wraps every block")
        outside = [u for u in units if all(self.block_of(m) is None for m in u.modules)]
        mixed = [u.name for u in outside if not (all(map(self.before, u.modules)) or all(map(self.after, u.modules)))]
        if mixed:
            losses.append(f"units spanning both ends of the model ({few(mixed)}, e.g. a tied embedding and head) "
                          "cannot be said: TorchTitan wraps tok_embeddings and [norm, output] apart")
        for side, test, what in (("embedding", self.before, "tok_embeddings"),
                                 ("final norm and head", self.after, "[norm, output]")):
            if not any(all(map(test, u.modules)) for u in outside):
                losses.append(f"TorchTitan wraps {what} as a unit of its own; the plan leaves the {side} to the root "
                              "unit")


def _params_of(plan: WrapPlan) -> list[str]:
    params = plan.model.get("params")
    return list(params) if isinstance(params, dict) else []


# -- the sections ------------------------------------------------------------------------------------


def _parallelism(plan: WrapPlan, layout: _BlockLayout, losses: list[str]) -> dict[str, Any]:
    """[parallelism]: the degrees, FSDP's resharding, TP's switches and the pipeline."""
    mesh, tp, pipe = plan.mesh, plan.spec.tp, plan.spec.pipeline
    out: dict[str, Any] = {
        "data_parallel_replicate_degree": mesh.replicate_size,
        "data_parallel_shard_degree": mesh.dp_shard,  # FSDP over dp_shard x cp: shard_size counts the cp ranks
        "tensor_parallel_degree": mesh.tp_size,
        "pipeline_parallel_degree": mesh.pp_size,
        "fsdp_reshard_after_forward": _reshard_policy(plan, layout, losses),
    }
    for key, degree in (("context_parallel_degree", mesh.cp_size), ("expert_parallel_degree", mesh.ep_size)):
        if degree > 1:  # TorchTitan's default is 1
            out[key] = degree
    if mesh.shard_size == 1 and mesh.replicate_size > 1 and (mesh.tp_size > 1 or mesh.pp_size > 1):
        losses.append("data parallelism without sharding (DDP) under tensor or pipeline parallelism: TorchTitan "
                      "refuses it (\"DDP has not supported > 1D parallelism\"); use a shard group of 2 or more")
    if tp is not None:
        out["disable_loss_parallel"] = not tp.loss_parallel
        out["enable_async_tensor_parallel"] = bool(tp.async_tp and getattr(plan.train_config, "compile", False))
        if not tp.sequence_parallel:
            losses.append("sequence parallelism off: TorchTitan applies SequenceParallel to the norms with every "
                          "TP plan (norms and residuals on 1/tp of the sequence), so it holds less than the plan")
        if tp.async_tp and not out["enable_async_tensor_parallel"]:
            losses.append("async TP is written off: TorchTitan runs it only under torch.compile ([compile] enable "
                          "= true), which wrapopt does not price; set both to run it")
        if tp.source != "builtin":
            losses.append("the plan's own TP plan (--tp-plan) is not written: TorchTitan applies its model's TP plan")
    if pipe is not None:
        out["pipeline_parallel_schedule"] = pipe.schedule
        micro = plan.micro_batch
        if micro is not None:
            out["pipeline_parallel_microbatch_size"] = micro
        parts = [layout.titan_names(s) for s in pipe.stages] if layout.blocks else [None]
        if all(p for p in parts):
            out["module_fqns_per_model_part"] = parts
        else:
            losses.append("the plan's stage boundaries are not written (its modules have no TorchTitan names: one "
                          "chain of blocks between an embedding and a head); TorchTitan splits the layers itself")
    return out


def _reshard_policy(plan: WrapPlan, layout: _BlockLayout, losses: list[str]) -> str:
    """``fsdp_reshard_after_forward``: the blocks' setting ("default" is TorchTitan's own for FSDP
    alone: blocks reshard, [norm, output] and the root do not)."""
    blocks = [u for u in plan.units if not u.is_root and any(m in layout.index for m in u.modules)]
    if not blocks:
        return "default"
    hpz = [u.name for u in blocks if not isinstance(u.reshard_after_forward, bool)]
    if hpz:
        losses.append(f"reshard_after_forward=N (reshard to groups of N ranks) has no TorchTitan setting and "
                      f"becomes true: {few(hpz)}")
    on = [u for u in blocks if u.reshard_after_forward is not False]
    raf = len(on) * 2 >= len(blocks)
    odd = [u.name for u in blocks if (u.reshard_after_forward is not False) != raf]
    if odd:
        losses.append(f"one reshard_after_forward for every block ({raf}); the plan has {not raf} for {few(odd)}")
    if not raf:
        return "never"
    return "always" if plan.mesh.pp_size > 1 else "default"


def _checkpointing(plan: WrapPlan, layout: _BlockLayout, losses: list[str]) -> dict[str, Any]:
    """[activation_checkpoint]: one mode for every block, or TorchTitan's every N-th block."""
    root = plan.spec.root
    if root.checkpoint:
        losses.append("the root unit is checkpointed in the plan: TorchTitan checkpoints blocks only")
    units = [u for u in plan.units if not u.is_root]
    not_blocks = [u.name for u in units if u.checkpoint and any(layout.block_of(m) != m for m in u.modules)]
    if not_blocks:
        losses.append(f"checkpointing of units that are not whole blocks is lost ({few(not_blocks)}): TorchTitan "
                      "checkpoints whole blocks")
    mode_of = {m: u.checkpoint for u in units for m in u.modules}
    modes = [mode_of.get(b, False) for b in layout.blocks]
    kinds = set(modes)
    if not modes or kinds == {False}:
        return {"mode": "none"}
    if kinds == {True}:
        return {"mode": "full"}
    if kinds == {SELECTIVE_OP}:  # the same policy: See [Note: selective checkpointing] in wrapopt/selective.py
        return {"mode": "selective", "selective_ac_option": "op"}
    every = _every_nth(modes)
    if every and plan.mesh.pp_size == 1:
        return {"mode": "selective", "selective_ac_option": str(every)}
    full = modes.count(True) * 2 >= len(modes)
    mode = "full" if full else "none"
    odd = [b for b, m in zip(layout.blocks, modes) if (m is True) != full]
    losses.append(f"one checkpointing mode for every block ({mode}); the plan differs for {few(odd)} (TorchTitan "
                  "mixes only every N-th block, counted per pipeline rank)")
    return {"mode": mode}


def _every_nth(modes: list[bool | str]) -> int | None:
    """N when exactly the blocks ``i`` with ``(i + 1) % N == 0`` are fully checkpointed (TorchTitan's
    ``selective_ac_option = "N"``: its counter checkpoints the N-th, 2N-th, ... block)."""
    if set(modes) - {True, False}:
        return None
    for n in range(2, len(modes) + 1):
        if all((m is True) == ((i + 1) % n == 0) for i, m in enumerate(modes)):
            return n
    return None


def _training(plan: WrapPlan, losses: list[str]) -> dict[str, Any]:
    """[training]: batch sizes, sequence length, mixed precision and offload."""
    out: dict[str, Any] = {}
    mesh, pipe = plan.mesh, plan.spec.pipeline
    micro = plan.micro_batch
    if micro is None and pipe is None and plan.assumptions is not None and float(plan.assumptions.batch).is_integer():
        micro = int(plan.assumptions.batch) or None
    if micro is not None:
        local = micro * (pipe.microbatches if pipe is not None else 1)
        out["local_batch_size"] = local
        out["global_batch_size"] = plan.global_batch or local * plan.accumulation * mesh.batch_size
        if out["global_batch_size"] % (local * mesh.batch_size):
            losses.append(f"global batch {out['global_batch_size']} is not a multiple of local_batch_size {local} x "
                          f"{mesh.batch_size} data-parallel ranks, which TorchTitan needs for its accumulation steps")
    else:
        losses.append("the plan records no micro-batch: set training.local_batch_size (sequences per data-parallel "
                      "rank per accumulation step) and global_batch_size; TorchTitan's default is 8")
    seq = plan.assumptions.seq if plan.assumptions is not None else 0
    if seq:
        out["seq_len"] = seq
        if seq % mesh.tp_size:
            losses.append(f"seq_len {seq} is not a multiple of the TP degree {mesh.tp_size}, which TorchTitan needs")
        if mesh.cp_size > 1 and seq % (2 * mesh.cp_size):
            losses.append(f"seq_len {seq} does not split into 2 x cp = {2 * mesh.cp_size} chunks, which "
                          "TorchTitan's context parallelism (head-tail load balancing) needs")
    else:
        losses.append("the plan records no sequence length: set training.seq_len (TorchTitan's default is 2048)")
    train = plan.train_config
    param = train.param_dtype
    if param in _PARAM_DTYPES:
        out["mixed_precision_param"] = _PARAM_DTYPES[param]
    else:
        losses.append(f"param_dtype {param} has no TorchTitan setting (bfloat16 or float32); bfloat16 is written")
        out["mixed_precision_param"] = "bfloat16"
    reduce = train.reduce_dtype or param
    out["mixed_precision_reduce"] = "float32"
    if reduce not in (None, "float32"):
        losses.append(f"gradients reduce in {reduce} in the plan; TorchTitan reduces in float32 only")
    if train.output_dtype:
        losses.append(f"output_dtype {train.output_dtype} has no TorchTitan setting")
    stored = plan.assumptions.param_dtype if plan.assumptions is not None else "float32"
    if stored == "bfloat16":  # a model stored in bf16: TorchTitan's pure bf16 training, no fp32 master weights
        out["dtype"] = "bfloat16"
    elif stored != "float32":
        losses.append(f"parameters stored as {stored}: TorchTitan stores every parameter in one dtype "
                      "(training.dtype float32 is written)")
    if plan.spec.offload:
        out["enable_cpu_offload"] = True
    return out


def _optimizer(plan: WrapPlan, losses: list[str]) -> dict[str, Any]:
    """[optimizer]: its name, where TorchTitan has the plan's (its state is in the plan's memory)."""
    opt = plan.train_config.optimizer
    if opt not in _OPTIMIZERS:
        losses.append(f"the plan was scored for {opt}, which TorchTitan does not name (Adam, AdamW): AdamW is "
                      "written, with its two states per parameter")
    return {"name": _OPTIMIZERS.get(opt, "AdamW")}


def _knobs(plan: WrapPlan) -> dict[str, dict[str, Any]]:
    """[compile], and the float8 converter with its [quantize.linear.float8] options (TorchTitan 0.2.x
    registers it as "quantize.linear.float8"; its 0.2.x job config refuses ``recipe_name`` together with
    the float8 all-gather, so tensorwise leaves the recipe unset, its default). See [Note: the TorchTitan
    job config]."""
    train = plan.train_config
    out: dict[str, dict[str, Any]] = {}
    if getattr(train, "compile", False):  # TorchTitan compiles each block, and the loss
        out["compile"] = {"enable": True, "components": ["model", "loss"]}
    recipe = getattr(train, "float8", "none") or "none"
    if recipe != "none":
        gather = bool(getattr(train, "float8_all_gather", False))
        out["model"] = {"converters": ["quantize.linear.float8"]}
        f8: dict[str, Any] = {"enable_fsdp_float8_all_gather": gather,
                              "precompute_float8_dynamic_scale_for_fsdp": gather}
        if recipe != "tensorwise":
            f8["recipe_name"] = recipe
        f8["filter_fqns"] = ["output", "auto_filter_small_kn"]  # the small linears stay, as priced
        out["quantize.linear.float8"] = f8
    return out


def _guidance(plan: WrapPlan, layout: _BlockLayout) -> str:
    """The comment lines a user needs before running the file: what to fill in."""
    lines = ["Set [model] name, flavor and hf_assets_path to TorchTitan's definition of this model"
             f" ({plan.model.get('class')}" + (f", {len(layout.blocks)} layers)" if layout.blocks else ")"),
             "and [job] dump_folder; the keys below are the plan's.",
             "torchtitan 0.3 and later read no TOML: set the same [parallelism] and [training] keys in your config",
             "function (there, the loss is vocab-parallel under TP and async TP is a [compile] key)."]
    return "".join(f"# {comment(x)}\n" for x in lines) + "\n"


# -- TOML ----------------------------------------------------------------------------------------------


def toml_text(sections: dict[str, dict[str, Any]]) -> str:
    """``[section]`` tables of scalars and (nested) lists, written by hand (no TOML dependency)."""
    out = []
    for name, table in sections.items():
        out.append(f"[{name}]")
        out += [f"{key} = {_toml_value(value)}" for key, value in table.items()]
        out.append("")
    return "\n".join(out)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(str(value))  # a JSON string is a TOML basic string
