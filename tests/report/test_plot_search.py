"""The two pictures of a real search (gpt-tiny on meta shapes, 2 ranks, a budget some plans miss),
read back from the figures: every number drawn is the table's (``format_report``: the choice and
each baseline, predicted step and peak), and the axes hold every plan that fits."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("matplotlib")

from wrapopt.cost import Simulator  # noqa: E402
from wrapopt.evaluation.pictures import picture_parts, pictures_json  # noqa: E402
from wrapopt.hardware.presets import analytical_compute, analytical_fabric  # noqa: E402
from wrapopt.report.choice import format_report  # noqa: E402
from wrapopt.report.pareto import pareto_figure  # noqa: E402
from wrapopt.report.plots import fmt_seconds, timeline_figure  # noqa: E402
from wrapopt.search.driver import search_plan  # noqa: E402
from wrapopt.spec import MeshSpec  # noqa: E402

MESH = MeshSpec(world_size=2, ranks_per_node=2, shard_size=2)
UNITS = {"s": 1.0, "ms": 1e-3, "µs": 1e-6, "GiB": 2**30, "MiB": 2**20, "KiB": 2**10}
BUDGET = 11 * 2**20


@pytest.fixture(scope="module")
def searched(gpt_tiny):
    _model, _inputs, graph = gpt_tiny
    fabric, compute = analytical_fabric(world_size=2, ranks_per_node=2), analytical_compute()
    sim = Simulator(graph, fabric, compute)
    result = search_plan(graph, sim, MESH, memory_budget=BUDGET)
    pics = json.loads(json.dumps(pictures_json(sim, result, result.best.plan)))  # travels as JSON
    return result, pics, format_report(result, fabric, compute, MESH)


def _unit(label: str) -> float:
    return UNITS[label.rsplit("(", 1)[1].rstrip(")")]


def _names(label: str) -> list[str]:
    """The plans a label names: "root-only = size-1e8: 13.3 MiB, 594 µs"; a name may carry its degrees."""
    return [n.split(" (")[0] for n in label.split(": ")[0].split(" = ")]


def test_pareto_draws_the_tables_numbers_and_holds_every_fitting_plan(searched):
    result, pics, table = searched
    assert any(not s.fits for s in result.candidates)  # the budget leaves some plans out
    _panels, points = picture_parts(pics)
    fig = pareto_figure(points, budget_bytes=pics["memory_budget"])
    ax = next(a for a in fig.axes if a.get_label() == "pareto")
    b_div, t_div = _unit(ax.get_xlabel()), _unit(ax.get_ylabel())
    t_unit = ax.get_ylabel().rsplit("(", 1)[1].rstrip(")")
    (x0, x1), (y0, y1) = ax.get_xlim(), ax.get_ylim()
    fitting = [s for s in result.candidates if s.fits]
    for s in fitting:
        assert x0 <= s.estimate.peak_bytes / b_div <= x1 and y0 <= s.estimate.step_s / t_div <= y1, s.plan.label
    star = [c.get_offsets()[0] for c in ax.collections if c.get_gid() == "chosen"]
    assert len(star) == 1
    peak, step = star[0][0] * b_div, star[0][1] * t_div
    assert (step, peak) == pytest.approx((result.best.estimate.step_s, result.best.estimate.peak_bytes))
    assert f"{step * 1e3:8.2f}ms" in table.splitlines()[next(i for i, line in enumerate(table.splitlines())
                                                             if line.startswith("* "))]
    squares = {tuple(round(v, 9) for v in xy) for c in ax.collections if c.get_gid() == "baseline"
               for xy in c.get_offsets()}
    labels = [t.get_text() for t in ax.texts if t.get_gid() == "label"]
    for name, s in result.baselines.items():
        e = s.estimate
        if x0 <= e.peak_bytes / b_div <= x1 and y0 <= e.step_s / t_div <= y1:
            assert (round(e.peak_bytes / b_div, 9), round(e.step_s / t_div, 9)) in squares, name
            assert any(name in _names(t) for t in labels), (name, labels)
        else:  # at the edge, its numbers in its label
            assert any(name in _names(t) and t.endswith(f", {e.step_s / t_div:,.4g} {t_unit}")
                       for t in labels), (name, labels)
        assert f"{e.step_s * 1e3:8.2f}ms" in table, name


def test_timeline_headings_are_the_tables_step_and_peak(searched):
    result, pics, _table = searched
    panels, _points = picture_parts(pics)
    fig = timeline_figure(panels, budget_bytes=pics["memory_budget"])
    chosen, ref = result.best.estimate, result.baselines[pics["reference"]["label"]].estimate
    for k, e in enumerate((chosen, ref)):
        lanes = next(a for a in fig.axes if a.get_label() == f"lanes:{k}")
        heading = lanes._left_title.get_text()
        mem = next(a for a in fig.axes if a.get_label() == f"memory:{k}")
        t_unit = mem.get_xlabel().rsplit("(", 1)[1].rstrip(")")
        b_unit = mem.get_ylabel().rsplit("(", 1)[1].rstrip(")")
        assert f"step {fmt_seconds(e.step_s)}, peak {e.peak_bytes / UNITS[b_unit]:.3g} {b_unit}" in heading, heading
        assert "FSDP 2 · TP 1 · PP 1" in heading
        drawn = max(ev[4] for ev in panels[k].events) / UNITS[t_unit]
        assert drawn <= lanes.get_xlim()[1] <= drawn * 1.1
        peak_line = [ln for ln in mem.get_lines() if ln.get_label().startswith("predicted peak")]
        assert peak_line and peak_line[0].get_ydata()[0] == pytest.approx(e.peak_bytes / UNITS[b_unit])
