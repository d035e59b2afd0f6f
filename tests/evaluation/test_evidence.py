"""The verdict logic of `wrapopt bench`: which plans fit, which are re-measured, and the ratios."""

from __future__ import annotations

import pytest

from wrapopt.evaluation.bench import Measured
from wrapopt.evaluation.evaluate import _confirm_set
from wrapopt.evaluation.stats import paired_ratio, spearman
from wrapopt.evaluation.evidence import CAUSES, diagnose, fmt_diagnosis, judge
from wrapopt.spec import MeshSpec, PlanSpec


def _m(step_ms: float, peak_mib: float) -> Measured:
    return Measured("x", step_ms / 1e3, (step_ms / 1e3,), 0.1, int(peak_mib * 2**20), ())


def _plans(labels):
    mesh = MeshSpec(world_size=2, ranks_per_node=2, shard_size=2)
    return [PlanSpec((), mesh, label=label) for label in labels]


def test_confirm_set_takes_fastest_fitting_plans_wrapopts_and_the_best_fitting_baseline():
    plans = _plans(["wrapopt:dp", "per-block", "size-1e8", "[2+2]", "[1+3]", "[4]"])
    measured = [_m(12, 9), _m(15, 9), _m(8, 20), _m(10, 9), _m(11, 9), _m(7, 30)]
    budgets = [{"name": "tight", "bytes": 10 * 2**20}, {"name": "loose", "bytes": float("inf")}]
    picks = _confirm_set(plans, measured, budgets, {0: ["tight"]}, top=2)
    # tight: [2+2], [1+3] fastest fitting; per-block the only fitting baseline; loose: [4], size-1e8.
    assert picks == [0, 1, 2, 3, 4, 5]
    picks = _confirm_set(plans, measured, budgets[:1], {0: ["tight"]}, top=1)
    assert picks == [0, 1, 3]  # size-1e8 is faster but does not fit the tight budget


def _row(plan, step_ms, peak_mib, *, chosen_for=(), confirmed=False, pred_ms=None, pred_peak_mib=None,
         scored_for=("tight", "loose")):
    return {"plan": plan, "meas_step_s": step_ms / 1e3, "meas_peak_bytes": peak_mib * 2**20, "meas_spread": 0.2,
            "chosen_for": list(chosen_for), "confirmed": confirmed,
            "pred_step_s": (step_ms if pred_ms is None else pred_ms) / 1e3,
            "pred_peak_bytes": (peak_mib if pred_peak_mib is None else pred_peak_mib) * 2**20,
            "scored_for": list(scored_for)}


def test_judge_compares_fitting_plans_by_measured_peak():
    res = {"budgets": [{"name": "tight", "bytes": 10 * 2**20, "why": ""},
                       {"name": "loose", "bytes": float("inf"), "why": ""}],
           "rows": [_row("wrapopt:a", 11, 9, chosen_for=["tight"]), _row("per-block", 13, 9), _row("[2+2]", 10, 9.5),
                    _row("size-1e8", 8, 11), _row("wrapopt:b", 8.8, 12, chosen_for=["loose"])]}
    tight, loose = judge(res)
    assert (tight["best_baseline"], tight["optimum"]) == ("per-block", "[2+2]")
    assert tight["vs_best_baseline"] == pytest.approx(11 / 13) and tight["vs_optimum"] == pytest.approx(1.1)
    assert tight["num_fit"] == 3 and tight["wrapopt_fits"]
    assert (loose["best_baseline"], loose["optimum"]) == ("size-1e8", "size-1e8")
    assert loose["vs_optimum"] == pytest.approx(1.1)


def test_judge_after_confirmation_compares_only_the_rows_of_that_round():
    # [2+2] looked fastest in the screening round but was not re-measured; the verdict
    # uses the confirmed rows, whose times come from one round.
    res = {"budgets": [{"name": "loose", "bytes": float("inf"), "why": ""}],
           "rows": [_row("wrapopt:a", 10, 9, chosen_for=["loose"], confirmed=True), _row("[2+2]", 6, 9),
                    _row("size-1e8", 9.5, 9, confirmed=True)]}
    (v,) = judge(res)
    assert v["optimum"] == "size-1e8" and v["vs_optimum"] == pytest.approx(10 / 9.5)


# --- the diagnosis: See [Note: diagnosis] in wrapopt/evaluation/evidence.py -------------------------

TIGHT = 10 * 2**20


def _why(mine, contender, noise=None):
    d = diagnose(mine, contender, budget="tight", budget_bytes=TIGHT, noise=noise)
    return d and d["cause"]


def test_diagnose_memory_predicted_too_high():
    mine = _row("wrapopt:a", 11, 9, chosen_for=["tight"])
    # Measured at 9.5 MiB (fits), predicted at 10.5 MiB (over): the search excluded it for memory.
    assert _why(mine, _row("[3+3]", 10, 9.5, pred_ms=9, pred_peak_mib=10.5)) == "memory"


def test_diagnose_time_mispredicted():
    mine = _row("wrapopt:a", 11, 9, pred_ms=8)
    # Predicted to fit, predicted slower than wrapopt's plan (9 > 8 ms), measured faster.
    assert _why(mine, _row("[3+3]", 10, 9.5, pred_ms=9)) == "time"
    assert _why(mine, _row("[3+3]", 10, 9.5, pred_ms=8)) == "time"  # a tie is not a preference


def test_diagnose_not_in_the_search_space_and_what_the_simulator_thinks():
    mine = _row("wrapopt:a", 11, 9, pred_ms=10)
    d = diagnose(mine, _row("uniform-3", 10, 9.5, pred_ms=9, scored_for=["loose"]), budget="tight", budget_bytes=TIGHT)
    assert d["cause"] == "not searched" and d["simulator"] == "predicted to fit and faster"
    assert d["ratio"] == pytest.approx(1.1) and d["pred_ratio"] == pytest.approx(10 / 9)
    d = diagnose(mine, _row("uniform-3", 10, 9.5, pred_peak_mib=11, scored_for=()), budget="tight", budget_bytes=TIGHT)
    assert d["cause"] == "not searched" and d["simulator"] == "predicted peak over budget"
    assert "not searched" in fmt_diagnosis(d) and "uniform-3" in fmt_diagnosis(d)


def test_diagnose_wrapopt_over_budget_and_other():
    assert _why(_row("wrapopt:a", 11, 10.5), _row("[3+3]", 10, 9.5)) == "over budget"
    # Over budget is reported even where the plan was faster than every plan that fits.
    assert _why(_row("wrapopt:a", 9, 10.5), _row("[3+3]", 10, 9.5), noise=(1.0, 0.9, 1.1)) == "over budget"
    # Scored, predicted to fit and faster, not chosen: the search itself is at fault.
    assert _why(_row("wrapopt:a", 11, 9, pred_ms=10), _row("[3+3]", 10, 9.5, pred_ms=9)) == "other"
    assert set(CAUSES) == {"memory", "time", "not searched", "over budget", "other"}


def test_diagnose_nothing_when_not_measurably_slower():
    mine = _row("wrapopt:a", 10.3, 9, pred_ms=8)
    other = _row("[3+3]", 10, 9.5, pred_ms=9)
    assert _why(mine, other) == "time"  # 1.03 with no A/A interval: any loss counts
    assert _why(mine, other, noise=(1.0, 0.96, 1.05)) is None  # inside the A/A interval
    assert _why(mine, other, noise=(1.0, 0.99, 1.02)) == "time"
    # An interval that misses 1.00 reaches as far on its other side: 0.81 is 0.19 from 1.00.
    assert _why(mine, other, noise=(0.9, 0.81, 0.98)) is None
    assert _why(_row("wrapopt:a", 9, 9), other) is None  # faster


def test_judge_carries_the_diagnosis_per_budget():
    res = {"budgets": [{"name": "tight", "bytes": TIGHT, "why": ""},
                       {"name": "loose", "bytes": float("inf"), "why": ""}],
           "rows": [_row("wrapopt:a", 11, 9, chosen_for=["tight", "loose"]),
                    _row("[2+2]", 10, 9.5, pred_peak_mib=10.5, pred_ms=9)]}
    tight, loose = judge(res, noise=(1.0, 0.98, 1.02))
    assert tight["diagnosis"]["cause"] == "memory" and tight["diagnosis"]["contender"] == "[2+2]"
    assert loose["diagnosis"]["cause"] == "other"  # no budget: it fitted, was faster, scored
    assert judge(res, noise=(1.0, 0.9, 1.2))[0]["diagnosis"] is None


def test_spearman_handles_ties_and_reversal():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 1, 2], [5, 5, 6]) == pytest.approx(1.0)


def test_paired_ratio_cancels_drift_between_rounds():
    import statistics

    # The machine slows down round by round (1x, 2x, 3x); plan A is 5% slower than
    # B in every round, except that B's first step was hit by a stall. The ratio of
    # the medians says A is faster; the median of the per-round ratios does not.
    a = [1.05, 2.1, 3.15]
    b = [2.5, 2.0, 3.0]
    assert statistics.median(a) / statistics.median(b) < 0.9
    med, lo, hi = paired_ratio(a, b)
    assert med == pytest.approx(1.05) and lo <= med <= hi
    assert paired_ratio([1.05 * x for x in (1.0, 2.0, 3.0)], [1.0, 2.0, 3.0]) == pytest.approx((1.05, 1.05, 1.05))
    noisy = paired_ratio([1.0, 1.2, 0.9, 1.1, 1.3, 1.0], [1.0] * 6)
    assert noisy[1] <= noisy[0] <= noisy[2] and noisy[1] < noisy[2]
    assert paired_ratio([1.0, 1.2, 0.9, 1.1, 1.3, 1.0], [1.0] * 6) == noisy  # seeded: the same interval every time
    with pytest.raises(ValueError, match="equal"):
        paired_ratio([1.0, 2.0], [1.0])


def test_noise_floor_compares_the_a_a_copy_with_the_original_round_by_round():
    from wrapopt.evaluation.stats import noise_floor

    assert noise_floor({"rows": []}) is None  # no confirmation round, no A/A copy
    base = [1.0, 2.0, 1.5, 3.0, 1.2]  # the machine's speed drifts between rounds
    same = noise_floor({"aa": {"plan": "p", "times_s": list(base), "of_times_s": list(base)}})
    assert same == pytest.approx((1.0, 1.0, 1.0))
    slower = noise_floor({"aa": {"plan": "p", "times_s": [1.1 * x for x in base], "of_times_s": base}})
    assert slower[0] == pytest.approx(1.1)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 7, 10])
def test_round_order_puts_every_plan_in_every_place_and_after_every_other(n):
    from wrapopt.evaluation.bench import round_order

    rounds = [round_order(n, r) for r in range(n)]
    assert all(sorted(o) == list(range(n)) for o in rounds)  # each round runs every plan once
    for place in range(n):  # over n rounds each plan takes every place once
        assert sorted(o[place] for o in rounds) == list(range(n))
    if n % 2 == 0:  # and (n even) directly follows every other plan once
        pairs = [(o[k], o[k + 1]) for o in rounds for k in range(n - 1)]
        assert sorted(pairs) == sorted((a, b) for a in range(n) for b in range(n) if a != b)
    assert round_order(n, n) == rounds[0]


def test_place_effect_finds_a_slow_first_place_and_nothing_where_there_is_none():
    from wrapopt.evaluation.bench import round_order
    from wrapopt.evaluation.stats import place_effect

    n, warmup, repeats = 5, 2, 10
    base = [0.1 * (i + 1) for i in range(n)]  # plans of different speeds

    def run(first_penalty: float) -> dict:
        times = [[0.0] * repeats for _ in range(n)]
        for k in range(repeats):
            for place, i in enumerate(round_order(n, k + warmup)):
                times[i][k] = base[i] * (first_penalty if place == 0 else 1.0)
        return {"screen_warmup": warmup, "rows": [{"screen_times_s": t} for t in times]}

    assert place_effect(run(1.0)) == pytest.approx([1.0] * n)
    slow_first = place_effect(run(1.3))
    assert slow_first[0] == pytest.approx(1.3) and slow_first[1:] == pytest.approx([1.0] * (n - 1))
    assert place_effect({"rows": [{"screen_times_s": [1.0]}]}) is None  # not recorded
