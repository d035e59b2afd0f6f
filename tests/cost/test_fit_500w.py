"""The 500 W H100 preset's four constants, fitted jointly on four named TorchTitan rows: See [Note: the
TorchTitan fit] in benchmarks/torchtitan_fit.py. The fit itself takes minutes (four rows, a Jacobian);
these check what it ships and which rows it names, in milliseconds."""

from __future__ import annotations

import math

from benchmarks.torchtitan_fit import FIELDS, _solve, fit_rows
from benchmarks.torchtitan_rows import FLAGS
from wrapopt.hardware.catalog import GPUS


def test_the_500w_constants_are_plausible_fractions_of_peak():
    f = GPUS["h100-hbm2e-500w"].fitted
    assert 0 < f.matmul_fraction <= 1 and 0 < f.attention_fraction <= 0.6
    assert f.float8_fraction * f.matmul_fraction <= 1  # FP8 GEMMs at or under the FP8 peak
    assert "Table 2" in f.fitted_on and "Table 1" in f.knobs_fitted_on


def test_the_h100_sxm_keeps_its_llm_foundry_fit_and_the_three_row_knobs():
    sxm, w500 = GPUS["h100-sxm"].fitted, GPUS["h100-hbm2e-500w"].fitted
    assert "llm-foundry" in sxm.fitted_on and "TorchTitan" not in sxm.fitted_on
    assert "three-row" in sxm.knobs_fitted_on and sxm.attention_fraction != w500.attention_fraction
    for name in ("h100-nvl", "h200"):
        assert GPUS[name].fitted.float8_fraction == sxm.float8_fraction


def test_the_fit_names_four_rows_one_constant_each():
    rows = fit_rows()
    assert [r[1] for r in rows] == list(FIELDS)
    name, _field, world, flags, current, tps, tokens = rows[3]
    assert "32768" in name and world == 8 and flags[flags.index("--seq") + 1] == "32768"
    assert "--cp" not in flags and "full AC" in current and tokens == 8 * 32768 and tps == 3890
    assert FLAGS[FLAGS.index("--seq") + 1] == "8192" and all("--seq" not in r[3] for r in rows[:3])  # Table 1: 8192


def test_the_newton_step_solves_the_linear_system():
    a = [[2.0, 0.5, 0.0, 0.3], [0.1, 3.0, 0.2, 0.0], [0.0, 0.4, 1.5, 0.2], [0.3, 0.0, 0.1, 1.0]]
    x = [0.5, -1.0, 2.0, 0.25]
    b = [sum(r[j] * x[j] for j in range(4)) for r in a]
    assert all(math.isclose(u, v, abs_tol=1e-12) for u, v in zip(_solve(a, b), x))
