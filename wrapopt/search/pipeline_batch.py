"""A fixed global batch on the pipeline degrees: the micro-batch count and size chosen with the plan.

[Note: pipeline global batch] With ``global_batch`` N and pipeline degree p > 1 at
tensor-parallel degree t, the data-parallel size is ``dp = world / (p x t)``: each pipeline
(a data-parallel replica) runs ``N / dp`` sequences per optimizer step, split into the
schedule's ``m`` micro-batches of ``N / (dp x m)`` sequences, each a whole number. ``m`` is
tried at ``p`` x 1, 2, 4 and 8, as without a global batch ([Note: pipeline search] in
search/pipeline.py), and at ``N / dp`` (micro-batches of one sequence, the smallest memory),
where each is a multiple of ``p`` dividing ``N / dp``. A micro-batch fixed by ``--batch`` keeps
the one count that gives it, an accumulation fixed by ``--accumulation K`` the count ``K`` (a
pipeline's micro-batches are its accumulation).

The stage simulators price a micro-batch of ``N / (dp x m)`` sequences: ``pipeline_sim`` sets
``SimOptions.batch_scale = N / (world x traced batch)`` (each rank's share of the global
batch) without accumulation, which ``stage_options`` in cost/pipeline.py turns into ``t x p / m``
times that for a stage (the tensor-parallel view multiplies by t, the pipeline's p ranks' shares
are split m ways): ``N / (dp x m)`` sequences, for every p, t and m, so one simulator serves
every pipeline degree. Degree 1 keeps ``global_batch_search`` ([Note: global batch search] in
search/batch.py) unchanged. Every row is then at the same global batch, and step times compare
(tokens/s/GPU = N x seq / (step x world)).

A degree that no count can run (N not a multiple of ``dp x p``; with a fixed micro-batch or
accumulation, of ``dp x`` those) is dropped with the reason, as tensor-parallel degrees are;
when no degree can run N, ``run_search`` raises ``OptionError`` naming ``--global-batch`` and
the nearest values that work. A pipeline plan records ``micro_batch = N / (dp x m)``,
``grad_accumulation`` 1 and ``global_batch`` N, so that ``N = micro_batch x microbatches x dp``
(``plan_scale`` in search/batch.py turns it back into the simulator's scale).

Under context parallelism (a shape with ``cp > 1``) ``dp`` is the pipelines that read different
sequences, ``world / (p x t x cp)`` (``Shape.dp``, ``MeshSpec.batch_size``), and the stages are
priced by ``sim_for(cp)``: the scale times cp, which the cp view divides by cp again, so that each
rank prices 1/cp of its pipeline's micro-batch of ``N / (dp x m)`` sequences. Every shape runs the
same N sequences a step, so the steps compare as they are (not per token).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from wrapopt.cost.simulate import Simulator
from wrapopt.errors import OptionError
from wrapopt.search.batch import nearest_batches
from wrapopt.spec import ModelGraph, ParallelRequest, PlanSpec, Shape
from wrapopt.train import TrainConfig

__all__ = ["PipelineBatch", "pipeline_batch", "pipeline_at_batch"]

COUNTS = (1, 2, 4, 8)  # micro-batch counts tried, in multiples of the pipeline degree (with N / dp)
# The most micro-batches per step a schedule is priced with: its order (torch's own, per micro-batch
# and stage) grows with the count, and N / dp micro-batches of one sequence at a global batch of
# 10**12 would never finish. TorchTitan's largest published runs use a few hundred.
MAX_MICROBATCHES = 4096


@dataclass(frozen=True, slots=True)
class PipelineBatch:
    """A fixed global batch for the pipeline degrees: See [Note: pipeline global batch]."""

    global_batch: int  # sequences per optimizer step over every pipeline
    world_size: int
    sim: Simulator  # prices a stage's micro-batch for every degree and count
    micro_batch: int | None = None  # fixed by --batch: sequences per pipeline micro-batch
    accumulation: int | None = None  # fixed by --accumulation K > 1: the micro-batch count
    _cp_sims: dict[int, Simulator] = field(default_factory=dict, compare=False, repr=False)

    def sim_for(self, cp: int) -> Simulator:
        """The simulator that prices a stage's micro-batch of a shape with context-parallel degree ``cp``:
        ``sim`` at ``cp`` times its share (the cp view gives each rank 1/cp of a micro-batch's sequences).
        See [Note: cp in a pipeline] in search/shapes.py."""
        if cp == 1:
            return self.sim
        hit = self._cp_sims.get(cp)
        if hit is None:
            s = self.sim
            opts = replace(s.options, batch_scale=s.options.batch_scale * cp)
            hit = self._cp_sims[cp] = Simulator(s.traced, s.fabric, s.compute, opts, backend=s.backend, host=s.host)
        return hit

    def counts(self, shape: Shape) -> tuple[tuple[int, ...], str]:
        """The micro-batch counts that split the global batch at ``shape``'s pipeline and
        tensor-parallel degrees, smallest first, and why there are none ("" when there are)."""
        pp = shape.pp
        dp = shape.dp(self.world_size)
        n, mb, k = self.global_batch, self.micro_batch, self.accumulation
        per = n // dp if n % dp == 0 else 0  # sequences per pipeline per step
        if k:
            tries: tuple[int, ...] = (k,)
        elif mb:
            tries = (per // mb,) if per % mb == 0 else ()
        else:
            tries = (*(c * pp for c in COUNTS), per)
        runs = {m for m in tries if m >= pp and m % pp == 0 and per and per % m == 0 and mb in (None, per // m)}
        found = tuple(sorted(m for m in runs if m <= MAX_MICROBATCHES))
        if found:
            return found, ""
        if runs:
            return (), (f"dropped: global batch {n} needs {min(runs)} micro-batches per pipeline, more than the "
                        f"{MAX_MICROBATCHES} a schedule is priced with; a smaller --global-batch, or a larger --batch")
        fixed = (f", micro-batch {mb}" if mb else "") + (f", {k} micro-batches (--accumulation)" if k else "")
        unit = self.unit(shape)
        works = f"; multiples of {unit} work" if unit else f"; --accumulation {k} is not a multiple of {pp}"
        if per and per < pp:
            return (), (f"dropped: global batch {n} gives each of its {dp} pipelines {per} sequences, fewer than "
                        f"its {pp} stages (a micro-batch per stage){works}")
        return (), (f"dropped: global batch {n} is not micro-batch x micro-batches x {dp} pipelines with the "
                    f"micro-batches a multiple of {pp}{fixed}{works}")

    def unit(self, shape: Shape) -> int | None:
        """The global batches ``shape`` runs are the multiples of this (None: none)."""
        if self.accumulation and self.accumulation % shape.pp:
            return None
        return shape.dp(self.world_size) * (self.micro_batch or 1) * (self.accumulation or shape.pp)

    def nearest(self, shapes: list[Shape], degree_one: list[int]) -> list[int]:
        """The nearest global batches that some pipeline shape or degree 1 (``degree_one``: its
        units, multiples of which work) runs."""
        units = sorted({u for u in map(self.unit, shapes) if u} | set(degree_one))
        return nearest_batches(self.global_batch, units, exact=bool(self.micro_batch and self.accumulation))

    def check_plan(self, plan: PlanSpec) -> None:
        """Raise ``OptionError`` unless pipeline ``plan`` (its micro-batch count fixed) runs the
        global batch: ``N / (dp x m)`` sequences per micro-batch, a whole number (the fixed
        micro-batch, if any), and ``m`` the fixed accumulation, if any."""
        assert plan.pipeline is not None
        n, dp, m, mb = self.global_batch, plan.mesh.batch_size, plan.pipeline.microbatches, self.micro_batch
        why = ""
        if self.accumulation and self.accumulation != m:
            why = f"the plan runs {m} micro-batches, not --accumulation {self.accumulation}"
        elif n % (dp * m) or (mb and n != dp * m * mb):
            unit = dp * m * (mb or 1)
            runs = f"{m} micro-batches" + (f" of {mb} sequences" if mb else "") + f" on each of its {dp} pipelines"
            near = " and ".join(map(str, nearest_batches(n, [unit], exact=bool(mb))))
            need = f"{unit}" if mb else f"a multiple of {unit}"
            why = f"the plan runs {runs}: it needs {need}; the nearest that work: {near}"
        if why:
            raise OptionError(f"--global-batch {n}: {why}")

    def pipeline_batch_of(self, plan: PlanSpec) -> int:
        """Sequences per micro-batch of a pipeline plan at this global batch."""
        assert plan.pipeline is not None
        return self.global_batch // (plan.mesh.batch_size * plan.pipeline.microbatches)

    def train_for(self, train: TrainConfig, plan: PlanSpec) -> TrainConfig:
        """``train`` as a pipeline plan runs it: its micro-batch, no accumulation, the global batch."""
        return replace(train, grad_accumulation=1, micro_batch=self.pipeline_batch_of(plan),
                       global_batch=self.global_batch)


def pipeline_at_batch(graph: ModelGraph, sim: Simulator, plan: PlanSpec, request: ParallelRequest, *,
                      memory_budget: float | None) -> tuple[Simulator, TrainConfig]:
    """The simulator and training step of pipeline ``plan`` at the request's global batch (for
    ``wrapopt estimate``); ``OptionError`` when the plan's micro-batch count does not split it."""
    fixed = pipeline_batch(graph, sim, request, memory_budget=memory_budget)
    fixed.check_plan(plan)
    return fixed.sim_for(plan.mesh.cp_size), fixed.train_for(request.train, plan)


def pipeline_batch(graph: ModelGraph, sim: Simulator, request: ParallelRequest, *,
                   memory_budget: float | None) -> PipelineBatch:
    """The pipeline degrees' view of the request's global batch: its simulator (``sim``'s fabric,
    compute and offload; the request's step without accumulation, at each rank's share of the global
    batch) and the micro-batch or accumulation the step fixes. See [Note: pipeline global batch]."""
    train, batch, world_size = request.train, request.batch, request.mesh.world_size
    assert batch is not None, "pipeline_batch needs a request with a global batch"
    step = replace(train, grad_accumulation=1, micro_batch=None, global_batch=None)
    scale = batch.sequences / (world_size * max(1, graph.batch_size))
    opts = replace(step.sim_options(batch_scale=scale, memory_budget=memory_budget), offload=sim.options.offload)
    return PipelineBatch(global_batch=batch.sequences, world_size=world_size,
                         sim=Simulator(graph, sim.fabric, sim.compute, opts, backend=sim.backend, host=sim.host),
                         micro_batch=batch.micro_batch, accumulation=batch.accumulation)
