"""report/plots.py: the timeline and time-memory pictures are valid PNGs of a sensible
size (matplotlib's Agg backend, no display), their inputs are checked, and a missing
matplotlib is a WrapoptError that says how to install it."""

from __future__ import annotations

import struct
import sys

import pytest

from wrapopt.errors import WrapoptError
from wrapopt.report.pareto import PlanPoint, draw_pareto
from wrapopt.report.plots import TimelinePanel, draw_timelines

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
MiB = 2**20


def png_size(path) -> tuple[int, int]:
    """(width, height) in pixels of a PNG file, after checking its signature and header chunk."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def _prediction(step_ms: float, peak_mib: float, units: int) -> dict:
    """A predicted step in a plan file's form: per unit a forward, a backward and their collectives."""
    ev, t = [], 0.0
    for u in range(units):
        ev.append(["comm", "all_gather", f"u{u}", t, t + 0.1e-3, 0])
        ev.append(["compute", "fwd", f"u{u}", t + 0.1e-3, t + 1e-3, int((2 + u) * MiB)])
        t += 1e-3
    ev.append(["compute", "loss", "<root>", t, t + 0.5e-3, int(peak_mib * MiB * 0.9)])
    t += 0.5e-3
    for u in reversed(range(units)):
        ev.append(["compute", "bwd", f"u{u}", t, t + 2e-3, int((2 + u) * MiB)])
        ev.append(["comm", "reduce_scatter", f"u{u}", t + 2e-3, t + 2.2e-3, 0])
        t += 2e-3
    ev.append(["compute", "optim", "<all>", t + 0.2e-3, step_ms * 1e-3, MiB])
    return {"step_s": step_ms * 1e-3, "peak_bytes": int(peak_mib * MiB), "timeline": ev}


def test_timelines_of_two_plans_make_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    panels = [TimelinePanel.from_prediction("wrapopt's choice (3 units)", _prediction(12.0, 9.0, 3)),
              TimelinePanel.from_prediction("baseline per-block (5 units)", _prediction(18.0, 8.0, 5))]
    path = tmp_path / "timeline.png"
    draw_timelines(panels, path, budget_bytes=10 * MiB, title="predicted step")
    width, height = png_size(path)
    assert 1000 <= width <= 2000 and 500 <= height <= 1500
    assert path.stat().st_size > 10_000  # bars, curves and text, not an empty canvas


def test_pareto_with_measured_points_makes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    points = [PlanPoint(f"optuna#{k}", (10 + k) * 1e-3, (12 - 0.3 * k) * MiB) for k in range(12)]
    points += [PlanPoint("per-block", 15e-3, 9 * MiB, "baseline", measured_step_s=16e-3, measured_peak_bytes=9 * MiB),
               PlanPoint("no-shard", 9e-3, 14 * MiB, "baseline"),
               PlanPoint("dp", 11e-3, 10 * MiB, "chosen", measured_step_s=12e-3, measured_peak_bytes=10.1 * MiB)]
    path = tmp_path / "pareto.png"
    draw_pareto(points, path, budget_bytes=11 * MiB, title="time against memory")
    width, height = png_size(path)
    assert 800 <= width <= 2000 and 400 <= height <= 1500
    assert path.stat().st_size > 10_000


def test_a_prediction_without_a_timeline_is_refused():
    with pytest.raises(WrapoptError, match="no timeline"):
        TimelinePanel.from_prediction("plan", {"step_s": 1.0, "peak_bytes": 1})
    with pytest.raises(ValueError, match="at least one"):
        draw_pareto([], "unused.png")


def test_missing_matplotlib_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed: the import fails
    with pytest.raises(WrapoptError, match=r"wrapopt\[plot\]"):
        draw_pareto([PlanPoint("a", 1.0, 1.0)], tmp_path / "p.png")
    assert not (tmp_path / "p.png").exists()
