"""The global batch as the fixed quantity: the micro-batch and the accumulation chosen with the plan.

[Note: global batch search] With ``global_batch`` N sequences per optimizer step, every
tensor-parallel degree t asked for has ``dp = world / t`` data-parallel ranks, and every way to
write ``N = micro_batch x accumulation x dp`` is a split (``batch_splits``). The simulator
prices a split by ``SimOptions.batch_scale = micro_batch / (traced batch x t)`` (compute,
saved activations, the working set and the loss all scale linearly with it; the tensor-parallel
view multiplies it by t again: a group runs its data-parallel rank's micro-batch) and
``grad_accumulation``; its step covers the whole global batch, so step times of different
splits compare directly (tokens/s/GPU = N x seq / (step x world)). No split retraces: a
trace at one batch, scaled, prices another batch about as a trace at that batch would.

The search runs in two passes, so that a dozen splits cost little more than one search:

1. every split, smallest micro-batch first per degree: the smallest plan (one unit per block,
   resharded and checkpointed) is simulated first; over the budget, no plan fits it nor any
   larger micro-batch of that degree, and they are skipped. Otherwise a screen: the whole
   search without the study, FSDP over the data-parallel ranks only (the shard group asked
   for, if one is), units of at most ``SCREEN_MAX_GROUP`` blocks (the exact DP's cost grows
   with the group size, and a screen only ranks the splits);
2. the ``REFINE`` fastest splits of the screen get the whole search (every shard group, HSDP,
   the study's trials shared out among them); the fastest fitting plan of those wins.

Every split keeps a row (``BatchRow``) with its best step, for the report's table. A split of a
context-parallel degree c (``BatchSplit.cp_size``) has ``dp = world / (t x c)`` ranks that read
different sequences (TorchTitan's ``batch`` axis: the c ranks of a cp group split their
sequences); it is priced on the cp view of its simulator and searched with FSDP over ``dp x c``
(shard groups that hold whole cp groups): See [Note: context parallel at a global batch] in
search/cp.py. A split of an expert-parallel degree e (``BatchSplit.ep_size``) keeps
``dp = world / t`` (ep borrows data-parallel ranks) and is priced on its ep view, FSDP over every
data-parallel rank or HSDP. Either comes in as ``search_batch``'s ``axis`` (See [Note: the degree loop of
an axis] in search/axes.py). With ``--pp``, this is degree 1's search; the pipeline degrees split the same
global batch into their micro-batches: See [Note: pipeline global batch] in search/pipeline_batch.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Sequence

from wrapopt.cost.simulate import Simulator
from wrapopt.errors import InfeasibleError, OptionError
from wrapopt.search.baselines import smallest_plan
from wrapopt.search.driver import SearchResult
from wrapopt.search.strategy import Scored, SearchOptions, dp_shard_sizes
from wrapopt.search.tp import combine_tp, dp_mesh, lift_plan, search_shape
from wrapopt.spec import GlobalBatch, MeshSpec, ModelGraph, ParallelRequest, PlanSpec, Shape
from wrapopt.train import TrainConfig
from wrapopt.tp import TPSpec

__all__ = ["BatchSplit", "BatchRow", "BatchSearch", "batch_splits", "check_global_batch", "batch_scale",
           "search_batch", "global_batch_search", "score_splits", "train_for", "recorded_scale", "plan_scale",
           "nearest_batches", "divisors", "REFINE"]

# [Note: a micro-batch past counting] A global batch of 10**12 sequences has splits whose
# micro-batch is 10**11 sequences: the simulator's byte counts (int64, as numpy and the compiled
# step loop hold them) overflow before any budget is compared, and a failure in compiled code turns
# the shared backend to Python for the rest of the search. Such a split is no plan on any device: a
# split whose activations (the traced ones, scaled to its micro-batch) pass ``MAX_PRICED_BYTES`` is
# skipped with ``TOO_LARGE`` before it is simulated, and so is every larger micro-batch of its
# degree; an ``OverflowError`` all the same is treated alike.
MAX_PRICED_BYTES = 2**53  # 8 PiB per rank: no device holds it, and float64 still counts its bytes exactly
TOO_LARGE = "skipped: too large to price (its activations pass 8 PiB per rank)"
REFINE = 2  # splits that get the whole search after the screen: See [Note: global batch search]
SCREEN_MAX_GROUP = 2  # the screen's largest group of blocks in one unit (the whole search keeps the asked one)


@dataclass(frozen=True, slots=True, order=True)
class BatchSplit:
    """One way to run a global batch: ``micro_batch x accumulation x dp_size`` sequences."""

    tp_size: int  # tensor-parallel degree
    micro_batch: int  # sequences per data-parallel rank (tensor-parallel group) per micro-batch
    accumulation: int  # micro-batches per optimizer step
    dp_size: int  # ranks that read different sequences: the world over tp_size x cp_size
    cp_size: int = 1  # context-parallel degree: its ranks split each sequence
    ep_size: int = 1  # expert-parallel degree: its ranks split the experts, each reading its own sequences

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.accumulation * self.dp_size

    def describe(self) -> str:
        axes = "".join(f", {name}{d}" for name, d in (("tp", self.tp_size), ("cp", self.cp_size),
                                                      ("ep", self.ep_size)) if d > 1)
        return f"{self.micro_batch} x {self.accumulation} x {self.dp_size} ranks{axes}"


@dataclass(frozen=True, slots=True)
class BatchRow:
    """One split as the search left it: its best plan (None: nothing fits) and how far it was searched."""

    split: BatchSplit
    best: Scored | None
    searched: str  # "whole search", "screen" or "skipped: ..." (See [Note: global batch search])
    chosen: bool = False  # the split of the search's answer


@dataclass(frozen=True, slots=True)
class BatchSearch:
    """What ``search_batch`` returns: the winner's search, its split and every split's row."""

    result: SearchResult  # the chosen split's search, with every split's row (``batch_rows``)
    split: BatchSplit
    rows: tuple[BatchRow, ...]
    train: TrainConfig  # the training step at the chosen split (micro-batch, accumulation, global batch)
    sim: Simulator  # the chosen split's simulator
    notes: tuple[str, ...] = ()


def batch_scale(micro_batch: int, traced_batch: int, tp_size: int = 1) -> float:
    """``SimOptions.batch_scale`` of ``micro_batch`` sequences per data-parallel rank, for a
    model traced at ``traced_batch``: See [Note: global batch search]."""
    return micro_batch / (max(1, traced_batch) * tp_size)


def batch_splits(batch: GlobalBatch, dp_sizes: dict[int, int], cp: int = 1, ep: int = 1) -> tuple[BatchSplit, ...]:
    """Every split of ``batch`` over ``dp_sizes`` (tensor-parallel degree -> ranks that read different
    sequences) at context-parallel degree ``cp`` and expert-parallel degree ``ep``, sorted by degree
    then micro-batch; a micro-batch or an accumulation the batch fixes keeps only the splits with
    that value."""
    micro_batch, accumulation = batch.micro_batch, batch.accumulation
    out = []
    for tp, dp in sorted(dp_sizes.items()):
        if batch.sequences % dp:
            continue
        per_rank = batch.sequences // dp
        for m in divisors(per_rank):
            if micro_batch in (None, m) and accumulation in (None, per_rank // m):
                out.append(BatchSplit(tp, m, per_rank // m, dp, cp, ep))
    return tuple(out)


def divisors(n: int) -> list[int]:
    """The divisors of ``n`` (at least 1), ascending.

    [Note: divisors, not a scan] A global batch is a user's number and may be 10**12: a scan of
    every micro-batch size up to it spins for minutes. ``n`` is factored by trial division up to
    the square root of what is left (each prime found shrinks the rest; 10**12 factors in a few
    steps, a prime near 10**12 in 10**6 steps) and the divisors are built from the factors, so
    the cost is the number of divisors plus the factoring, not ``n``."""
    factors: list[tuple[int, int]] = []
    rest, p = n, 2
    while p * p <= rest:
        if rest % p == 0:
            k = 0
            while rest % p == 0:
                rest //= p
                k += 1
            factors.append((p, k))
        p += 1 if p == 2 else 2
    if rest > 1:
        factors.append((rest, 1))
    out = [1]
    for prime, k in factors:
        out = [d * prime**e for d in out for e in range(k + 1)]
    return sorted(out)


def check_global_batch(batch: GlobalBatch, dp_sizes: dict[int, int], cp: int = 1) -> tuple[BatchSplit, ...]:
    """``batch_splits``, or ValueError naming the nearest global batches that have a split."""
    splits = batch_splits(batch, dp_sizes, cp)
    if splits:
        return splits
    units = sorted({dp * (batch.micro_batch or 1) * (batch.accumulation or 1) for dp in dp_sizes.values()})
    near = nearest_batches(batch.sequences, units, exact=bool(batch.micro_batch and batch.accumulation))
    ranks = " or ".join(str(dp) for dp in sorted(set(dp_sizes.values())))
    cp_said = f" under context parallelism of {cp}" if cp > 1 else ""
    raise ValueError(f"global batch {batch.sequences} is not micro-batch x accumulation x data-parallel ranks "
                     f"({ranks} data-parallel ranks{cp_said}{batch.describe_fixed()}): it must be a multiple of "
                     f"{' or '.join(map(str, units))}; the nearest that work are {' and '.join(map(str, near))}")


def nearest_batches(n: int, units: Sequence[int], *, exact: bool = False) -> list[int]:
    """The nearest global batches below and above ``n`` sequences that are a multiple of one of
    ``units`` (``exact``: that are one of ``units``, when the micro-batch and accumulation are both fixed)."""
    works = list(units) if exact else [b for u in units for b in ((n // u) * u, (n // u + 1) * u) if b >= 1]
    below = [b for b in works if b < n]
    above = [b for b in works if b > n]
    return ([max(below)] if below else []) + ([min(above)] if above else [])


def _priceable(graph: ModelGraph, split: BatchSplit) -> bool:
    """Whether ``split``'s activations stay under ``MAX_PRICED_BYTES``: See [Note: a micro-batch past counting]."""
    traced = sum(m.saved_bytes + m.output_bytes + m.fwd_bytes + m.bwd_bytes for m in graph.modules)
    traced += graph.loss_peak_bytes + graph.loss_saved_bytes + graph.loss_grad_bytes
    return batch_scale(split.micro_batch, graph.batch_size, split.tp_size) * max(traced, 1) < MAX_PRICED_BYTES


def _smallest(graph: ModelGraph, mesh: MeshSpec, split: BatchSplit, spec: TPSpec | None) -> PlanSpec:
    """One unit per block (every leaf without blocks), resharded and checkpointed, lifted to the degree."""
    return lift_plan(smallest_plan(graph, dp_mesh(mesh, split.tp_size)), split.tp_size, spec)


def _sim(graph: ModelGraph, sim: Simulator, train: TrainConfig, split: BatchSplit, budget: float | None) -> Simulator:
    t = replace(train, grad_accumulation=split.accumulation)
    opts = replace(t.sim_options(batch_scale=batch_scale(split.micro_batch, graph.batch_size, split.tp_size),
                                 memory_budget=budget), offload=sim.options.offload)
    return Simulator(graph, sim.fabric, sim.compute, opts, backend=sim.backend, host=sim.host)


def _view(sim: Simulator, mesh: MeshSpec, axis: tuple[Any, int] | None, split: BatchSplit) -> Simulator:
    """The simulator a split's plans are searched on: its own, or one rank's share of ``axis`` (an
    ``Axis`` of search/axes.py and its degree; plans lifted onto its mesh by ``Axis.lift_result``)."""
    if axis is None:
        return sim
    return axis[0].view(sim, axis[1], tp=split.tp_size, ranks_per_node=mesh.ranks_per_node)


def _axis_sizes(sizes: Sequence[int] | None, mesh: MeshSpec, axis: tuple[Any, int] | None,
                split: BatchSplit) -> tuple[int, ...] | None:
    """Shard groups a split's plans may use under ``axis`` (whole groups of its degree: ``Axis.shard_sizes``):
    of ``sizes`` (the split's data-parallel mesh's when None); without an axis, ``sizes`` as given."""
    if axis is None:
        return tuple(sizes) if sizes else None
    return axis[0].shard_sizes(axis[1], tuple(sizes or dp_shard_sizes(dp_mesh(mesh, split.tp_size))))


def _search(graph: ModelGraph, sim: Simulator, mesh: MeshSpec, split: BatchSplit, spec: TPSpec | None,
            budget: float | None, options: SearchOptions) -> SearchResult:
    if options.storage:  # one study per split in the storage (a study's identity does not hold the batch)
        stem = options.study_name or f"wrapopt-{graph.model_class}-w{mesh.world_size}"
        axes = "".join(f"-{n}{d}" for n, d in (("cp", split.cp_size), ("ep", split.ep_size)) if d > 1)
        options = replace(options, study_name=f"{stem}-tp{split.tp_size}{axes}-mb{split.micro_batch}"
                                              f"-acc{split.accumulation}")
    shape = Shape(tp=split.tp_size)  # the split's batch is in ``sim`` (``_sim``)
    res = search_shape(graph, sim, mesh, shape, spec=spec, memory_budget=budget, options=options)
    return res if shape.tp == 1 else combine_tp(sim, {shape.tp: res}, {}, degrees=(shape.tp,))


def search_batch(graph: ModelGraph, sim: Simulator, mesh: MeshSpec, *, train: TrainConfig,
                 splits: Sequence[BatchSplit], spec: TPSpec | None, memory_budget: float | None,
                 options: SearchOptions, axis: tuple[Any, int] | None = None) -> BatchSearch:
    """The fastest fitting plan and split of a fixed global batch (See [Note: global batch
    search]); ``sim`` gives the fabric and compute, ``train`` the rest of the step, ``mesh``
    the whole mesh without tensor parallelism. ``axis``: (an ``Axis`` of search/axes.py, its
    degree): each split is searched on that axis's view, its plans lifted onto the axis's mesh
    before they are ranked. Raises ``InfeasibleError`` when no split fits."""
    limit = float(memory_budget) if memory_budget else float("inf")
    rows: dict[BatchSplit, BatchRow] = {}
    sims: dict[BatchSplit, Simulator] = {}
    views: dict[BatchSplit, Simulator] = {}
    too_big: dict[int, int] = {}  # degree -> the smallest micro-batch nothing fits
    failed: list[str] = []
    screen = replace(options, trials=0, progress=False, storage=None, study_name=None,
                     max_group=min(options.max_group, SCREEN_MAX_GROUP))
    for split in sorted(splits, key=lambda s: (s.tp_size, s.micro_batch)):
        if split.micro_batch >= too_big.get(split.tp_size, math.inf):
            rows[split] = BatchRow(split, None, "skipped: a smaller micro-batch did not fit")
            continue
        if not _priceable(graph, split):  # See [Note: a micro-batch past counting]
            too_big[split.tp_size] = split.micro_batch
            rows[split] = BatchRow(split, None, TOO_LARGE)
            continue
        try:
            sims[split] = _sim(graph, sim, train, split, memory_budget)
            s = views[split] = _view(sims[split], mesh, axis, split)
            if s.simulate(_smallest(graph, mesh, split, spec)).peak_bytes > limit:
                too_big[split.tp_size] = split.micro_batch
                rows[split] = BatchRow(split, None, "skipped: one unit per block, checkpointed, does not fit")
                continue
            # FSDP over the data-parallel ranks (dp_shard x cp)
            sizes = ((options.shard_sizes and _axis_sizes(options.shard_sizes, mesh, axis, split))
                     or (split.dp_size * split.cp_size,))
            res = _search(graph, s, mesh, split, spec, memory_budget, replace(screen, shard_sizes=sizes))
            res = axis[0].lift_result(res, axis[1]) if axis else res
            rows[split] = BatchRow(split, res.best, "screen")
        except InfeasibleError as e:
            failed.append(f"{split.describe()}: {e}")
            too_big[split.tp_size] = split.micro_batch
            rows[split] = BatchRow(split, None, "skipped: nothing fits")
        except OverflowError:  # See [Note: a micro-batch past counting]
            too_big[split.tp_size] = split.micro_batch
            rows[split] = BatchRow(split, None, TOO_LARGE)
    ranked = sorted((r for r in rows.values() if r.best is not None), key=lambda r: r.best.estimate.step_s)
    if not ranked:
        raise InfeasibleError(failed[0] if failed else (
            "no micro-batch x accumulation split of the global batch fits the memory budget, not even with one "
            "unit per block, resharded and checkpointed, at micro-batch 1; a smaller global batch or more "
            "ranks"))  # the other remedies are priced: See [Note: computed remedies] in search/remedies.py
    top = ranked[:REFINE]
    whole = replace(options, trials=-(-options.trials // len(top)) if options.trials else 0)
    results: dict[BatchSplit, SearchResult] = {}
    for r in top:
        res = _search(graph, views[r.split], mesh, r.split, spec, memory_budget,
                      replace(whole, shard_sizes=_axis_sizes(whole.shard_sizes, mesh, axis, r.split)))
        res = axis[0].lift_result(res, axis[1]) if axis else res
        results[r.split] = res
        rows[r.split] = BatchRow(r.split, res.best, "whole search")
    chosen = min(results, key=lambda sp: results[sp].best.estimate.step_s)
    rows[chosen] = replace(rows[chosen], chosen=True)
    order = tuple(sorted(rows.values(), key=lambda r: (r.split.tp_size, r.split.micro_batch)))
    result = replace(results[chosen], batch_rows=order)
    if len({s.tp_size for s in splits}) > 1:  # its rows compare one degree's plans; the splits compare degrees
        result = replace(result, tp_rows=())
    return BatchSearch(result=result, split=chosen, rows=order,
                       train=train_for(train, chosen), sim=sims[chosen], notes=tuple(failed[:3]))


def global_batch_search(graph: ModelGraph, sim: Simulator, request: ParallelRequest, *, degrees: Sequence[int],
                        spec: TPSpec | None, memory_budget: float | None, options: SearchOptions) -> BatchSearch:
    """``search_batch`` over every split of the request's global batch for the tensor-parallel
    ``degrees``; a micro-batch or an accumulation above 1 given in the request's step is kept.
    A global batch with no split raises ValueError naming the nearest that work."""
    mesh, train, batch = request.mesh, request.train, request.batch
    assert batch is not None, "global_batch_search needs a request with a global batch"
    dp_sizes = {d: mesh.world_size // d for d in degrees}
    splits = check_global_batch(batch, dp_sizes)
    found = search_batch(graph, sim, mesh, train=train, splits=splits, spec=spec, memory_budget=memory_budget,
                         options=options)
    left = sorted(d for d in degrees if not any(s.tp_size == d for s in splits))
    notes = tuple(f"tp{d}: global batch {batch.sequences} has no split over its {dp_sizes[d]} data-parallel ranks"
                  for d in left)
    return replace(found, notes=found.notes + notes)


def score_splits(graph: ModelGraph, sim: Simulator, plan: PlanSpec, request: ParallelRequest, *,
                 memory_budget: float | None) -> tuple[BatchSplit, Simulator, tuple[BatchRow, ...]]:
    """A given plan at every split of the request's global batch on its mesh: the fastest that fits
    (the smallest peak when none does), its simulator and every split's row (for ``wrapopt estimate``)."""
    train, batch = request.train, request.batch
    assert batch is not None, "score_splits needs a request with a global batch"
    splits = check_global_batch(batch, {plan.mesh.tp_size: plan.mesh.batch_size}, plan.mesh.cp_size)
    limit = float(memory_budget) if memory_budget else float("inf")
    rows, sims = [], {}
    over = False  # a smaller micro-batch is over the budget: the plan's peak grows with the micro-batch
    for split in sorted(splits, key=lambda sp: sp.micro_batch):
        if over:
            rows.append(BatchRow(split, None, "skipped: a smaller micro-batch did not fit"))
            continue
        if not _priceable(graph, split):  # See [Note: a micro-batch past counting]
            rows.append(BatchRow(split, None, TOO_LARGE))
            over = True
            continue
        try:
            s = _sim(graph, sim, train, split, memory_budget)
            est = s.simulate(plan)
        except OverflowError:  # See [Note: a micro-batch past counting]
            rows.append(BatchRow(split, None, TOO_LARGE))
            over = True
            continue
        sims[split] = s
        over = est.peak_bytes > limit
        rows.append(BatchRow(split, Scored(plan, est, not over), "scored"))
    scored = [r for r in rows if r.best is not None]
    if not scored:
        raise OptionError(f"global batch {request.batch.sequences}: even micro-batch {rows[0].split.micro_batch} "
                          f"is {TOO_LARGE.removeprefix('skipped: ')}; give a smaller --global-batch")
    fitting = [r for r in scored if r.best.fits]
    pick = (min(fitting, key=lambda r: r.best.estimate.step_s) if fitting
            else min(scored, key=lambda r: r.best.estimate.peak_bytes))
    return pick.split, sims[pick.split], tuple(rows)


def train_for(train: TrainConfig, split: BatchSplit) -> TrainConfig:
    """``train`` at ``split``: its accumulation, micro-batch and global batch recorded."""
    return replace(train, grad_accumulation=split.accumulation, micro_batch=split.micro_batch,
                   global_batch=split.global_batch)


def plan_scale(micro_batch: int, traced_batch: int, plan: PlanSpec, accumulation: int = 1) -> float:
    """``SimOptions.batch_scale`` at which ``plan`` runs micro-batches of ``micro_batch`` sequences:
    ``batch_scale`` for a plan without a pipeline; for a pipeline plan, whose simulator reads the
    scale as the per-rank share of the global batch (``cost/pipeline.py``'s ``stage_options``), that
    times ``microbatches / (pp x accumulation)``: See [Note: pipeline global batch] in
    search/pipeline_batch.py."""
    scale = batch_scale(micro_batch, traced_batch, plan.mesh.tp_size)
    if plan.pipeline is not None:
        scale *= plan.pipeline.microbatches / (plan.mesh.pp_size * accumulation)
    return scale


def recorded_scale(graph: ModelGraph, train: TrainConfig, plan: PlanSpec) -> float:
    """``SimOptions.batch_scale`` of ``plan`` under a training step that records its micro-batch
    (1.0 when it does not)."""
    return plan_scale(train.micro_batch, graph.batch_size, plan, train.grad_accumulation) if train.micro_batch else 1.0

