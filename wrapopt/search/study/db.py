"""Optuna storages on a database server (PostgreSQL, MySQL, ...) for a search
shared by several hosts.

[Note: shared studies on a server] Every worker opens the study through an
``RDBStorage`` with a heartbeat: while a trial runs, its worker records a
heartbeat in the database every ``HEARTBEAT_S`` seconds, and before each new
trial a worker marks FAIL every RUNNING trial whose heartbeat is older than
``GRACE_S`` seconds (database time, so the hosts' clocks do not matter). The
failed trial is queued again with the same parameters
(``RetryHeartbeatStaleTrialCallback``, ``RetryFailedTrialCallback`` before
Optuna 4.9), so a worker killed in the middle of a trial (``kill -9``, a
preempted host) loses nothing: its finished trials are committed, and the one
it was running is run by a live worker. A trial whose worker dies before its
first heartbeat stays RUNNING for good and is not counted; one whose worker
dies when no other worker has trials left to run is failed and retried by the
next search on the study that has. A simulated trial takes milliseconds, so ``GRACE_S`` only has to
cover a worker's pauses (garbage collection, a slow network to the database).
The heartbeat costs each trial a thread and a few more SQL statements, a small
share of a trial's; SQLite files, shared by the workers of one host, go
without it.

[Note: seeds enqueued twice] Workers that start together each find the study
without its seeds and each enqueue them (``skip_if_exists`` reads, then
writes; nothing makes the two steps atomic), so every seed may be evaluated
twice, and a small trial budget can go on the seeds alone. After enqueueing,
each worker therefore drops the queued (WAITING) copies of a seed that is
already done, and every queued copy but the one with the lowest trial number.
Dropping claims a copy the way a worker takes a trial from the queue (WAITING
to RUNNING, which only one process can do) and then marks it FAIL with the
user attribute ``duplicate_seed``. The lowest-numbered copy is never dropped
by anyone (a worker that sees only some copies still sees no copy below it),
so no seed is lost; a copy that a worker took in the meantime still runs, so a
seed may rarely still run twice. The queued copies of a seed whose other copy
is RUNNING are kept: a copy being dropped is briefly RUNNING, so two workers
cleaning up at once would drop both copies of the seed.

A plain ``postgresql://`` URL is given the ``psycopg`` (version 3) driver when
it is installed (``pip install 'wrapopt[db]'``): SQLAlchemy 2.1 picks it by
default, 2.0 would ask for ``psycopg2``. A URL that names its driver
(``postgresql+psycopg2://``) is kept.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import warnings
from typing import Any

from wrapopt.errors import WrapoptError

__all__ = ["HEARTBEAT_S", "GRACE_S", "MAX_RETRY", "drop_duplicate_seeds", "rdb_storage", "server_storage", "shown_url"]

HEARTBEAT_S = 5
GRACE_S = 30
MAX_RETRY = 3  # a trial that keeps killing its worker is given up after this many retries

# URL scheme (before any "+driver") -> (module that drives it, what to install)
_DRIVERS = {
    "postgresql": (("psycopg", "psycopg2"), "pip install 'wrapopt[db]' (psycopg)"),
    "postgres": (("psycopg", "psycopg2"), "pip install 'wrapopt[db]' (psycopg)"),
    "mysql": (("pymysql", "MySQLdb"), "pip install pymysql, and use mysql+pymysql://"),
}


def shown_url(url: str | None) -> str | None:
    """``url`` with its password replaced by ``***``, for messages and reports."""
    if url is None or "@" not in url:
        return url
    try:
        from sqlalchemy.engine import make_url

        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # not an SQLAlchemy URL (journal:///...): nothing to hide
        return url


def _with_driver(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    if "+" in scheme or scheme not in _DRIVERS:
        return url
    modules, install = _DRIVERS[scheme]
    found = [m for m in modules if importlib.util.find_spec(m) is not None]
    if not found:
        raise WrapoptError(f"--storage {shown_url(url)}: no {scheme} driver is installed; {install}")
    if scheme in ("postgresql", "postgres"):
        return f"postgresql+{found[0]}{sep}{rest}"
    return url


def _heartbeat_kwargs(heartbeat_s: int, grace_s: int) -> dict[str, Any]:
    import optuna

    if heartbeat_s <= 0 or grace_s <= heartbeat_s:
        raise ValueError(f"heartbeat {heartbeat_s} s and grace {grace_s} s: need 0 < heartbeat < grace")
    params = inspect.signature(optuna.storages.RDBStorage.__init__).parameters
    kw: dict[str, Any] = {"heartbeat_interval": int(heartbeat_s), "grace_period": int(grace_s)}
    if "heartbeat_stale_trial_callback" in params:  # Optuna >= 4.9
        kw["heartbeat_stale_trial_callback"] = optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=MAX_RETRY)
    else:
        kw["failed_trial_callback"] = optuna.storages.RetryFailedTrialCallback(max_retry=MAX_RETRY)
    return kw


def rdb_storage(url: str, *, engine_kwargs: dict[str, Any] | None = None, heartbeat_s: int = HEARTBEAT_S,
                grace_s: int = GRACE_S):
    """An ``RDBStorage`` whose workers keep a heartbeat, so that the trials of dead
    workers are failed and retried (See [Note: shared studies on a server])."""
    import optuna

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)  # the heartbeat API's notice
        return optuna.storages.RDBStorage(url, engine_kwargs=engine_kwargs,
                                          **_heartbeat_kwargs(heartbeat_s, grace_s))


def server_storage(url: str, *, heartbeat_s: int = HEARTBEAT_S, grace_s: int = GRACE_S):
    """A study storage on a database server: the URL given its driver, a heartbeat."""
    # pool_pre_ping: a worker whose connection the server closed (idle timeout,
    # a restarted server) reconnects instead of failing its next trial.
    return rdb_storage(_with_driver(url), engine_kwargs={"pool_pre_ping": True},
                       heartbeat_s=heartbeat_s, grace_s=grace_s)


def drop_duplicate_seeds(study) -> int:
    """Drop the queued copies of seeds enqueued twice; returns how many were dropped.
    See [Note: seeds enqueued twice]."""
    import optuna
    from optuna.trial import TrialState

    live = (TrialState.WAITING, TrialState.RUNNING, TrialState.COMPLETE)
    groups: dict[str, list] = {}
    for t in study.get_trials(deepcopy=False, states=live):
        fixed = t.system_attrs.get("fixed_params")
        if fixed is not None:
            groups.setdefault(json.dumps(fixed, sort_keys=True, default=str), []).append(t)
    # Optuna has no public call to move another trial between states; its own queue
    # uses the storage's set_trial_state_values, as here.
    storage = study._storage
    dropped = 0
    for copies in groups.values():
        first = min(t.number for t in copies)
        done = any(t.state == TrialState.COMPLETE for t in copies)
        for t in copies:
            if t.state != TrialState.WAITING or (t.number == first and not done):
                continue
            try:
                if not storage.set_trial_state_values(t._trial_id, state=TrialState.RUNNING):
                    continue  # a worker took it first
                storage.set_trial_user_attr(t._trial_id, "duplicate_seed", True)
                storage.set_trial_state_values(t._trial_id, state=TrialState.FAIL)
                dropped += 1
            except optuna.exceptions.UpdateFinishedTrialError:
                continue
    return dropped
