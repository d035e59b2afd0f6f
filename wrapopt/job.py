"""``prepare(request, model, inputs) -> Job``: the one wiring of fabric -> compute -> budget -> trace -> simulator.

Every entry point that scores plans (``optimize_wrap``, ``estimate``, ``wrapopt search``, the
fidelity bench) builds its ``ParallelRequest`` and calls ``prepare``; the search and the
reports take the ``Job``. One wiring keeps them agreeing: one ``Simulator`` with one set of
options, and the budget resolved at one point.

The order is the user's: what can be refused without the model (a fabric file, a budget, the
offload host) is refused before the model is traced, so a bad flag fails in a second, not after
the trace of a 70B model.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch.distributed as dist
import torch.nn as nn

from wrapopt.checks import check_count
from wrapopt.cost.simulate import Simulator
from wrapopt.errors import ModelError
from wrapopt.hardware.budget import budget_line, budget_source, resolve_budget
from wrapopt.hardware.host import HostSpec, host_for
from wrapopt.hardware.profiles import ComputeProfile, FabricProfile
from wrapopt.hardware.resolve import check_fabric_fits, compute_for, resolve_fabric
from wrapopt.search.knobs import settle_compile
from wrapopt.spec import MeshSpec, ModelGraph, ParallelRequest
from wrapopt.trace.meta import trace_model
from wrapopt.train import FLOAT8_AUTO, TrainConfig, model_dtype

__all__ = ["Job", "prepare", "default_mesh", "job_mesh"]


@dataclass(frozen=True)
class Job:
    """What a search or an estimate needs, wired once: the request, the traced model, the
    profiles, the budget in bytes and the simulator of the step asked for (its batch as traced)."""

    request: ParallelRequest
    model: nn.Module = field(repr=False)  # real or meta: its fingerprint goes into the plan
    graph: ModelGraph = field(repr=False)
    fabric: FabricProfile
    compute: ComputeProfile
    budget: float | None  # bytes; None: every plan fits
    budget_source: str  # where the budget came from, as the plan's assumptions state it
    budget_note: str  # one line for the user: "memory budget: 72.0 GiB (90% of ...)"
    sim: Simulator = field(repr=False)
    host: HostSpec | None = None  # the host CPU offload goes to (``request.offload``)
    notes: tuple[str, ...] = ()  # what wiring noticed (a rescaled fabric, the model's source)
    knobs: tuple[str, ...] = ()  # compile on or off and why (See [Note: knob defaults] in search/knobs.py)

    @property
    def train(self) -> TrainConfig:
        """The training step asked for, its compile settled (``float8`` may still be "auto": searched)."""
        return self.request.train

    @property
    def mesh(self) -> MeshSpec:
        """The mesh asked for, FSDP over the world unless ``request.dp_shard`` says otherwise."""
        return self.request.mesh

    def simulator(self, train: TrainConfig | None = None, *, batch_scale: float = 1.0) -> Simulator:
        """The job's fabric, compute and host pricing another step: a chosen micro-batch and
        accumulation (``batch_scale``, See [Note: global batch search] in search/batch.py) or a plan
        file's own step (default: the request's)."""
        step = train if train is not None else self.train
        if step.float8 == FLOAT8_AUTO:  # not searched yet: priced off
            step = replace(step, float8="none", float8_all_gather=False)
        if step.compile is None:
            step = replace(step, compile=self.train.compile)
        return Simulator(self.graph, self.fabric, self.compute,
                         step.sim_options(memory_budget=self.budget, batch_scale=batch_scale), host=self.host)


def prepare(request: ParallelRequest, model: nn.Module, example_inputs: Any = None, *,
            fabric: FabricProfile | str | os.PathLike | None = None, compute: ComputeProfile | str | None = None,
            loss_fn: Callable[..., Any] | None = None, graph: ModelGraph | None = None,
            rescale_fabric: bool = False, notes: tuple[str, ...] = (), apply_device: str | None = None) -> Job:
    """Wire the stages for ``request``: the fabric (given, a file, a named analytical one, else
    the default H100 + InfiniBand), the compute (given, else the analytical fabric's device in the
    step's dtype), the budget, the offload host, the trace of ``model`` on ``example_inputs`` in
    the step's compute dtype (unless ``graph`` is given: already traced) and the simulator. The
    step's compile is settled here against the compute profile (and ``apply_device``, where
    ``optimize_wrap`` applies the plan): See [Note: knob defaults] in search/knobs.py.

    Example:
        >>> from wrapopt import zoo
        >>> from wrapopt.spec import MeshSpec, ParallelRequest
        >>> model, x = zoo.build("gpt-tiny", "meta")
        >>> job = prepare(ParallelRequest(mesh=MeshSpec(world_size=8, ranks_per_node=8, shard_size=8)), model, x)
        >>> job.budget is not None and job.sim.simulate is not None
        True
    """
    train = request.train if request.train is not None else TrainConfig()
    if request.train is None:
        request = replace(request, train=train)
    mesh = request.mesh
    fab = resolve_fabric(fabric, world_size=mesh.world_size, ranks_per_node=mesh.ranks_per_node)
    said = [*notes, *check_fabric_fits(fab, mesh, rescale=rescale_fabric)]
    host = (host_for(fab, host_memory_bytes=request.host_memory, ranks_per_node=mesh.ranks_per_node)
            if request.offload else None)  # before tracing: --offload on a fabric without a host fails at once
    comp = compute_for(fab, compute, train, model_dtype(model))
    budget = resolve_budget(request.memory_budget, comp)  # before tracing: a bad budget fails at once
    train, compile_line = settle_compile(train, comp, apply_device=apply_device)
    request = replace(request, train=train)
    if graph is None:
        # in the step's compute dtype: See [Note: tracing in the compute dtype] in trace/record.py
        graph = trace_model(model, example_inputs, loss_fn=loss_fn, compute_dtype=train.param_dtype)
    priced = train if train.float8 != FLOAT8_AUTO else replace(train, float8="none")  # searched later
    sim = Simulator(graph, fab, comp, priced.sim_options(memory_budget=budget), host=host)
    return Job(request=request, model=model, graph=graph, fabric=fab, compute=comp, budget=budget,
               budget_source=budget_source(request.memory_budget, comp),
               budget_note=budget_line(request.memory_budget, comp, budget), sim=sim, host=host, notes=tuple(said),
               knobs=(compile_line,))


def default_mesh(*, world_size: int | None, gpus_per_node: int | None) -> MeshSpec:
    """The mesh asked for, FSDP over the world: ``gpus_per_node`` defaults to ``world_size``
    up to 8, ``world_size`` to ``gpus_per_node`` (8 ranks on one node when neither is given).
    A size given is checked, never replaced: 0 is an ``OptionError`` naming the argument."""
    if world_size is not None:
        check_count(world_size, "world_size (--world-size)")
    if gpus_per_node is not None:
        check_count(gpus_per_node, "gpus_per_node (--gpus-per-node)")
    gpn = min(8 if world_size is None else world_size, 8) if gpus_per_node is None else gpus_per_node
    world = gpn if world_size is None else world_size
    return MeshSpec(world_size=world, ranks_per_node=min(gpn, world), shard_size=world)


def job_mesh(world_size: int | None, gpus_per_node: int | None) -> MeshSpec:
    """``default_mesh``; under a process group its world, with torchrun's LOCAL_WORLD_SIZE
    ranks per node unless ``gpus_per_node`` says otherwise."""
    if not dist.is_initialized():
        return default_mesh(world_size=world_size, gpus_per_node=gpus_per_node)
    if world_size is not None:
        check_count(world_size, "world_size")
    world = dist.get_world_size()
    if world_size is not None and world_size != world:
        raise ModelError(f"world_size={world_size} but the process group has {world} ranks")
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world)) if gpus_per_node is None else gpus_per_node
    return default_mesh(world_size=world, gpus_per_node=per_node)
