"""Per-trial sampler seeds, and the trials of dead workers on this host.

[Note: per-trial seeds] An Optuna sampler draws from one random stream seeded once, so a
study resumed after ``kill -9`` starts the stream again from the seed (the trials after the
resume differ from an uninterrupted run's), and two workers started with one seed draw the
same stream (they propose the same trials). Here the stream is reseeded before every trial
from (seed, the trial's *place*): the number of earlier trials that did not fail. Two
workers never share a place (a running trial of the other worker counts), so they draw
different streams; and a resumed study whose killed trial is failed (``fail_dead_workers``)
gives the next trial the place the killed one had, so with the same finished history the
sampler proposes what the uninterrupted run did. Each trial records its ``sampler_seed``.
Reseeding uses the samplers' private ``_rng`` and ``_random_sampler`` (Optuna 4-5 TPE,
NSGA-II, Random); a sampler without them keeps its one stream.
"""

from __future__ import annotations

import functools
import hashlib
import os
import socket

__all__ = ["per_trial_seed_sampler", "fail_dead_workers", "worker_name"]


def worker_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def _trial_seed(seed: int, place: int) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{place}".encode()).digest()[:4], "little")


@functools.cache
def _sampler_class():  # made on first use: optuna is imported late, as everywhere in search/study
    from optuna.samplers import BaseSampler
    from optuna.trial import TrialState

    class PerTrialSeedSampler(BaseSampler):
        """``inner`` with its random stream reseeded before each trial: See [Note: per-trial seeds]."""

        def __init__(self, inner: BaseSampler, seed: int) -> None:
            self.inner = inner
            self.seed = seed

        def infer_relative_search_space(self, study, trial):
            return self.inner.infer_relative_search_space(study, trial)

        def sample_relative(self, study, trial, search_space):
            return self.inner.sample_relative(study, trial, search_space)

        def sample_independent(self, study, trial, param_name, param_distribution):
            return self.inner.sample_independent(study, trial, param_name, param_distribution)

        def before_trial(self, study, trial) -> None:
            place = sum(t.number < trial.number and t.state != TrialState.FAIL
                        for t in study.get_trials(deepcopy=False))
            s = _trial_seed(self.seed, place)
            for owner in (self.inner, getattr(self.inner, "_random_sampler", None)):
                rng = getattr(owner, "_rng", None)
                if rng is not None and hasattr(rng, "rng"):
                    rng.rng.seed(s)
            study._storage.set_trial_system_attr(trial._trial_id, "sampler_seed", s)
            self.inner.before_trial(study, trial)

        def after_trial(self, study, trial, state, values) -> None:
            self.inner.after_trial(study, trial, state, values)

        def reseed_rng(self) -> None:
            self.inner.reseed_rng()

    return PerTrialSeedSampler


def per_trial_seed_sampler(inner, seed: int):
    """``inner`` reseeded before each trial from ``seed`` and the trial's place: See [Note: per-trial seeds]."""
    return _sampler_class()(inner, seed)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def fail_dead_workers(study) -> int:
    """Mark FAIL the RUNNING trials of workers on this host whose process is gone (``kill -9``);
    returns how many. File storages have no heartbeat to do it (See [Note: per-trial seeds])."""
    from optuna.trial import TrialState

    host = socket.gethostname()
    failed = 0
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        who, _, pid = str(t.user_attrs.get("worker", "")).rpartition(":")
        if who != host or not pid.isdigit() or _alive(int(pid)):
            continue
        if study._storage.set_trial_state_values(t._trial_id, state=TrialState.FAIL):
            failed += 1
    return failed
