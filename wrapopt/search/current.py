"""The user's current configuration as the baseline: parsed, scored, and set beside the search's.

[Note: the current configuration] ``--current`` takes a plan file (``*.json``, as ``wrapopt
search --out`` writes) or a description of the configuration a job runs today, a few items
separated by commas, in any order (``CURRENT_FORMS``), for example ``"per-block, full AC,
micro-batch 2"``. Anything left unsaid keeps FSDP2's own defaults: one unit per block
(``per-block``), resharded after forward, no checkpointing, FSDP over every data-parallel
rank, no tensor parallelism, the traced batch per rank (or, at a fixed global batch, the
micro-batch the search would pick for it).

It is scored with the simulator that scores the search's plans, at the same global batch
(``micro-batch x accumulation x data-parallel ranks``), so the two step times compare
directly. Each choice where the search's plan differs (``DIMENSIONS``) is then applied *alone*
to the current configuration and scored: the gain that one change buys. These gains do not
multiply to the whole: the choices interact (fewer checkpointed blocks need the memory a
smaller micro-batch frees), and the report says so.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace

from wrapopt.choices import CURRENT_FORMS
from wrapopt.cost.simulate import Simulator
from wrapopt.errors import OptionError
from wrapopt.search.baselines import baselines, with_choices
from wrapopt.search.batch import batch_scale
from wrapopt.search.tp import dp_mesh, lift_plan
from wrapopt.spec import SELECTIVE_OP, CostEstimate, MeshSpec, ModelGraph, ParallelRequest, PlanSpec
from wrapopt.tp import TPSpec, builtin_tp_plan, check_tp

__all__ = ["CURRENT_FORMS", "DIMENSIONS", "Current", "Config", "ChoiceGain", "Comparison", "parse_current",
           "compare_current"]

# The choices compared one at a time, in the report's order.
DIMENSIONS = ("micro-batch", "tensor parallel", "shard group", "units", "reshard", "checkpointing", "pipeline")


@dataclass(frozen=True, slots=True)
class Current:
    """A configuration to compare against: the plan and its micro-batch (None: the traced
    batch, or at a fixed global batch the search's)."""

    plan: PlanSpec
    micro_batch: int | None
    text: str  # what the user wrote, for the report


@dataclass(frozen=True, slots=True)
class Config:
    """A plan at a split of the batch, scored."""

    plan: PlanSpec
    micro_batch: int  # sequences per data-parallel rank per micro-batch
    accumulation: int
    estimate: CostEstimate

    @property
    def sequences_per_s_per_rank(self) -> float:
        return self.micro_batch * self.accumulation * self.plan.mesh.dp_size / (
            self.estimate.step_s * self.plan.mesh.world_size)


@dataclass(frozen=True, slots=True)
class ChoiceGain:
    """One choice where the search's configuration differs, applied alone to the current one."""

    dimension: str  # one of DIMENSIONS
    current: str
    chosen: str
    alone: Config | None  # None: the change alone is not a configuration (e.g. no split of the batch)
    why_not: str = ""


@dataclass(frozen=True, slots=True)
class Comparison:
    current: Config
    chosen: Config
    gains: tuple[ChoiceGain, ...]
    current_text: str

    @property
    def speedup(self) -> float:
        """Throughput (tokens/s/GPU) of the search's configuration over the current one's."""
        return self.chosen.sequences_per_s_per_rank / self.current.sequences_per_s_per_rank


def _fail(text: str, why: str) -> OptionError:
    return OptionError(f"--current {text!r}: {why}. Accepted: {CURRENT_FORMS}")


def parse_current(text: str, graph: ModelGraph, mesh: MeshSpec, *, tp_spec: TPSpec | None = None,
                  load_plan=None) -> Current:
    """``text`` (See [Note: the current configuration]) on ``mesh`` (the whole mesh, without
    tensor parallelism). ``load_plan(path) -> (PlanSpec, micro_batch)`` reads a plan file (the
    caller's: the plan file format lives above search). Raises ``OptionError`` naming the item
    and the accepted forms."""
    text = text.strip()
    if text.lower().endswith(".json") or os.path.sep in text:
        if load_plan is None:
            raise _fail(text, "plan files are read by the CLI and optimize_wrap, not here")
        plan, micro_batch = load_plan(text)
        return Current(plan, micro_batch, text)
    if not text:
        raise _fail(text, "nothing given")
    base = baselines(graph, mesh)
    units_name, ckpt_every, reshard, micro_batch, shard, tp = None, 0, True, None, None, 1
    for raw in (s for s in re.split(r"[,;]", text) if s.strip()):
        item = " ".join(raw.lower().replace("_", "-").split())
        if item in base:
            units_name = item
        elif item in ("no ac", "no ckpt", "no checkpointing", "ac none", "none ac"):
            ckpt_every = 0
        elif item in ("full ac", "ac", "ckpt", "full ckpt", "checkpointing", "full checkpointing", "ac full"):
            ckpt_every = 1
        elif item in ("selective ac", "selective-op", "selective-op ac", "sac", "selective checkpointing"):
            ckpt_every = -1
        elif m := re.fullmatch(r"(?:ac|ckpt|checkpoint(?:ing)?) every (\d+)(?:st|nd|rd|th)?(?: blocks?)?", item):
            ckpt_every = int(m.group(1))
        elif m := re.fullmatch(r"(?:micro-?batch|micro batch|mbs)\s*[=:]?\s*(\d+)", item):
            micro_batch = int(m.group(1))
        elif item in ("reshard", "reshard after forward"):
            reshard = True
        elif item in ("no reshard", "no reshard after forward", "zero2", "zero-2"):
            reshard = False
        elif m := re.fullmatch(r"shard\s*=?\s*(\d+)", item):
            shard = int(m.group(1))
        elif m := re.fullmatch(r"tp\s*=?\s*(\d+)", item):
            tp = int(m.group(1))
        else:
            raise _fail(text, f"cannot read {raw.strip()!r}")
        if micro_batch == 0 or tp == 0 or shard == 0 or (ckpt_every == 0 and "every" in item):
            raise _fail(text, f"{raw.strip()!r} needs a positive count")
    if units_name is None:
        units_name = "per-block" if "per-block" in base else "every-leaf"
    plan = base[units_name]
    if mesh.ranks_per_node % tp or mesh.world_size % tp:
        raise _fail(text, f"tp {tp} does not divide the {mesh.ranks_per_node} ranks per node")
    dp = dp_mesh(mesh, tp)
    if shard is not None:
        if dp.world_size % shard:
            raise _fail(text, f"shard {shard} does not divide the {dp.world_size} data-parallel ranks")
        dp = replace(dp, shard_size=shard)
    if plan.mesh.shard_size != 1:  # no-shard keeps its own mesh
        plan = replace(plan, mesh=dp)
    units = with_choices(plan, reshard=reshard).units
    if ckpt_every < 0:  # selective-op on every unit but the root
        units = tuple(u if u.is_root else replace(u, checkpoint=SELECTIVE_OP) for u in units)
    elif ckpt_every:
        blocks = set(graph.blocks)
        order = [i for i, u in enumerate(units) if not u.is_root and u.modules[0] in blocks] or \
            [i for i, u in enumerate(units) if not u.is_root]
        every = set(order[ckpt_every - 1::ckpt_every])
        units = tuple(replace(u, checkpoint=True) if i in every else u for i, u in enumerate(units))
    plan = replace(plan, units=units, label=f"current: {text}")
    if tp > 1:
        spec = tp_spec or builtin_tp_plan(graph)
        check_tp(graph, spec, tp)
        plan = lift_plan(plan, tp, spec)
    return Current(plan, micro_batch, text)


def _choices_by_module(plan: PlanSpec) -> dict[str, tuple[bool | int, object]]:
    return {m: (u.reshard_after_forward, u.checkpoint) for u in plan.units if not u.is_root for m in u.modules}


def _take(units_of: PlanSpec, choices_of: PlanSpec, *, reshard: bool, checkpoint: bool) -> PlanSpec:
    """``units_of`` with the reshard and/or checkpoint choice of ``choices_of``'s unit holding
    each unit's first module (a module ``choices_of`` leaves to its root: resharded, not
    checkpointed)."""
    by = _choices_by_module(choices_of)
    out = []
    for u in units_of.units:
        if not u.is_root:
            raf, ck = by.get(u.modules[0], (True, False))
            u = replace(u, reshard_after_forward=raf if reshard else u.reshard_after_forward,
                        checkpoint=ck if checkpoint else u.checkpoint)
        out.append(u)
    return replace(units_of, units=tuple(out))


def _describe_ckpt(plan: PlanSpec) -> str:
    inner = [u for u in plan.units if not u.is_root]
    full = sum(1 for u in inner if u.checkpoint is True)
    sel = sum(1 for u in inner if u.checkpoint == SELECTIVE_OP)
    parts = [f"{'every unit' if n == len(inner) else f'{n} of {len(inner)} units'} {what}"
             for n, what in ((full, "full"), (sel, "selective-op")) if n]
    return ", ".join(parts) or "none"


def _describe_reshard(plan: PlanSpec) -> str:
    vals = {u.reshard_after_forward for u in plan.units if not u.is_root}
    if not vals:
        return "-"
    return ("after forward" if vals == {True} else "kept to backward" if vals == {False}
            else f"mixed ({sum(1 for u in plan.units if not u.is_root and u.reshard_after_forward is True)} of "
                 f"{len(plan.units) - 1} units)")


def _describe_units(plan: PlanSpec) -> str:
    return f"{len(plan.units)} units" + (f" ({plan.label.split(' + ')[0]})" if plan.label and
                                         not plan.label.startswith("current") else "")


# [Note: the current configuration and a pipeline] A search with ``--pp`` may choose a pipeline
# plan. The current configuration (a description or a plan file without stages) has none, and a
# pipeline changes the mesh, the units per stage and the batch split at once, so no single choice
# of it applies alone to the current plan: the two are compared whole, at the same global batch.
# The pipeline plan keeps the search's own estimate; its throughput counts a step's sequences as
# its micro-batch x its micro-batches x its pipelines (``Config`` with the micro-batches as the
# accumulation). At a fixed global batch without a given micro-batch, the current plan takes the
# pipeline's per-rank share of a step: its micro-batch x micro-batches / pp.
def compare_current(graph: ModelGraph, sim: Simulator, current: Current, chosen: PlanSpec, *,
                    request: ParallelRequest, chosen_micro_batch: int | None,
                    chosen_estimate: CostEstimate | None = None) -> Comparison:
    """The current configuration and the search's (``chosen`` at ``chosen_micro_batch``),
    scored by ``sim``'s fabric and compute at the request's step and global batch, and each
    differing choice alone. A pipeline plan chosen is compared whole, with the search's own
    ``chosen_estimate`` (See [Note: the current configuration and a pipeline]). See [Note: the
    current configuration]."""
    train, global_batch = request.train, request.global_batch
    traced = graph.batch_size or 1
    if current.plan.pipeline is not None:
        raise OptionError(f"--current {current.text!r}: a plan with pipeline stages is not compared here; score it "
                          f"with `wrapopt estimate --plan {current.text}` beside the search's plan file")

    def split_of(plan: PlanSpec, mb: int | None) -> tuple[int, int] | None:
        mb = mb or traced
        if global_batch is None:
            return mb, train.grad_accumulation
        per = mb * plan.mesh.dp_size
        return (mb, global_batch // per) if global_batch % per == 0 else None

    def score(plan: PlanSpec, mb: int | None) -> Config | None:
        sp = split_of(plan, mb)
        if sp is None:
            return None
        t = replace(train, grad_accumulation=sp[1])
        opts = t.sim_options(batch_scale=batch_scale(sp[0], traced, plan.mesh.tp_size),
                             memory_budget=sim.options.memory_budget_bytes)  # offload: the plan's own field
        est = Simulator(graph, sim.fabric, sim.compute, opts, backend=sim.backend, host=sim.host).simulate(plan)
        return Config(plan, sp[0], sp[1], est)

    pipe = chosen.pipeline
    cur_mb = current.micro_batch
    if cur_mb is None and global_batch is not None:
        want = chosen_micro_batch  # a pipeline's: its share per rank (See the note above)
        if pipe is not None and want:
            want = max(1, want * pipe.microbatches // chosen.mesh.pp_size)
        cur_mb = want if split_of(current.plan, want) else None
    cur = score(current.plan, cur_mb)
    if cur is None:
        dp = current.plan.mesh.dp_size
        raise OptionError(f"--current {current.text!r}: micro-batch {cur_mb or traced} x {dp} data-parallel ranks "
                          f"does not divide the global batch {global_batch}; give a micro-batch N with "
                          f"N x {dp} dividing it")
    if pipe is not None:  # See [Note: the current configuration and a pipeline]
        assert chosen_estimate is not None, "a pipeline plan is compared with the search's own estimate"
        whole = Config(chosen, chosen_micro_batch or traced, pipe.microbatches, chosen_estimate)
        what = f"pp{chosen.mesh.pp_size} {pipe.schedule} m{pipe.microbatches}"
        return Comparison(cur, whole, (ChoiceGain("pipeline", "none", what, None, "a pipeline changes every "
                                                  "choice at once; not taken apart"),), current.text)
    best = score(chosen, chosen_micro_batch)
    assert best is not None, "the search's own split divides its global batch"
    cp, bp = current.plan, chosen
    gains: list[ChoiceGain] = []

    def add(dim: str, cur_s: str, best_s: str, plan: PlanSpec | None, mb: int | None, why: str = "") -> None:
        if cur_s != best_s:
            alone = score(plan, mb) if plan is not None else None
            gains.append(ChoiceGain(dim, cur_s, best_s, alone, why if alone is None else ""))

    add("micro-batch", str(cur.micro_batch), str(best.micro_batch), cp, best.micro_batch,
        "does not divide the global batch on the current mesh")
    if cp.mesh.tp_size != bp.mesh.tp_size or cp.mesh.shard_size != bp.mesh.shard_size:
        moved = replace(cp, mesh=bp.mesh, tp=bp.tp) if cp.mesh.shard_size != 1 else None
        if cp.mesh.tp_size != bp.mesh.tp_size:
            add("tensor parallel", f"tp{cp.mesh.tp_size}", f"tp{bp.mesh.tp_size}", moved, cur.micro_batch,
                "the micro-batch does not divide the global batch at that degree")
        else:
            add("shard group", str(cp.mesh.shard_size), str(bp.mesh.shard_size), moved, cur.micro_batch)
    units_alone = _take(replace(bp, mesh=cp.mesh, tp=cp.tp), cp, reshard=True, checkpoint=True) if (
        cp.mesh.shard_size != 1 and bp.mesh.shard_size != 1) else None
    if [u.modules for u in cp.units] != [u.modules for u in bp.units]:
        gains.append(ChoiceGain("units", _describe_units(cp), _describe_units(bp),
                                score(units_alone, cur.micro_batch) if units_alone else None,
                                "" if units_alone else "one of the two does not shard"))
    add("reshard", _describe_reshard(cp), _describe_reshard(_take(cp, bp, reshard=True, checkpoint=False)),
        _take(cp, bp, reshard=True, checkpoint=False), cur.micro_batch)
    add("checkpointing", _describe_ckpt(cp), _describe_ckpt(_take(cp, bp, reshard=False, checkpoint=True)),
        _take(cp, bp, reshard=False, checkpoint=True), cur.micro_batch)
    return Comparison(cur, best, tuple(gains), current.text)
