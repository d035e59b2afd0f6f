"""Pictures of plans (PNG): predicted step timelines, and predicted time against memory.

``draw_timelines`` puts the predicted steps of a few plans one above the
other on one time axis (so a longer step is a longer row): a compute lane and
a communication lane per plan, and under them the memory held while
computing, with the peak and the budget. ``draw_pareto`` plots every scored
plan's predicted step time against its predicted peak, the time-memory front
of the plans that fit, the budget, and where the plans run for real landed
(an arrow from predicted to measured). ``draw_timeline`` draws one plan file's
timeline (``wrapopt show --timeline``).

The inputs are plain data (``TimelinePanel``, ``PlanPoint``), built by the
wiring from a search or a demo. matplotlib is an extra (``wrapopt[plot]``),
loaded on the first drawing, with the Agg backend (no display needed).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Sequence

from wrapopt.errors import WrapoptError

__all__ = ["TimelinePanel", "PlanPoint", "draw_timelines", "draw_pareto", "draw_timeline", "require_matplotlib"]

_COLORS = {"fwd": "#4c72b0", "loss": "#64b5cd", "bwd": "#55a868", "recompute": "#8172b2", "all_gather": "#dd8452",
           "reduce_scatter": "#c44e52", "all_reduce": "#937860", "optim": "#8c8c8c"}
_NAMES = {"fwd": "forward", "loss": "loss", "bwd": "backward", "recompute": "recompute (checkpointing)",
          "all_gather": "all-gather", "reduce_scatter": "reduce-scatter", "all_reduce": "all-reduce",
          "optim": "optimizer step"}


@dataclass(frozen=True, slots=True)
class TimelinePanel:
    """One plan's predicted step, as a plan file's ``prediction`` holds it."""

    title: str
    events: tuple[tuple[Any, ...], ...]  # (lane, kind, unit, start_s, end_s, memory_bytes)
    step_s: float
    peak_bytes: float
    # Micro-batches per step: the simulator records one micro-batch (the others repeat it), and
    # ``step_s`` is the whole step; the drawing says so rather than calling one micro-batch a step.
    micro_batches: int = 1

    @classmethod
    def from_prediction(cls, title: str, prediction: dict[str, Any], micro_batches: int | None = None,
                        ) -> TimelinePanel:
        events = tuple(tuple(e) for e in prediction.get("timeline") or ())
        if not events:
            raise WrapoptError(f"{title}: the prediction has no timeline; simulate the plan with record=True "
                               "(or re-run `wrapopt search` to write a plan file with one)")
        n = micro_batches if micro_batches is not None else int(prediction.get("micro_batches", 1))
        return cls(title, events, float(prediction["step_s"]), float(prediction["peak_bytes"]), n)


@dataclass(frozen=True, slots=True)
class PlanPoint:
    """One scored plan: predicted figures, and measured ones when it was run."""

    label: str
    step_s: float
    peak_bytes: float
    role: str = "scored"  # "scored" (a search candidate), "baseline" or "chosen"
    measured_step_s: float | None = None
    measured_peak_bytes: float | None = None


def _pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (an optional dependency: loaded here only)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise WrapoptError("drawing needs matplotlib: pip install 'wrapopt[plot]'") from None
    return plt


def require_matplotlib() -> None:
    """Raise ``WrapoptError`` saying how to install matplotlib when it is missing (check before long work)."""
    _pyplot()


def _bytes_unit(top: float) -> tuple[float, str]:
    return (2**30, "GiB") if top >= 4 * 2**30 else (2**20, "MiB") if top >= 4 * 2**20 else (2**10, "KiB")


def _time_unit(top_s: float) -> tuple[float, str]:
    return (1.0, "s") if top_s >= 10 else (1e-3, "ms") if top_s >= 10e-3 else (1e-6, "µs")


def draw_timelines(panels: Sequence[TimelinePanel], path: str | os.PathLike, *, budget_bytes: float | None = None,
                   title: str | None = None) -> None:
    """The predicted steps of ``panels``, one above the other on one time axis, to a PNG.

    Each plan gets a lane row (compute above, communication below) and a memory
    row: the bytes held while computing, its predicted peak (dotted) and the
    budget (dashed red), in the same units for every plan.
    """
    if not panels:
        raise ValueError("draw_timelines needs at least one panel")
    plt = _pyplot()
    t_div, t_unit = _time_unit(max(p.step_s for p in panels))
    top = max([p.peak_bytes for p in panels] + ([budget_bytes] if budget_bytes and math.isfinite(budget_bytes) else []))
    b_div, b_unit = _bytes_unit(top)
    ratios = [r for _ in panels for r in (1.2, 1.0, 0.55)][:-1]  # lanes, memory, a gap before the next plan
    fig = plt.figure(figsize=(12, 2.6 * len(panels) + 1.6))
    grid = fig.add_gridspec(len(ratios), 1, height_ratios=ratios, hspace=0.12)
    axes: list[Any] = []
    for k in range(len(panels)):
        for row in (3 * k, 3 * k + 1):
            axes.append(fig.add_subplot(grid[row], sharex=axes[0] if axes else None))
    seen: dict[str, Any] = {}
    for k, panel in enumerate(panels):
        lanes, mem = axes[2 * k], axes[2 * k + 1]
        lanes.tick_params(labelbottom=False)
        for lane, kind, _unit, start, end, _m in panel.events:
            y = 1 if lane == "compute" else 0
            h = lanes.broken_barh([(start / t_div, (end - start) / t_div)], (y - 0.38, 0.76),
                                  facecolor=_COLORS.get(kind, "#999999"), edgecolor="white", linewidth=0.4)
            seen.setdefault(kind, h)
        lanes.set_yticks([0, 1], ["comm", "compute"])
        lanes.set_ylim(-0.6, 1.6)
        n = panel.micro_batches
        drawn = f"micro-batch 1 of {n} drawn; " if n > 1 else ""
        lanes.set_title(f"{panel.title}: {drawn}step {panel.step_s / t_div:.3g} {t_unit}, "
                        f"peak {panel.peak_bytes / b_div:.3g} {b_unit}", loc="left", fontsize=10)
        lanes.axvline(panel.step_s / t_div, color="black", linewidth=0.8)
        if n > 1 and panel.events:
            last = max(e[4] for e in panel.events)
            lanes.axvspan(last / t_div, panel.step_s / t_div, color="#eeeeee", zorder=0)
            lanes.text((last + panel.step_s) / 2 / t_div, 0.5, f"micro-batches 2-{n}\n(as the first)",
                       ha="center", va="center", fontsize=8, color="#555555")
        compute = sorted((e[3], e[4], e[5]) for e in panel.events if e[0] == "compute" and e[5])
        if compute:
            xs = [s / t_div for s, _e, _m in compute] + [compute[-1][1] / t_div]
            ys = [m / b_div for _s, _e, m in compute] + [compute[-1][2] / b_div]
            mem.step(xs, ys, where="post", color="#333333", linewidth=1.2)
            mem.fill_between(xs, ys, step="post", color="#cccccc", alpha=0.6)
        mem.axhline(panel.peak_bytes / b_div, color="#333333", linestyle=":", linewidth=1,
                    label=f"predicted peak {panel.peak_bytes / b_div:.3g} {b_unit}")
        if budget_bytes and math.isfinite(budget_bytes):
            mem.axhline(budget_bytes / b_div, color="#d62728", linestyle="--", linewidth=1,
                        label=f"budget {budget_bytes / b_div:.3g} {b_unit}")
        mem.set_ylim(0, top / b_div * 1.15)
        mem.set_ylabel(f"memory\n({b_unit})", fontsize=9)
        mem.legend(loc="center right", fontsize=8, framealpha=0.9)
    for mem in axes[1:-1:2]:
        mem.tick_params(labelbottom=True)
    axes[-1].set_xlabel(f"time in the step ({t_unit}); the black line ends each plan's step")
    axes[-1].set_xlim(0, max(p.step_s for p in panels) / t_div * 1.02)
    order = [k for k in _COLORS if k in seen] + [k for k in seen if k not in _COLORS]
    inch = 1 / fig.get_figheight()  # figure fraction of one inch
    if title:
        fig.suptitle(title, y=1 - 0.12 * inch, va="top", fontsize=11)
    fig.legend([seen[k] for k in order], [_NAMES.get(k, k) for k in order], loc="upper center",
               ncol=len(order), fontsize=9, frameon=False, bbox_to_anchor=(0.5, 1 - (0.42 if title else 0.1) * inch))
    fig.text(0.01, 0.1 * inch, "Memory rows: bytes held during each compute event. The predicted peak (dotted) can "
             "come from a moment the curve does not show: an all-gather's copy-out, the loss's working memory.",
             fontsize=8, color="#555555")
    fig.subplots_adjust(left=0.08, right=0.98, top=1 - (0.95 if title else 0.6) * inch, bottom=0.75 * inch)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _front(points: Sequence[PlanPoint], budget: float) -> list[PlanPoint]:
    """Fitting points that no other fitting point beats in both time and memory, fastest first."""
    out, best_peak = [], math.inf
    for p in sorted((p for p in points if p.peak_bytes <= budget), key=lambda p: (p.step_s, p.peak_bytes)):
        if p.peak_bytes < best_peak:
            out.append(p)
            best_peak = p.peak_bytes
    return out


def draw_pareto(points: Sequence[PlanPoint], path: str | os.PathLike, *, budget_bytes: float | None = None,
                title: str | None = None) -> None:
    """Predicted step time against predicted peak for ``points``, to a PNG.

    Grey dots: every scored plan; the line: the time-memory front of the plans
    that fit; squares: the baselines; the star: the chosen plan; the dashed
    red line: the budget. Points with measured figures get a hollow marker
    where they were measured, joined to the prediction by an arrow.
    """
    if not points:
        raise ValueError("draw_pareto needs at least one plan")
    plt = _pyplot()
    budget = budget_bytes if budget_bytes and math.isfinite(budget_bytes) else math.inf
    meas = [p for p in points if p.measured_step_s is not None and p.measured_peak_bytes is not None]
    peaks = [p.peak_bytes for p in points] + [p.measured_peak_bytes for p in meas]
    steps = [p.step_s for p in points] + [p.measured_step_s for p in meas]
    t_div, t_unit = _time_unit(max(steps))
    b_div, b_unit = _bytes_unit(max(peaks + ([budget] if math.isfinite(budget) else [])))
    fig, ax = plt.subplots(figsize=(11, 6))
    scored = [p for p in points if p.role == "scored"]
    if scored:
        ax.scatter([p.peak_bytes / b_div for p in scored], [p.step_s / t_div for p in scored], s=14, color="#9e9e9e",
                   alpha=0.6, label=f"scored plans ({len(scored)})", zorder=2)
    # The front as a staircase over memory: with m bytes, the fastest fitting plan whose peak is at most m.
    front = sorted(_front(points, budget), key=lambda p: p.peak_bytes)
    if front:
        right = budget if math.isfinite(budget) else max(peaks)
        xs = [p.peak_bytes / b_div for p in front] + [max(right, front[-1].peak_bytes) / b_div]
        ys = [p.step_s / t_div for p in front] + [front[-1].step_s / t_div]
        ax.step(xs, ys, where="post", color="#1f77b4", linewidth=1.2, zorder=3,
                label="time-memory front (fastest fitting plan per memory)")
    styles = {"baseline": dict(marker="s", s=55, color="#ff7f0e"), "chosen": dict(marker="*", s=220, color="#2ca02c")}
    for role, style in styles.items():
        pts = [p for p in points if p.role == role]
        if pts:
            name = "baselines" if role == "baseline" else "wrapopt's choice"
            ax.scatter([p.peak_bytes / b_div for p in pts], [p.step_s / t_div for p in pts], zorder=5,
                       edgecolor="black", linewidth=0.6, label=f"{name} (predicted)", **style)
    for i, p in enumerate(meas):
        style = styles.get(p.role, dict(marker="o", s=40, color="#7f7f7f"))
        ax.scatter([p.measured_peak_bytes / b_div], [p.measured_step_s / t_div], marker=style["marker"], zorder=6,
                   s=style["s"], facecolor="none", edgecolor=style["color"], linewidth=1.5,
                   label="measured (hollow; arrow from the prediction)" if i == 0 else None)
        ax.annotate("", xy=(p.measured_peak_bytes / b_div, p.measured_step_s / t_div),
                    xytext=(p.peak_bytes / b_div, p.step_s / t_div), zorder=4,
                    arrowprops=dict(arrowstyle="->", color=style["color"], linewidth=0.9, shrinkA=4, shrinkB=6))
    _label_points(ax, [p for p in points if p.role in styles], t_div, b_div)
    if math.isfinite(budget):
        ax.axvline(budget / b_div, color="#d62728", linestyle="--", linewidth=1.2,
                   label=f"memory budget {budget / b_div:.3g} {b_unit}")
    if max(steps) / max(min(steps), 1e-12) > 20:
        ax.set_yscale("log")
    ax.set_xlabel(f"peak memory per rank ({b_unit})")
    ax.set_ylabel(f"step time ({t_unit})")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    ax.set_title(title or "predicted step time against peak memory", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _label_points(ax: Any, points: Sequence[PlanPoint], t_div: float, b_div: float) -> None:
    """Name each labelled point once; plans predicted at the same spot share one label."""
    spots: dict[tuple[float, float], list[str]] = {}
    for p in sorted(points, key=lambda p: p.role != "chosen"):
        key = (round(p.peak_bytes / b_div, 3), round(p.step_s / t_div, 4))
        if p.label not in spots.setdefault(key, []):
            spots[key].append(p.label)
    for (x, y), labels in spots.items():
        ax.annotate(" = ".join(labels), (x, y), xytext=(7, 5), textcoords="offset points", fontsize=8, zorder=7,
                    bbox=dict(boxstyle="round,pad=0.15", facecolor="white", edgecolor="none", alpha=0.75))


def draw_timeline(plan: Any, path: str | os.PathLike) -> None:
    """The predicted step of one plan file (a ``WrapPlan``), to a PNG."""
    fab = plan.fabric
    micro = plan.train.grad_accumulation if plan.train is not None else 1
    panel = TimelinePanel.from_prediction(f"plan {plan.spec.label or 'wrapopt'}", plan.prediction, micro)
    draw_timelines([panel], path, title=f"predicted step on {fab.get('name')} ({fab.get('kind')})")
