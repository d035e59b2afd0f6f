"""Shared fixtures: the repository root on ``sys.path`` (so ``tests.fixtures_models``
imports and works as a CLI ``MODEL``), traced tiny zoo models reused by several
tests, and the one spawn of 2 gloo ranks that runs the registered two-rank cases."""

from __future__ import annotations

import os
import sys

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)


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


@pytest.fixture(scope="session")
def two_rank_cases(tmp_path_factory) -> list[dict]:
    """Every ``@two_rank_case`` of the collected test modules, run in one spawn of 2 gloo
    ranks (See tests/ranks.py): each rank's dict of results, by rank."""
    from tests.ranks import spawn_cases

    return spawn_cases(str(tmp_path_factory.mktemp("ranks")))
