"""What ``find_remedies`` (search/remedies.py) hands back when no plan fits: each remedy as priced
(``Remedy``) and the advice they make (``Advice``), with its text. See [Note: computed remedies]
in search/remedies.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from wrapopt.fileio import fmt_bytes
from wrapopt.search.choose import MEMORY_ERROR

__all__ = ["REMEDY_TIME_S", "Remedy", "Advice", "ms_text"]

REMEDY_TIME_S = 20.0  # no re-simulation starts after this many seconds: See [Note: computed remedies]


@dataclass(frozen=True, slots=True)
class Remedy:
    """One remedy as priced: the flags that ask for it and what the plan of least memory gives."""

    flag: str  # exactly what to add to the command line, e.g. "--tp 4"
    peak_bytes: int
    step_s: float
    plan_label: str
    fits: bool
    note: str = ""  # what else it changes or needs ("1/2 of the tokens per step")
    work: float = 1.0  # the tokens per step it trains, over the request's (a shorter sequence: below 1)
    setting: Any = field(default=None, repr=False, compare=False)  # what was priced (``_Setting``)


@dataclass(frozen=True, slots=True)
class Advice:
    """What ``find_remedies`` found: every remedy priced, those in place, those not priced, the time."""

    base_label: str
    base_peak_bytes: int
    budget_bytes: float
    priced: tuple[Remedy, ...]  # one per remedy: its first variant that fits, else its smallest peak
    in_place: tuple[str, ...] = ()
    not_priced: tuple[str, ...] = ()  # "remedy: why"
    elapsed_s: float = 0.0
    limit_s: float = REMEDY_TIME_S
    num_simulated: int = 0  # settings priced (a pipeline degree: its search, one setting)
    together: Remedy | None = None  # when none fits alone: the best pair of remedies priced together

    @property
    def fitting(self) -> tuple[Remedy, ...]:
        """The remedies that fit, fastest first; those that train fewer tokens per step last."""
        return tuple(sorted((r for r in self.priced if r.fits), key=lambda r: (r.work < 1, r.step_s)))

    def text(self) -> str:
        """The advice, a line per remedy that fits (else the closest and by how much it is over),
        then what is in place and what was not priced."""
        head = (f"Remedies, each alone on {self.base_label} ({fmt_bytes(self.base_peak_bytes)} now; "
                f"{self.num_simulated} settings priced in {self.elapsed_s:.1f} s, bound {self.limit_s:.0f} s; "
                "a search with the flag may find a faster plan):")
        lines = [head]
        fit = self.fitting
        for r in fit:
            lines.append(f"  {r.flag}: fits, {fmt_bytes(r.peak_bytes)}, {ms_text(r.step_s)} per step"
                         + self._detail(r))
        if not fit:
            if self.priced:
                near = min(self.priced, key=lambda r: r.peak_bytes)
                lines.append(f"  none fits alone; the closest is {near.flag}: {fmt_bytes(near.peak_bytes)}, "
                             f"{fmt_bytes(near.peak_bytes - self.budget_bytes)} over the budget of "
                             f"{fmt_bytes(self.budget_bytes)}" + self._detail(near))
            else:
                lines.append("  none could be priced")
            if self.together is not None:
                t = self.together
                said = (f"fits, {fmt_bytes(t.peak_bytes)}, {ms_text(t.step_s)} per step" if t.fits else
                        f"{fmt_bytes(t.peak_bytes)}, {fmt_bytes(t.peak_bytes - self.budget_bytes)} over")
                lines.append(f"  together, {t.flag}: {said}" + self._detail(t))
        if self.in_place:
            lines.append("  already in place: " + "; ".join(self.in_place))
        if self.not_priced:
            lines.append("  not priced: " + "; ".join(self.not_priced))
        return "\n".join(lines)

    def _detail(self, r: Remedy) -> str:
        """`` (its plan where not the base; its note; inside the memory model's margin)``."""
        said = [r.plan_label] if r.plan_label != self.base_label else []
        said += [r.note] if r.note else []
        if r.fits and r.peak_bytes > self.budget_bytes * (1 - MEMORY_ERROR):
            said.append(f"inside the memory model's {MEMORY_ERROR * 100:.0f}% error of the budget")
        return f" ({'; '.join(said)})" if said else ""


def ms_text(step_s: float) -> str:
    """``1,325 ms`` or ``3.39 ms``: three significant figures at least."""
    ms = step_s * 1e3
    return f"{ms:,.0f} ms" if ms >= 100 else f"{ms:.3g} ms"
