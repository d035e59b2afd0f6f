"""A study shared through a real PostgreSQL server (See [Note: shared studies on
a server] in wrapopt/search/study/db.py).

The module starts a throw-away cluster itself: Debian's ``postgresql`` package
(``initdb``, ``pg_ctl`` under /usr/lib/postgresql/*/bin), a data directory in a
temporary folder, a free port on 127.0.0.1, password authentication; run as
the ``postgres`` user when the tests run as root (``initdb`` refuses root).
It is stopped and deleted at teardown, also when a test fails. Without the
server or a driver every test here is skipped with the reason.

What "equals a single-worker run" means here: with an adaptive sampler two
workers see different histories (each samples from the trials finished so far,
in whatever order the other worker finished them), so their best plan is not a
function of the seed. What is deterministic is a fixed set of candidates: the
test draws 40 distinct plans from a seeded generator, queues them in a study,
and lets two worker processes (forked from the test) evaluate them while one
is killed with SIGKILL inside a trial. The study must end holding exactly
those 40 plans, each once: nothing lost (the finished trials of the killed
worker are kept, its running trial is failed by its stale heartbeat and run
again by the live worker), nothing run twice; so its best and its Pareto front equal those of one worker
evaluating the same candidates alone (in memory). Without the retry the killed
trial's plan would be missing and a sampled plan would take its place. The
workers' simulator sleeps 0.12 s per trial (a stand-in for a slower trial) so
that the kill lands inside a trial and the live worker is still busy when the
killed trial's heartbeat goes stale (grace 2 s).
"""

from __future__ import annotations

import contextlib
import functools
import glob
import importlib.util
import io
import json
import multiprocessing
import os
import pwd
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time

import pytest

pytestmark = pytest.mark.multiprocess  # worker processes and a database server

NUM_CANDIDATES = 40
TRIAL_DELAY_S = 0.12
HEARTBEAT_S, GRACE_S = 1, 2
PASSWORD = "wrapopt-secret"


# --- the server --------------------------------------------------------------------------------


def _bindir() -> str | None:
    def version(path: str) -> tuple[int, ...]:
        v = path.split("/")[-3]
        return tuple(int(x) for x in v.split(".") if x.isdigit())

    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=version)
    if found:
        return os.path.dirname(found[-1])
    initdb = shutil.which("initdb")
    return os.path.dirname(initdb) if initdb else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: str, n: int = 5) -> str:
    try:
        with open(path, errors="replace") as f:
            return " | ".join(line.strip() for line in f.readlines()[-n:])
    except OSError:
        return "(no log)"


@pytest.fixture(scope="module")
def pg_url():
    bindir = _bindir()
    if bindir is None:
        pytest.skip("no PostgreSQL server: no initdb under /usr/lib/postgresql/*/bin or on PATH "
                    "(apt-get install -y postgresql)")
    if not any(importlib.util.find_spec(m) for m in ("psycopg", "psycopg2")):
        pytest.skip("no PostgreSQL driver for Python: pip install 'wrapopt[db]'")
    as_user: list[str] = []
    if os.geteuid() == 0:  # initdb and postgres refuse to run as root
        try:
            owner = pwd.getpwnam("postgres")
        except KeyError:
            pytest.skip("running as root and there is no 'postgres' user to run the server as")
        runuser = shutil.which("runuser")
        if runuser is None:
            pytest.skip("running as root and there is no runuser to start the server as 'postgres'")
        as_user = [runuser, "-u", "postgres", "--"]
    tmp = tempfile.mkdtemp(prefix="wrapopt-pg-")
    data, log, pwfile = os.path.join(tmp, "data"), os.path.join(tmp, "server.log"), os.path.join(tmp, "pw")
    with open(pwfile, "w") as f:
        f.write(PASSWORD + "\n")
    if as_user:
        for p in (tmp, pwfile):
            os.chown(p, owner.pw_uid, owner.pw_gid)
    started = False
    try:
        init = subprocess.run([*as_user, f"{bindir}/initdb", "-D", data, "-U", "wrapopt", f"--pwfile={pwfile}",
                               "-A", "scram-sha-256", "-E", "UTF8", "--no-sync", "--no-instructions"],
                              capture_output=True, text=True, timeout=60)
        if init.returncode != 0:
            pytest.skip(f"initdb failed: {(init.stderr or init.stdout).strip().splitlines()[-1:]}")
        for _attempt in range(3):  # another process may take the free port first
            port = _free_port()
            opts = (f"-c listen_addresses=127.0.0.1 -p {port} -k {tmp} -c fsync=off "
                    "-c synchronous_commit=off -c full_page_writes=off")
            start = subprocess.run([*as_user, f"{bindir}/pg_ctl", "-D", data, "-l", log, "-w", "-t", "30",
                                    "-o", opts, "start"], capture_output=True, text=True, timeout=60)
            if start.returncode == 0:
                started = True
                break
        if not started:
            pytest.skip(f"the PostgreSQL server did not start: {_tail(log)}")
        yield f"postgresql://wrapopt:{PASSWORD}@127.0.0.1:{port}/postgres"
    finally:
        if started:
            subprocess.run([*as_user, f"{bindir}/pg_ctl", "-D", data, "-m", "immediate", "-w", "stop"],
                           capture_output=True, timeout=60)
        shutil.rmtree(tmp, ignore_errors=True)


# --- the problem and its fixed candidates -------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _problem():
    from wrapopt.models import zoo
    from wrapopt.cost import Simulator
    from wrapopt.hardware.presets import analytical_compute, analytical_fabric
    from wrapopt.search.study.space import SearchSpace
    from wrapopt.trace.meta import trace_model
    from wrapopt.spec import MeshSpec

    e = zoo.get_entry("gpt-tiny")
    g = trace_model(e.build("meta"), e.inputs(), loss_fn=e.loss)
    mesh = MeshSpec(world_size=16, ranks_per_node=8, shard_size=16)
    sim = Simulator(g, analytical_fabric(world_size=16), analytical_compute())
    return g, sim, SearchSpace(g, mesh)


class _RandomSource:
    def __init__(self, rng: random.Random):
        self.rng, self.params = rng, {}

    def cat(self, name, choices):
        self.params[name] = self.rng.choice(choices)
        return self.params[name]


def _candidates(seed: int) -> tuple[list[dict], float]:
    """``NUM_CANDIDATES`` parameter sets drawn from ``seed``, with distinct predicted
    (time, peak), so that the best is one plan; and a budget that half of them fit."""
    g, sim, space = _problem()
    rng = random.Random(seed)
    out, seen = [], set()
    for _ in range(100 * NUM_CANDIDATES):
        src = _RandomSource(rng)
        est = sim.simulate(space.decode(src))
        key = (est.step_s, est.peak_bytes)
        if key not in seen:
            seen.add(key)
            out.append(space.complete(src.params))
        if len(out) == NUM_CANDIDATES:
            break
    assert len(out) == NUM_CANDIDATES, "gpt-tiny's space has too few distinct plans for this test"
    peaks = sorted(sim.simulate(space.from_params(p)).peak_bytes for p in out)
    return out, float(peaks[len(peaks) // 2])


@functools.lru_cache(maxsize=None)
def _storage(url: str):
    """One storage (one connection pool) per URL and process."""
    from wrapopt.search.study.run import open_storage as storage

    return storage(url, heartbeat_s=HEARTBEAT_S, grace_s=GRACE_S)


def _queue(url: str, name: str, candidates: list[dict], budget: float) -> None:
    """Create study ``name`` as ``run_study`` would, with the candidates queued."""
    import optuna

    from wrapopt.search.study.run import study_identity

    g, sim, space = _problem()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(storage=_storage(url), study_name=name, directions=["minimize", "minimize"])
    study.set_user_attr("wrapopt", study_identity(g, sim, space, budget))
    for i, p in enumerate(candidates):
        study.enqueue_trial(p, user_attrs={"seed": f"c{i}"})


def _run(url: str, name: str, budget: float, sim=None):
    """Join study ``name`` until it holds the candidates' number of trials."""
    from wrapopt.search.study.run import run_study

    g, real, space = _problem()
    return run_study(g, sim or real, space, memory_budget=budget, seeds=[], trials=NUM_CANDIDATES, storage=url,
                     study_name=name, sampler="nsga2", heartbeat_s=HEARTBEAT_S, grace_s=GRACE_S)


class _SlowSimulator:
    """The real simulator, ``TRIAL_DELAY_S`` slower per plan."""

    def __init__(self, sim):
        self._sim = sim

    def simulate(self, plan):
        time.sleep(TRIAL_DELAY_S)
        return self._sim.simulate(plan)

    def __getattr__(self, name):
        return getattr(self._sim, name)


def _worker(url: str, name: str, budget: float) -> None:
    """A worker process (forked from the test, so it starts with the traced model)."""
    _run(url, name, budget, sim=_SlowSimulator(_problem()[1]))


def _study(url: str, name: str):
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna.load_study(study_name=name, storage=_storage(url))


def _trials(url: str, name: str, *states) -> list:
    return _study(url, name).get_trials(deepcopy=False, states=states or None)


def _key(params: dict) -> str:
    return json.dumps(params, sort_keys=True)


def _has_heartbeat(url: str, trial_id: int) -> bool:
    import sqlalchemy

    engine = _storage(url).engine
    with engine.connect() as conn:
        return conn.execute(sqlalchemy.text("SELECT 1 FROM trial_heartbeats WHERE trial_id = :t"),
                            {"t": trial_id}).first() is not None


# --- the tests ---------------------------------------------------------------------------------


def test_two_workers_one_killed_lose_nothing_and_match_one_worker(pg_url):
    from optuna.trial import TrialState

    from wrapopt.search.study.run import run_study

    candidates, budget = _candidates(seed=23)
    g, sim, space = _problem()
    plans = [space.from_params(p) for p in candidates]
    # The reference: one worker, in memory, evaluates the candidates alone.
    single = run_study(g, sim, space, memory_budget=budget, seeds=plans, trials=NUM_CANDIDATES, sampler="nsga2")
    assert single.num_seeds == NUM_CANDIDATES and single.num_trials == NUM_CANDIDATES and single.best is not None

    # Two workers on one study; one is killed inside a trial. The workers are forked:
    # they start at once with the model traced (a fresh interpreter takes seconds).
    _queue(pg_url, "shared", candidates, budget)
    _storage(pg_url).engine.dispose()  # no pooled connection is shared with the children
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_worker, args=(pg_url, "shared", budget)) for _ in range(2)]
    for p in procs:
        p.start()
    try:
        a, b = procs
        names = {p.pid: f"{socket.gethostname()}:{p.pid}" for p in procs}
        deadline = time.monotonic() + 120

        def by(trials, pid):
            return [t for t in trials if t.user_attrs.get("worker") == names[pid]]

        while True:  # both workers have finished trials: they share the study
            done = _trials(pg_url, "shared", TrialState.COMPLETE)
            if by(done, a.pid) and by(done, b.pid):
                break
            assert a.is_alive() and b.is_alive(), "a worker ended early (its traceback is in the captured stderr)"
            assert time.monotonic() < deadline, "the workers did not share the study"
            time.sleep(0.25)
        while True:  # stop a, and kill it if it is inside a trial (with a heartbeat); else let it go on
            os.kill(a.pid, signal.SIGSTOP)
            running = by(_trials(pg_url, "shared", TrialState.RUNNING), a.pid)
            if running and _has_heartbeat(pg_url, running[0]._trial_id):
                os.kill(a.pid, signal.SIGKILL)
                break
            os.kill(a.pid, signal.SIGCONT)
            assert time.monotonic() < deadline, "could not catch the worker inside a trial"
            time.sleep(0.03)
        a.join(timeout=30)
        assert a.exitcode == -signal.SIGKILL
        killed = running[0]
        before = {t.number: (t.params, t.values) for t in _trials(pg_url, "shared", TrialState.COMPLETE)}
        assert len(before) < NUM_CANDIDATES and by(_trials(pg_url, "shared", TrialState.COMPLETE), a.pid)
        b.join(timeout=120)
        assert b.exitcode == 0, "the live worker failed (its traceback is in the captured stderr)"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()

    trials = _trials(pg_url, "shared")
    done = [t for t in trials if t.state == TrialState.COMPLETE]
    # No finished trial lost or changed.
    now = {t.number: (t.params, t.values) for t in done}
    assert all(now.get(n) == v for n, v in before.items())
    # The killed trial was failed by its stale heartbeat and run again, with the same plan.
    assert next(t for t in trials if t.number == killed.number).state == TrialState.FAIL
    retried = [t for t in done if t.system_attrs.get("failed_trial") == killed.number]
    assert len(retried) == 1 and retried[0].user_attrs["worker"] == names[b.pid]
    assert retried[0].params == killed.system_attrs["fixed_params"]
    # Every candidate once, nothing else: the same set as the single worker's, so the same best.
    assert sorted(_key(t.params) for t in done) == sorted(_key(p) for p in candidates)
    assert sorted(map(repr, (space.from_params(t.params).units for t in done))) == \
        sorted(map(repr, (p.units for p in plans)))

    resumed = _run(pg_url, "shared", budget)  # a restarted worker finds the study complete
    assert resumed.num_run_here == 0 and resumed.num_trials == NUM_CANDIDATES
    assert resumed.best.plan.units == single.best.plan.units
    assert resumed.best.plan.mesh == single.best.plan.mesh
    assert resumed.best.plan.forward_prefetch == single.best.plan.forward_prefetch
    assert (resumed.best.estimate.step_s, resumed.best.estimate.peak_bytes) == \
        (single.best.estimate.step_s, single.best.estimate.peak_bytes)
    assert [t.plan.units for t in resumed.pareto] == [t.plan.units for t in single.pareto]


def _cli(argv: list[str]) -> tuple[int, str, str]:
    from wrapopt.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    return rc, out.getvalue(), err.getvalue()


def test_cli_search_resumes_on_postgres_and_hides_the_password(pg_url):
    base = ["search", "zoo:gpt-tiny", "--world-size", "16", "--gpus-per-node", "8", "--storage", pg_url,
            "--study-name", "cli", "--sampler", "nsga2", "--json"]
    rc, out, err = _cli([*base, "--trials", "12"])
    assert rc == 0, err
    study = json.loads(out)["search"]["study"]
    assert study["finished_trials"] == 12 and study["run_here"] == 12
    assert PASSWORD not in out and study["storage"].startswith("postgresql") and "***" in study["storage"]
    rc, out, err = _cli([*base, "--trials", "16"])
    assert rc == 0, err
    study = json.loads(out)["search"]["study"]
    assert study["finished_trials"] == 16 and study["run_here"] == 4  # resumed, not redone

    wrong = pg_url.replace(PASSWORD, "not-the-password")
    rc, out, err = _cli([*base[:-1], "--trials", "5", "--storage", wrong])
    assert rc == 1 and out == ""
    assert "cannot open study 'cli'" in err and "not-the-password" not in err and PASSWORD not in err
    assert len(err.strip().splitlines()) == 1


def test_seeds_enqueued_twice_are_dropped_never_lost():
    """[Note: seeds enqueued twice], on Optuna's in-memory storage: deterministic."""
    import optuna
    from optuna.trial import TrialState

    from wrapopt.search.study.db import drop_duplicate_seeds

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(directions=["minimize", "minimize"])
    seeds = [{"x": i} for i in range(5)]
    for _ in range(2):  # two workers enqueued every seed: numbers 0-4, then 5-9
        for p in seeds:
            study.enqueue_trial(p)
    first = study.ask()  # seed 0, number 0, is evaluated
    study.tell(first, [1.0, 1.0])
    assert drop_duplicate_seeds(study) == 5  # seed 0's queued copy, and the second copy of seeds 1-4
    waiting = study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
    assert sorted((t.number, t.system_attrs["fixed_params"]["x"]) for t in waiting) == [(i, i) for i in range(1, 5)]
    failed = study.get_trials(deepcopy=False, states=(TrialState.FAIL,))
    assert (sorted(t.number for t in failed) == list(range(5, 10))
            and all(t.user_attrs["duplicate_seed"] for t in failed))
    assert drop_duplicate_seeds(study) == 0


def test_two_workers_starting_together_lose_no_seed(pg_url):
    """Two workers open a new study at the same moment; each enqueues the seeds."""
    from optuna.trial import TrialState

    from wrapopt.search.study.run import run_study

    candidates, budget = _candidates(seed=24)
    g, sim, space = _problem()
    plans = [space.from_params(p) for p in candidates[:10]]
    _storage(pg_url).engine.dispose()
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(2)

    def worker():
        barrier.wait(timeout=60)
        run_study(g, sim, space, memory_budget=budget, seeds=plans, trials=20, storage=pg_url,
                  study_name="together", sampler="nsga2")

    procs = [ctx.Process(target=worker) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        if p.is_alive():
            p.kill()
            p.join()
    assert [p.exitcode for p in procs] == [0, 0]
    trials = _trials(pg_url, "together")
    done = [t for t in trials if t.state == TrialState.COMPLETE]
    assert 20 <= len(done) <= 21  # a worker may finish the trial it was running
    seeded = [_key(t.system_attrs["fixed_params"]) for t in done if "fixed_params" in t.system_attrs]
    assert set(seeded) == {_key(space.encode(p)) for p in plans}  # every seed evaluated
    # Mostly once each: a copy is run twice only when a worker takes it before the
    # other worker, still enqueueing, drops it (without the drop: up to every seed twice).
    assert len(seeded) <= len(plans) + 1
    assert all(t.user_attrs.get("duplicate_seed") for t in trials if t.state == TrialState.FAIL)


def test_server_urls_get_a_driver_and_hide_the_password(monkeypatch):
    from wrapopt.errors import WrapoptError
    from wrapopt.search.study import db

    assert db.shown_url("postgresql://u:pw@dbhost:5433/wrapopt") == "postgresql://u:***@dbhost:5433/wrapopt"
    assert db.shown_url("sqlite:////tmp/s.db") == "sqlite:////tmp/s.db" and db.shown_url(None) is None
    assert db._with_driver("postgresql+psycopg2://u@h/d") == "postgresql+psycopg2://u@h/d"  # named: kept
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "psycopg" else None)
    assert db._with_driver("postgresql://u:pw@h/d") == "postgresql+psycopg://u:pw@h/d"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(WrapoptError, match=r"no postgresql driver .*wrapopt\[db\]") as e:
        db._with_driver("postgresql://u:pw@h/d")
    assert "pw" not in str(e.value)
