"""consensus.py: agree() and every_rank() on 2 gloo ranks, in the shared spawn (See
tests/ranks.py), and their no-op form outside a process group."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from tests.ranks import catch, two_rank_case
from wrapopt.consensus import agree, every_rank, input_facts
from wrapopt.errors import RankFailedError, RanksDisagreeError


@two_rank_case
def consensus_cases(rank: int, world: int, tmp: str, out: dict) -> None:
    same = {"world_size": world, "inputs": input_facts((torch.zeros(2, 3, dtype=torch.long),))}
    out["agree/same"] = catch(lambda: agree("testing", same), RanksDisagreeError)
    differ = {"world_size": world, "inputs": input_facts((torch.zeros(2, 3 + rank),)), "layers": 4 + rank}
    out["agree/differ"] = catch(lambda: agree("testing", differ), RanksDisagreeError)

    def fails_on_rank_1() -> None:
        with every_rank("tracing the model"):
            if rank == 1:
                raise ValueError("forward failed in layers.3")

    out["every/one"] = catch(fails_on_rank_1, RankFailedError)
    try:
        fails_on_rank_1()
    except RankFailedError as e:
        out["every/cause"] = type(e.__cause__).__name__ if e.__cause__ is not None else None
        out["every/ranks"] = list(e.ranks)

    def fine() -> None:
        with every_rank("reading the plan"):
            pass

    out["every/none"] = catch(fine, RankFailedError)

    def fails_everywhere() -> None:
        with every_rank("reading the plan"):
            raise KeyError(f"rank {rank}'s own")

    out["every/all"] = catch(fails_everywhere, KeyError)
    _apply_cases(rank, out)
    _profile_case(rank, out)
    # The group still works after a reported failure: the exchange consumed it cleanly.
    out["after"] = catch(lambda: agree("after a failure", same), RanksDisagreeError)


def _mlp(n: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(4, 4) for _ in range(n)])


def _apply_cases(rank: int, out: dict) -> None:
    """Rank 1 is given a model with one more layer than rank 0 (and than the plan's)."""
    from wrapopt.errors import WrapoptError
    from wrapopt.fingerprint import model_fingerprint
    from wrapopt.plan.file import WrapPlan
    from wrapopt.spec import ROOT, MeshSpec, PlanSpec, UnitSpec

    spec = PlanSpec(units=(UnitSpec(("0",)), UnitSpec(("1",)), UnitSpec((ROOT,), reshard_after_forward=False)),
                    mesh=MeshSpec(world_size=2, ranks_per_node=2, shard_size=2))
    plan = WrapPlan(spec=spec, model=model_fingerprint(_mlp(2)))
    out["apply/strict"] = catch(lambda: plan.apply(_mlp(2 + rank)), WrapoptError)
    out["apply/names-only"] = catch(lambda: plan.apply(_mlp(2 + rank), strict=False), WrapoptError)


class _FailsOnRank1(nn.Module):
    def __init__(self, rank: int):
        super().__init__()
        self.rank, self.lin = rank, nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rank == 1:
            raise RuntimeError("CUDA error: an illegal memory access (rank 1's forward)")
        return self.lin(x)


def _profile_case(rank: int, out: dict) -> None:
    """Rank 1's model raises in forward while the compute profile times it."""
    from wrapopt.errors import WrapoptError
    from wrapopt.hardware.measure_device import measure_compute

    model, inputs = _FailsOnRank1(rank), (torch.ones(2, 4),)
    out["profile/forward"] = catch(lambda: measure_compute(model=model, example_inputs=inputs, repeats=1),
                                   WrapoptError)


pytestmark_mp = pytest.mark.multiprocess


@pytestmark_mp
def test_agree_names_the_ranks_and_what_differs(two_rank_cases):
    for r in two_rank_cases:
        assert r["agree/same"] is None and r["after"] is None
        msg = r["agree/differ"]
        assert msg is not None and msg.startswith("RanksDisagreeError: the ranks disagree while testing")
        assert "layers: rank 0 has 4, rank 1 has 5" in msg
        assert "inputs:" in msg and "world_size" not in msg  # only what differs
    assert two_rank_cases[0]["agree/differ"] == two_rank_cases[1]["agree/differ"]  # the same line everywhere


@pytestmark_mp
def test_every_rank_hears_of_a_local_failure(two_rank_cases):
    for rank, r in enumerate(two_rank_cases):
        assert r["every/one"] == ("RankFailedError: rank 1 failed while tracing the model: "
                                  "ValueError: forward failed in layers.3")
        assert r["every/ranks"] == [1]
        assert r["every/cause"] == ("ValueError" if rank == 1 else None)
        assert r["every/none"] is None
        assert r["every/all"] == f"KeyError: \"rank {rank}'s own\""  # all failed: each its own error


def test_outside_a_process_group_they_are_plain_code():
    agree("anything", {"a": 1})
    with pytest.raises(ValueError, match="boom"):  # the rank's own error, unchanged
        with every_rank("local work"):
            raise ValueError("boom")


def test_input_facts_names_shapes_and_dtypes():
    x = (torch.zeros(2, 8, dtype=torch.long), {"mask": torch.ones(2, 8, dtype=torch.bool)}, None, 3)
    assert input_facts(x) == [[[2, 8], "int64"], {"mask": [[2, 8], "bool"]}, None, 3]


@pytestmark_mp
def test_apply_on_ranks_given_different_models_fails_on_every_rank_naming_it(two_rank_cases):
    a, b = two_rank_cases
    assert a["apply/strict"] == b["apply/strict"]
    assert a["apply/strict"].startswith("RankFailedError: rank 1 failed while checking the plan file against the "
                                        "model: PlanMismatchError")
    # Without the fingerprint check each rank's names exist: the ranks compare what they hold.
    assert a["apply/names-only"] == b["apply/names-only"]
    assert a["apply/names-only"].startswith("RanksDisagreeError: the ranks disagree while applying the plan: model:")


@pytestmark_mp
def test_a_forward_that_fails_on_one_rank_while_profiling_is_named_on_every_rank(two_rank_cases):
    a, b = two_rank_cases
    assert a["profile/forward"] == b["profile/forward"]
    assert a["profile/forward"].startswith("RankFailedError: rank 1 failed while running the model to time its "
                                           "modules: RuntimeError: CUDA error")
