"""Optuna over the general space: a seeded, constrained, two-objective study.

The study minimises (predicted step time, predicted peak bytes) with the
memory budget as a constraint, so its Pareto front is the time-memory
trade-off among plans that fit. It is seeded (``enqueue_trial``) with the
baselines and the DP answers, so its best is never worse than theirs.

[Note: resumable studies] With a storage URL every finished trial is
committed as it finishes. A search asks for a total of ``trials`` finished
trials: it counts those already stored and runs only the rest, and a callback
stops it as soon as the study holds the total, so a restarted search (after
``kill -9``) and several workers sharing one study finish the budget together
without redoing a finished trial. A trial that was running when its worker
died is not counted: in a file a live worker (or the next search) fails it
(See [Note: dead workers in a study file] in search/study/seeding.py); on a
database server it is failed and queued again by a live worker once its
heartbeat is stale (See [Note: shared studies on a server] in search/study/db.py). Seeds are enqueued with
``skip_if_exists``, so a restart does not run them twice. A study remembers
what it was made for (model, mesh, budget, fabric); reopening it for
anything else is an error rather than a silent mix.

[Note: illegal trials] The space is meant to be legal by construction, but
a model can hold what it does not foresee (BERT's masked-LM head ties
``cls.predictions.bias`` to ``decoder.bias``, one level below the modules the
space keeps together). A trial whose plan ``validate_plan`` refuses is
pruned, never raised: the search goes on, the trial counts as finished (so
a budget of trials still ends) and ``StudyOutcome.num_illegal`` counts it.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
import warnings
from dataclasses import dataclass, replace
from typing import Any

from wrapopt.cost.simulate import Simulator
from wrapopt.errors import PlanError, WrapoptError
from wrapopt.progress import Progress
from wrapopt.search.study import db, files, seeding
from wrapopt.search.study.split_memo import split_once_per_trial
from wrapopt.search.study.space import SearchSpace
from wrapopt.spec import CostEstimate, ModelGraph, PlanSpec
from wrapopt.units import validate_plan

__all__ = ["StudyOutcome", "TrialResult", "run_study", "open_storage", "storage_url", "default_study_name", "SAMPLERS"]

SAMPLERS = ("auto", "tpe", "nsga2")
# "auto": multi-objective TPE learns much more per trial, but its cost per trial
# grows with the number of parameters and trials; past this many parameters
# (a few dozen blocks) NSGA-II, which costs next to nothing per trial, takes over.
TPE_MAX_PARAMS = 64
ILLEGAL = "illegal"  # user attribute of a trial pruned because validate_plan refused its plan


@dataclass(frozen=True, slots=True)
class TrialResult:
    number: int
    plan: PlanSpec
    estimate: CostEstimate
    fits: bool


@dataclass(frozen=True)
class StudyOutcome:
    """What a study holds after a search: its best plan that fits and its Pareto front."""

    study_name: str
    storage: str | None
    num_trials: int  # finished trials in the study (all workers, all runs)
    num_run_here: int  # trials this call ran
    best: TrialResult | None  # fastest trial that fits
    pareto: tuple[TrialResult, ...]  # fitting trials not beaten in both time and memory, fastest first
    num_seeds: int
    sampler: str = ""
    num_illegal: int = 0  # trials pruned because validate_plan refused their plan: See [Note: illegal trials]


def storage_url(storage: str | None) -> str | None:
    """A path becomes a SQLite URL (``journal:///path`` for a path ending in
    ``.journal``: Optuna's append-only journal file, much faster per trial);
    a URL (``sqlite:///``, ``postgresql://``, ``mysql://``, ...) is kept."""
    if not storage:
        return None
    if "://" in storage:
        return storage
    path = os.path.abspath(os.path.expanduser(storage))
    directory = os.path.dirname(path)
    if not os.path.isdir(directory):
        raise WrapoptError(f"--storage {storage!r}: directory {directory} does not exist")
    return f"journal:///{path}" if path.endswith(".journal") else f"sqlite:///{path}"


def open_storage(url: str | None, *, heartbeat_s: int = db.HEARTBEAT_S, grace_s: int = db.GRACE_S):
    if url is None:
        return None
    if url.startswith("journal:///"):
        return files.journal_storage(url[len("journal:///"):])
    if url.startswith("sqlite:///") and ":memory:" not in url:
        return files.sqlite_storage(url, url[len("sqlite:///"):])
    if url.startswith("sqlite:"):  # in memory: one process, nothing to share
        return url
    return db.server_storage(url, heartbeat_s=heartbeat_s, grace_s=grace_s)


def study_identity(graph: ModelGraph, sim: Simulator, space: SearchSpace, memory_budget: float) -> dict[str, Any]:
    """What a study's trials depend on; stored in the study and hashed into its default name."""
    h = hashlib.sha256()
    for fqn, shape, dtype in sorted(graph.param_shapes):
        h.update(f"{fqn}:{shape}:{dtype};".encode())
    return {
        "model": graph.model_class,
        "params_hash": h.hexdigest()[:12],
        "world_size": space.mesh.world_size,
        "ranks_per_node": space.mesh.ranks_per_node,
        "shard_choices": list(space.shard_choices),
        "memory_budget": None if not math.isfinite(memory_budget) else int(memory_budget),
        "fabric": sim.fabric.label,
        "compute": f"{sim.compute.device} ({sim.compute.kind})",
        "num_space_params": space.num_params,
    }


def default_study_name(identity: dict[str, Any]) -> str:
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:10]
    return f"wrapopt-{identity['model']}-w{identity['world_size']}-{digest}"


class _ShowTrials:
    """An Optuna callback moving a ``Progress`` to the study's count of finished trials (other
    workers' included) and its best fitting time; the storage is read at most every 0.1 s."""

    def __init__(self, bar: Progress):
        self.bar = bar
        self.last = 0.0

    def __call__(self, study, _trial) -> None:
        now = time.monotonic()
        if now - self.last >= 0.1:
            self.last = now
            self.show(study)

    def show(self, study) -> None:
        best = _best_time(study)
        self.bar.set(_count_finished(study),
                     note=f"best fitting {best * 1e3:.2f} ms" if best is not None else "nothing fits yet")


def _count_finished(study) -> int:
    """Complete trials and those pruned as illegal (See [Note: illegal trials])."""
    from optuna.trial import TrialState

    return len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)))


def _fits(trial) -> bool:
    return trial.user_attrs.get("fits", False)


def _best_time(study) -> float | None:
    from optuna.trial import TrialState

    ts = [t.values[0] for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)) if _fits(t)]
    return min(ts) if ts else None


def _sampler(name: str, seed: int, population: int):
    import optuna

    constraints = None
    if not hasattr(optuna.trial.Trial, "set_constraint"):  # Optuna < 5: a constraints function
        constraints = lambda ft: (ft.user_attrs.get("memory_over_budget", 0.0),)  # noqa: E731
    match name:
        case "auto":
            raise AssertionError("resolved by run_study")  # internal invariant
        case "nsga2":
            return optuna.samplers.NSGAIISampler(seed=seed, population_size=population, constraints_func=constraints)
        case "tpe":
            return optuna.samplers.TPESampler(seed=seed, constraints_func=constraints, multivariate=False)
        case _:
            raise ValueError(f"unknown sampler {name!r}; choose one of {', '.join(SAMPLERS)}")


def _open_study(url: str | None, name: str, identity: dict[str, Any], sampler, heartbeat: dict[str, int]):
    import optuna

    for attempt in range(6):
        try:
            storage = open_storage(url, **heartbeat)
            study = optuna.create_study(storage=storage, study_name=name, directions=["minimize", "minimize"],
                                        sampler=sampler, load_if_exists=True)
            break
        except WrapoptError:
            raise
        except Exception as e:  # an unreachable database, a bad URL: say which
            # Workers starting together race to create the schema or the study;
            # the loser finds it made on its next try.
            if attempt == 5:
                raise WrapoptError(f"cannot open study {name!r} in storage {db.shown_url(url)}: "
                                   f"{str(e).splitlines()[0]}") from None
            time.sleep(0.2 * (attempt + 1))
    stored = study.user_attrs.get("wrapopt")
    if stored is None:
        study.set_user_attr("wrapopt", identity)
    elif stored != identity:
        diff = sorted(k for k in set(stored) | set(identity) if stored.get(k) != identity.get(k))
        raise WrapoptError(
            f"study {name!r} in {db.shown_url(url)} was made for a different search (differs in: {', '.join(diff)}); "
            "pass another --study-name or leave it to the default"
        )
    return study


def run_study(
    graph: ModelGraph,
    sim: Simulator,
    space: SearchSpace,
    *,
    memory_budget: float,
    seeds: list[PlanSpec],
    trials: int,
    seed: int = 0,
    storage: str | None = None,
    study_name: str | None = None,
    sampler: str = "auto",
    population: int | None = None,
    timeout_s: float | None = None,
    progress: bool = False,
    heartbeat_s: int = db.HEARTBEAT_S,
    grace_s: int = db.GRACE_S,
) -> StudyOutcome:
    """Run (or resume, or join) a study until it holds ``trials`` finished trials.

    See [Note: resumable studies]. ``seeds`` are enqueued first when they can
    be expressed in ``space``. ``sampler`` "auto" is TPE for spaces of at most
    ``TPE_MAX_PARAMS`` parameters and NSGA-II for larger ones. ``heartbeat_s`` and
    ``grace_s``: See [Note: shared studies on a server].
    """
    import optuna
    from optuna.trial import TrialState

    budget = float(memory_budget) if memory_budget else math.inf
    url = storage_url(storage)
    identity = study_identity(graph, sim, space, budget)
    name = study_name or default_study_name(identity)
    pop = population or max(8, min(50, trials // 6))
    if sampler == "auto":
        sampler = "tpe" if space.num_params <= TPE_MAX_PARAMS else "nsga2"
    level = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # experimental / deprecation notices about Optuna itself
            sampler_obj = seeding.per_trial_seed_sampler(_sampler(sampler, seed, pop), seed)
            study = _open_study(url, name, identity, sampler_obj, {"heartbeat_s": heartbeat_s, "grace_s": grace_s})
            worker = seeding.worker_name()
            watch = _WatchWorkers.of(study, url, worker)
            done = _count_finished(study)
            num_seeds = _enqueue_seeds(study, space, seeds, shared=url is not None) if done < trials else 0
            ran = 0

            def objective(trial) -> tuple[float, float]:
                nonlocal ran
                trial.set_user_attr("worker", worker)  # first: a killed worker's trial names it
                plan = space.suggest(trial)
                try:
                    validate_plan(graph, plan)
                except PlanError as err:  # See [Note: illegal trials]
                    ran += 1
                    trial.set_user_attr("fits", False)
                    trial.set_user_attr(ILLEGAL, str(err).splitlines()[0][:300])
                    raise optuna.TrialPruned(ILLEGAL) from None
                est = sim.simulate(plan)
                over = est.peak_bytes - budget if math.isfinite(budget) else -1.0
                trial.set_user_attr("fits", bool(over <= 0))
                if hasattr(trial, "set_constraint"):
                    trial.set_constraint("memory", over)
                else:
                    trial.set_user_attr("memory_over_budget", over)
                ran += 1
                return est.step_s, float(est.peak_bytes)

            _optimize(study, objective, trials=trials, done=done, timeout_s=timeout_s, progress=progress,
                      watch=watch)
            finished = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
            pruned = study.get_trials(deepcopy=False, states=(TrialState.PRUNED,))
            illegal = sum(ILLEGAL in t.user_attrs for t in pruned)
    finally:
        optuna.logging.set_verbosity(level)
    out = _outcome(space, sim, finished, name, url, ran, num_seeds, sampler)
    return replace(out, num_illegal=illegal) if illegal else out


def _enqueue_seeds(study, space: SearchSpace, seeds: list[PlanSpec], *, shared: bool) -> int:
    """Enqueue the seeds that ``space`` can express; return how many."""
    num_seeds = 0
    for plan in seeds:
        params = space.encode(plan)
        if params is not None:
            study.enqueue_trial(params, user_attrs={"seed": plan.label or "seed"}, skip_if_exists=True)
            num_seeds += 1
    if shared and num_seeds:
        db.drop_duplicate_seeds(study)  # See [Note: seeds enqueued twice]
    return num_seeds


class _WatchWorkers:
    """An Optuna callback for study files: this worker's beat every ``BEAT_S``, and the trials of
    dead workers failed every ``CHECK_S``; See [Note: dead workers in a study file] in search/study/seeding.py."""

    def __init__(self, worker: str):
        self.worker = worker
        self.last_beat = self.last_check = -math.inf

    @classmethod
    def of(cls, study, url: str | None, worker: str) -> "_WatchWorkers | None":
        """The watch of a study file, checked once as the study opens (a resume); None for others."""
        if url is None or not url.startswith(("journal:///", "sqlite:///")):
            return None
        watch = cls(worker)
        watch.check(study)
        return watch

    def check(self, study) -> None:
        now = time.monotonic()
        if now - self.last_beat >= seeding.BEAT_S:
            self.last_beat = now
            seeding.beat(study, self.worker)
        if now - self.last_check >= seeding.CHECK_S:
            self.last_check = now
            seeding.fail_dead_workers(study)

    def __call__(self, study, _trial) -> None:
        self.check(study)


def _optimize(study, objective, *, trials: int, done: int, timeout_s: float | None, progress: bool,
              watch: _WatchWorkers | None = None) -> None:
    """Run trials until the study holds ``trials`` finished ones (``done`` already), showing them."""

    def stop_at_budget(st, _trial) -> None:
        if _count_finished(st) >= trials:
            st.stop()

    show = _ShowTrials(Progress(trials, desc="search", unit="trial", enabled=progress and done < trials))
    show.bar.set(done)
    if done < trials:
        try:
            callbacks = [stop_at_budget, show] + ([watch] if watch is not None else [])
            with split_once_per_trial():  # See [Note: TPE's split once per trial]
                study.optimize(objective, n_trials=trials - done, timeout=timeout_s, callbacks=callbacks,
                               gc_after_trial=False)
            show.show(study)
        finally:
            show.bar.close()


def _outcome(space: SearchSpace, sim: Simulator, finished, name, url, ran, num_seeds, sampler) -> StudyOutcome:
    fitting = [t for t in finished if _fits(t)]
    fitting.sort(key=lambda t: (t.values[0], t.values[1], t.number))
    front = []
    best_peak = math.inf
    for t in fitting:  # fastest first; on the front when smaller in memory than every faster one
        if t.values[1] < best_peak:
            front.append(t)
            best_peak = t.values[1]

    def result(t) -> TrialResult:
        seed = t.user_attrs.get("seed")
        plan = space.from_params(t.params, label=f"optuna#{t.number}" + (f"={seed}" if seed else ""))
        return TrialResult(t.number, plan, sim.simulate(plan), True)

    pareto = tuple(result(t) for t in front)
    return StudyOutcome(study_name=name, storage=db.shown_url(url), num_trials=len(finished), num_run_here=ran,
                        best=pareto[0] if pareto else None, pareto=pareto, num_seeds=num_seeds, sampler=sampler)
