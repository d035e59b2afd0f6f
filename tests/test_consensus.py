"""consensus.py: agree() and every_rank() on 2 gloo ranks, in the shared spawn (See
tests/ranks.py), and their no-op form outside a process group."""

from __future__ import annotations

import pytest
import torch

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
    # The group still works after a reported failure: the exchange consumed it cleanly.
    out["after"] = catch(lambda: agree("after a failure", same), RanksDisagreeError)


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


def test_outside_a_process_group_they_are_plain_code():
    agree("anything", {"a": 1})
    with pytest.raises(ValueError, match="boom"):  # the rank's own error, unchanged
        with every_rank("local work"):
            raise ValueError("boom")


def test_input_facts_names_shapes_and_dtypes():
    x = (torch.zeros(2, 8, dtype=torch.long), {"mask": torch.ones(2, 8, dtype=torch.bool)}, None, 3)
    assert input_facts(x) == [[[2, 8], "int64"], {"mask": [[2, 8], "bool"]}, None, 3]
