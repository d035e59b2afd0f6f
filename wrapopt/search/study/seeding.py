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

[Note: dead workers in a study file] Optuna's heartbeat (``fail_stale_trials``) needs a storage
that records one (``BaseHeartbeat``: ``RDBStorage`` on a server, See [Note: shared studies on a
server] in search/study/db.py); Optuna 5.1's ``JournalStorage`` does not, and wrapopt's SQLite
files go without it. So a worker killed in the middle of a trial leaves it RUNNING. Each trial
names its worker ("host:pid") first thing, and ``fail_dead_workers`` marks FAIL the RUNNING
trials of a worker known to be gone: on this host, a pid with no process; elsewhere (a journal on
a shared file system), a worker whose ``beat`` (a study attribute ``worker_beat:host:pid``, wall
time, written at start and every ``BEAT_S`` while it runs trials) is older than ``STALE_S``. A
worker runs it when it opens the study (resume) and every ``CHECK_S`` while it runs, so a live
worker fails a dead one's trial within seconds (on this host) or ``STALE_S`` (elsewhere; the
hosts' clocks must agree to well within it, as NTP keeps them), and its own trials go on at their
rate. A failed trial names the worker that failed it (system attribute ``failed_as_dead``); it
is not counted in the study's budget, so another trial takes its place.
"""

from __future__ import annotations

import functools
import hashlib
import os
import socket
import time

__all__ = ["per_trial_seed_sampler", "fail_dead_workers", "worker_name", "beat", "BEAT_S", "STALE_S", "CHECK_S"]

BEAT_S = 5.0  # how often a running worker writes its beat (one record in the study file)
STALE_S = 60.0  # a worker on another host whose beat is older than this is dead
CHECK_S = 1.0  # how often a running worker looks for dead workers' trials
_BEAT_KEY = "worker_beat:"


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


def beat(study, worker: str) -> None:
    """Record that ``worker`` is alive now: See [Note: dead workers in a study file]."""
    study._storage.set_study_system_attr(study._study_id, _BEAT_KEY + worker, time.time())


def _dead(worker: str, host: str, beats: dict, now: float, stale_s: float) -> bool:
    who, _, pid = worker.rpartition(":")
    if who == host and pid.isdigit():
        return not _alive(int(pid))
    last = beats.get(_BEAT_KEY + worker)  # a worker that never beat (older wrapopt) is left alone
    return isinstance(last, (int, float)) and now - last > stale_s


def fail_dead_workers(study, *, stale_s: float = STALE_S) -> int:
    """Mark FAIL the RUNNING trials of dead workers; returns how many. See [Note: dead workers in
    a study file]."""
    import optuna
    from optuna.trial import TrialState

    running = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
    if not running:
        return 0
    host, me, now = socket.gethostname(), worker_name(), time.time()
    beats = study._storage.get_study_system_attrs(study._study_id)
    failed = 0
    for t in running:
        worker = str(t.user_attrs.get("worker", ""))
        if not worker or worker == me or not _dead(worker, host, beats, now, stale_s):
            continue
        try:
            # RUNNING -> FAIL; Optuna's own stale-trial check moves another worker's trial the same way
            study._storage.set_trial_system_attr(t._trial_id, "failed_as_dead", me)
            if study._storage.set_trial_state_values(t._trial_id, state=TrialState.FAIL):
                failed += 1
        except optuna.exceptions.UpdateFinishedTrialError:
            continue  # it finished after all (a worker that was only slow)
    return failed
