"""The shapes a search tries: every parallel layout the request and the model allow, and why not the others.

[Note: shapes tried] The search is one loop over shapes (``spec.request.Shape``: the degree of
every axis), not a nest of searches per axis. ``shape_space`` is its generator: it reads each
axis of the request (a degree, or ``auto``: every degree the mesh and the model allow), checks
what only the model can tell (heads divisible by a tensor-parallel degree, blocks enough for a
pipeline's stages) and returns the cross product of the degrees left, in two groups:

- ``flat``: no pipeline. Each is one mesh ``dp x tp`` searched by the 1-D search (the exact DP,
  uniform groupings, the study) on the simulator of one tensor-parallel rank's model (See
  [Note: 2-D search] in search/tp.py); at a fixed global batch, every micro-batch x accumulation
  split of each (See [Note: global batch search] in search/batch.py).
- ``piped``: a pipeline degree above 1 with its tensor-parallel degree (and, under ``--cp``, each
  context-parallel degree), searched by the pipeline search (See [Note: pipeline search] in
  search/pipeline.py).

[Note: cp in a pipeline] A pipeline shape with ``cp > 1`` is priced as the pipeline of one cp rank's
share (``Simulator.view(Shape(cp=c, tp=t))``: the stages cut from the cp view, their module times
holding ring attention's exchanges) on the mesh ``pp x dp_shard x cp x tp``, and compared with the
other shapes per token (``step x cp``), as the flat cp degrees are (See [Note: context parallel
search] in search/cp.py). At a fixed global batch each shape runs the same sequences, priced as
[Note: pipeline global batch] in search/pipeline_batch.py says for cp, and the steps compare as they
are. Not applied by wrapopt (``plan/pipeline.py`` refuses it naming TorchTitan's export).

[Note: ep in a pipeline] A pipeline shape with ``ep > 1`` (TorchTitan's ``pp x dp_replicate x efsdp
x ep`` sparse mesh: the experts of each stage split over ``ep`` of its data-parallel ranks) is
priced as the pipeline of one ep rank's model (``Simulator.view(Shape(ep=e))``: its experts
modules ``1/ep`` of the experts, their module times holding the all-to-all dispatch and combine;
each stage's view keeps the experts' own units and their collectives over efsdp, See [Note: expert
parallel costs] in cost/ep.py) on the mesh ``pp x dp_shard x tp`` with ``ep_size``. Degrees are
compared by the step, as the flat ep degrees are. With cp too (``pp x dp_shard x cp``, ep within a
stage's ``dp_shard x cp`` ranks) the stages are cut from the ep view of a cp rank's share (See [Note:
cp with ep] in search/axes.py). Not beside tensor parallelism (as without a pipeline), and not
applied by wrapopt (``plan/pipeline.py`` refuses it naming TorchTitan's export).

A shape left out is kept in ``dropped`` with the reason, for the report. Context and expert
parallelism are two more degree loops over the flat shapes (``cp`` and ``ep``), one loop for both
(See [Note: the degree loop of an axis] in search/axes.py); which degrees each allows is its own
(search/cp.py, search/ep.py). A new axis of that kind adds its degrees here, an ``Axis`` there, a
cost view and an apply step.
"""

from __future__ import annotations

from dataclasses import dataclass

from wrapopt.search.cp import resolve_cp
from wrapopt.search.ep import resolve_ep
from wrapopt.search.pipeline import resolve_pp
from wrapopt.search.stages import PipelineLayout
from wrapopt.search.tp import auto_degrees, resolve_tp
from wrapopt.spec import AUTO, ModelGraph, ParallelRequest, Shape
from wrapopt.tp import TPSpec

__all__ = ["ShapeSpace", "shape_space", "tp_group_sizes"]


@dataclass(frozen=True, slots=True)
class ShapeSpace:
    """The shapes a search tries (See [Note: shapes tried]) and what it needs to build their plans."""

    flat: tuple[Shape, ...]  # pipeline degree 1, one per tensor-parallel degree (none when a pipeline is forced)
    piped: tuple[Shape, ...]  # pipeline degree above 1 x tensor-parallel (x cp or ep) degree, dividing the world
    tp_spec: TPSpec | None  # how blocks split (None: no tensor-parallel degree above 1 is tried)
    layout: PipelineLayout | None  # the model's pipeline layout (None: no pipeline is tried)
    dropped: tuple[tuple[Shape, str], ...] = ()  # shapes not tried, with why
    notes: tuple[str, ...] = ()  # what the request became on this model ("--tp auto: ... not tried: ...")
    cp: tuple[int, ...] = ()  # cp degrees above 1 tried on the flat shapes: [Note: context parallel search]
    ep: tuple[int, ...] = ()  # expert-parallel degrees above 1 tried on the flat shapes: [Note: expert parallel search]

    @property
    def tp_degrees(self) -> tuple[int, ...]:
        """The tensor-parallel degrees tried (with and without a pipeline)."""
        return tuple(sorted({s.tp for s in (*self.flat, *self.piped)} or {1}))

    @property
    def tp_dropped(self) -> tuple[tuple[int, str], ...]:
        """(degree, why) for each tensor-parallel degree ``--tp auto`` left out."""
        return tuple((s.tp, why) for s, why in self.dropped if s.pp == 1)


def shape_space(graph: ModelGraph, request: ParallelRequest) -> ShapeSpace:
    """The shapes to search for ``request`` on ``graph``: See [Note: shapes tried]. A degree given
    that the model cannot take raises ``PlanError`` naming the module and what to pass; ``auto``
    leaves such degrees out and says why."""
    # cp and ep first: their refusals of a combination name it, before tp's of the model
    cp_degrees, cp_notes = resolve_cp(graph, request)  # See [Note: context parallel search] in search/cp.py
    ep_degrees, ep_notes = resolve_ep(graph, request)  # See [Note: expert parallel search] in search/ep.py
    tp_degrees, spec, tp_notes = resolve_tp(graph, request)
    pp_degrees, layout, pp_notes = resolve_pp(graph, request)
    dropped = [(Shape(tp=d), why) for d, why in auto_degrees(graph, request.mesh, spec)[2]
               ] if request.tp == AUTO else []
    world = request.mesh.world_size
    flat = tuple(Shape(tp=t) for t in tp_degrees) if 1 in pp_degrees else ()
    piped = []
    # a pipeline's cp and ep degrees: See [Note: cp in a pipeline] and [Note: ep in a pipeline]
    cps = ((1,) if request.cp in (1, AUTO) else ()) + cp_degrees
    eps = ((1,) if request.ep in (1, AUTO) else ()) + ep_degrees
    for p in (p for p in pp_degrees if p > 1):
        for t in tp_degrees:
            for c, e in ((c, e) for c in cps for e in eps if e == 1 or t == 1):
                shape = Shape(pp=p, tp=t, cp=c, ep=e)
                if shape.misfit(world):
                    dropped.append((shape, shape.misfit(world)))
                    continue
                piped.append(shape)
    return ShapeSpace(flat=flat, piped=tuple(piped), tp_spec=spec, layout=layout, dropped=tuple(dropped),
                      notes=(*tp_notes, *pp_notes, *cp_notes, *ep_notes), cp=cp_degrees,
                      ep=ep_degrees)


def tp_group_sizes(request: ParallelRequest) -> tuple[int, ...]:
    """The tensor-parallel group sizes a measured profile needs for the request (its degree, or
    every power of two dividing a node for ``auto``): their collectives and split matmuls, See
    [Note: tensor parallel costs] in cost/tp.py."""
    if request.tp == 1:
        return ()
    per_node = request.mesh.ranks_per_node
    return tuple(d for d in (2, 4, 8, 16) if per_node % d == 0 and request.tp in (AUTO, d))
