"""The time-memory picture (PNG): every scored plan's predicted step against its predicted peak.

``draw_pareto`` plots the scored plans, the time-memory front of the plans that
fit, the baselines, the chosen plan, the budget, and where the plans run for
real landed (an arrow from predicted to measured). ``pareto_figure`` returns the
figure, so that a test can read back what was drawn.

[Note: the view covers the plans that fit] At 70B-405B a plan without sharding
needs 1,600-2,300 GiB per rank against a budget of 72: axes that covered every
plan would leave the plans that fit a sliver. The memory axis covers the plans
that fit and the budget, plus a margin past it (``VIEW_MARGIN``, where the near
misses lie); the time axis covers those plans and every baseline. A plan outside
is drawn at the edge it lies beyond, as a triangle pointing that way, and a
labelled one (a baseline, the choice) names its peak and step there; the grey
plans outside are counted in the legend. With no budget, or none fitting, the
axes cover every plan.

[Note: greedy label placement] Labels are placed once the layout is fixed: for
each labelled point (the choice first), the first of a few offsets around it
whose box overlaps no placed label and no labelled marker, else the offset that
overlaps least; a label moved far from its point gets a leader line.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Sequence

from wrapopt.report.plots import DPI, bytes_unit, fmt_num, pyplot, save_figure, time_unit, wrap_title

__all__ = ["PlanPoint", "draw_pareto", "pareto_figure", "VIEW_MARGIN"]

VIEW_MARGIN = 0.3  # the view runs this fraction of the fitting plans' memory span past the budget
_STYLES = {"baseline": dict(marker="s", s=55, color="#ff7f0e"), "chosen": dict(marker="*", s=220, color="#2ca02c")}
# label offsets from the point, in points, tried in order: near first, then further (with a leader line)
_OFFSETS = [(9, 5), (9, -13), (-9, 5), (-9, -13), (0, 12), (0, -20), (24, 18), (24, -28), (-24, 18), (-24, -28),
            (0, 30), (0, -38), (48, 0), (-48, 0), (40, 40), (40, -48), (-40, 40), (-40, -48)]


@dataclass(frozen=True, slots=True)
class PlanPoint:
    """One scored plan: predicted figures, and measured ones when it was run."""

    label: str
    step_s: float
    peak_bytes: float
    role: str = "scored"  # "scored" (a search candidate), "baseline" or "chosen"
    measured_step_s: float | None = None
    measured_peak_bytes: float | None = None


def _front(points: Sequence[PlanPoint], budget: float) -> list[PlanPoint]:
    """Fitting points that no other fitting point beats in both time and memory, fastest first."""
    out, best_peak = [], math.inf
    for p in sorted((p for p in points if p.peak_bytes <= budget), key=lambda p: (p.step_s, p.peak_bytes)):
        if p.peak_bytes < best_peak:
            out.append(p)
            best_peak = p.peak_bytes
    return out


def _span(values: Sequence[float], log: bool, pad: float = 0.08) -> tuple[float, float]:
    lo, hi = min(values), max(values)
    if log:
        lo, hi = math.log(lo), math.log(hi)
    extra = max(hi - lo, abs(hi) * 0.05 if not log else 0.05, 1e-12) * pad
    lo, hi = lo - extra, hi + extra
    return (math.exp(lo), math.exp(hi)) if log else (lo, hi)


def _view(points: Sequence[PlanPoint], budget: float, t_div: float, b_div: float,
          ) -> tuple[tuple[float, float], tuple[float, float], bool]:
    """The axes' limits (in drawn units) and whether the time axis is logarithmic. See
    [Note: the view covers the plans that fit]."""
    fit = [p for p in points if p.peak_bytes <= budget] or list(points)
    pairs = [(p.peak_bytes, p.step_s) for p in fit]
    pairs += [(p.measured_peak_bytes, p.measured_step_s) for p in fit if p.measured_peak_bytes is not None
              and p.measured_step_s is not None]
    xs = [x for x, _ in pairs] + ([budget] if math.isfinite(budget) else [])
    x_lo, x_hi = min(xs), max(xs)
    if math.isfinite(budget) and len(fit) < len(points):
        x_hi += VIEW_MARGIN * max(x_hi - x_lo, 0.1 * x_hi)
    inside = pairs + [(p.peak_bytes, p.step_s) for p in points if p.peak_bytes <= x_hi or p.role != "scored"]
    ys = [y / t_div for _, y in inside]
    log = max(ys) / max(min(ys), 1e-12) > 20
    xlim = _span([x_lo / b_div, x_hi / b_div], False, pad=0.05)
    return (max(0.0, xlim[0]) if x_lo >= 0 else xlim[0], xlim[1]), _span(ys, log), log


def _clamp(v: float, lo: float, hi: float) -> tuple[float, int]:
    """``v`` moved into [lo, hi], and which edge it lies beyond (-1, 0, 1)."""
    return (lo, -1) if v < lo else (hi, 1) if v > hi else (v, 0)


@dataclass(frozen=True, slots=True)
class _Frame:
    """The axes' limits and units: where a plan is drawn, and how its figures are written."""

    x0: float
    x1: float
    y0: float
    y1: float
    b_div: float
    b_unit: str
    t_div: float
    t_unit: str

    def at(self, peak: float, step: float) -> tuple[float, float, int, int]:
        """Where a plan is drawn (inside the axes), and the edges it lies beyond (-1, 0, 1 per axis)."""
        x, ex = _clamp(peak / self.b_div, self.x0, self.x1)
        y, ey = _clamp(step / self.t_div, self.y0, self.y1)
        return x, y, ex, ey

    def value(self, p: PlanPoint) -> str:
        peak, step = fmt_num(p.peak_bytes / self.b_div, 4), fmt_num(p.step_s / self.t_div, 4)
        return f"{peak} {self.b_unit}, {step} {self.t_unit}"


def pareto_figure(points: Sequence[PlanPoint], *, budget_bytes: float | None = None, title: str | None = None) -> Any:
    """The figure ``draw_pareto`` saves (one axes, labelled ``pareto``; labels have gid ``label``,
    the chosen plan's star gid ``chosen``, markers at the edge gid ``outlier``)."""
    if not points:
        raise ValueError("draw_pareto needs at least one plan")
    plt = pyplot()
    budget = budget_bytes if budget_bytes and math.isfinite(budget_bytes) else math.inf
    fit = [p for p in points if p.peak_bytes <= budget] or list(points)
    t_div, t_unit = time_unit(max(p.step_s for p in fit))
    b_div, b_unit = bytes_unit(max([p.peak_bytes for p in fit] + ([budget] if math.isfinite(budget) else [])))
    (x0, x1), (y0, y1), log = _view(points, budget, t_div, b_div)
    fr = _Frame(x0, x1, y0, y1, b_div, b_unit, t_div, t_unit)
    width = 11.0
    fig = plt.figure(figsize=(width, 6.4), dpi=DPI, layout="constrained")
    ax = fig.add_subplot(label="pareto")
    if log:
        ax.set_yscale("log")
    ax.set_xlim(x0, x1)
    ax.set_ylim(y0, y1)
    scored = [p for p in points if p.role == "scored"]
    shown = [p for p in scored if not any(fr.at(p.peak_bytes, p.step_s)[2:])]
    if shown:
        ax.scatter([p.peak_bytes / b_div for p in shown], [p.step_s / t_div for p in shown], s=14, color="#9e9e9e",
                   alpha=0.6, label=f"scored plans ({len(scored)})", zorder=2)
    outside = [p for p in scored if any(fr.at(p.peak_bytes, p.step_s)[2:])]
    for p in outside:
        _edge_marker(ax, fr.at(p.peak_bytes, p.step_s), "#9e9e9e", 30)
    front = sorted(_front(points, budget), key=lambda p: p.peak_bytes)
    if front:
        right = budget if math.isfinite(budget) else max(p.peak_bytes for p in front)
        xs = [p.peak_bytes / b_div for p in front] + [max(right, front[-1].peak_bytes) / b_div]
        ys = [p.step_s / t_div for p in front] + [front[-1].step_s / t_div]
        ax.step(xs, ys, where="post", color="#1f77b4", linewidth=1.2, zorder=3,
                label="time-memory front (fastest fitting plan per memory)")
    labelled = _draw_marked(ax, points, fr)
    _draw_measured(ax, points, fr)
    if math.isfinite(budget):
        ax.axvline(budget / b_div, color="#d62728", linestyle="--", linewidth=1.2,
                   label=f"memory budget {budget / b_div:.3g} {b_unit}")
    if outside:
        far = max(outside, key=lambda p: p.peak_bytes)
        ax.scatter([], [], marker=">", s=30, color="#9e9e9e",
                   label=f"{len(outside)} scored plans beyond the axes, drawn at the edge (up to "
                         f"{fmt_num(far.peak_bytes / b_div, 4)} {b_unit})")
    ax.set_xlabel(f"peak memory per rank ({b_unit})")
    ax.set_ylabel(f"step time ({t_unit})")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    fig.suptitle(wrap_title(title or "predicted step time against peak memory", width * 0.95, 11), fontsize=11)
    fig.canvas.draw()  # the layout, fixed before labels are measured: See [Note: greedy label placement]
    fig.set_layout_engine("none")
    _place_labels(ax, _merge_spots(labelled))
    return fig


def _draw_marked(ax: Any, points: Sequence[PlanPoint], fr: _Frame) -> list[tuple[float, float, str, str, float]]:
    """The baselines (squares) and the choice (a star), or a triangle at the edge for one
    outside the axes; returns what to label: (x, y, name, value shown, marker radius in points)."""
    labelled = []
    for role, style in _STYLES.items():
        name = "baselines" if role == "baseline" else "wrapopt's choice"
        named = False
        for p in (p for p in points if p.role == role):
            x, y, ex, ey = fr.at(p.peak_bytes, p.step_s)
            if ex or ey:
                _edge_marker(ax, (x, y, ex, ey), style["color"], 70, zorder=8)
                shown = fr.value(p)
            else:
                ax.scatter([x], [y], zorder=5, edgecolor="black", linewidth=0.6, gid=role,
                           label=None if named else f"{name} (predicted)", **style)
                named, shown = True, ""
            labelled.append((x, y, p.label, shown, math.sqrt(style["s"]) / 2 + 1.5))
    if any(any(fr.at(p.peak_bytes, p.step_s)[2:]) for p in points if p.role != "scored"):
        ax.scatter([], [], marker=">", s=70, color=_STYLES["baseline"]["color"], edgecolor="black", linewidth=0.5,
                   label="baseline beyond the axes, at the edge (its peak and step named)")
    return labelled


def _draw_measured(ax: Any, points: Sequence[PlanPoint], fr: _Frame) -> None:
    """Hollow markers where the plans run for real landed, with an arrow from the prediction."""
    meas = [p for p in points if p.measured_step_s is not None and p.measured_peak_bytes is not None]
    for i, p in enumerate(meas):
        style = _STYLES.get(p.role, dict(marker="o", s=40, color="#7f7f7f"))
        mx, my, _, _ = fr.at(p.measured_peak_bytes, p.measured_step_s)  # type: ignore[arg-type]
        ax.scatter([mx], [my], marker=style["marker"], zorder=6, s=style["s"], facecolor="none", clip_on=False,
                   edgecolor=style["color"], linewidth=1.5, label="measured (hollow; arrow from the prediction)"
                   if i == 0 else None)
        px, py, _, _ = fr.at(p.peak_bytes, p.step_s)
        ax.annotate("", xy=(mx, my), xytext=(px, py), zorder=4,
                    arrowprops=dict(arrowstyle="->", color=style["color"], linewidth=0.9, shrinkA=4, shrinkB=6))


def _edge_marker(ax: Any, spot: tuple[float, float, int, int], color: str, size: float, zorder: int = 7) -> None:
    """A triangle at the edge a point lies beyond, pointing that way (drawn over the frame)."""
    x, y, ex, ey = spot
    marker = ">" if ex > 0 else "<" if ex < 0 else "^" if ey > 0 else "v"
    ax.scatter([x], [y], marker=marker, s=size, color=color, edgecolor="black", linewidth=0.5, zorder=zorder,
               clip_on=False, gid="outlier")


def _merge_spots(labelled: list[tuple[float, float, str, str, float]]) -> list[tuple[float, float, str, float]]:
    """Plans drawn at the same spot share one label, "a = b: value" (the choice's name first)."""
    spots: dict[tuple[float, float], tuple[list[str], str, float]] = {}
    for x, y, name, shown, r in labelled[::-1]:  # the choice was added last: it leads its spot
        key = (round(x, 9), round(y, 9))
        names, first, radius = spots.get(key, ([], shown, r))
        spots[key] = (names + [name] if name not in names else names, first, max(radius, r))
    return [(x, y, " = ".join(names) + (f": {shown}" if shown else ""), r)
            for (x, y), (names, shown, r) in spots.items()]


def _overlap(a: Any, b: Any) -> float:
    w = min(a.x1, b.x1) - max(a.x0, b.x0)
    h = min(a.y1, b.y1) - max(a.y0, b.y0)
    return w * h if w > 0 and h > 0 else 0.0


def _place_labels(ax: Any, spots: list[tuple[float, float, str, float]]) -> None:
    """See [Note: greedy label placement]."""
    from matplotlib.transforms import Bbox

    fig = ax.figure
    renderer = fig.canvas.get_renderer()
    px = fig.dpi / 72  # display pixels per point
    obstacles = []
    for x, y, _text, r in spots:
        cx, cy = ax.transData.transform((x, y))
        obstacles.append(Bbox.from_extents(cx - r * px, cy - r * px, cx + r * px, cy + r * px))
    frame = ax.bbox  # labels stay inside the axes: the legend is to the right, the title above
    placed: list[Any] = []
    for x, y, text, _r in spots:
        best: tuple[float, Any] | None = None
        for dx, dy in _OFFSETS:
            ha = "left" if dx > 0 else "right" if dx < 0 else "center"
            far = abs(dx) > 12 or abs(dy) > 21
            ann = ax.annotate(text, (x, y), xytext=(dx, dy), textcoords="offset points", ha=ha, va="bottom",
                              fontsize=8, zorder=8, gid="label", annotation_clip=False,
                              bbox=dict(boxstyle="round,pad=0.15", facecolor="white", edgecolor="none", alpha=0.85),
                              arrowprops=dict(arrowstyle="-", color="#555555", linewidth=0.6) if far else None)
            box = ann.get_window_extent(renderer)
            cost = sum(_overlap(box, o) for o in placed + obstacles)
            cost += 0.0 if frame.contains(box.x0, box.y0) and frame.contains(box.x1, box.y1) else 1e9 + box.width
            if best is None or cost < best[0]:
                if best is not None:
                    best[1].remove()
                best = (cost, ann)
            else:
                ann.remove()
            if cost == 0:
                break
        assert best is not None
        placed.append(best[1].get_window_extent(renderer))


def draw_pareto(points: Sequence[PlanPoint], path: str | os.PathLike, *, budget_bytes: float | None = None,
                title: str | None = None) -> None:
    """Predicted step time against predicted peak for ``points``, to a PNG (see ``pareto_figure``).

    Grey dots: every scored plan; the line: the time-memory front of the plans that fit;
    squares: the baselines; the star: the chosen plan; the dashed red line: the budget;
    triangles at an edge: plans beyond the axes. Points with measured figures get a hollow
    marker where they were measured, joined to the prediction by an arrow.
    """
    save_figure(pareto_figure(points, budget_bytes=budget_bytes, title=title), path)
