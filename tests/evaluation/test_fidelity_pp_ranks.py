"""The pipeline fidelity benchmark's worker (benchmarks/fidelity_pp.py) on 4 gloo ranks, in the
shared spawn of 4 ranks (See tests/ranks.py), on 3 of its plans (one without a pipeline, two
with: 1F1B and GPipe on 2 stages x 2 data-parallel ranks), 1 repeat and no warm-up, analytical profiles
instead of measured ones: the rows and the summary have their figures. Structure only; the
fidelity itself is the benchmark's (results/fidelity_pp.md). On gpt-tiny (tied head on both
stages): the worker traces the model and each pipeline plan exports it again on every rank, and
gpt-tiny's torch.export takes a fifth of llama-tiny's."""

from __future__ import annotations

import math

import pytest

from benchmarks.fidelity_pp import AA_LABEL, render, summarize, worker
from tests.ranks import four_rank_case

pytestmark = pytest.mark.multiprocess

ONLY = ["groups-of-2", "pp2 1F1B m2", "pp2 GPipe m4"]


@four_rank_case
def fidelity_pp_case(rank: int, world: int, out: dict) -> None:
    cfg = {"model": "gpt-tiny", "repeats": 1, "warmup": 0, "memory": False, "only": ONLY, "measure": False}
    out["run"] = worker(rank, world, cfg)


@pytest.fixture(scope="module")
def run(four_rank_cases) -> dict:
    assert [r[__name__]["run"] for r in four_rank_cases[1:]] == [None, None, None]
    return four_rank_cases[0][__name__]["run"]


def test_rows_hold_both_pipeline_degrees_with_positive_times(run):
    rows = run["rows"]
    assert [r["plan"] for r in rows] == ONLY
    assert [r["pp"] for r in rows] == [1, 2, 2]
    assert [r["microbatches"] for r in rows] == [1, 2, 4]
    for r in rows:
        assert r["pred_step_s"] > 0 and r["meas_step_s"] > 0
        assert len(r["meas_times_s"]) == 1 and all(t > 0 for t in r["meas_times_s"])
        assert r["meas_phase_s"]["fwd_bwd"] > 0 and r["meas_phase_s"]["optim"] > 0 and r["cpu_use"] > 0
    assert run["aa"]["plan"] in ONLY and len(run["aa"]["times_s"]) == 1
    assert run["machine"]["world_size"] == 4


def test_summary_has_spearman_and_the_fastest(run):
    s = summarize(run)
    assert s["plans"] == 3 and not math.isnan(s["spearman"]) and -1 <= s["spearman"] <= 1
    assert s["pred_fastest"] in ONLY and s["meas_fastest"] in ONLY
    assert s["pred_fastest_over_meas_fastest"] >= 1.0
    text = render([run], [s], date="d", wall=1.0, command="c", load={"start": "0", "end": "0"}, repeats=1, warmup=0)
    assert "| zoo:gpt-tiny | 3 |" in text and "pp2 GPipe m4" in text and AA_LABEL not in text.split("##")[1]
