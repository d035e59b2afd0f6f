"""The simulator's prediction for one plan: ``CostEstimate``, its ``UnitCost`` per unit and
its timeline."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from wrapopt.spec.plan import UnitSpec

__all__ = ["UnitCost", "UnitCosts", "TimelineEvent", "CostEstimate"]

class UnitCost(NamedTuple):  # a NamedTuple: cheap to make one per unit
    name: str
    param_bytes: int  # unsharded, as gathered
    fwd_s: float
    bwd_s: float
    all_gather_s: float
    reduce_scatter_s: float
    saved_bytes: int


class UnitCosts(Sequence[UnitCost]):
    """A plan's ``UnitCost`` per unit, made from the simulator's columns on first
    access: a search scores thousands of plans and reads few of these. Compares
    equal to any sequence of the same ``UnitCost`` items."""

    __slots__ = ("_src", "_items")

    def __init__(self, units: tuple[UnitSpec, ...], param_bytes: Sequence[float], *columns: Sequence[Any]):
        # Names come from the units, parameter bytes are made ints, the rest are the fields in order.
        self._src: Any = (units, param_bytes, columns)
        self._items: tuple[UnitCost, ...] | None = None

    def _all(self) -> tuple[UnitCost, ...]:
        if self._items is None:
            units, param_bytes, columns = self._src
            py = [c.tolist() if hasattr(c, "tolist") else c for c in (param_bytes, *columns)]  # numpy -> Python
            self._items = tuple(map(UnitCost._make, zip((u.name for u in units), map(int, py[0]), *py[1:])))
        return self._items

    def __getitem__(self, i: Any) -> Any:
        return self._all()[i]

    def __len__(self) -> int:
        return len(self._src[0])

    def __iter__(self) -> Iterator[UnitCost]:
        return iter(self._all())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (UnitCosts, tuple, list)):
            return self._all() == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._all())

    def __repr__(self) -> str:
        return repr(self._all())


class TimelineEvent(NamedTuple):
    lane: str  # "compute" or "comm"
    kind: str  # "fwd", "bwd", "recompute", "all_gather", "reduce_scatter", "all_reduce", "optim"
    unit: str
    start_s: float
    end_s: float
    memory_bytes: int = 0  # memory right after the event starts


@dataclass(frozen=True, slots=True)
class CostEstimate:
    """The simulator's prediction for one plan, per rank."""

    step_s: float
    fwd_s: float
    bwd_s: float
    compute_s: float
    comm_s: float
    exposed_comm_s: float
    peak_bytes: int
    peak_breakdown: tuple[tuple[str, int], ...]  # category -> bytes at the peak
    units: Sequence[UnitCost]  # a tuple, or ``UnitCosts`` from the simulator
    timeline: tuple[TimelineEvent, ...] = field(repr=False, default=())
    notes: tuple[str, ...] = ()  # extrapolations and other caveats
    optim_s: float = 0.0  # the optimizer step, at the end of step_s
    # Under gradient accumulation, the sync mode this estimate is for ("every" or "last";
    # None without accumulation). Not in ``to_json``: the plan file's ``train`` records it.
    accumulation_sync: str | None = None

    def summary_json(self) -> dict[str, Any]:
        """The headline figures only (for baselines in a plan file)."""
        d = self.to_json()
        d.pop("units")
        d.pop("timeline")
        return d

    def to_json(self) -> dict[str, Any]:
        return {
            "step_s": self.step_s,
            "fwd_s": self.fwd_s,
            "bwd_s": self.bwd_s,
            "compute_s": self.compute_s,
            "comm_s": self.comm_s,
            "exposed_comm_s": self.exposed_comm_s,
            "optim_s": self.optim_s,
            "peak_bytes": self.peak_bytes,
            "peak_breakdown": dict(self.peak_breakdown),
            "notes": list(self.notes),
            "units": [
                {"name": u.name, "param_bytes": u.param_bytes, "fwd_s": u.fwd_s, "bwd_s": u.bwd_s,
                 "all_gather_s": u.all_gather_s, "reduce_scatter_s": u.reduce_scatter_s, "saved_bytes": u.saved_bytes}
                for u in self.units
            ],
            "timeline": [[e.lane, e.kind, e.unit, e.start_s, e.end_s, e.memory_bytes] for e in self.timeline],
        }
