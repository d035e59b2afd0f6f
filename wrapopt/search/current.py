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
from dataclasses import dataclass, replace

from wrapopt.choices import CURRENT_FORMS
from wrapopt.spec.cp import cp_refusal
from wrapopt.cost.simulate import Simulator
from wrapopt.errors import OptionError, PlanError
from wrapopt.search.baselines import baselines, with_choices
from wrapopt.search.batch import batch_scale
from wrapopt.search.current_items import current_error as _fail, read_items as _read_items
from wrapopt.search.current_knobs import knobs_said
from wrapopt.search.current_pp import PipelineWords, block_checkpoints, pipeline_current
from wrapopt.search.pipeline import pipeline_sequences
from wrapopt.search.pipeline_batch import pipeline_at_batch
from wrapopt.search.stages import pipeline_layout
from wrapopt.search.tp import dp_mesh, lift_plan
from wrapopt.spec import SELECTIVE_OP, CostEstimate, MeshSpec, ModelGraph, ParallelRequest, PlanSpec
from wrapopt.tp import TPSpec, builtin_tp_plan, check_tp

__all__ = ["CURRENT_FORMS", "DIMENSIONS", "Current", "Config", "ChoiceGain", "Comparison", "parse_current",
           "compare_current", "current_sync"]

# The choices compared one at a time, in the report's order.
DIMENSIONS = ("micro-batch", "context parallel", "tensor parallel", "shard group", "units", "reshard",
              "checkpointing", "offload", "gradient sync", "pipeline")


@dataclass(frozen=True, slots=True)
class Current:
    """A configuration to compare against: the plan and its micro-batch (None: the traced
    batch, or at a fixed global batch the search's)."""

    plan: PlanSpec
    micro_batch: int | None  # a pipeline's: sequences per pipeline micro-batch
    text: str  # what the user wrote, for the report
    local_batch: int | None = None  # TorchTitan's training.local_batch_size, when said
    microbatches_said: bool = False  # a pipeline's micro-batch count was said (not set by the global batch)
    sync: str | None = None  # "every" or "last" when said (or a plan file records it): See [Note: current sync]
    knobs: tuple[tuple[str, object], ...] = ()  # TrainConfig's knobs said, scored with: search/current_knobs.py


@dataclass(frozen=True, slots=True)
class Config:
    """A plan at a split of the batch, scored."""

    plan: PlanSpec
    micro_batch: int  # sequences per data-parallel rank per micro-batch
    accumulation: int
    estimate: CostEstimate

    @property
    def sequences_per_s_per_rank(self) -> float:
        return self.micro_batch * self.accumulation * self.plan.mesh.batch_size / (
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


def parse_current(text: str, graph: ModelGraph, mesh: MeshSpec, *, tp_spec: TPSpec | None = None,
                  load_plan=None) -> Current:
    """``text`` (See [Note: the current configuration]; a pipeline: [Note: a pipeline described] in
    search/current_pp.py) on ``mesh`` (the whole mesh, without tensor parallelism). ``load_plan(path)
    -> (PlanSpec, micro_batch)`` reads a plan file (the caller's: the plan file format lives above
    search). Raises ``OptionError`` naming the item and the accepted forms."""
    text = text.strip()
    if text.lower().endswith(".json") or os.path.sep in text:
        if load_plan is None:
            raise _fail(text, "plan files are read by the CLI and optimize_wrap, not here")
        loaded = load_plan(text)  # (plan, micro-batch), or with the sync mode the file records
        plan, micro_batch = loaded[0], loaded[1]
        return Current(plan, micro_batch, text, microbatches_said=plan.pipeline is not None,
                       sync=loaded[2] if len(loaded) > 2 else None)
    if not text:
        raise _fail(text, "nothing given")
    base = baselines(graph, mesh)
    said = _read_items(text, base)
    units_name = said.get("units") or ("per-block" if "per-block" in base else "every-leaf")
    ckpt_every, reshard, tp, shard = said.get("ckpt", 0), said.get("reshard"), said.get("tp", 1), said.get("shard")
    local_batch, micro_batch = said.get("local"), said.get("micro")
    if mesh.ranks_per_node % tp or mesh.world_size % tp:
        raise _fail(text, f"tp {tp} does not divide the {mesh.ranks_per_node} ranks per node")
    spec = None
    if tp > 1:
        spec = tp_spec or builtin_tp_plan(graph)
        check_tp(graph, spec, tp)
        spec = replace(spec, **said.get("switches", {}))
        if spec.async_tp and not spec.sequence_parallel:
            if said.get("switches", {}).get("async_tp"):
                raise _fail(text, "async tp overlaps sequence parallelism's collectives, which are off here: "
                                  "add sequence parallel")
            spec = replace(spec, async_tp=False)
    elif said.get("switches"):
        raise _fail(text, f"{', '.join(said['switch_words'])} needs tensor parallelism: add tp N")
    if "pp" in said or "schedule" in said:
        cur = _pipeline(text, graph, mesh, said, units_name, spec)  # cp, ep: [Note: cp in a pipeline] in shapes.py
        return replace(cur, plan=_with_cp_ep(text, graph, cur.plan, said.get("cp", 1), said.get("ep", 1)),
                       knobs=knobs_said(text, said, _fail))
    if local_batch is not None:  # TorchTitan's local batch: one forward and backward's sequences per rank
        if micro_batch not in (None, local_batch):
            raise _fail(text, f"local batch {local_batch} is the micro-batch without a pipeline (TorchTitan's "
                              f"training.local_batch_size); micro-batch {micro_batch} says otherwise: give one")
        micro_batch = local_batch
    plan = base[units_name]
    dp = dp_mesh(mesh, tp)
    if shard is not None:
        if dp.world_size % shard:
            raise _fail(text, f"shard {shard} does not divide the {dp.world_size} data-parallel ranks")
        dp = replace(dp, shard_size=shard)
    if plan.mesh.shard_size != 1:  # no-shard keeps its own mesh
        plan = replace(plan, mesh=dp)
    units = with_choices(plan, reshard=reshard is not False).units
    if ckpt_every < 0:  # selective-op on every unit but the root
        units = tuple(u if u.is_root else replace(u, checkpoint=SELECTIVE_OP) for u in units)
    elif ckpt_every:
        blocks = set(graph.blocks)
        order = [i for i, u in enumerate(units) if not u.is_root and u.modules[0] in blocks] or \
            [i for i, u in enumerate(units) if not u.is_root]
        every = set(order[ckpt_every - 1::ckpt_every])
        units = tuple(replace(u, checkpoint=True) if i in every else u for i, u in enumerate(units))
    plan = replace(plan, units=units, label=f"current: {text}")
    plan = _with_cp_ep(text, graph, plan, said.get("cp", 1), said.get("ep", 1))
    if tp > 1:
        plan = lift_plan(plan, tp, spec)
    return Current(plan, micro_batch, text, local_batch=local_batch, sync=said.get("sync"),
                   knobs=knobs_said(text, said, _fail))


def _with_cp_ep(text: str, graph: ModelGraph, plan: PlanSpec, cp: int, ep: int) -> PlanSpec:
    """The plan with ``cp N`` and ``ep N`` on its mesh (See [Note: the cp and ep axes of the mesh]
    in spec/plan.py): the cp ranks inside the shard group, the experts over ep ranks; a cp degree
    the model (attention without SDPA) or the sequence (2 x cp chunks) cannot take is refused."""
    if cp == 1 and ep == 1:
        return plan
    why = cp_refusal(graph) if cp > 1 else None
    if why:
        raise _fail(text, f"cp {cp}: {why}")
    if cp > 1 and graph.seq_len % (2 * cp):
        works = [c for c in range(2, graph.seq_len + 1) if graph.seq_len % (2 * c) == 0][:8]
        raise _fail(text, f"cp {cp} does not split the sequence of {graph.seq_len} tokens into 2 x {cp} chunks; "
                          f"degrees that do: {', '.join(map(str, works)) or 'none'}")
    if plan.mesh.shard_size == 1:
        raise _fail(text, f"{'cp' if cp > 1 else 'ep'} needs FSDP's shard group (it shards over dp_shard x cp): "
                          "no-shard has none; pick other units")
    try:
        return replace(plan, mesh=plan.mesh.with_cp(cp, ep))
    except ValueError as e:
        raise _fail(text, str(e)) from None


def _pipeline(text: str, graph: ModelGraph, mesh: MeshSpec, said: dict, units_name: str,
              spec: TPSpec | None) -> Current:
    """The described pipeline's plan: See [Note: a pipeline described] in search/current_pp.py."""
    if "pp" not in said:
        raise _fail(text, f"schedule {said['schedule']} needs a pipeline degree: add pp N")
    if units_name != "per-block":
        raise _fail(text, f"a pipeline (pp {said['pp']}) takes one unit per block (per-block), not {units_name}")
    words = PipelineWords(said["pp"], said.get("schedule", "1F1B"), said.get("virtual"), said.get("count"))
    try:
        layout_blocks = len(pipeline_layout(graph).blocks)
        plan = pipeline_current(graph, mesh, words, tp=said.get("tp", 1), shard=said.get("shard"),
                                reshard=said.get("reshard"),
                                checkpoints=block_checkpoints(layout_blocks, said.get("ckpt", 0)),
                                micro_batch=said.get("micro") or 1, local_batch=said.get("local"), tp_spec=spec,
                                label=f"current: {text}")
    except (ValueError, PlanError) as e:
        raise _fail(text, str(e)) from None
    return Current(plan, said.get("micro") or 1, text, local_batch=said.get("local"),
                   microbatches_said=said.get("count") is not None)


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
# plan, and the current configuration may be one (``pp N`` in the description, or a plan file with
# stages). A pipeline changes the mesh, the units per stage and the batch split at once, so no
# single choice of it applies alone to the other plan: the two are compared whole, at the same
# global batch. A pipeline chosen keeps the search's own estimate; its throughput counts a step's
# sequences as its micro-batch x its micro-batches x its pipelines (``Config`` with the
# micro-batches as the accumulation). At a fixed global batch without a given micro-batch, a
# current plan without a pipeline takes the pipeline's per-rank share of a step: its micro-batch x
# micro-batches / pp. A current pipeline is scored as the search scores a pipeline at a global
# batch (``pipeline_at_batch``): the global batch N is ``--global-batch``, else its local batch x
# its data-parallel ranks, else its pipeline's share of the traced batch on every rank; each of its
# ``dp`` pipelines runs ``N / dp`` sequences (its local batch) a step, in micro-batches of its
# micro-batch (the description's, default 1, as TorchTitan's pipeline_parallel_microbatch_size; a
# plan file's, else the search's at its local batch: the pipeline's share of the traced batch over
# its micro-batches, as the search's own pipeline plan is counted). A pipeline's micro-batches are
# its accumulation, so a local batch said must be ``N / dp``. Under cp, ``dp`` counts the pipelines
# that read different sequences (``MeshSpec.batch_size``: a cp group reads one), and the plan is
# priced as [Note: pipeline global batch] in search/pipeline_batch.py says for cp.
# [Note: current sync] A plain FSDP2 loop with gradient accumulation reduce-scatters after every
# micro-batch: ``no_sync`` (``set_requires_gradient_sync(False)``) is something a job adds. So the
# current configuration, and each choice applied alone to it, is scored syncing every micro-batch
# unless told otherwise: ``sync last`` / ``no sync`` in the description, the sync mode a plan file
# records, or ``--sync`` (which sets the search's too). The search's own plan keeps the mode the
# search chose for it. Scoring the current job in the faster mode that fits (as the search scores
# its own plans) would credit it with a no-sync loop it may not run, and shrink the gain shown.
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
    cur_sync = current_sync(current, request)  # See [Note: current sync]

    def split_of(plan: PlanSpec, mb: int | None) -> tuple[int, int] | None:
        mb = mb or traced
        if global_batch is None:
            return mb, train.grad_accumulation
        per = mb * plan.mesh.batch_size
        return (mb, global_batch // per) if global_batch % per == 0 else None

    cur_knobs = dict(current.knobs)  # the current's own knobs, when said; the search's plan: the request's
    def score(plan: PlanSpec, mb: int | None, sync: str | None = cur_sync, knobs: dict = cur_knobs) -> Config | None:
        sp = split_of(plan, mb)
        if sp is None:
            return None
        t = replace(train, grad_accumulation=sp[1], accumulation_sync=sync, **knobs)
        opts = t.sim_options(batch_scale=batch_scale(sp[0], traced, plan.mesh.tp_size),
                             memory_budget=sim.options.memory_budget_bytes)  # offload: the plan's own field
        est = Simulator(graph, sim.fabric, sim.compute, opts, backend=sim.backend, host=sim.host).simulate(plan)
        return Config(plan, sp[0], sp[1], est)

    pipe = chosen.pipeline
    if pipe is not None:  # the search's pipeline at its local batch: its share of the traced batch
        chosen_micro_batch = chosen_micro_batch or _pipeline_micro_batch(graph, chosen, train.grad_accumulation)
    if current.plan.pipeline is not None:  # See [Note: the current configuration and a pipeline]
        whole = (Config(chosen, chosen_micro_batch, pipe.microbatches, chosen_estimate) if pipe is not None
                 else score(chosen, chosen_micro_batch, train.accumulation_sync))
        assert whole is not None, "the search's own split divides its global batch"
        return _whole(_score_pipeline(graph, sim, current, request), whole, current.text)
    cur_mb = current.micro_batch
    if cur_mb is None and global_batch is not None:
        want = chosen_micro_batch  # a pipeline's: its share per rank (See the note above)
        if pipe is not None and want:
            want = max(1, want * pipe.microbatches // chosen.mesh.pp_size)
        cur_mb = want if split_of(current.plan, want) else None
    cur = score(current.plan, cur_mb)
    if cur is None:
        dp = current.plan.mesh.batch_size
        raise OptionError(f"--current {current.text!r}: micro-batch {cur_mb or traced} x {dp} data-parallel ranks "
                          f"does not divide the global batch {global_batch}; give a micro-batch N with "
                          f"N x {dp} dividing it")
    if pipe is not None:  # See [Note: the current configuration and a pipeline]
        assert chosen_estimate is not None, "a pipeline plan is compared with the search's own estimate"
        return _whole(cur, Config(chosen, chosen_micro_batch, pipe.microbatches, chosen_estimate), current.text)
    best = score(chosen, chosen_micro_batch, train.accumulation_sync, {})  # the search's own mode and knobs
    assert best is not None, "the search's own split divides its global batch"
    return Comparison(cur, best, _gains(current.plan, chosen, cur, best, score, cur_sync), current.text)


def _gains(cp: PlanSpec, bp: PlanSpec, cur: Config, best: Config, score, cur_sync: str) -> tuple[ChoiceGain, ...]:
    """Each choice where the search's plan ``bp`` differs from the current ``cp``, applied alone to
    the current configuration and scored by ``score(plan, micro_batch, sync)``."""
    gains: list[ChoiceGain] = []

    def add(dim: str, cur_s: str, best_s: str, plan: PlanSpec | None, mb: int | None, why: str = "",
            sync: str = cur_sync) -> None:
        if cur_s != best_s:
            alone = score(plan, mb, sync) if plan is not None else None
            gains.append(ChoiceGain(dim, cur_s, best_s, alone, why if alone is None else ""))

    add("micro-batch", str(cur.micro_batch), str(best.micro_batch), cp, best.micro_batch,
        "does not divide the global batch on the current mesh")
    if cp.mesh.cp_size != bp.mesh.cp_size:  # the current's plan with the chosen cp degree (a step of 1/cp the tokens)
        c = bp.mesh.cp_size
        add("context parallel", f"cp{cp.mesh.cp_size}", f"cp{c}",
            replace(cp, mesh=cp.mesh.with_cp(c)) if cp.mesh.shard_size % c == 0 else None, cur.micro_batch,
            f"the current shard group of {cp.mesh.shard_size} does not hold cp groups of {c}")
    if cp.mesh.tp_size != bp.mesh.tp_size or cp.mesh.shard_size != bp.mesh.shard_size:
        moved = replace(cp, mesh=bp.mesh, tp=bp.tp) if cp.mesh.shard_size != 1 else None
        if cp.mesh.tp_size != bp.mesh.tp_size:
            add("tensor parallel", f"tp{cp.mesh.tp_size}", f"tp{bp.mesh.tp_size}", moved, cur.micro_batch,
                "the micro-batch does not divide the global batch at that degree")
        else:
            add("shard group", str(cp.mesh.shard_size), str(bp.mesh.shard_size), moved, cur.micro_batch)
    units_alone = _take(replace(bp, mesh=cp.mesh, tp=cp.tp, offload=cp.offload), cp, reshard=True,
                        checkpoint=True) if cp.mesh.shard_size != 1 and bp.mesh.shard_size != 1 else None
    if [u.modules for u in cp.units] != [u.modules for u in bp.units]:
        gains.append(ChoiceGain("units", _describe_units(cp), _describe_units(bp),
                                score(units_alone, cur.micro_batch, cur_sync) if units_alone else None,
                                "" if units_alone else "one of the two does not shard"))
    add("reshard", _describe_reshard(cp), _describe_reshard(_take(cp, bp, reshard=True, checkpoint=False)),
        _take(cp, bp, reshard=True, checkpoint=False), cur.micro_batch)
    add("checkpointing", _describe_ckpt(cp), _describe_ckpt(_take(cp, bp, reshard=False, checkpoint=True)),
        _take(cp, bp, reshard=False, checkpoint=True), cur.micro_batch)
    add("offload", _OFFLOAD_WORDS[cp.offload], _OFFLOAD_WORDS[bp.offload], replace(cp, offload=bp.offload),
        cur.micro_batch)
    best_sync = best.estimate.accumulation_sync or cur_sync
    if cur.accumulation > 1 and best.accumulation > 1:  # See [Note: current sync]
        add("gradient sync", _SYNC_WORDS[cur_sync], _SYNC_WORDS[best_sync], cp, cur.micro_batch, sync=best_sync)
    return tuple(gains)


_OFFLOAD_WORDS = {False: "none", True: "CPU offload (parameters, gradients, optimizer state)"}
_SYNC_WORDS = {"every": "every micro-batch", "last": "last micro-batch (no-sync)"}


def current_sync(current: Current, request: ParallelRequest) -> str:
    """The sync mode the current configuration is scored in: said, else ``--sync``, else every
    micro-batch (See [Note: current sync])."""
    return current.sync or request.train.accumulation_sync or "every"


def _pipeline_micro_batch(graph: ModelGraph, plan: PlanSpec, accumulation: int) -> int:
    """A pipeline plan's micro-batch at the search's local batch: its pipeline's share of the traced
    batch (``pp x tp x accumulation`` ranks' batches, as ``microbatch_counts``) over its micro-batches."""
    assert plan.pipeline is not None
    share = pipeline_sequences(graph, plan.mesh.pp_size, plan.mesh.tp_size, accumulation)
    return max(1, share // plan.pipeline.microbatches)


def _whole(cur: Config, chosen: Config, text: str) -> Comparison:
    """Two configurations, one of them a pipeline, compared whole (See [Note: the current
    configuration and a pipeline])."""
    gain = ChoiceGain("pipeline", _describe_pipeline(cur.plan), _describe_pipeline(chosen.plan), None,
                      "a pipeline changes every choice at once; not taken apart")
    return Comparison(cur, chosen, (gain,), text)


def _describe_pipeline(plan: PlanSpec) -> str:
    pipe = plan.pipeline
    if pipe is None:
        return "none"
    v = pipe.virtual_stages(plan.mesh.pp_size)
    return (f"pp{plan.mesh.pp_size} {pipe.schedule}{f' x{v}' if v > 1 else ''} m{pipe.microbatches}"
            + (f" tp{plan.mesh.tp_size}" if plan.mesh.tp_size > 1 else ""))


def _score_pipeline(graph: ModelGraph, sim: Simulator, current: Current, request: ParallelRequest) -> Config:
    """A current pipeline plan at its global batch: See [Note: the current configuration and a pipeline]."""
    plan, pipe = current.plan, current.plan.pipeline
    assert pipe is not None
    dp = plan.mesh.batch_size  # its pipelines that read different sequences (a cp group reads one)
    mb = current.micro_batch or (1 if not current.microbatches_said else  # a plan file without one: the search's
                                 _pipeline_micro_batch(graph, plan, request.train.grad_accumulation))
    n = request.global_batch
    local = current.local_batch
    if n is None:  # its local batch, its micro-batches said, else its pipeline's share of the traced batch
        per = local or (pipe.microbatches * mb if current.microbatches_said else
                        pipeline_sequences(graph, plan.mesh.pp_size, plan.mesh.tp_size))
        n = dp * per
    if local is not None and local * dp != n:
        raise OptionError(f"--current {current.text!r}: local batch {local} x {dp} data-parallel ranks is "
                          f"{local * dp} sequences a step, not the global batch {n} (a pipeline's micro-batches "
                          f"are its accumulation); say local batch {n // dp if n % dp == 0 else 'N'} or "
                          f"--global-batch {local * dp}")
    if n % (dp * mb):
        raise OptionError(f"--current {current.text!r}: the global batch {n} is not micro-batches of {mb} on each "
                          f"of its {dp} pipelines; a global batch that is a multiple of {dp * mb}")
    m = n // (dp * mb)
    if current.microbatches_said and m != pipe.microbatches:
        raise OptionError(f"--current {current.text!r}: {pipe.microbatches} micro-batches of {mb} on each of {dp} "
                          f"pipelines run {pipe.microbatches * mb * dp} sequences a step, not the global batch {n}")
    try:
        plan = replace(plan, pipeline=replace(pipe, microbatches=m))
        train = replace(request.train, micro_batch=mb, grad_accumulation=1, global_batch=None)
        at = replace(request, mesh=MeshSpec(world_size=plan.mesh.world_size, ranks_per_node=plan.mesh.ranks_per_node,
                                            shard_size=plan.mesh.world_size), global_batch=n, train=train, pp=1, tp=1,
                     cp=1, ep=1)  # under cp, priced as [Note: pipeline global batch] says
        psim, _train = pipeline_at_batch(graph, sim, plan, at, memory_budget=sim.options.memory_budget_bytes)
        est = psim.simulate(plan)
    except (OptionError, PlanError, ValueError) as e:
        raise OptionError(f"--current {current.text!r}: {e}") from None
    return Config(plan, mb, m, est)
