"""The search strategy interface: what a strategy is given and what it returns.

[Note: search strategies] A search is a sequence of strategies. Each is a way
to propose plans: the named baselines, the exact DP, uniform groupings, an
Optuna study. ``driver.search_plan`` runs the registered strategies
(``registry.STRATEGIES``) in order, scores with the simulator every plan they
propose, and picks among the plans that fit the memory budget (the simplest
within the simulator's error of the fastest: [Note: plans within the error]). Adding a
strategy is adding a ``Strategy`` subclass and registering it; the driver is
not edited, and nothing anywhere tells strategies apart by a plan's label:
what the driver needs to know of a plan (which strategy proposed it) it keeps
in ``Scored.strategy`` and in the search's ``Round``s.

Later strategies see what earlier ones scored (``History``): the Optuna study
is seeded with every plan of the strategies that set ``seed_every_plan`` (the
baselines, the DP) and with the fastest of the rest.
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass, field, replace
from typing import ClassVar

from wrapopt.choices import DEFAULT_TRIALS
from wrapopt.cost.simulate import Simulator
from wrapopt.spec import CHECKPOINT_MODES, SELECTIVE_OP, CostEstimate, MeshSpec, ModelGraph, PlanSpec

__all__ = [
    "step_per_token",
    "compared_step",
    "Strategy",
    "SearchOptions",
    "SearchProblem",
    "Proposal",
    "Scored",
    "Round",
    "History",
    "make_problem",
    "fastest",
    "dp_shard_sizes",
    "DEFAULT_TRIALS",
]

@dataclass(kw_only=True)
class SearchOptions:
    """How ``search_plan`` searches; the CLI's ``search`` flags map onto these."""

    trials: int = 0  # Optuna trials in total (a resumed study counts its stored ones); 0: no study
    seed: int = 0  # the sampler's seed: the same seed gives the same study
    storage: str | None = None  # a path (SQLite) or an Optuna storage URL; None: in memory
    study_name: str | None = None  # default: from the model, mesh, budget and fabric
    sampler: str = "auto"  # "tpe", "nsga2", or "auto": TPE on small spaces, NSGA-II on large ones
    # Shard-group sizes to consider; None: the world, and when it spans
    # nodes one node and whole nodes (HSDP). The study also tries parts of a node.
    shard_sizes: tuple[int, ...] | None = None
    max_group: int = 8  # the DP's largest group of blocks in one unit
    timeout_s: float | None = None  # stop the study after this long (finished trials are kept)
    progress: bool = False  # a progress line on stderr
    # Per-unit checkpointing the DP, the uniform groupings and the study choose from: False (none),
    # True (full) and, when listed, SELECTIVE_OP ("selective-op": See [Note: selective checkpointing]
    # in wrapopt/selective.py). The default leaves selective-op out; the CLI's
    # --checkpoint-modes none,full,selective-op adds it.
    checkpoint_modes: tuple[bool | str, ...] = (False, True)
    # What will run the plan: "wrapopt" (``apply``: any plan) or "torchtitan" (its job config: only the
    # plans it can say, See [Note: TorchTitan's plans] in search/torchtitan.py).
    runtime: str = "wrapopt"

    def __post_init__(self) -> None:
        if self.trials < 0:
            raise ValueError(f"trials must be >= 0, got {self.trials}")
        if self.max_group < 1:
            raise ValueError(f"max_group must be >= 1, got {self.max_group}")
        if self.sampler not in ("auto", "tpe", "nsga2"):
            raise ValueError(f"unknown sampler {self.sampler!r}; choose auto, tpe or nsga2")
        bad = [m for m in self.checkpoint_modes if m not in CHECKPOINT_MODES or not isinstance(m, (bool, str))]
        if bad or not self.checkpoint_modes:
            raise ValueError(f"checkpoint_modes must list some of False, True, {SELECTIVE_OP!r}; got "
                             f"{self.checkpoint_modes!r}")
        if self.runtime not in ("wrapopt", "torchtitan"):
            raise ValueError(f"unknown runtime {self.runtime!r}; choose wrapopt or torchtitan")
        if self.study_name is not None and not self.study_name.strip():
            raise ValueError("the study name is empty")


@dataclass(frozen=True, slots=True)
class Scored:
    """A plan with the simulator's estimate, and whether it fits the budget."""

    plan: PlanSpec
    estimate: CostEstimate
    fits: bool
    strategy: str = ""  # the name of the strategy that proposed it first ("" outside a search)


def step_per_token(s: Scored) -> float:
    """``s``'s step per token, up to a constant that every plan of a local batch shares: the step times
    its cp degree, since a cp plan's step runs 1/cp of the tokens per GPU (See [Note: context parallel
    search] in search/cp.py). Not for steps at a fixed global batch, which cover the same tokens."""
    return s.estimate.step_s * s.plan.mesh.cp_size


def compared_step(s: Scored, per_token: bool) -> float:
    """What plans of different shapes compare by: ``step_per_token`` at a local batch, the step itself
    at a fixed global batch (every plan runs the same sequences)."""
    return step_per_token(s) if per_token else s.estimate.step_s


@dataclass(frozen=True, kw_only=True)
class SearchProblem:
    """What every strategy of one search is given."""

    graph: ModelGraph
    sim: Simulator  # the cost model; a strategy may call it (the DP re-scores its answers, the study its trials)
    mesh: MeshSpec  # the mesh asked for; its shard group is the default
    memory_budget: float  # bytes per rank; math.inf: no budget
    shard_sizes: tuple[int, ...]  # shard-group sizes to consider, each legal on ``mesh``
    options: SearchOptions  # with ``max_group`` resolved


@dataclass(frozen=True)
class Proposal:
    """What a strategy returns from ``propose``."""

    # Plans for the driver to score, in order. A plan equal to one already
    # scored keeps that score (and the label it was first scored under).
    plans: tuple[PlanSpec, ...] = ()
    # Plans the strategy scored itself because it needed the scores to search
    # (an optimiser's trials, e.g. the Optuna study's Pareto front); the driver
    # keeps them as they are and judges only whether they fit.
    evaluated: tuple[Scored, ...] = ()
    detail: object | None = field(default=None, repr=False)  # anything to hand back to the caller (the StudyOutcome)
    # Plans the strategy ruled out itself because validate_plan refused them (the study's pruned trials).
    num_illegal: int = 0


@dataclass(frozen=True)
class Round:
    """One strategy's turn in a search, as the driver recorded it."""

    strategy: Strategy
    proposed: tuple[PlanSpec, ...]  # ``Proposal.plans`` as proposed (labels as the strategy gave them)
    # One score per proposed plan (the first score of an equal plan), then the strategy's own evaluations.
    scored: tuple[Scored, ...]
    detail: object | None = field(default=None, repr=False)

    @property
    def best(self) -> Scored | None:
        """The fastest plan of this round that fits, as ``fastest`` orders them."""
        return fastest([s for s in self.scored if s.fits])


@dataclass(frozen=True)
class History:
    """What the strategies before this one did: their rounds, and every plan scored so far."""

    rounds: tuple[Round, ...] = ()
    # In the order scored; equal plans once, except reference plans and an optimiser's own trials (each kept).
    scored: tuple[Scored, ...] = ()


class Strategy(abc.ABC):
    """A way to propose plans: the base class of every search strategy.

    ``search_plan`` makes one ``SearchProblem`` per search and then, for each
    registered strategy in turn, calls ``propose`` exactly once, scores with
    the simulator every plan of the returned ``Proposal`` (checking each with
    ``validate_plan``: a strategy proposes legal plans), and records a
    ``Round``. Strategies do not pick the answer: the driver does, among
    every strategy's plans (the fastest that fits the budget).

    A strategy must be deterministic: the same problem, history and
    ``options.seed`` give the same proposal. The conformance suite
    (``wrapopt.testing.pytest_strategies``) checks this and the rest of the
    contract; run it from the strategy's test file.

    Attributes:
        name: a short unique name; ``SearchResult.round(name)`` finds its round.
        reference: its plans are reference points shown beside the answer
            (``SearchResult.baselines``, by label): each is scored and kept
            under its own label even when equal to another.
        seed_every_plan: every plan it proposes is worth starting an
            optimiser from (later strategies that take seeds take them all);
            other plans are offered only among the fastest scored so far.
    """

    name: ClassVar[str] = ""
    reference: ClassVar[bool] = False
    seed_every_plan: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if not cls.name:
            raise TypeError(f"search strategy {cls.__qualname__} needs a class attribute `name`")

    @abc.abstractmethod
    def propose(self, problem: SearchProblem, history: History) -> Proposal:
        """Propose plans for ``problem``.

        Called once per search, after every strategy registered before this
        one has proposed and been scored (``history`` holds their rounds and
        every plan scored so far); the plans returned are scored after this
        returns, before the next strategy is called. Return an empty
        ``Proposal`` when the strategy has nothing for this problem (the DP
        on a model without block chains, the study with ``trials == 0``).
        """

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def make_problem(graph: ModelGraph, sim: Simulator, mesh: MeshSpec, *, memory_budget: float | None = None,
                 max_group: int | None = None, options: SearchOptions | None = None) -> SearchProblem:
    """The problem ``search_plan`` gives its strategies; raises ``ValueError``
    (from ``MeshSpec``) for a shard-group size that is illegal on ``mesh``."""
    opts = options or SearchOptions()
    if max_group and max_group != opts.max_group:
        opts = replace(opts, max_group=max_group)
    sizes = tuple(opts.shard_sizes) if opts.shard_sizes else dp_shard_sizes(mesh)
    for s in sizes:
        MeshSpec(world_size=mesh.world_size, ranks_per_node=mesh.ranks_per_node, shard_size=s)  # raises if illegal
    budget = float(memory_budget) if memory_budget else math.inf
    return SearchProblem(graph=graph, sim=sim, mesh=mesh, memory_budget=budget, shard_sizes=sizes, options=opts)


def fastest(scored: list[Scored]) -> Scored | None:
    """The fastest of ``scored``; among equal times (to 1e-12 s) the smaller
    peak, then fewer units, then the first. None for an empty list."""
    if not scored:
        return None
    return min(scored, key=lambda s: (round(s.estimate.step_s, 12), s.estimate.peak_bytes, len(s.plan.units)))


def dp_shard_sizes(mesh: MeshSpec) -> tuple[int, ...]:
    """Shard groups a search considers by default: the world, and when it
    spans nodes one node and every power-of-two number of whole nodes below
    the world."""
    if mesh.world_size <= mesh.ranks_per_node:
        return (mesh.world_size,)
    out = {mesh.world_size}
    s = mesh.ranks_per_node
    while s < mesh.world_size:
        if mesh.world_size % s == 0:
            out.add(s)
        s *= 2
    return tuple(sorted(out, reverse=True))
