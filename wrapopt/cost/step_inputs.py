"""The step loop's inputs and its result: five named tuples and ``StepResult``.

``layout.py`` builds ``Segments`` and ``UnitLayout`` (per set of units),
``simulate.py`` builds ``UnitPlan`` and ``PlanScalars`` (per plan) and
``StepConstants`` (per ``Simulator``); ``step.py``'s ``step_loop`` reads them
and ``backend.py``'s ``Backend.step`` returns a ``StepResult``. The fields are
the model's figures; what the loop does with them is ``step.py`` and its
notes. No modelling decision here.

[Note: step loop inputs] The loop reads five named tuples: the layout's
``Segments`` and ``UnitLayout``, the plan's ``UnitPlan`` and ``PlanScalars``,
and the simulator's ``StepConstants`` (built once); ``Backend.step`` returns
a ``StepResult``. numba (0.68) compiles named tuples of arrays and scalars as
they are, but types a named tuple argument in Python on every call, where a
plain tuple's type is found in C, and boxes a returned named tuple field by
field; against the few microseconds a cached plan takes to score, both show.
So the compiled ``step_loop`` is given plain tuples (``x[:]``, in field
order) and returns one. The loop and its phases unpack the inputs by
position, in their fields' order (asserted against ``_fields`` at import),
into variables named as the fields: named or plain, the same line reads
both, free in compiled code and cheaper as Python than naming them again
(``Segments(*segs)``) and reading attributes. The per-plan named tuples are
built by ``tuple.__new__(Cls, fields)``, which skips the keyword parsing of
``Cls(...)``: these records are built on every scoring, so their cost is the
simulator's speed; records built once per set of units or mesh use keywords.
"""

from __future__ import annotations

from typing import Any, NamedTuple

__all__ = ["CK_NONE", "CK_FULL", "CK_SELECTIVE", "PlanScalars", "Segments", "StepConstants", "StepResult",
           "UnitLayout", "UnitPlan"]


# UnitPlan.checkpoint per unit: none, full, selective-op (See [Note: memory] in step.py).
CK_NONE, CK_FULL, CK_SELECTIVE = 0, 1, 2


class Segments(NamedTuple):
    """The segments a step walks, as columns in forward order (the fields of
    ``layout.Segment``; See [Note: segments] in ``layout.py``)."""

    unit: Any  # the unit that owns it (int)
    fwd_s: Any
    bwd_s: Any
    saved: Any  # activation bytes it saves
    work: Any  # working set: largest module output in the segment
    grad_numel: Any  # gradient elements that appear during its backward
    bwd_work: Any  # most its backward holds beyond its saved activations and earlier gradients
    keep: Any  # what checkpointing keeps of its block (on a block's first segment; else 0)
    sel_fwd_s: Any  # what selective-op recomputes of it (seconds)
    sel_keep: Any  # what selective-op keeps of it: its saved ops' outputs, plus ``keep``
    sel_ops_s: Any  # what selective-op's dispatch modes add to each pass over it (forward, recompute)
    # what full checkpointing recomputes of it (seconds): its forward less what the recompute's early
    # stop skips (See [Note: early stop] in wrapopt/trace/record.py)
    ckpt_fwd_s: Any


class UnitLayout(NamedTuple):
    """Per unit, what the layout fixes (not the per-unit choices or the mesh)."""

    forward: Any  # the units that run, in forward order of their first segment
    backward: Any  # the same in backward order (post-forward order reversed)
    last_fwd: Any  # per unit: its last forward segment
    fwd_pos: Any  # per unit: its place in ``forward`` (-1: never runs)
    bwd_pos: Any  # per unit: its place in ``backward``
    num_segments: Any
    seg_grad_numel: Any  # gradient elements that appear during its segments' backward (float)
    trainable_bytes: Any  # float


class UnitPlan(NamedTuple):
    """Per unit, what the plan makes of it: bytes and collective times on its mesh, and its choices."""

    gathered_bytes: Any  # unsharded parameters
    grad_bytes: Any  # unsharded gradients
    all_gather_s: Any
    reduce_scatter_s: Any
    all_reduce_s: Any  # across the replicas (HSDP)
    regather_s: Any  # backward all-gather (0: kept since forward): See [Note: reshard after forward]
    kept_bytes: Any  # what it keeps of its parameters between forward and backward
    checkpoint: Any  # int: CK_NONE, CK_FULL or CK_SELECTIVE
    param_overhead_s: Any  # its parameter tensors' part of FSDP2's work per all-gather and reduction


class StepConstants(NamedTuple):
    """What the profiles and step options fix for every plan a ``Simulator`` scores. See
    the notes in ``step.py``."""

    reduce_elem_bytes: float  # bytes per gradient element in the reduce-scatter
    overlap_compute: float  # 1 + slowdown of overlapped compute: See [Note: overlap]
    overlap_comm: float  # 1 + slowdown of overlapped collectives
    unit_overhead_s: float  # FSDP2's work per unit per all-gather and reduction (UnitPlan adds its parameters')
    checkpoint_overhead_s: float  # per checkpointed block
    loss_s: float  # See [Note: loss]
    loss_work_bytes: float  # what memory holds while the loss runs
    output_bytes: float  # the model's output
    loss_saved_bytes: float  # what the loss saves for its backward
    loss_grad_bytes: float  # the gradients its backward holds at once: See [Note: loss] in step.py
    collective_copy: float  # See [Note: collective copies]
    serial: float  # 1.0: each collective holds the issuing thread until it ends (See [Note: blocking collectives])
    checkpoint_forward_s: float  # of that, its forward's part: See [Note: checkpoint overhead] in cost/step.py


class PlanScalars(NamedTuple):
    """The rest of one plan's inputs."""

    static_bytes: float  # sharded parameters, optimizer state, accumulated gradients: See [Note: memory]
    shard_size: float  # how far the loop divides gradients as they land (inf: already sharded)
    prefetch_depth: int  # forward all-gathers issued this many units ahead
    record: bool  # record events into ``ev``
    gathers: bool  # the shard group has more than one rank (a group of one gathers nothing)


class StepResult(NamedTuple):
    """What ``step_loop`` returns (as a plain tuple, in this order)."""

    fwd_end: float
    bwd_end: float
    end: float  # when the last collective lands
    comm_s: float  # all collectives' time
    peak_bytes: float
    # at the peak: sharded gradients, gathered, all-gather buffer, unsharded gradients, activations, working set
    peak_parts: tuple[float, float, float, float, float, float]
    num_events: int
