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
The heartbeat costs each trial a thread and about 4 more SQL statements (some
120 without it on gpt-tiny's 23 parameters); SQLite files, shared by the
workers of one host, go without it.

A plain ``postgresql://`` URL is given the ``psycopg`` (version 3) driver when
it is installed (``pip install 'wrapopt[db]'``): SQLAlchemy 2.1 picks it by
default, 2.0 would ask for ``psycopg2``. A URL that names its driver
(``postgresql+psycopg2://``) is kept.
"""

from __future__ import annotations

import importlib.util
import inspect
import warnings
from typing import Any

from wrapopt.errors import WrapoptError

__all__ = ["HEARTBEAT_S", "GRACE_S", "MAX_RETRY", "rdb_storage", "server_storage", "shown_url"]

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
