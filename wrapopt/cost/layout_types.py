"""What a layout is: the segment sequence and per-unit sums a plan's simulation walks, as
``Layouts`` (``layout.py``) builds them for a set of units. See [Note: segments] in
``layout.py``."""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from wrapopt.cost.step_inputs import Segments, UnitLayout

__all__ = ["Layout", "Segment", "unit_modules", "NUMEL", "STORAGE", "TRAINABLE_NUMEL", "TRAINABLE_BYTES", "SAVED",
           "WORK", "INPUT", "KEEPS"]


class Segment(NamedTuple):
    """A plain tuple, so the simulation's hot loop can unpack it."""

    unit: int
    fwd_s: float
    bwd_s: float
    saved: int
    work: int  # working set: largest module output in the segment
    grad_numel: int  # gradients that appear during this segment's backward
    bwd_work: int  # most its backward holds beyond its saved activations and earlier gradients
    keep: int  # what checkpointing keeps of this block: its output (~ the next block's input)
    # Selective-op (See [Note: selective checkpointing] in wrapopt/selective.py): the forward
    # seconds it recomputes, what it keeps (its saved ops' outputs, plus ``keep``), and the
    # seconds torch's selective dispatch modes add to each pass (its forward, its recompute).
    sel_fwd_s: float
    sel_keep: int
    sel_ops_s: float
    ckpt_fwd_s: float  # what full checkpointing recomputes: See [Note: early stop] in wrapopt/trace/record.py


unit_modules = operator.attrgetter("modules")  # a unit's modules: the key of a set of units is these, per unit

# Rows of ``Layout.counts``, per unit:
NUMEL, STORAGE, TRAINABLE_NUMEL, TRAINABLE_BYTES, SAVED, WORK, INPUT, KEEPS = range(8)


@dataclass(frozen=True, slots=True, eq=False)
class Layout:
    """Everything about a set of units that does not depend on per-unit choices."""

    # Per unit (int64, rows above): parameter elements and storage bytes, trainable
    # elements and bytes, saved activations, working set (largest module output),
    # input bytes (what checkpointing keeps of it, ~ its largest output), and how
    # many of its segments start a piece (pay the checkpoint overhead).
    counts: np.ndarray
    # Per unit (float64): forward, backward, selective-op's recompute and per-pass overhead, full
    # checkpointing's recompute (See [Note: early stop] in wrapopt/trace/record.py).
    times: np.ndarray
    # What the step loop reads (``step.step_loop``): the segments' columns and the units'
    # order and sums. Tuples, or numpy arrays where the layout kernel built it.
    seg_cols: Segments
    unit_cols: UnitLayout

    def _row(self, i: int) -> tuple[int, ...]:
        return tuple(self.counts[i].tolist())

    numel = property(lambda self: self._row(NUMEL))
    storage_bytes = property(lambda self: self._row(STORAGE))
    trainable_numel = property(lambda self: self._row(TRAINABLE_NUMEL))
    trainable_bytes = property(lambda self: self._row(TRAINABLE_BYTES))
    saved = property(lambda self: self._row(SAVED))
    work = property(lambda self: self._row(WORK))
    input_bytes = property(lambda self: self._row(INPUT))
    fwd_s = property(lambda self: tuple(self.times[0].tolist()))
    bwd_s = property(lambda self: tuple(self.times[1].tolist()))

    @property
    def segments(self) -> tuple[Segment, ...]:
        cols = [c.tolist() if isinstance(c, np.ndarray) else c for c in self.seg_cols]
        return tuple(map(Segment._make, zip(*cols)))

    @property
    def num_segments(self) -> int:
        return len(self.seg_cols.unit)
