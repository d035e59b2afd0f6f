"""Shared fixtures: traced tiny zoo models reused by several tests, and the one spawn
of 2 gloo ranks that runs the registered two-rank cases. (The repository root is on
``sys.path`` through pytest's rootdir insertion: ``tests`` is a package, so
``tests.fixtures_models`` works as a CLI ``MODEL`` and ``benchmarks`` imports.)

A test that starts ranks through ``wrapopt.launch.spawn`` (in its body or in one of
its fixtures) must carry ``@pytest.mark.multiprocess``, so that ``make test`` runs it
with the multi-process part; without the marker it fails and says so."""

from __future__ import annotations

import os
import threading

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _NoProcesses:
    """Stands in for ``wrapopt.launch.mp`` while a test without the marker runs."""

    def __init__(self, nodeid: str) -> None:
        self.nodeid = nodeid

    def get_context(self, *args, **kwargs):
        raise AssertionError(
            f"{self.nodeid} starts processes through wrapopt.launch.spawn but is not marked "
            "@pytest.mark.multiprocess; mark it, so that `make test` runs it with the multi-process tests"
        )


def pytest_configure(config):
    """[Note: threads per xdist worker] `make test` runs 2 pytest-xdist workers on the
    machine's cores; each worker's torch would start an intra-op thread per core, and threads of
    one worker spin-wait for each other while the other workers hold the cores (llama-tiny's
    batch-share measurement on 2 busy cores: 13 s of CPU at 2 threads, 0.9 s at 1). So a worker
    runs torch on its share of the cores (at least 1), and the commands its tests start inherit it
    as OMP_NUM_THREADS. The multi-process part runs outside xdist: its ranks set one thread each
    (wrapopt.launch)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if os.environ.get("PYTEST_XDIST_WORKER") and workers > 0:
        threads = max(1, (os.cpu_count() or 1) // workers)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        import torch

        torch.set_num_threads(threads)


_SHARED_SPAWNS = ("two_rank_cases", "four_rank_cases")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """[Note: the parts of make test] A test that reads a shared spawn (``two_rank_cases``,
    ``four_rank_cases``) is marked ``shared_spawn``: those spawns keep every core busy for minutes, so
    `make test` runs them last (side by side: See [Note: the shared spawns side by side]), once the
    other multi-process tests have passed, beside what is left of the single-process part. Those other
    multi-process tests spend much of their time waiting (on timeouts they test, on workers, on a
    server), so they run beside the single-process part from the start.
    This hook runs before pytest's ``-m`` selection (``tryfirst``), which then sees the marker."""
    for item in items:
        if any(name in getattr(item, "fixturenames", ()) for name in _SHARED_SPAWNS):
            item.add_marker(pytest.mark.shared_spawn)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Setup, call and teardown of a test without the ``multiprocess`` marker cannot spawn."""
    if item.get_closest_marker("multiprocess") is not None:
        yield
        return
    from wrapopt import launch

    real = launch.mp
    launch.mp = _NoProcesses(item.nodeid)
    try:
        yield
    finally:
        launch.mp = real


@pytest.fixture(scope="session")
def repo_root() -> str:
    return REPO_ROOT


@pytest.fixture(scope="session")
def gpt_tiny():
    """``(model, inputs, graph)`` for zoo gpt-tiny built on meta (4 blocks, tied wte/lm_head)."""
    from wrapopt.models import zoo
    from wrapopt.trace.meta import trace_model

    model, inputs = zoo.build("gpt-tiny", "meta")
    graph = trace_model(model, inputs, loss_fn=zoo.ZOO["gpt-tiny"].loss)
    return model, inputs, graph


@pytest.fixture(scope="session")
def llama_tiny():
    """``(model, inputs, graph)`` for zoo llama-tiny built on meta (6 blocks, no ties)."""
    from wrapopt.models import zoo
    from wrapopt.trace.meta import trace_model

    model, inputs = zoo.build("llama-tiny", "meta")
    graph = trace_model(model, inputs, loss_fn=zoo.ZOO["llama-tiny"].loss)
    return model, inputs, graph


class _Spawn(threading.Thread):
    """One shared spawn, run in a thread of its own (daemon: an interrupted session does not wait for it)."""

    def __init__(self, fn, *args) -> None:
        super().__init__(daemon=True)
        self.fn, self.args, self.result, self.error = fn, args, None, None

    def run(self) -> None:
        try:
            self.result = self.fn(*self.args)
        except BaseException as e:  # re-raised in the fixture that reads it
            self.error = e

    def get(self):
        self.join()
        if self.error is not None:
            raise self.error
        return self.result


_STARTED: dict[str, _Spawn] = {}


def _shared_spawn(request, name: str):
    """[Note: the shared spawns side by side] The first test that reads a shared spawn starts every
    shared spawn the session's tests read, each in a thread: the 2-rank spawn's ranks wait on each
    other often (rank 0 searches while rank 1 waits in a broadcast), and the 4-rank spawn's fill those
    gaps, so both end sooner together (same CPU, the cores kept busy). Each fixture then waits for its own."""
    if not _STARTED:
        from tests.ranks import spawn_cases, spawn_four

        wanted = {n for item in request.session.items for n in _SHARED_SPAWNS if n in getattr(item, "fixturenames", ())}
        wanted.add(name)
        if "four_rank_cases" in wanted:
            _STARTED["four_rank_cases"] = _Spawn(spawn_four)
        if "two_rank_cases" in wanted:
            tmp = str(request.getfixturevalue("tmp_path_factory").mktemp("ranks"))
            _STARTED["two_rank_cases"] = _Spawn(spawn_cases, tmp)
        for spawn in _STARTED.values():
            spawn.start()
    return _STARTED[name].get()


@pytest.fixture(scope="session")
def two_rank_cases(request) -> list[dict]:
    """Every ``@two_rank_case`` of the collected test modules, run in one spawn of 2 gloo
    ranks (See tests/ranks.py): each rank's dict of results, by rank."""
    out = _shared_spawn(request, "two_rank_cases")
    _SPAWNS["2 ranks"] = out[0].get("case_s", {})
    return out


@pytest.fixture(scope="session")
def four_rank_cases(request) -> list[dict]:
    """Every ``@four_rank_case`` of the collected test modules, run in one spawn of 4 gloo
    ranks (See tests/ranks.py): by rank, each module's dict of results."""
    out = _shared_spawn(request, "four_rank_cases")
    _SPAWNS["4 ranks"] = out[0].get("case_s", {})
    return out


_SPAWNS: dict[str, dict[str, float]] = {}  # rank 0's seconds per case of each shared spawn that ran


def pytest_terminal_summary(terminalreporter):
    """Where the shared spawns' time went: rank 0's seconds per case, slowest first."""
    for spawn, case_s in _SPAWNS.items():
        terminalreporter.write_sep("-", f"shared spawn of {spawn}: {sum(case_s.values()):.1f} s in its cases")
        for name, s in sorted(case_s.items(), key=lambda kv: -kv[1]):
            terminalreporter.write_line(f"{s:8.2f}s  {name}")
