"""Pictures of a plan: the predicted step's timeline (PNG)."""

from __future__ import annotations

import os

from wrapopt.errors import WrapoptError

__all__ = ["draw_timeline"]


def draw_timeline(plan, path: str | os.PathLike) -> None:
    """Compute and comm lanes of the predicted step, and the memory curve, to a PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise WrapoptError("drawing needs matplotlib: pip install 'wrapopt[plot]'") from None
    events = plan.prediction.get("timeline") or []
    if not events:
        raise WrapoptError("this plan file has no predicted timeline; re-run `wrapopt search` to make one")
    colors = {"fwd": "#4c72b0", "bwd": "#55a868", "recompute": "#8172b2", "all_gather": "#dd8452",
              "reduce_scatter": "#c44e52", "all_reduce": "#937860", "optim": "#8c8c8c"}
    fig, (ax, axm) = plt.subplots(2, 1, figsize=(12, 5), sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    lanes = {"compute": 1, "comm": 0}
    seen = set()
    for lane, kind, _unit, start, end, _mem in events:
        ax.broken_barh([(start * 1e3, (end - start) * 1e3)], (lanes[lane] - 0.4, 0.8), color=colors.get(kind, "#999"),
                       label=kind if kind not in seen else None, edgecolor="white", linewidth=0.3)
        seen.add(kind)
    ax.set_yticks([0, 1], ["comm", "compute"])
    ax.legend(loc="upper right", ncol=4, fontsize=8)
    ax.set_title(f"predicted step of plan {plan.spec.label or ''}: {plan.prediction.get('step_s', 0) * 1e3:.2f} ms "
                 f"on {plan.fabric.get('name')} ({plan.fabric.get('kind')})")
    mem = sorted((s * 1e3, m) for lane, _k, _u, s, _e, m in events if lane == "compute" and m)
    if mem:
        axm.step([x for x, _ in mem], [m / 2**20 for _, m in mem], where="post")
    axm.set_ylabel("memory (MiB)")
    axm.set_xlabel("time (ms)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
