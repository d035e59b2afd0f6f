"""Out-of-memory advice, computed: each remedy re-simulated on the plan of least memory.

[Note: computed remedies] When no plan fits, the message says what would, and only what was
priced. The plan of least memory (one unit per block, resharded, checkpointed as far as the
request's checkpoint modes allow: ``least_memory_plan``) is re-simulated under each remedy alone,
on the search's fabric, compute and host:

- a smaller micro-batch (``--batch m --accumulation k``, the sequences per step kept);
- more checkpointing (``--checkpoint-modes ...,full``), a larger shard group (``--shard-size``);
- mixed precision, the sync mode, a lighter optimizer (``--precision``, ``--sync``, ``--optimizer``);
- tensor parallelism (``--tp d``: the ``Simulator.view`` of one tensor-parallel rank at the same
  global batch, and at one sequence per tensor-parallel group through ``--global-batch``);
- a pipeline (``--pp d``: the pipeline search of that degree, ``search_pipeline_degree``);
- CPU offload (``--offload``), priced only where the GPU's host link is stated (``offload_host``),
  with the host memory it needs;
- a shorter sequence (``--seq``), priced by scaling the tokens (``SimOptions.batch_scale``): the
  trace is not redone, so attention's quadratic term is scaled linearly (its step is an upper bound).

Within a remedy the variants run mildest first (the largest micro-batch, the smallest degree, the
longest sequence) and stop at the first that fits with the memory model's margin (See [Note:
plans within the error] in search/choose.py); a remedy reports that variant, else the first that
fits only past the margin, else its smallest peak. A remedy already in place (a micro-batch of
one sequence, bf16 on, every block checkpointed, ``--tp auto``, ...) is not tried, and said so.
Each result is one plan's: a search with the flag may find a faster plan that fits. When none
fits alone, up to ``_PAIRS`` pairs of those that lowered the peak (the largest summed savings
first; two that set one field, e.g. two micro-batch splits, are not paired) are priced together.

Bounded in time: no re-simulation starts after ``REMEDY_TIME_S`` seconds, and the remedies left
are named as not tried. The cheap run first (a new step's simulator, then one simulation each);
the tensor-parallel views (building one prices the split blocks) and the pipeline search (one
degree scores a few dozen stage layouts) run last. Measured on llama-70b (8 H100s, 4096 tokens) on
a shared 2-core machine: 9 settings in 3.4-4.5 s; with --global-batch 16 (a new simulator and
tensor-parallel view per split) 11 settings in 17-27 s at load 11-15, the last started before 20 s.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable, Sequence

from wrapopt.cost.simulate import Simulator
from wrapopt.errors import PlanError, WrapoptError
from wrapopt.search.baselines import baselines, checkpointed
from wrapopt.search.choose import MEMORY_ERROR
from wrapopt.search.advice import REMEDY_TIME_S, Advice, Remedy
from wrapopt.search.batch import batch_scale, batch_splits, train_for
from wrapopt.search.pipeline import AUTO_PP, search_pipeline_degree
from wrapopt.search.pipeline_batch import pipeline_batch
from wrapopt.search.stages import pipeline_layout
from wrapopt.search.tp import auto_degrees, dp_mesh, request_spec
from wrapopt.spec import AUTO, SELECTIVE_OP, CostEstimate, MeshSpec, ModelGraph, ParallelRequest, PlanSpec, Shape
from wrapopt.train import TrainConfig

__all__ = ["REMEDY_TIME_S", "Remedy", "Advice", "find_remedies", "least_memory_plan"]

_SEQ_FACTORS = (2, 4, 8)  # a shorter sequence: half, a quarter, an eighth
_STEP_FIELDS = ("param_dtype", "reduce_dtype", "output_dtype", "optimizer", "accumulation_sync")  # the step's knobs


@dataclass(frozen=True, slots=True)
class _Setting:
    """One way to run the step: what a remedy changes of the base."""

    train: TrainConfig
    scale: float  # SimOptions.batch_scale, before the tensor-parallel view multiplies it
    tp: int = 1
    pp: int = 1
    offload: bool = False
    checkpoint: bool | str = True
    shard: int | None = None  # the shard group over the data-parallel ranks (None: all of them)


@dataclass
class _Pricer:
    """Prices settings on the plan of least memory, with a simulator per step (cached)."""

    graph: ModelGraph
    sim: Simulator
    request: ParallelRequest
    budget: float
    offload_host: Any
    tp_spec: Any = None
    base_scale: float = 1.0
    sims: dict = field(default_factory=dict)
    count: int = 0

    def simulator(self, s: _Setting) -> Simulator:
        key = (s.train, s.scale, s.offload)
        if key not in self.sims:
            opts = replace(s.train.sim_options(batch_scale=s.scale, memory_budget=self.budget), offload=s.offload)
            host = self.sim.host if self.sim.host is not None or not s.offload else self.offload_host
            self.sims[key] = self.sim if opts == self.sim.options else Simulator(  # the search's: priced already
                self.graph, self.sim.fabric, self.sim.compute, opts, backend=self.sim.backend, host=host)
        return self.sims[key]

    def price(self, s: _Setting) -> tuple[PlanSpec, CostEstimate, Simulator]:
        """The plan of least memory under ``s``: its plan (on the view's mesh), estimate and simulator."""
        self.count += 1
        full = self.simulator(s)
        mesh = self.request.mesh
        if s.pp > 1:
            return self._pipeline(full, s)
        view = full.view(Shape(tp=s.tp), self.tp_spec)
        dp = dp_mesh(mesh, s.tp)
        if s.shard is not None:
            dp = replace(dp, shard_size=s.shard)
        plan = least_memory_plan(view.traced, dp, s.checkpoint)
        if s.tp > 1:
            plan = replace(plan, label=f"{plan.label} + tp{s.tp}")
        return plan, view.simulate(plan), view

    def remedy(self, flag: str, s: _Setting, note: str) -> Remedy:
        """``s`` priced as a remedy asked for by ``flag`` (offload: with the host memory it needs)."""
        plan, est, sim = self.price(s)
        if s.offload:
            need = sim.host_bytes_per_rank(plan) * self.request.mesh.ranks_per_node
            flag = flag.replace("--offload", f"--offload --host-memory {math.ceil(need / 2**30)}GiB")
            note = "; ".join(x for x in (note, "the least host memory per node it needs: give what a node has") if x)
        seq = re.search(r"--seq (\d+)", flag)
        return Remedy(flag, est.peak_bytes, est.step_s, plan.label or "plan", est.peak_bytes <= self.budget, note,
                      int(seq.group(1)) / self.graph.seq_len if seq else 1.0, s)

    def _pipeline(self, full: Simulator, s: _Setting) -> tuple[PlanSpec, CostEstimate, Simulator]:
        mesh, request = self.request.mesh, self.request
        shape = Shape(pp=s.pp, tp=s.tp)
        counts, sim = None, full
        if request.global_batch is not None:  # the request's split, with the setting's step and sequence
            step = replace(request.train, **{k: getattr(s.train, k) for k in _STEP_FIELDS})
            fixed = pipeline_batch(self.graph, full, replace(request, train=step), memory_budget=self.budget)
            found, why = fixed.counts(shape)
            if not found:
                raise PlanError(why)
            opts = replace(fixed.sim.options, batch_scale=fixed.sim.options.batch_scale * s.scale / self.base_scale)
            counts, sim = found, Simulator(self.graph, full.fabric, full.compute, opts, backend=full.backend,
                                           host=full.host)
        top, scored, why = search_pipeline_degree(self.graph, sim, mesh, pipeline_layout(self.graph), shape=shape,
                                                  spec=self.tp_spec if s.tp > 1 else None, memory_budget=self.budget,
                                                  counts=counts, refine=False)
        if top is None and not scored:
            raise PlanError(why)
        best = top if top is not None else min(scored, key=lambda x: x.estimate.peak_bytes)
        return best.plan, best.estimate, sim


def least_memory_plan(graph: ModelGraph, mesh: MeshSpec, checkpoint: bool | str) -> PlanSpec:
    """One unit per block (every leaf without blocks), resharded, every unit checkpointed in
    ``checkpoint`` mode (False: none)."""
    base = baselines(graph, mesh)
    name = "per-block" if "per-block" in base else "every-leaf"
    if checkpoint is False:
        return base[name]
    return checkpointed(base[name], f"{name},{'sac' if checkpoint == SELECTIVE_OP else 'ckpt'}", checkpoint)


_Variant = tuple[str, _Setting, str]  # (flag, setting, note)


def find_remedies(graph: ModelGraph, sim: Simulator, request: ParallelRequest, budget: float, *,
                  checkpoint_modes: Sequence[bool | str] = (False, True), offload_host: Any = None,
                  time_limit_s: float | None = None) -> Advice:
    """Each remedy of [Note: computed remedies] priced on the plan of least memory for ``request``
    on ``sim``'s fabric and compute. ``offload_host``: a ``HostSpec`` with the GPU's stated host
    link, to price CPU offload when the request has none (its host memory is not read: the advice
    says how much the plan needs). ``time_limit_s``: the bound (default ``REMEDY_TIME_S``)."""
    start = time.monotonic()
    time_limit_s = REMEDY_TIME_S if time_limit_s is None else time_limit_s
    train = request.train if request.train is not None else TrainConfig()
    try:
        spec, _why = sim.with_async(request_spec(graph, request), request.async_tp)
        tp_why = ""
    except PlanError as e:
        spec, tp_why = None, str(e)
    tp = request.tp if isinstance(request.tp, int) else 1
    ckpt = True if True in checkpoint_modes else (SELECTIVE_OP if SELECTIVE_OP in checkpoint_modes else False)
    base = _base(graph, sim, request, train, tp, ckpt)
    pricer = _Pricer(graph, sim, request, budget, offload_host, tp_spec=spec, base_scale=base.scale)
    base_plan, base_est, _ = pricer.price(base)
    in_place: list[str] = []
    not_priced: list[str] = []
    families = _families(graph, request, base, checkpoint_modes, offload_host is not None, spec, tp_why,
                         in_place, not_priced)
    priced: list[Remedy] = []
    for name, variants in families:  # the cheap first: a tensor-parallel view and a pipeline search last
        if time.monotonic() - start > time_limit_s:
            not_priced.append(f"{name}: not tried (past the {time_limit_s:.0f} s bound)")
            continue
        priced += _first_fit(pricer, variants(), budget, start, time_limit_s, not_priced, name)
    together = None
    if priced and not any(r.fits for r in priced):
        together = _pairs(pricer, base, base_est.peak_bytes, priced, budget, start, time_limit_s)
    return Advice(base_label=base_plan.label or "the plan of least memory", base_peak_bytes=base_est.peak_bytes,
                  budget_bytes=budget, priced=tuple(priced), in_place=tuple(in_place),
                  not_priced=tuple(not_priced), elapsed_s=time.monotonic() - start, limit_s=time_limit_s,
                  num_simulated=pricer.count, together=together)


def _families(graph: ModelGraph, request: ParallelRequest, base: _Setting, checkpoint_modes: Sequence[bool | str],
              can_offload: bool, spec: Any, tp_why: str, in_place: list[str],
              not_priced: list[str]) -> list[tuple[str, Callable[[], list[_Variant]]]]:
    """(name, its variants) for each remedy not in place, the cheapest to price first; what is in
    place, or cannot be priced, is added to ``in_place`` and ``not_priced``."""
    mesh, train, tp = request.mesh, base.train, base.tp
    out: list[tuple[str, Callable[[], list[_Variant]]]] = []
    # the batch: a smaller micro-batch, the sequences per step kept
    per_rank = round(max(1, graph.batch_size) * base.scale)
    if request.global_batch is not None:
        in_place.append(f"every micro-batch x accumulation split of --global-batch {request.global_batch} "
                        "(the search tried them)")
    elif per_rank <= 1:
        in_place.append("a micro-batch of one sequence per rank")
    else:
        out.append(("micro-batch", lambda: [
            (f"--batch {m} --accumulation {train.grad_accumulation * per_rank // m}",
             replace(base, train=replace(train, grad_accumulation=train.grad_accumulation * per_rank // m),
                     scale=base.scale * m / per_rank), "the same sequences per step")
            for m in range(per_rank - 1, 0, -1) if per_rank % m == 0]))  # a traced batch: a tensor's rows
    # checkpointing and the shard group
    if base.checkpoint is True:
        in_place.append("every block checkpointed")
    else:
        modes = [{False: "none", True: "full", SELECTIVE_OP: SELECTIVE_OP}[m] for m in checkpoint_modes]
        out.append(("checkpointing", lambda: [(f"--checkpoint-modes {','.join([*modes, 'full'])}",
                                               replace(base, checkpoint=True), "")]))
    if base.shard is not None:
        out.append(("shard group", lambda: [(f"--shard-size {mesh.world_size // tp}", replace(base, shard=None), "")]))
    # the training step's knobs
    compute = graph.compute_dtype or next((d for _f, _s, d in graph.param_shapes), "float32")
    knobs = _knobs(base, _dtype(compute), in_place)
    out.append(("training step", lambda: knobs))
    # offload, a shorter sequence, tensor parallelism, a pipeline
    if request.offload:
        in_place.append("CPU offload (--offload searched)")
    elif not can_offload:
        not_priced.append("--offload: CPU offload is priced from a stated GPU's host link: add --gpu PRESET "
                          "(with --offload --host-memory SIZE)")
    else:
        out.append(("offload", lambda: [("--offload", replace(base, offload=True), "")]))
    if graph.seq_len >= 2:
        out.append(("sequence", lambda: [
            (f"--seq {graph.seq_len // f}", replace(base, scale=base.scale / f),
             f"1/{f} of the tokens per step; its step scaled from the trace, an upper bound")
            for f in _SEQ_FACTORS if graph.seq_len // f >= 1]))
    if request.tp == AUTO:
        in_place.append("tensor parallelism (--tp auto: every degree searched)")
    elif spec is None:
        not_priced.append(f"--tp: {tp_why}")
    else:
        out.append(("tensor parallelism", lambda: _tp_variants(graph, request, base, spec, tp)))
    if request.pp == AUTO or (isinstance(request.pp, int) and request.pp > 1):
        in_place.append(f"a pipeline (--pp {request.pp} searched)")
    else:
        try:
            layout = pipeline_layout(graph)
            out.append(("pipeline", lambda: [(f"--pp {d}", replace(base, pp=d), "") for d in AUTO_PP
                                             if mesh.world_size % (d * tp) == 0 and d <= len(layout.blocks)]))
        except PlanError as e:
            not_priced.append(f"--pp: {e}")
    return out


def _base(graph: ModelGraph, sim: Simulator, request: ParallelRequest, train: TrainConfig, tp: int,
          ckpt: bool | str) -> _Setting:
    """The request's own setting: at a fixed global batch, its smallest micro-batch at ``tp``; a
    pipeline degree asked for (not ``auto``: its degree 1 is the flat plan) kept."""
    pp = request.pp if isinstance(request.pp, int) else 1
    shard = request.dp_shard if request.dp_shard is not None and request.dp_shard < request.mesh.world_size // tp \
        else None
    if request.global_batch is not None:
        splits = batch_splits(request.batch, {tp: request.mesh.world_size // tp})
        if splits:
            split = splits[0]
            return _Setting(train=train_for(train, split), scale=batch_scale(split.micro_batch, graph.batch_size, tp),
                            tp=tp, pp=pp, checkpoint=ckpt, shard=shard)
    return _Setting(train=train, scale=sim.options.batch_scale, tp=tp, pp=pp, checkpoint=ckpt, shard=shard)


def _knobs(base: _Setting, compute_dtype: str, in_place: list[str]) -> list[_Variant]:
    """Mixed precision, the sync mode and the optimizer, each where it is not already the lighter
    (``compute_dtype``: what the traced step computes in)."""
    train, out = base.train, []
    if (train.param_dtype or compute_dtype) == "float32":
        bf16 = TrainConfig.preset("bf16", grad_accumulation=train.grad_accumulation, optimizer=train.optimizer,
                                  accumulation_sync=train.accumulation_sync, micro_batch=train.micro_batch,
                                  global_batch=train.global_batch)
        out.append(("--precision bf16", replace(base, train=bf16), ""))
    else:
        in_place.append(f"compute in {train.param_dtype or compute_dtype}" + (
            f" (--precision {train.precision})" if train.param_dtype else " (the model's own dtype)"))
    if train.grad_accumulation > 1 and train.accumulation_sync == "last":
        out.append(("--sync every", replace(base, train=train.with_sync("every")), ""))
    if train.optimizer in ("adamw", "adam"):
        out.append(("--optimizer adafactor", replace(base, train=replace(train, optimizer="adafactor")),
                    f"another optimizer: Adafactor's factored state instead of {train.optimizer}'s two moments"))
    return out


def _dtype(name: str) -> str:
    """``torch.bfloat16`` or ``bfloat16`` as ``bfloat16``."""
    return name.removeprefix("torch.")


def _tp_variants(graph: ModelGraph, request: ParallelRequest, base: _Setting, spec: Any, tp: int) -> list[_Variant]:
    """Every degree above ``tp`` the node and the heads allow, smallest first: at the same global batch,
    then (without a fixed global batch) at one sequence per tensor-parallel group through --global-batch."""
    mesh, train = request.mesh, base.train
    degrees = [d for d in auto_degrees(graph, mesh, spec)[0] if d > tp]
    traced = max(1, graph.batch_size)
    out: list[_Variant] = []
    for d in degrees:
        if request.global_batch is not None:
            splits = batch_splits(request.batch, {d: mesh.world_size // d})
            if splits:
                split = splits[0]
                out.append((f"--tp {d}", replace(base, tp=d, train=train_for(train, split),
                                                 scale=batch_scale(split.micro_batch, traced, d)),
                            f"split {split.describe()}"))
            continue
        out.append((f"--tp {d}", replace(base, tp=d), ""))
        sequences = round(traced * base.scale) * train.grad_accumulation * mesh.world_size
        acc = sequences // (mesh.world_size // d)
        out.append((f"--tp {d} --global-batch {sequences} --batch 1 --accumulation {acc}",
                    replace(base, tp=d, train=replace(train, grad_accumulation=acc), scale=batch_scale(1, traced, d)),
                    "one sequence per tensor-parallel group, the same sequences per step"))
    return out


def _first_fit(pricer: _Pricer, variants: list[_Variant], budget: float, start: float, limit_s: float,
               not_priced: list[str], name: str) -> list[Remedy]:
    """The family's first variant that fits, else the one of least peak (one per training-step knob:
    each is its own remedy)."""
    each = name == "training step"
    out: list[Remedy] = []
    best: Remedy | None = None
    for flag, setting, note in variants:
        if time.monotonic() - start > limit_s:
            not_priced.append(f"{flag}: not tried (past the {limit_s:.0f} s bound)")
            break
        try:
            r = pricer.remedy(flag, setting, note)
        except (WrapoptError, ValueError) as e:  # a shape the model or the batch cannot take
            not_priced.append(f"{flag}: {str(e).splitlines()[0]}")
            continue
        if each:
            out.append(r)
            continue
        if r.fits and r.peak_bytes <= budget * (1 - MEMORY_ERROR):  # See [Note: plans within the error]
            return [r]
        if best is None or (not best.fits and (r.fits or r.peak_bytes < best.peak_bytes)):
            best = r  # the first that fits past the margin, else the least peak
    return out if each else ([best] if best is not None else [])


_PAIRS = 6  # pairs of remedies priced together when none fits alone, the likeliest first


def _pairs(pricer: _Pricer, base: _Setting, base_peak: int, priced: list[Remedy], budget: float, start: float,
           limit_s: float) -> Remedy | None:
    """When no remedy fits alone: pairs of those that lowered the peak, the likeliest first (the
    sum of their savings), priced together; the first that fits, else the one of least peak."""
    useful = [r for r in priced if r.peak_bytes < base_peak and r.setting is not None]
    pairs = sorted(((a, b) for i, a in enumerate(useful) for b in useful[i + 1:]),
                   key=lambda ab: ab[0].peak_bytes + ab[1].peak_bytes)
    best: Remedy | None = None
    tried = 0
    for a, b in pairs:
        merged = _merge(base, a.setting, b.setting)
        if merged is None or tried >= _PAIRS or time.monotonic() - start > limit_s:
            continue
        tried += 1
        flags = " ".join(re.sub(r" --host-memory \S+", "", r.flag) for r in (a, b))  # priced again with both
        notes = "; ".join(x.note for x in (a, b) if x.note and "host memory" not in x.note)
        try:
            r = pricer.remedy(flags, merged, notes)
        except (WrapoptError, ValueError):
            continue
        if best is None or r.peak_bytes < best.peak_bytes:
            best = r
        if r.fits:
            return r
    return best


def _merge(base: _Setting, a: _Setting, b: _Setting) -> _Setting | None:
    """``base`` with what ``a`` and ``b`` each change of it; None where both change one field
    (two micro-batch splits, two tensor-parallel degrees)."""
    def pick(x: Any, y: Any, was: Any) -> tuple[bool, Any]:
        if x != was and y != was and x != y:
            return False, None
        return True, x if x != was else y

    out: dict[str, Any] = {}
    for name in ("tp", "pp", "offload", "checkpoint", "shard"):
        ok, out[name] = pick(getattr(a, name), getattr(b, name), getattr(base, name))
        if not ok:
            return None
    step: dict[str, Any] = {}
    for f in fields(TrainConfig):
        ok, step[f.name] = pick(getattr(a.train, f.name), getattr(b.train, f.name), getattr(base.train, f.name))
        if not ok:
            return None
    return _Setting(train=TrainConfig(**step), scale=a.scale * b.scale / base.scale, **out)
