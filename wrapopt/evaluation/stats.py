"""Statistics of bench runs: paired round-by-round ratios, rank correlation, the noise floor, CPU steal.

Pure arithmetic on the times and rows that ``evaluate`` and ``measure_plans``
record, shared by the evaluation's reports and the benchmark scripts; nothing
here starts a rank or measures a step.
"""

from __future__ import annotations

import random
import statistics
from typing import Any

from wrapopt.evaluation.bench import round_order

__all__ = ["cpu_steal", "cpu_times", "fmt_ratio", "fmt_steal", "noise_floor", "paired_ratio", "place_effect",
           "spearman"]


def cpu_times() -> list[int] | None:
    """The machine's CPU time counters (Linux ``/proc/stat``), or None elsewhere."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        return [int(x) for x in fields[1:9]] if fields and fields[0] == "cpu" else None
    except (OSError, ValueError):
        return None


def cpu_steal(before: list[int] | None, after: list[int] | None) -> float | None:
    """Share of CPU time the hypervisor gave to other guests between two ``cpu_times`` readings: on a
    shared VM, the part of the noise that comes from outside (None where unknown)."""
    if not before or not after or len(before) < 8 or len(after) < 8:
        return None
    d = [b - a for a, b in zip(before, after)]
    return d[7] / sum(d) if sum(d) > 0 else None


def paired_ratio(a: list[float], b: list[float], *, level: float = 0.9, resamples: int = 2000,
                 seed: int = 0) -> tuple[float, float, float]:
    """Median over rounds of ``a[k] / b[k]`` and its bootstrap ``level`` interval.

    ``a`` and ``b`` are one plan's and another's step times from the same
    interleaved rounds (``measure_plans`` keeps them in round order), so each
    ratio compares two steps taken moments apart: the machine's drift between
    rounds cancels, which a ratio of the two medians does not do.
    """
    if len(a) != len(b) or not a:
        raise ValueError(f"paired_ratio needs two equal, non-empty series of round times, got {len(a)} and {len(b)}")
    ratios = [x / y for x, y in zip(a, b)]
    rng = random.Random(seed)
    boots = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(resamples))
    tail = int(resamples * (1 - level) / 2)
    return statistics.median(ratios), boots[tail], boots[resamples - 1 - tail]


def fmt_ratio(r: tuple[float, float, float] | list[float], digits: int = 3, ci_digits: int | None = None) -> str:
    """``median [low, high]`` of a ``paired_ratio`` result, for the reports."""
    c = digits if ci_digits is None else ci_digits
    return f"{r[0]:.{digits}f} [{r[1]:.{c}f}, {r[2]:.{c}f}]"


def place_effect(run: dict[str, Any]) -> list[float] | None:
    """Per place in the round (first, second, ...), the median over the screening
    round's steps taken there of step time / that plan's median: 1.0 everywhere
    when a plan's place does not matter (See [Note: round order] in bench.py).
    None for runs that did not record it (from before the order changed every round)."""
    if "screen_warmup" not in run or not all(r.get("screen_times_s") for r in run["rows"]):
        return None
    rows = run["rows"]
    n = len(rows)
    medians = [statistics.median(r["screen_times_s"]) for r in rows]
    by_place: list[list[float]] = [[] for _ in range(n)]
    for k in range(len(rows[0]["screen_times_s"])):
        for place, i in enumerate(round_order(n, k + run["screen_warmup"])):
            by_place[place].append(rows[i]["screen_times_s"][k] / medians[i])
    return [statistics.median(v) for v in by_place]


def fmt_steal(steal: float | None) -> str:
    """The CPU steal ``evaluate`` records over a case (``machine["steal"]``), for the reports."""
    return f"{steal:.1%}" if steal is not None else "not known"


def noise_floor(run: dict[str, Any]) -> tuple[float, float, float] | None:
    """The A/A ratio of an ``evaluate`` result: the predicted fastest's second copy
    against itself, round by round (See [Note: A/A copy] in evaluate.py); None without a
    confirmation round."""
    aa = run.get("aa")
    return paired_ratio(aa["times_s"], aa["of_times_s"]) if aa else None


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman rank correlation (average ranks for ties)."""
    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    n = len(xs)
    if n < 2:
        return float("nan")
    rx, ry = ranks(xs), ranks(ys)
    mx, my = sum(rx) / n, sum(ry) / n
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    vx = sum((a - mx) ** 2 for a in rx) ** 0.5
    vy = sum((b - my) ** 2 for b in ry) ** 0.5
    return cov / (vx * vy) if vx and vy else float("nan")
