"""Pictures of plans (PNG): predicted step timelines; shared drawing helpers.

``draw_timelines`` puts the predicted steps of a few plans one above the other:
per plan, lanes of events (compute, all-gather, reduce-scatter; for a pipeline
plan one lane per pipeline rank) and under them the memory held while
computing, with the peak and the budget. ``draw_timeline`` draws one plan
file's timeline (``wrapopt show --timeline``). The time-memory picture is in
``report/pareto.py``.

The inputs are plain data (``TimelinePanel``), built by the wiring from a search
or a demo. matplotlib is an extra (``wrapopt[plot]``), loaded on the first
drawing, with the Agg backend (no display needed). ``timeline_figure`` returns
the figure so that a test can read back what was drawn; ``draw_*`` write the
PNG by atomic replace (``fileio.atomic_write_bytes``): a symlink where the
picture goes is replaced, never written through.
"""

from __future__ import annotations

import io
import math
import os
import re
import textwrap
from dataclasses import dataclass
from typing import Any, Sequence

from wrapopt.errors import WrapoptError
from wrapopt.fileio import atomic_write_bytes

__all__ = ["TimelinePanel", "draw_timelines", "draw_timeline", "timeline_figure", "mesh_degrees", "fmt_seconds",
           "fmt_num", "require_matplotlib", "save_figure", "wrap_title", "pyplot", "bytes_unit", "time_unit", "DPI"]

DPI = 110  # the figures are made and saved at this resolution, so label placement measured on screen holds
COLORS = {"fwd": "#4c72b0", "loss": "#64b5cd", "bwd": "#55a868", "recompute": "#8172b2", "all_gather": "#dd8452",
          "reduce_scatter": "#c44e52", "all_reduce": "#937860", "optim": "#8c8c8c"}
_NAMES = {"fwd": "forward", "loss": "loss", "bwd": "backward", "recompute": "recompute (checkpointing)",
          "all_gather": "all-gather", "reduce_scatter": "reduce-scatter", "all_reduce": "all-reduce",
          "optim": "optimizer step"}
# Communication lanes: FSDP2 issues all-gathers and reduce-scatters on separate streams, so they
# overlap each other; one lane each keeps both readable.
_COMM_LANES = {"all_gather": "all-gather", "reduce_scatter": "reduce-scatter\n/ all-reduce",
               "all_reduce": "reduce-scatter\n/ all-reduce"}
_PIPELINE_UNIT = re.compile(r"rank(\d+) stage(\d+)")  # cost/pipeline.py names its events so
_SHARE_X_RATIO = 2.5  # panels share one time axis when their drawn spans are within this factor


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
    degrees: str = ""  # the plan's parallel degrees (``mesh_degrees``), drawn under the title

    @classmethod
    def from_prediction(cls, title: str, prediction: dict[str, Any], micro_batches: int | None = None,
                        degrees: str = "") -> TimelinePanel:
        events = tuple(tuple(e) for e in prediction.get("timeline") or ())
        if not events:
            raise WrapoptError(f"{title}: the prediction has no timeline; simulate the plan with record=True "
                               "(or re-run `wrapopt search` to write a plan file with one)")
        n = micro_batches if micro_batches is not None else int(prediction.get("micro_batches", 1))
        return cls(title, events, float(prediction["step_s"]), float(prediction["peak_bytes"]), n, degrees)

    @property
    def drawn_s(self) -> float:
        """Where the recorded events end: one micro-batch (and the optimizer step) of the step."""
        return max(e[4] for e in self.events)

    @property
    def pipeline_ranks(self) -> tuple[int, ...]:
        """The pipeline ranks the events name (empty for a plan without a pipeline)."""
        found = {int(m.group(1)) for e in self.events if (m := _PIPELINE_UNIT.match(str(e[2])))}
        return tuple(sorted(found))


def mesh_degrees(spec: Any) -> str:
    """"FSDP 8 · TP 8 · PP 8 (Interleaved1F1B, 32 micro-batches)": a plan's parallel degrees.

    TP and PP are always named (1 when absent); a context- or expert-parallel degree
    (``cp_size``, ``ep_size``) is named when the mesh has such an axis."""
    m = spec.mesh
    if m.shard_size == 1 and m.dp_size > 1:
        dp = f"DDP {m.dp_size}"  # every rank holds everything
    elif m.dp_size > m.shard_size:
        dp = f"HSDP {m.dp_size} (replicate {m.dp_size // m.shard_size} x shard {m.shard_size})"
    else:
        dp = f"FSDP {m.dp_size}"
    parts = [dp, f"TP {m.tp_size}", f"PP {m.pp_size}"]
    pipe = getattr(spec, "pipeline", None)
    if pipe is not None:
        parts[-1] += f" ({pipe.schedule}, {pipe.microbatches} micro-batches)"
    parts += [f"{axis.upper()} {getattr(m, f'{axis}_size')}" for axis in ("cp", "ep") if hasattr(m, f"{axis}_size")]
    return " · ".join(parts) + (" · CPU offload" if getattr(spec, "offload", False) else "")


def pyplot() -> Any:
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
    pyplot()


def bytes_unit(top: float) -> tuple[float, str]:
    return (2**30, "GiB") if top >= 4 * 2**30 else (2**20, "MiB") if top >= 4 * 2**20 else (2**10, "KiB")


def time_unit(top_s: float) -> tuple[float, str]:
    return (1.0, "s") if top_s >= 10 else (1e-3, "ms") if top_s >= 10e-3 else (1e-6, "µs")


def wrap_title(text: str, width_in: float, fontsize: float) -> str:
    """``text`` wrapped to lines that fit ``width_in`` inches at ``fontsize`` points (its own
    line breaks kept): a long model path or plan label never runs off the figure."""
    chars = max(20, int(width_in * 72 / (fontsize * 0.6)))
    return "\n".join(textwrap.fill(line, chars) if line else "" for line in text.split("\n"))


def save_figure(fig: Any, path: str | os.PathLike) -> None:
    """Render ``fig`` to PNG bytes and write them by atomic replace; close the figure."""
    plt = pyplot()
    try:
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=DPI)
    finally:
        plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())


def _lanes(panel: TimelinePanel) -> tuple[list[str], Any]:
    """The lane names of a panel, top first, and a function from an event to its lane index."""
    ranks = panel.pipeline_ranks
    if ranks:
        index = {r: i for i, r in enumerate(ranks)}
        names = [f"pp rank {r}" for r in ranks]
        return names, lambda e: index[int(_PIPELINE_UNIT.match(str(e[2])).group(1))]  # type: ignore[union-attr]
    comm = [name for kind, name in _COMM_LANES.items() if any(e[0] == "comm" and e[1] == kind for e in panel.events)]
    names = ["compute"] + list(dict.fromkeys(comm))
    return names, lambda e: 0 if e[0] != "comm" else names.index(_COMM_LANES.get(e[1], names[-1]))


def fmt_num(value: float, digits: int = 3) -> str:
    """``value`` to ``digits`` significant figures, never in exponent form ("1,577", not "1.58e+03")."""
    return f"{value:,.0f}" if abs(value) >= 10**digits - 0.5 else f"{value:,.{digits}g}"


def fmt_seconds(seconds: float) -> str:
    """"102 s", "1.6 ms": three significant figures in the unit that suits the value."""
    div, unit = (1.0, "s") if seconds >= 1 else (1e-3, "ms") if seconds >= 1e-3 else (1e-6, "µs")
    return f"{fmt_num(seconds / div)} {unit}"


def _panel_heading(panel: TimelinePanel, b_div: float, b_unit: str) -> str:
    n = panel.micro_batches
    drawn = (f"micro-batch 1 of {n} drawn ({fmt_seconds(panel.drawn_s)}); micro-batches 2-{n} repeat it"
             if n > 1 else "the whole step drawn")
    figures = f"step {fmt_seconds(panel.step_s)}, peak {fmt_num(panel.peak_bytes / b_div)} {b_unit}; {drawn}"
    return "\n".join([panel.title] + ([panel.degrees] if panel.degrees else []) + [figures])


def timeline_figure(panels: Sequence[TimelinePanel], *, budget_bytes: float | None = None,
                    title: str | None = None) -> Any:
    """The figure ``draw_timelines`` saves (for tests: axes labelled ``lanes:K`` and ``memory:K``).

    [Note: one micro-batch at full width] The simulator records one micro-batch of an
    accumulating step (the others repeat it). The time axis covers what was recorded, so
    that micro-batch fills the width; a hatched strip past its end, labelled, stands for
    the repeats, and the heading gives the whole step. Panels share one time axis only
    when their drawn spans are comparable (within ``_SHARE_X_RATIO``).
    """
    if not panels:
        raise ValueError("draw_timelines needs at least one panel")
    plt = pyplot()
    spans = [p.drawn_s for p in panels]
    shared = max(spans) / max(min(spans), 1e-12) <= _SHARE_X_RATIO
    t_div, t_unit = time_unit(max(spans))
    has_budget = bool(budget_bytes) and math.isfinite(budget_bytes or 0.0)
    top = max([p.peak_bytes for p in panels] + ([budget_bytes] if has_budget else []))  # type: ignore[list-item]
    b_div, b_unit = bytes_unit(top)
    lanes_of = [_lanes(p) for p in panels]
    heights = [0.3] + [h for names, _ in lanes_of for h in (max(0.95, 0.34 * len(names) + 0.25), 1.0)]
    width = 12.0
    fig = plt.figure(figsize=(width, sum(heights) + 0.95 * len(panels) + 1.0), dpi=DPI, layout="constrained")
    grid = fig.add_gridspec(len(heights), 1, height_ratios=heights)
    key = fig.add_subplot(grid[0], label="legend")  # a row of its own: the legend never meets the title
    key.axis("off")
    seen: dict[str, Any] = {}
    first: Any = None
    for k, (panel, (names, lane_of)) in enumerate(zip(panels, lanes_of)):
        lanes = fig.add_subplot(grid[2 * k + 1], label=f"lanes:{k}", sharex=first if shared else None)
        mem = fig.add_subplot(grid[2 * k + 2], label=f"memory:{k}", sharex=lanes)
        first = first or lanes
        top_lane = len(names) - 1
        by_kind: dict[str, list[tuple[float, float, int]]] = {}
        for e in panel.events:
            by_kind.setdefault(str(e[1]), []).append((e[3] / t_div, (e[4] - e[3]) / t_div, top_lane - lane_of(e)))
        for kind, bars in by_kind.items():
            color = COLORS.get(kind, "#999999")
            for y in sorted({b[2] for b in bars}):
                # edges in the face colour: a bar narrower than a pixel still shows at full strength
                h = lanes.broken_barh([(x, w) for x, w, yy in bars if yy == y], (y - 0.4, 0.8), facecolor=color,
                                      edgecolor=color, linewidth=0.5)
                seen.setdefault(kind, h)
        lanes.set_yticks(range(len(names)), list(reversed(names)), fontsize=8)
        lanes.set_ylim(-0.6, len(names) - 0.4)
        lanes.tick_params(labelbottom=False)
        lanes.set_title(wrap_title(_panel_heading(panel, b_div, b_unit), width - 1.5, 10),
                        loc="left", fontsize=10)
        repeats = max(p.micro_batches for p in panels) > 1  # room for the strip that stands for them
        right = (max(spans) if shared else panel.drawn_s) * (1.11 if repeats else 1.01)
        lanes.axvline(panel.drawn_s / t_div, color="black", linewidth=0.8)
        if panel.micro_batches > 1:
            for ax in (lanes, mem):
                ax.axvspan(panel.drawn_s / t_div, right / t_div, facecolor="#f2f2f2", edgecolor="#bbbbbb",
                           hatch="//", zorder=0)
            lanes.text((panel.drawn_s + right) / 2 / t_div, (len(names) - 1) / 2,
                       f"micro-batches\n2-{panel.micro_batches} repeat\nthis one\n(step {fmt_seconds(panel.step_s)})",
                       ha="center", va="center", fontsize=7, color="#333333", gid="repeats",
                       bbox=dict(boxstyle="round,pad=0.2", facecolor="white", edgecolor="#999999"))
        lanes.set_xlim(0, right / t_div)
        _memory_row(mem, panel, t_div, b_div, b_unit, top, budget_bytes if has_budget else None)
        mem.set_xlabel(f"time in {'micro-batch 1' if panel.micro_batches > 1 else 'the step'} ({t_unit})",
                       fontsize=9)
    order = [k for k in COLORS if k in seen] + [k for k in seen if k not in COLORS]
    key.legend([seen[k] for k in order], [_NAMES.get(k, k) for k in order], loc="center", ncol=len(order),
               fontsize=9, frameon=False)
    if title:
        fig.suptitle(wrap_title(title, width, 11), fontsize=11)
    fig.supxlabel("Memory rows: bytes held during each compute event. The predicted peak (dotted) can come from a "
                  "moment the curve does not show: an all-gather's copy-out, the loss's working memory.",
                  fontsize=8, color="#555555")
    return fig


def _memory_row(mem: Any, panel: TimelinePanel, t_div: float, b_div: float, b_unit: str, top: float,
                budget: float | None) -> None:
    compute = sorted((e[3], e[4], e[5]) for e in panel.events if e[0] == "compute" and e[5])
    if compute:
        xs = [s / t_div for s, _e, _m in compute] + [compute[-1][1] / t_div]
        ys = [m / b_div for _s, _e, m in compute] + [compute[-1][2] / b_div]
        mem.step(xs, ys, where="post", color="#333333", linewidth=1.2)
        mem.fill_between(xs, ys, step="post", color="#cccccc", alpha=0.6)
    elif panel.pipeline_ranks:
        mem.text(0.01, 0.5, "memory over time is not recorded for a pipeline: the dotted line is the worst "
                 "rank's predicted peak", transform=mem.transAxes, fontsize=8, color="#555555", va="center")
    mem.axhline(panel.peak_bytes / b_div, color="#333333", linestyle=":", linewidth=1,
                label=f"predicted peak {panel.peak_bytes / b_div:.3g} {b_unit}")
    if budget is not None:
        mem.axhline(budget / b_div, color="#d62728", linestyle="--", linewidth=1,
                    label=f"budget {budget / b_div:.3g} {b_unit}")
    mem.set_ylim(0, top / b_div * 1.15)
    mem.set_ylabel(f"memory\n({b_unit})", fontsize=9)
    mem.legend(loc="lower right", fontsize=8, framealpha=0.9)


def draw_timelines(panels: Sequence[TimelinePanel], path: str | os.PathLike, *, budget_bytes: float | None = None,
                   title: str | None = None) -> None:
    """The predicted steps of ``panels``, one above the other, to a PNG (see ``timeline_figure``).

    Each plan gets its lanes (compute, all-gather, reduce-scatter; pipeline ranks) and a
    memory row: the bytes held while computing, its predicted peak (dotted) and the
    budget (dashed red), in the same units for every plan.
    """
    save_figure(timeline_figure(panels, budget_bytes=budget_bytes, title=title), path)


def draw_timeline(plan: Any, path: str | os.PathLike) -> None:
    """The predicted step of one plan file (a ``WrapPlan``), to a PNG."""
    fab = plan.fabric
    micro = plan.train.grad_accumulation if plan.train is not None else 1
    panel = TimelinePanel.from_prediction(f"plan {plan.spec.label or 'wrapopt'}", plan.prediction, micro,
                                          degrees=mesh_degrees(plan.spec))
    draw_timelines([panel], path, title=f"predicted step on {fab.get('name')} ({fab.get('kind')})")
