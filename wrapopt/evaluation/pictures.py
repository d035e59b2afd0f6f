"""The two pictures of a search: ``timeline.png`` and ``pareto.png``.

``pictures_json`` collects, where the search ran (a demo rank, or ``wrapopt
search``), what the pictures need as plain JSON: the chosen plan's predicted
timeline, the timeline of the baseline it is compared with (per-block when
there is one, since that is the plan most users would write by hand), and the
predicted figures of every plan the search scored, and the parallel degrees
(``mesh_degrees``) of the choice, the reference and the baselines.
``write_pictures`` draws them (``report.plots``, ``report.pareto``), adding the
measured figures of the plans a demo ran.
"""

from __future__ import annotations

import os
from typing import Any

from wrapopt.choices import PICTURES
from wrapopt.cost.simulate import Simulator
from wrapopt.report.pareto import PlanPoint, draw_pareto
from wrapopt.report.plots import TimelinePanel, draw_timelines, mesh_degrees
from wrapopt.search.driver import SearchResult
from wrapopt.spec import PlanSpec

__all__ = ["pictures_json", "picture_parts", "write_pictures", "PICTURES", "REFERENCE_BASELINE"]

REFERENCE_BASELINE = "per-block"  # the hand-written plan the chosen one is drawn beside, when the model has blocks


def _prediction(sim: Simulator, plan: PlanSpec) -> dict[str, Any]:
    est = sim.simulate(plan, record=True)
    d = est.to_json()
    d.pop("units")
    d["micro_batches"] = sim.options.grad_accumulation  # the timeline is one of them: See TimelinePanel
    return d


def pictures_json(sim: Simulator, result: SearchResult, chosen: PlanSpec) -> dict[str, Any]:
    """What ``write_pictures`` draws, as JSON (it travels from a rank to the parent).

    ``sim`` must be the simulator the search scored with (its ``SimOptions``: precision,
    gradient accumulation, sync mode), so that the pictures show the table's numbers."""
    key = (chosen.units, chosen.mesh, chosen.forward_prefetch)
    others = {name: s for name, s in result.baselines.items()
              if (s.plan.units, s.plan.mesh, s.plan.forward_prefetch) != key}
    ref_name = REFERENCE_BASELINE if REFERENCE_BASELINE in others else min(
        others, key=lambda n: others[n].estimate.step_s, default=None)
    ref = None if ref_name is None else {"label": ref_name, "num_units": len(others[ref_name].plan.units),
                                          "degrees": mesh_degrees(others[ref_name].plan),
                                          "prediction": _prediction(sim, others[ref_name].plan)}
    return {
        "chosen": {"label": chosen.label or "wrapopt", "num_units": len(chosen.units),
                   "degrees": mesh_degrees(chosen), "prediction": _prediction(sim, chosen)},
        "reference": ref,
        "scored": [{"label": s.plan.label or "", "strategy": s.strategy, "step_s": s.estimate.step_s,
                    "peak_bytes": s.estimate.peak_bytes}
                   | ({"degrees": mesh_degrees(s.plan)} if s.strategy == "baselines" else {})
                   for s in result.candidates],
        "memory_budget": None if result.memory_budget == float("inf") else result.memory_budget,
    }


def _units(n: int) -> str:
    return f"{n} unit" + ("" if n == 1 else "s")


def _named(label: str, degrees: str, chosen: set[str]) -> str:
    """A baseline's label, with the parallel degrees where they differ from the choice's."""
    other = [d for d in degrees.split(" · ") if d and d not in chosen]
    return f"{label} ({' · '.join(other)})" if other and chosen != {""} else label


def picture_parts(pics: dict[str, Any], *, measured: list[dict[str, Any]] | None = None,
                  ) -> tuple[list[TimelinePanel], list[PlanPoint]]:
    """What the two pictures draw: the timeline panels (the choice first, then the
    reference) and the Pareto points (the choice last, role ``chosen``), from
    ``pictures_json``'s data and the measured rows (see ``write_pictures``)."""
    chosen, ref = pics["chosen"], pics["reference"]
    panels = [TimelinePanel.from_prediction(f"wrapopt's choice ({chosen['label']}, {_units(chosen['num_units'])})",
                                            chosen["prediction"], degrees=chosen.get("degrees", ""))]
    if ref is not None:
        panels.append(TimelinePanel.from_prediction(f"baseline {ref['label']} ({_units(ref['num_units'])})",
                                                    ref["prediction"], degrees=ref.get("degrees", "")))
    mine = set(chosen.get("degrees", "").split(" · "))
    points = [PlanPoint(_named(p["label"], p.get("degrees", ""), mine), p["step_s"], p["peak_bytes"],
                        "baseline" if p["strategy"] == "baselines" else "scored")
              for p in pics["scored"]]
    by_label = {p["label"]: i for i, p in enumerate(pics["scored"]) if p["strategy"] == "baselines"}
    pred = chosen["prediction"]
    chosen_point = PlanPoint(chosen["label"], pred["step_s"], pred["peak_bytes"], "chosen")
    for row in measured or []:
        figures = dict(measured_step_s=row["meas_step_s"], measured_peak_bytes=row["meas_peak_bytes"])
        if row["chosen"]:
            chosen_point = PlanPoint(chosen_point.label, row["pred_step_s"], row["pred_peak_bytes"], "chosen",
                                     **figures)
        elif row["plan"] in by_label:
            i = by_label[row["plan"]]
            points[i] = PlanPoint(points[i].label, row["pred_step_s"], row["pred_peak_bytes"], "baseline", **figures)
        else:
            points.append(PlanPoint(row["plan"], row["pred_step_s"], row["pred_peak_bytes"], "baseline", **figures))
    return panels, points + [chosen_point]


def write_pictures(out_dir: str | os.PathLike, pics: dict[str, Any], *, measured: list[dict[str, Any]] | None = None,
                   title: str = "") -> tuple[str, str]:
    """Draw ``timeline.png`` and ``pareto.png`` into ``out_dir``; returns their paths. Each is
    written by atomic replace: a symlink there is replaced, never written through.

    ``measured``: rows of an ``evaluate`` result (``plan``, ``chosen``, predicted and
    measured step and peak); their measured points join the Pareto picture.
    """
    os.makedirs(out_dir, exist_ok=True)
    timeline, pareto = (os.path.join(os.fspath(out_dir), name) for name in PICTURES)
    panels, points = picture_parts(pics, measured=measured)
    budget = pics["memory_budget"]
    draw_timelines(panels, timeline, budget_bytes=budget,
                   title=f"predicted step, {title}" if title else "predicted step")
    what = "every plan scored, predicted" + ("; the plans run here, measured" if measured else "")
    degrees = pics["chosen"].get("degrees")
    draw_pareto(points, pareto, budget_bytes=budget,
                title=f"step time against peak memory: {what}" + (f"\n{title}" if title else "")
                + (f"\nwrapopt's choice: {degrees}" if degrees else ""))
    return timeline, pareto
