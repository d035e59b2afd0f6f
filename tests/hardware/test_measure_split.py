"""measure_split_efficiency: the projections a TPSpec splits, timed whole and split."""

from __future__ import annotations

from wrapopt import zoo
from wrapopt.hardware.measure_split import measure_split_efficiency
from wrapopt.tp import builtin_tp_plan
from wrapopt.trace import trace_model


def test_split_efficiency_per_degree_that_divides():
    model, x = zoo.build("llama-tiny", "meta")
    g = trace_model(model, x)
    spec = builtin_tp_plan(g)
    eff = dict(measure_split_efficiency(g, spec, (1, 2, 3), repeats=1))
    # 1 is not a split; 3 divides no projection of width 64; 2 is measured
    assert set(eff) == {2}
    assert 0.05 < eff[2] < 20
