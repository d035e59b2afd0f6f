"""report/plots.py and report/pareto.py at 70B-405B scale (issue #51), read back from the figures:
the timeline draws one micro-batch at full width with a labelled note of the repeats and a lane per
collective; the Pareto axes cover the plans that fit, with the plans outside marked at the edge and
their values named; labels do not overlap each other or the star; titles stay inside the figure; and
the parallel degrees are named."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest

from tests.report.test_plots import _prediction

pytest.importorskip("matplotlib")

from matplotlib.text import Annotation  # noqa: E402

from wrapopt.report.pareto import PlanPoint, pareto_figure  # noqa: E402
from wrapopt.report.plots import TimelinePanel, mesh_degrees, timeline_figure  # noqa: E402

GiB = 2**30


def _axes(fig, label):
    return next(ax for ax in fig.axes if ax.get_label() == label)


def _inside(fig, artist) -> bool:
    box, frame = artist.get_window_extent(fig.canvas.get_renderer()), fig.bbox
    return frame.x0 - 1 <= box.x0 and box.x1 <= frame.x1 + 1 and frame.y0 - 1 <= box.y0 and box.y1 <= frame.y1 + 1


def _overlap(a, b) -> float:
    w, h = min(a.x1, b.x1) - max(a.x0, b.x0), min(a.y1, b.y1) - max(a.y0, b.y0)
    return w * h if w > 0 and h > 0 else 0.0


# A 70B search as issue #51 met it: the plans that fit between 45 and 70 GiB under a 72 GiB budget,
# the unsharded baselines at 275-1,577 GiB, and grey candidates out to 650 GiB.
SEVENTY_B = ([PlanPoint(f"optuna#{k}", (88.5 + 0.3 * k), (50 + 2.5 * k) * GiB) for k in range(8)]
             + [PlanPoint(f"optuna#{k}", 72.5 + k, (150 + 50 * k) * GiB) for k in range(8, 18)]
             + [PlanPoint("per-block,ckpt", 90.22, 45.73 * GiB, "baseline"),
                PlanPoint("per-block", 72.43, 275.25 * GiB, "baseline"),
                PlanPoint("size-1e8", 72.41, 271.34 * GiB, "baseline"),
                PlanPoint("no-shard", 86.60, 1577.0 * GiB, "baseline"),
                PlanPoint("per-block,dp", 88.22, 68.99 * GiB, "chosen")])
BUDGET = 72 * GiB


def test_pareto_axes_cover_the_plans_that_fit_not_no_shard():
    fig = pareto_figure(SEVENTY_B, budget_bytes=BUDGET, title="a 70B search")
    ax = _axes(fig, "pareto")
    assert ax.get_xlabel().endswith("(GiB)") and ax.get_ylabel().endswith("(s)")
    (x0, x1), (y0, y1) = ax.get_xlim(), ax.get_ylim()
    fit = [p for p in SEVENTY_B if p.peak_bytes <= BUDGET]
    assert len(fit) == 10
    for p in fit:
        assert x0 <= p.peak_bytes / GiB <= x1 and y0 <= p.step_s <= y1, p
    assert x1 >= 72 and x1 < 2 * 72  # the budget shows; the 1,577 GiB plan does not stretch the axis
    assert (x1 - x0) < 0.6 * x1  # the fitting plans fill the width, not a sliver at the left
    star = [c for c in ax.collections if c.get_gid() == "chosen"]
    assert len(star) == 1 and tuple(star[0].get_offsets()[0]) == pytest.approx((68.99, 88.22))


def test_pareto_marks_plans_beyond_the_axes_at_the_edge_with_their_values():
    fig = pareto_figure(SEVENTY_B, budget_bytes=BUDGET)
    ax = _axes(fig, "pareto")
    x1 = ax.get_xlim()[1]
    edge = [tuple(c.get_offsets()[0]) for c in ax.collections if c.get_gid() == "outlier"]
    beyond = [p for p in SEVENTY_B if p.peak_bytes / GiB > x1]
    assert len(edge) == len(beyond) == 13
    assert all(x == pytest.approx(x1) for x, _ in edge)
    labels = [a.get_text() for a in ax.texts if a.get_gid() == "label"]
    assert "no-shard: 1,577 GiB, 86.6 s" in labels and "per-block: 275.2 GiB, 72.43 s" in labels
    # the baselines beyond the axes keep their step: the time axis covers them
    for p in (p for p in beyond if p.role == "baseline"):
        assert (x1, pytest.approx(p.step_s)) in [(pytest.approx(x), y) for x, y in edge]
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert any(t.startswith("10 scored plans beyond the axes") for t in legend), legend


def _crowded() -> list[PlanPoint]:
    """Baselines a hair apart and the choice next to them: the labels must be moved apart."""
    return [PlanPoint("optuna#1", 40e-3, 2 * 2**20), PlanPoint("optuna#2", 12e-3, 10.9 * 2**20),
            PlanPoint("per-block", 15.0e-3, 10.0 * 2**20, "baseline"),
            PlanPoint("size-1e8", 15.02e-3, 10.05 * 2**20, "baseline"),
            PlanPoint("every-leaf", 15.05e-3, 10.1 * 2**20, "baseline"),
            PlanPoint("per-block,dp", 14.97e-3, 10.02 * 2**20, "chosen")]


@pytest.mark.parametrize("points, budget", [(SEVENTY_B, BUDGET), (_crowded(), 11 * 2**20)], ids=["70b", "crowded"])
def test_labels_overlap_neither_each_other_nor_the_star(points, budget):
    fig = pareto_figure(points, budget_bytes=budget)
    ax = _axes(fig, "pareto")
    renderer = fig.canvas.get_renderer()
    labels = [a for a in ax.texts if isinstance(a, Annotation) and a.get_gid() == "label"]
    assert len(labels) == len({p.label for p in points if p.role != "scored"})
    boxes = [a.get_window_extent(renderer) for a in labels]
    for a, b in itertools.combinations(boxes, 2):
        assert _overlap(a, b) == 0, (a, b)
    star = next(c for c in ax.collections if c.get_gid() == "chosen")
    sx, sy = ax.transData.transform(star.get_offsets()[0])
    r = 220**0.5 / 2 * fig.dpi / 72  # the star's radius: its marker size (220 points²) is its diameter squared
    for box in boxes:
        assert box.x1 <= sx - r or box.x0 >= sx + r or box.y1 <= sy - r or box.y0 >= sy + r, box
    for a in labels:
        assert ax.bbox.contains(*a.get_window_extent(renderer).p0) and ax.bbox.contains(
            *a.get_window_extent(renderer).p1)


def test_long_titles_wrap_inside_the_figure():
    long = "hf:/a/very/long/path/to/the/checkpoint/folder/Meta-Llama-3.1-405B-Instruct/config.json " * 3
    fig = pareto_figure(SEVENTY_B, budget_bytes=BUDGET, title=f"step time against peak memory\n{long}")
    assert _inside(fig, fig._suptitle) and fig._suptitle.get_text().count("\n") >= 3
    panel = TimelinePanel.from_prediction("wrapopt's choice " + long, _prediction(12.0, 9.0, 3),
                                          degrees="FSDP 8 · TP 8 · PP 8 (Interleaved1F1B, 32 micro-batches)")
    fig = timeline_figure([panel], title=long)
    lanes = _axes(fig, "lanes:0")
    assert _inside(fig, fig._suptitle) and _inside(fig, lanes._left_title)


def _accumulating(units: int, micro_batches: int) -> TimelinePanel:
    pred = _prediction(12.0, 9.0, units)
    drawn = max(e[4] for e in pred["timeline"])
    pred.update(step_s=drawn * micro_batches, micro_batches=micro_batches)
    return TimelinePanel.from_prediction("wrapopt's choice (per-block,dp, 81 units)", pred,
                                         degrees="FSDP 64 · TP 1 · PP 1")


def test_timeline_draws_one_micro_batch_at_full_width_and_names_the_repeats():
    panel = _accumulating(80, 8)
    fig = timeline_figure([panel], budget_bytes=10 * 2**20)
    lanes = _axes(fig, "lanes:0")
    x1 = lanes.get_xlim()[1]
    assert panel.drawn_s * 1e3 <= x1 <= panel.drawn_s * 1e3 * 1.12  # ms: one micro-batch, not 8 of them
    note = [t.get_text() for t in lanes.texts if t.get_gid() == "repeats"]
    assert panel.step_s > 1 > panel.drawn_s  # the step in seconds, the micro-batch drawn in milliseconds
    assert note == [f"micro-batches\n2-8 repeat\nthis one\n(step {panel.step_s:.3g} s)"]
    heading = lanes._left_title.get_text()
    assert "FSDP 64 · TP 1 · PP 1" in heading
    assert f"step {panel.step_s:.3g} s, peak {panel.peak_bytes / 2**20:.3g} MiB" in heading
    assert f"micro-batch 1 of 8 drawn ({panel.drawn_s * 1e3:.3g} ms)" in heading
    # a step of seconds whose micro-batch is drawn in milliseconds is written in seconds, not "1.02e+05 ms"
    long = _accumulating(80, 64)
    heading = _axes(timeline_figure([long]), "lanes:0")._left_title.get_text()
    assert f"step {long.step_s:.3g} s" in heading and "e+" not in heading


def test_timeline_gives_each_collective_a_lane_of_full_strength_bars():
    fig = timeline_figure([_accumulating(80, 8)])
    lanes = _axes(fig, "lanes:0")
    assert [t.get_text() for t in lanes.get_yticklabels()] == ["reduce-scatter\n/ all-reduce", "all-gather",
                                                               "compute"]
    bars = [c for c in lanes.collections if len(c.get_paths()) >= 80]  # one bar per unit's collective
    assert len(bars) >= 3
    for c in bars:
        face, edge = c.get_facecolor()[0], c.get_edgecolor()[0]
        assert face[3] == 1 and tuple(edge) == tuple(face)  # no white edges washing thin bars out


def test_a_pipeline_timeline_has_a_lane_per_pipeline_rank():
    events = [("compute", kind, f"rank{r} stage{r + 4 * v} mb{m}", t0, t0 + 1.0, 0)
              for r in range(4) for v in range(2) for m, (kind, t0) in enumerate([("fwd", r + 2.0 * v),
                                                                                   ("bwd", 10.0 + r + 2.0 * v)])]
    panel = TimelinePanel.from_prediction("pp4", {"step_s": 16.0, "peak_bytes": 8 * GiB, "timeline": events},
                                          degrees="FSDP 2 · TP 1 · PP 4 (Interleaved1F1B, 8 micro-batches)")
    assert panel.pipeline_ranks == (0, 1, 2, 3)
    fig = timeline_figure([panel], budget_bytes=BUDGET)
    lanes = _axes(fig, "lanes:0")
    assert [t.get_text() for t in lanes.get_yticklabels()] == [f"pp rank {r}" for r in (3, 2, 1, 0)]
    assert "PP 4 (Interleaved1F1B" in lanes._left_title.get_text()


def _spec(world, shard, tp=1, pp=1, **axes):
    dp = world // (tp * pp)
    mesh = SimpleNamespace(world_size=world, shard_size=shard, tp_size=tp, pp_size=pp, dp_size=dp, **axes)
    pipe = SimpleNamespace(schedule="1F1B", microbatches=16) if pp > 1 else None
    return SimpleNamespace(mesh=mesh, pipeline=pipe, offload=False)


@pytest.mark.parametrize("spec, text", [
    (_spec(64, 64), "FSDP 64 · TP 1 · PP 1"),
    (_spec(64, 8), "HSDP 64 (replicate 8 x shard 8) · TP 1 · PP 1"),
    (_spec(8, 1), "DDP 8 · TP 1 · PP 1"),
    (_spec(512, 8, tp=8, pp=8), "FSDP 8 · TP 8 · PP 8 (1F1B, 16 micro-batches)"),
    (_spec(64, 16, tp=4, cp_size=2, ep_size=1), "FSDP 16 · TP 4 · PP 1 · CP 2 · EP 1"),  # axes a mesh may grow
])
def test_mesh_degrees_names_every_axis_the_mesh_has(spec, text):
    assert mesh_degrees(spec) == text
