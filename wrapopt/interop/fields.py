"""Every plan field an export accounts for: written for the tool, stated for the training script, or lost.

[Note: every plan field is written, stated or lost]
A plan is more than its units: it was scored (and chosen: it may fit only so) with CPU offload,
a batch split (micro-batch x accumulation x data-parallel ranks), a gradient-sync mode, a
sequence length, an optimizer, mixed precision, tensor and pipeline degrees. ``PLAN_FIELDS`` lists
them once, each with the words for its value; ``plan_fields`` gives those a plan sets. Every
exporter runs an ``Accounting`` and gives each field one status:

- written: the file sets it for the tool (a YAML key, a strategy argument, a TOML key);
- stated: the tool reads no such setting (the data loader's batch, the optimizer, the launch
  command on each machine); the file says what the training script or launch must do, in its
  header under TO RUN THE PLAN, and ``wrapopt export`` repeats it on stderr;
- lost: the tool cannot do it; a line under LOSSES (file and stderr), and ``--strict`` refuses.

``Accounting.finish`` lists as lost every field the plan sets that the exporter did not account
for, so a field added here is never dropped silently by an exporter written before it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

from wrapopt.plan.file import WrapPlan

__all__ = ["PLAN_FIELDS", "PlanField", "Accounting", "plan_fields", "selective_as_full", "state_data_and_optimizer",
           "state_float8_compile", "WRITTEN", "STATED", "LOST"]

WRITTEN, STATED, LOST = "written", "stated", "lost"


@dataclass(frozen=True, slots=True)
class PlanField:
    """One thing a plan decides that a run must follow."""

    name: str
    words: Callable[[WrapPlan], str | None]  # the value in words; None where the plan leaves the default


def _units(plan: WrapPlan) -> list:
    return [u for u in plan.units if not u.is_root]


def _count(units: list, what: str) -> str | None:
    return f"{len(units)} unit(s) {what}" if units else None


def _mixed_precision(plan: WrapPlan) -> str | None:
    mp = plan.train_config.mixed_precision()
    parts = [f"{k} {v}" for k, v in mp.items() if v]
    return ", ".join(parts) or None


def _sync(plan: WrapPlan) -> str | None:
    if plan.accumulation == 1:
        return None
    mode = plan.train_config.accumulation_sync
    return {"every": "gradients reduce-scattered every micro-batch (sync every)",
            "last": "gradients held unsharded until the last micro-batch of the step (sync last)"}.get(
        mode or "", "not recorded")


def _float8(plan: WrapPlan) -> str | None:
    recipe = getattr(plan.train_config, "float8", "none") or "none"
    if recipe == "none":
        return None
    return f"float8 {recipe} training (torchao)" + (
        ", float8 all-gather" if getattr(plan.train_config, "float8_all_gather", False) else "")


PLAN_FIELDS: tuple[PlanField, ...] = (
    PlanField("units", lambda p: f"{len(_units(p))} units and the root"),
    PlanField("mesh", lambda p: f"{p.mesh.world_size} ranks, {p.mesh.ranks_per_node} per node"),
    PlanField("multi_node", lambda p: f"{p.mesh.num_nodes} machines" if p.mesh.num_nodes > 1 else None),
    PlanField("hsdp", lambda p: f"{p.mesh.replicate_size} replicas x {p.mesh.shard_size} shards"
              if p.mesh.is_hsdp and p.mesh.shard_size > 1 else None),
    PlanField("reshard", lambda p: _count([u for u in _units(p) if u.reshard_after_forward is not True],
                                          "not resharded (fully) after forward")),
    PlanField("checkpoint", lambda p: _count([u for u in _units(p) if u.full_checkpoint], "fully checkpointed")),
    PlanField("selective_checkpoint", lambda p: _count([u for u in _units(p) if u.selective_checkpoint],
                                                       "with selective-op checkpointing")),
    PlanField("prefetch", lambda p: f"forward prefetch of {p.spec.forward_prefetch} unit(s)"
              if p.spec.forward_prefetch else None),
    PlanField("offload", lambda p: "parameters, gradients and optimizer state in host memory (CPU offload)"
              if p.spec.offload else None),
    PlanField("mixed_precision", _mixed_precision),
    PlanField("micro_batch", lambda p: f"{p.micro_batch} sequence(s) per data-parallel rank per micro-batch"
              if p.micro_batch else None),
    PlanField("accumulation", lambda p: f"{p.accumulation} micro-batches per step" if p.accumulation > 1 else None),
    PlanField("sync", _sync),
    PlanField("seq_len", lambda p: f"{p.assumptions.seq} tokens per sequence"
              if p.assumptions is not None and p.assumptions.seq else None),
    PlanField("optimizer", lambda p: p.train.optimizer if p.train is not None else None),
    PlanField("tp", lambda p: f"tensor parallel degree {p.mesh.tp_size}" if p.spec.tp is not None else None),
    PlanField("sequence_parallel", lambda p: "on" if p.spec.tp is not None and p.spec.tp.sequence_parallel else None),
    PlanField("loss_parallel", lambda p: "on" if p.spec.tp is not None and p.spec.tp.loss_parallel else None),
    PlanField("async_tp", lambda p: "on" if p.spec.tp is not None and p.spec.tp.async_tp else None),
    PlanField("cp", lambda p: f"context parallel degree {p.mesh.cp_size} (FSDP over dp_shard x cp)"
              if p.mesh.cp_size > 1 else None),
    PlanField("ep", lambda p: f"expert parallel degree {p.mesh.ep_size}" if p.mesh.ep_size > 1 else None),
    PlanField("pipeline", lambda p: f"{len(p.spec.pipeline.stages)} stages, {p.spec.pipeline.schedule}, "
              f"{p.spec.pipeline.microbatches} micro-batches" if p.spec.pipeline is not None else None),
    PlanField("compile", lambda p: "each block compiled (torch.compile, fullgraph), after fully_shard"
              if getattr(p.train_config, "compile", False) else None),
    PlanField("float8", _float8),
)


def plan_fields(plan: WrapPlan) -> dict[str, str]:
    """``{field: its value in words}`` for every field of ``PLAN_FIELDS`` that ``plan`` sets."""
    out = {}
    for f in PLAN_FIELDS:
        words = f.words(plan)
        if words is not None:
            out[f.name] = words
    return out


@dataclass
class Accounting:
    """One export's account of the plan's fields; see [Note: every plan field is written, stated or lost]."""

    plan: WrapPlan
    target: str
    losses: list[str] = field(default_factory=list)  # LOSSES lines (those of the wrapping policy first)
    script: list[str] = field(default_factory=list)  # TO RUN THE PLAN lines
    status: dict[str, str] = field(default_factory=dict)  # field -> WRITTEN, STATED or LOST
    fields: dict[str, str] = field(init=False)

    def __post_init__(self) -> None:
        self.fields = plan_fields(self.plan)

    def sets(self, name: str) -> bool:
        """Whether the plan sets the field ``name`` (a name of ``PLAN_FIELDS``)."""
        return name in self.fields

    def write(self, *names: str) -> None:
        """The file sets these fields for the tool."""
        for n in names:
            if self.sets(n):
                self.status[n] = WRITTEN

    def state(self, name: str, line: str) -> None:
        """The tool has no setting for ``name``: ``line`` tells the training script or launch what to do."""
        if self.sets(name):
            self.status[name] = STATED
            self.script.append(line)

    def lose(self, name: str, line: str, *, first: bool = False) -> None:
        """The tool cannot do ``name``: ``line`` says what differs from the plan, and what to do;
        ``first``: at the head of LOSSES (what may not fit in memory, or runs slower than predicted)."""
        if self.sets(name):
            self.status[name] = LOST
            self.losses.insert(0 if first else len(self.losses), line)

    def finish(self) -> None:
        """Every field the plan sets and the exporter did not account for, listed as lost."""
        for name, words in self.fields.items():
            if name not in self.status:
                self.lose(name, f"the plan's {name.replace('_', ' ')} ({words}) has no {self.target} setting and is "
                                "not written")


def state_data_and_optimizer(acc: Accounting) -> None:
    """What no FSDP-only tool's setting says, for the training script: the data loader's micro-batch
    (and the global batch it makes), the sequence length and the optimizer the plan was scored for."""
    plan = acc.plan
    glob = f"; {plan.global_batch} per step over all ranks" if plan.global_batch else ""
    acc.state("micro_batch", f"micro-batch: the data loader gives {plan.micro_batch} sequence(s) per rank per "
                             f"micro-batch (DataLoader(batch_size={plan.micro_batch})){glob}")
    acc.state("seq_len", f"sequence length: {acc.fields.get('seq_len')}, as the plan was scored")
    acc.state("optimizer", f"optimizer: {plan.train_config.optimizer}, as the plan was scored (its state is part of "
                           "the plan's memory)")


def selective_as_full(acc: Accounting, *, why: str) -> WrapPlan:
    """The plan with every selective-op unit fully checkpointed, for a tool that checkpoints whole modules
    only; the change is a loss. Full checkpointing holds less than selective-op, so the plan still fits."""
    plan = acc.plan
    if not acc.sets("selective_checkpoint"):
        return plan
    acc.lose("selective_checkpoint", f"selective-op checkpointing ({acc.fields['selective_checkpoint']}) becomes "
                                     f"full checkpointing ({why}): it holds less and recomputes more than the plan")
    units = tuple(replace(u, checkpoint=True) if u.selective_checkpoint else u for u in plan.units)
    return replace(plan, spec=replace(plan.spec, units=units))


def state_float8_compile(acc: Accounting, *, applied: bool = False, fsdp2: bool = True) -> None:
    """Float8 and per-block compile for a tool that has no setting for them: the training script
    converts and compiles as ``WrapPlan.apply`` does (``applied``: the exported file calls it, so
    both are written). Under FSDP1 (``fsdp2=False``) the float8 all-gather is lost: it is FSDP2's.
    See [Note: applying float8] in plan/float8.py and [Note: compiling per block] in plan/compile.py."""
    train = acc.plan.train_config
    recipe = getattr(train, "float8", "none")
    gather = bool(getattr(train, "float8_all_gather", False))
    if applied:
        acc.write("compile")
    else:
        acc.state("compile", "torch.compile: after wrapping, compile each block as the plan was scored: "
                             "block.compile(fullgraph=True) (wrapopt.plan.compile.compile_blocks(model, names) names "
                             "a block that cannot be compiled whole and runs it eager)")
    if not acc.sets("float8"):
        return
    if gather and not fsdp2:
        acc.lose("float8", f"FLOAT8 ALL-GATHER: the plan all-gathers float8 weights (FSDP2, torchao); "
                           f"{acc.target} runs FSDP1, which all-gathers them at their own width, more bytes than "
                           f"predicted: convert with wrapopt.plan.float8.convert_float8(model, \"{recipe}\") before "
                           "wrapping, or re-run the search without --float8-all-gather", first=True)
        return
    step = ("; after each optimizer.step() call wrapopt.plan.float8.after_optimizer_step(model) (the all-gather's "
            "scales: torchao's precompute_float8_dynamic_scale_for_fsdp)") if gather else ""
    if applied and not gather:
        acc.write("float8")
    elif applied:
        acc.state("float8", "float8: WrapPlan.apply converts the model (torchao)" + step)
    else:
        acc.state("float8", f"float8 {recipe}: before wrapping, convert the model with torchao as the plan was scored: "
                            f"wrapopt.plan.float8.convert_float8(model, \"{recipe}\""
                            + (", all_gather=True" if gather else "") + ") (TorchTitan's filter, the output head "
                            "kept at its precision)" + step)
