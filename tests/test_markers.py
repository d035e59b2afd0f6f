"""The ``multiprocess`` marker is kept honest: a test without it cannot start ranks
(See tests/conftest.py), so ``make test``'s single-process part stays single-process."""

from __future__ import annotations

import pytest

from wrapopt.launch import spawn


def _never_runs(rank: int, world: int) -> int:
    return rank


def test_an_unmarked_test_cannot_spawn_and_is_told_to_take_the_marker(request) -> None:
    with pytest.raises(AssertionError) as err:
        spawn(_never_runs, world_size=2, timeout_s=5)
    assert request.node.nodeid in str(err.value) and "@pytest.mark.multiprocess" in str(err.value)
