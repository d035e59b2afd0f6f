"""The views of ``Simulator``: one rank's share of a parallel shape, as a simulator of its own.

Each axis beyond FSDP is priced by handing the 1-D step loop the model one rank of that
axis runs (``view``): a context-parallel rank's share of the sequence (``for_cp``, cost/cp.py),
a tensor-parallel rank's share of each block (``for_tp``, cost/tp.py), an expert-parallel
rank's experts (``for_ep``, cost/ep.py), a pipeline stage's modules (``for_stage``,
cost/stage_view.py). Each view is cached on the simulator that made it. A new axis adds its
view here and its cost model in a file of its own.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import Any

from wrapopt.cost.cp import cp_view
from wrapopt.cost.dtypes import traced_dtype_bytes
from wrapopt.cost.ep import ep_view, expert_units, stacked_experts
from wrapopt.cost.stage_view import stage_compute, stage_graph
from wrapopt.cost.tp import tp_view, with_async
from wrapopt.spec import Shape, SimOptions
from wrapopt.spec.cp import cp_ranks_per_node
from wrapopt.tp import TPSpec


class Views:
    """The views of ``Simulator`` (its base class): each builds a simulator of the same class
    for one rank's share of an axis, on the caches ``Simulator.__init__`` makes."""

    # -- views: one rank of a shape ------------------------------------------------------------

    def view(self, shape: Shape, tp_spec: TPSpec | None = None) -> Any:
        """The simulator of one rank of ``shape`` outside its pipeline, scoring plans on the shape's
        data-parallel mesh: this simulator for a 1-D shape, one tensor-parallel rank's share for
        ``shape.tp > 1`` (``for_tp``, blocks split as ``tp_spec`` says). A pipeline stage of it is
        ``view(shape, tp_spec).for_stage(...)``. A new axis adds its view here. See [Note: shapes
        tried] in search/shapes.py."""
        if shape.cp > 1:  # See [Note: context parallel costs] in cost/cp.py
            rest = Shape(pp=shape.pp, tp=shape.tp, ep=shape.ep, micro_batch=shape.micro_batch,
                         accumulation=shape.accumulation)
            per_node = cp_ranks_per_node(shape.cp, self.fabric.ranks_per_node, shape.tp)
            return self.for_cp(shape.cp, per_node)[0].view(rest, tp_spec)
        if shape.ep > 1:  # See [Note: expert parallel costs] in cost/ep.py
            if shape.tp > 1:
                raise ValueError(f"{shape.describe()}: expert parallelism under tensor parallelism has no cost view")
            return self.for_ep(shape.ep)[0]
        if shape.tp == 1:
            return self
        if tp_spec is None:
            raise ValueError(f"{shape.describe()}: a tensor-parallel view needs the TPSpec its blocks split by")
        return self.for_tp(tp_spec, shape.tp)[0]

    def for_cp(self, size: int, per_node: int) -> tuple[Any, frozenset[str]]:
        """The simulator of one context-parallel rank's share (``batch_scale / size`` sequences,
        ring attention's exchanges on a cp group with ``per_node`` ranks per node), scoring plans
        on the flattened ``dp_shard x cp`` mesh, and the view's caveats. See [Note: context
        parallel costs] in cost/cp.py."""
        key = (size, per_node)
        hit = self._cp_views.get(key)
        if hit is None:
            opts = replace(self.options, batch_scale=self.options.batch_scale / size)
            elem = float(self.options.activation_dtype_bytes or traced_dtype_bytes(self.traced))
            g, c, notes = cp_view(self.graph, self.traced, self.compute, self.fabric, size, group_per_node=per_node,
                                  batch_scale=opts.batch_scale, elem=elem)
            view = type(self)(g, self.fabric, c, opts, backend=self.backend, host=self.host)
            hit = self._cp_views[key] = (view, notes)
        return hit

    def with_async(self, spec: TPSpec | None, asked: bool | str) -> tuple[TPSpec | None, str | None]:
        """``spec`` with async tensor parallelism as asked ("auto": where this fabric and GPU run it),
        and a note when it is off or cannot run. See [Note: async tensor parallel] in cost/tp.py."""
        return with_async(spec, asked, self.compute, self.fabric)

    def for_tp(self, spec: TPSpec, size: int) -> tuple[Any, frozenset[str]]:
        """The simulator of one tensor-parallel rank's share of the model (scores plans on the
        data-parallel mesh), and the view's caveats. See [Note: tensor parallel costs] in tp.py."""
        key = (spec, size)
        hit = self._tp_views.get(key)
        if hit is None:
            # The same global batch as a 1-D plan: a tensor-parallel group runs ``size`` ranks' batches.
            opts = replace(self.options, batch_scale=self.options.batch_scale * size)
            g, c, notes = tp_view(self.traced, self.compute, self.fabric, spec, size, batch_scale=opts.batch_scale,
                                  activation_dtype_bytes=opts.activation_dtype_bytes, timed=self.graph)
            view = type(self)(g, self.fabric, c, opts, backend=self.backend, host=self.host)
            hit = self._tp_views[key] = (view, notes)
        return hit

    def for_ep(self, size: int) -> tuple[Any, frozenset[str]]:
        """The simulator of one expert-parallel rank's share (scores plans on the data-parallel mesh,
        each experts module a unit of its own), and the view's notes. See [Note: expert parallel
        costs] in cost/ep.py."""
        hit = self._ep_views.get(size)
        if hit is None:
            g, c, notes = ep_view(self.traced, self.compute, self.fabric, size, batch_scale=self.options.batch_scale,
                                  activation_dtype_bytes=self.options.activation_dtype_bytes, timed=self.graph)
            view = type(self)(g, self.fabric, c, self.options, backend=self.backend, host=self.host)
            experts = tuple(stacked_experts(self.traced))
            view._plan_fix, view._ep_alone = partial(expert_units, experts=experts), (size, frozenset(experts))
            hit = self._ep_views[size] = (view, notes)
        return hit

    def for_stage(self, modules: tuple[str, ...], *, first: bool, last: bool, options: SimOptions) -> Any:
        """The simulator of one pipeline stage (the modules it owns), cached. See [Note: pipeline stages]."""
        if len(self._stage_views) > 512 and (modules, first, last) not in self._stage_views:
            self._stage_views.clear()  # a long search visits many cuts; each view holds its own caches
        views = self._stage_views.setdefault((modules, first, last), {})  # per stage, a simulator per options
        hit = views.get(options)
        if hit is None:
            g = next(iter(views.values())).traced if views else stage_graph(self.traced, modules, first=first,
                                                                            last=last)
            hit = views[options] = type(self)(g, self.fabric, stage_compute(self.compute, g, last=last), options,
                                             backend=self.backend, host=self.host)
            hit._ep_alone = self._ep_alone  # an ep view's stage: its experts' own collectives (See [Note: ep in a
            # pipeline] in search/shapes.py); the plan's experts units are made once, by the whole model's view
        return hit
