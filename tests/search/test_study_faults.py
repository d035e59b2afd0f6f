"""Study storages under faults (issue 33): a worker killed holding the journal lock, a study
resumed after kill -9 (same Pareto front as an uninterrupted run), two workers on one seed
(no repeated trials), and damaged storage files (one line naming the file)."""

from __future__ import annotations

import fcntl
import math
import os
import signal
import socket
import subprocess
import sys

import optuna
import pytest

from tests.search.common import zoo_graph
from wrapopt.cost import Simulator
from wrapopt.errors import WrapoptError
from wrapopt.hardware.presets import analytical_compute, analytical_fabric
from wrapopt.search.study.run import open_storage, run_study, storage_url
from wrapopt.search.study.seeding import per_trial_seed_sampler
from wrapopt.search.study.space import SearchSpace
from wrapopt.spec import MeshSpec


@pytest.fixture(scope="module")
def gpt():
    g = zoo_graph("gpt-tiny")
    mesh = MeshSpec(world_size=16, ranks_per_node=8, shard_size=16)
    return g, SearchSpace(g, mesh), Simulator(g, analytical_fabric(world_size=16), analytical_compute())


def _run(gpt, path: str, trials: int, **kw):
    g, space, sim = gpt
    return run_study(g, sim, space, memory_budget=math.inf, seeds=[], trials=trials, storage=path, study_name="s",
                     sampler="tpe", seed=3, **kw)


def _front(outcome) -> list:
    return [(r.plan.units, r.estimate.step_s) for r in outcome.pareto]


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_resumed_study_after_kill_9_has_the_uninterrupted_pareto_front(gpt, tmp_path):
    whole = _run(gpt, str(tmp_path / "whole.journal"), 24)
    path = str(tmp_path / "killed.journal")
    _run(gpt, path, 10)
    # what kill -9 leaves: a RUNNING trial of a worker on this host that is gone, half sampled
    study = optuna.load_study(study_name="s", storage=open_storage(storage_url(path)))
    trial = study.ask()
    trial.set_user_attr("worker", f"{socket.gethostname()}:{_dead_pid()}")
    gpt[1].suggest(trial)
    resumed = _run(gpt, path, 24)
    assert resumed.num_trials == 24 and resumed.num_run_here == 14
    assert _front(resumed) == _front(whole)


def test_two_workers_on_one_seed_do_not_repeat_trials(gpt, tmp_path):
    _, space, sim = gpt
    storage = open_storage(storage_url(str(tmp_path / "two.journal")))
    studies = [optuna.create_study(storage=storage, study_name="s", directions=["minimize", "minimize"],
                                   load_if_exists=True,
                                   sampler=per_trial_seed_sampler(optuna.samplers.TPESampler(seed=0), 0))
               for _ in range(2)]
    same = 0
    for _ in range(12):  # in lockstep: each asks while the other's trial runs (one seed: all 12 were equal)
        trials = [s.ask() for s in studies]
        plans = [space.suggest(t) for t in trials]
        same += plans[0].units == plans[1].units
        for s, t, p in zip(studies, trials, plans):
            est = sim.simulate(p)
            s.tell(t, [est.step_s, float(est.peak_bytes)])
    assert same == 0
    seeds = [t.system_attrs["sampler_seed"] for t in studies[0].get_trials()]
    assert len(set(seeds)) == len(seeds)  # recorded, one per trial


def test_worker_killed_holding_the_journal_lock_does_not_stall_the_next(gpt, tmp_path, repo_root):
    path = str(tmp_path / "lock.journal")
    _run(gpt, path, 3)
    child = ("import os, signal\nfrom wrapopt.search.study.run import open_storage, storage_url\n"
             f"st = open_storage(storage_url({path!r}))\nst._backend._lock.acquire()\n"
             "os.kill(os.getpid(), signal.SIGKILL)\n")
    env = dict(os.environ, PYTHONPATH=repo_root)
    assert subprocess.run([sys.executable, "-c", child], env=env, timeout=60).returncode == -signal.SIGKILL
    # Optuna's lock file stayed behind, and the next worker waited out a 30 s grace period for it
    assert not os.path.exists(path + ".lock")
    fd = os.open(path + ".flock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free at once: the kernel dropped the dead holder's lock
    finally:
        os.close(fd)
    assert _run(gpt, path, 6).num_trials == 6


def test_torn_last_journal_line_is_cut_and_the_study_resumes(gpt, tmp_path):
    path = str(tmp_path / "torn.journal")
    _run(gpt, path, 4)
    with open(path, "ab") as f:
        f.write(b'{"op_code": 4, "worker_id": "x", "trial_id": 3, "sta')  # killed mid-append
    assert _run(gpt, path, 7).num_trials == 7


@pytest.mark.parametrize("name, junk", [
    ("bad.journal", b'{"op_code": 0, "study_name": "s"}\nnot json at all\n{"op_code": 1}\n'),
    ("bad.db", b"SQLite format 2\x00" + b"\x13" * 4000),
])
def test_damaged_storage_file_is_one_line_naming_it(gpt, tmp_path, name, junk):
    path = str(tmp_path / name)
    with open(path, "wb") as f:
        f.write(junk)
    with pytest.raises(WrapoptError) as e:
        _run(gpt, path, 3)
    msg = str(e.value)
    assert "\n" not in msg and path in msg and "move it aside" in msg, msg
