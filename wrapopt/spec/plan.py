"""A plan: its units (``UnitSpec``), its mesh (``MeshSpec``) and, on a tensor-parallel
mesh, how tensor parallelism cuts each block (``TPSpec``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from wrapopt.checks import check_count
from wrapopt.errors import OptionError
from wrapopt.spec.graph import ROOT

__all__ = ["MeshSpec", "UnitSpec", "TP_STYLES", "TPSpec", "PP_SCHEDULES", "PipelineSpec", "PlanSpec", "SELECTIVE_OP",
           "CHECKPOINT_MODES", "checkpoint_label"]

# Activation checkpointing of a unit, a closed set: False (none), True (full: every activation
# recomputed) or SELECTIVE_OP (the outputs of matmuls and attention kept, the rest recomputed:
# See [Note: selective checkpointing] in selective.py). True and False are plain booleans, so plan
# files and golden answers that hold them read unchanged.
SELECTIVE_OP = "selective-op"
CHECKPOINT_MODES: tuple[bool | str, ...] = (False, True, SELECTIVE_OP)


def checkpoint_label(mode: bool | str) -> str:
    """How reports name a unit's checkpointing: "none", "full" or "selective-op"."""
    return SELECTIVE_OP if mode == SELECTIVE_OP else ("full" if mode else "none")


@dataclass(frozen=True, slots=True)
class MeshSpec:
    """The mesh a plan runs on.

    ``shard_size`` ranks share one copy of the parameters (FSDP's shard group);
    ``replicate_size`` such groups replicate it (HSDP). ``shard_size ==
    world_size`` is plain FSDP; ``shard_size == 1`` is no sharding at all
    (every rank holds everything, gradients are all-reduced: DDP-like).
    ``tp_size > 1`` adds a tensor-parallel axis, innermost (consecutive ranks,
    inside a node), so the mesh is ``replicate x shard x tp`` as TorchTitan builds
    it; FSDP runs on the data-parallel ranks ``world_size / tp_size``. See
    [Note: tensor parallel] in tp.py. ``pp_size > 1`` adds a pipeline axis,
    outermost (``pp x replicate x shard x tp``, stages across nodes as TorchTitan
    lays them out): each stage's ranks form the mesh ``stage_mesh()``, and FSDP
    runs on its data-parallel ranks ``world_size / (pp_size * tp_size)``. See
    the pipeline notes.

    [Note: the cp and ep axes of the mesh] ``cp_size > 1`` adds a context-parallel axis between
    the shard group and tp (``pp x replicate x dp_shard x cp x tp``, TorchTitan's order): each
    sequence is split over ``cp_size`` ranks, and FSDP shards over ``dp_shard x cp`` flattened,
    as TorchTitan's ``dp_shard_cp`` (its ``fsdp`` axis): the parameters are the same on every cp
    rank, so the cp ranks join the shard group. ``shard_size`` keeps its meaning (the ranks
    that share one copy of the parameters, FSDP's group) and so includes the cp ranks:
    ``dp_shard = shard_size / cp_size``, and ``cp_size`` must divide ``shard_size``. The ranks
    that read different data are ``batch_size = dp_size / cp_size``. ``ep_size > 1`` splits the
    experts over ``ep_size`` ranks of the ``dp_shard x cp x tp`` ranks, FSDP sharding each
    expert over the other ``efsdp_size = dp_shard x cp x tp / ep_size`` (TorchTitan's sparse
    mesh ``dp_replicate x efsdp x ep``; its rule: ``ep`` divides ``dp_shard x cp x tp``). Both
    are 1 where absent, so plan files from before them read unchanged.
    """

    world_size: int
    ranks_per_node: int
    shard_size: int
    tp_size: int = 1
    pp_size: int = 1
    cp_size: int = 1
    ep_size: int = 1

    def __post_init__(self) -> None:
        for name in ("world_size", "ranks_per_node", "shard_size", "tp_size", "pp_size", "cp_size", "ep_size"):
            check_count(getattr(self, name), f"MeshSpec.{name}")
        if self.world_size % self.pp_size:
            raise OptionError(f"pipeline degree {self.pp_size} does not divide the world of {self.world_size} "
                              "ranks; pass --pp dividing the world size")
        if self.world_size % self.ranks_per_node and self.world_size > self.ranks_per_node:
            raise OptionError(
                f"world size {self.world_size} is not a multiple of {self.ranks_per_node} "
                "ranks per node; pass --gpus-per-node that divides the world size"
            )
        if self.tp_size > 1 and (self.ranks_per_node % self.tp_size or self.world_size % self.tp_size):
            raise OptionError(
                f"tensor-parallel degree {self.tp_size} does not divide the {self.ranks_per_node} ranks per node "
                f"(and the world of {self.world_size}); tensor parallelism runs inside a node: pass --tp 1, 2, 4 or 8 "
                "dividing --gpus-per-node"
            )
        dp = self.world_size // (self.tp_size * self.pp_size)
        if self.world_size % (self.tp_size * self.pp_size) or self.shard_size > dp or dp % self.shard_size:
            raise OptionError(
                f"shard group of {self.shard_size} ranks does not divide the {dp} data-parallel ranks "
                f"(world {self.world_size} / tensor-parallel degree {self.tp_size}"
                f"{f' / pipeline degree {self.pp_size}' if self.pp_size > 1 else ''}); use a divisor of {dp}"
            )
        self._check_cp_ep()

    def _check_cp_ep(self) -> None:
        """The context- and expert-parallel degrees against the shard group. See [Note: the cp
        and ep axes of the mesh]."""
        if self.cp_size > 1 and self.shard_size % self.cp_size:
            works = [k for k in range(2, self.shard_size + 1) if self.shard_size % k == 0][:8]
            raise OptionError(
                f"context-parallel degree {self.cp_size} does not divide the shard group of {self.shard_size} "
                f"ranks (FSDP shards over dp_shard x cp); use cp {', '.join(map(str, works)) or '1'}, "
                "or a shard group that is a multiple of it")
        sparse = self.shard_size * self.tp_size
        if self.ep_size > 1 and sparse % self.ep_size:
            works = [k for k in range(2, sparse + 1) if sparse % k == 0][:8]
            raise OptionError(
                f"expert-parallel degree {self.ep_size} does not divide dp_shard x cp x tp = {sparse} ranks "
                f"(TorchTitan's rule); use ep {', '.join(map(str, works)) or '1'}")

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks of one pipeline stage: the world over the tensor-parallel and
        pipeline degrees."""
        return self.world_size // (self.tp_size * self.pp_size)

    @property
    def replicate_size(self) -> int:
        return self.dp_size // self.shard_size

    @property
    def dp_shard(self) -> int:
        """The shard group without its cp ranks: TorchTitan's ``data_parallel_shard_degree``."""
        return self.shard_size // self.cp_size

    @property
    def batch_size(self) -> int:
        """Ranks of one pipeline stage that read different sequences: the data-parallel ranks over
        the context-parallel degree (``dp_replicate x dp_shard``, TorchTitan's ``batch`` axis)."""
        return self.dp_size // self.cp_size

    @property
    def efsdp_size(self) -> int:
        """Ranks FSDP shards each expert over under expert parallelism: ``dp_shard x cp x tp / ep``."""
        return self.shard_size * self.tp_size // self.ep_size

    def stage_mesh(self) -> "MeshSpec":
        """The ranks of one pipeline stage (this mesh without its pipeline axis); the mesh itself
        when ``pp_size == 1``. A stage smaller than a node keeps its own size as ranks per node."""
        if self.pp_size == 1:
            return self
        ranks = self.world_size // self.pp_size
        return MeshSpec(world_size=ranks, ranks_per_node=min(self.ranks_per_node, ranks),
                        shard_size=self.shard_size, tp_size=self.tp_size, cp_size=self.cp_size, ep_size=self.ep_size)

    @property
    def stages_cross_nodes(self) -> bool:
        """Whether neighbouring pipeline stages talk over the inter-node link."""
        return self.pp_size > 1 and self.world_size // self.pp_size >= self.ranks_per_node

    @property
    def num_nodes(self) -> int:
        return max(1, self.world_size // self.ranks_per_node)

    @property
    def is_hsdp(self) -> bool:
        return self.replicate_size > 1

    def data_parallel(self) -> "MeshSpec":
        """The FSDP part alone: one rank of each tensor-parallel group, ``ranks_per_node /
        tp_size`` of them per node, the cp ranks flattened into the shard group (``dp_shard_cp``)
        and no expert axis. The simulator scores FSDP's collectives on it."""
        if self.pp_size > 1:
            return self.stage_mesh().data_parallel()
        if self.tp_size == 1 and self.cp_size == 1 and self.ep_size == 1:
            return self
        return MeshSpec(world_size=self.dp_size, ranks_per_node=max(1, self.ranks_per_node // self.tp_size),
                        shard_size=self.shard_size)

    def with_tp(self, tp_size: int) -> "MeshSpec":
        """This data-parallel mesh with a tensor-parallel axis of ``tp_size`` under it
        (``world_size`` and ``ranks_per_node`` multiplied by it)."""
        return MeshSpec(world_size=self.world_size * tp_size, ranks_per_node=self.ranks_per_node * tp_size,
                        shard_size=self.shard_size, tp_size=self.tp_size * tp_size, pp_size=self.pp_size,
                        cp_size=self.cp_size, ep_size=self.ep_size)

    def with_cp(self, cp_size: int, ep_size: int | None = None) -> "MeshSpec":
        """This mesh with its shard group split as ``dp_shard x cp`` (``cp_size`` dividing the
        shard group; the world unchanged), and ``ep_size`` (None: this mesh's)."""
        return MeshSpec(world_size=self.world_size, ranks_per_node=self.ranks_per_node, shard_size=self.shard_size,
                        tp_size=self.tp_size, pp_size=self.pp_size, cp_size=cp_size,
                        ep_size=self.ep_size if ep_size is None else ep_size)

    def with_pp(self, pp_size: int) -> "MeshSpec":
        """This mesh as one stage of ``pp_size`` stages (``world_size`` multiplied by it; the
        stages sit side by side, across nodes once a stage fills a node)."""
        return MeshSpec(world_size=self.world_size * pp_size,
                        ranks_per_node=self.ranks_per_node, shard_size=self.shard_size, tp_size=self.tp_size,
                        pp_size=self.pp_size * pp_size, cp_size=self.cp_size, ep_size=self.ep_size)

    @property
    def shape(self) -> tuple[int, ...]:
        """The ``DeviceMesh`` shape, outermost first, matching ``axis_names``. Under cp the shard
        axis is ``dp_shard`` alone and FSDP runs on ``("shard", "cp")`` flattened."""
        return tuple(n for n, keep in ((self.pp_size, self.pp_size > 1), (self.replicate_size, self.is_hsdp),
                                       (self.dp_shard, True), (self.cp_size, self.cp_size > 1),
                                       (self.tp_size, self.tp_size > 1)) if keep)

    @property
    def axis_names(self) -> tuple[str, ...]:
        return tuple(n for n, keep in (("pp", self.pp_size > 1), ("replicate", self.is_hsdp), ("shard", True),
                                       ("cp", self.cp_size > 1), ("tp", self.tp_size > 1)) if keep)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "world_size": self.world_size,
            "ranks_per_node": self.ranks_per_node,
            "shard_size": self.shard_size,
        }
        if self.tp_size > 1:
            out["tp_size"] = self.tp_size
        if self.pp_size > 1:
            out["pp_size"] = self.pp_size
        if self.cp_size > 1:
            out["cp_size"] = self.cp_size
        if self.ep_size > 1:
            out["ep_size"] = self.ep_size
        out["shape"], out["axis_names"] = list(self.shape), list(self.axis_names)
        return out


@dataclass(frozen=True, slots=True)
class UnitSpec:
    """One FSDP unit: ``fully_shard(modules)`` with its per-unit choices.

    ``modules == (ROOT,)`` is the root unit. Several modules form one unit
    through ``fully_shard([m1, m2, ...])`` (contiguous blocks, tied groups).
    """

    modules: tuple[str, ...]
    # True: free after forward, re-gather in backward. False: keep until
    # backward. An int N: reshard to groups of N ranks (hpZ-style re-gather).
    # Plans give the root False, FSDP2's own default for the root.
    reshard_after_forward: bool | int = True
    # Activation checkpointing of the unit's modules: one of CHECKPOINT_MODES (False, True, SELECTIVE_OP).
    checkpoint: bool | str = False

    def __post_init__(self) -> None:
        if self.checkpoint not in CHECKPOINT_MODES or not isinstance(self.checkpoint, (bool, str)):
            raise OptionError(f"unit {self.name}: checkpoint must be false, true or {SELECTIVE_OP!r}, got "
                              f"{self.checkpoint!r}; use True for full activation checkpointing")

    @property
    def full_checkpoint(self) -> bool:
        """Every activation of the unit recomputed in backward (``checkpoint is True``)."""
        return self.checkpoint is True

    @property
    def selective_checkpoint(self) -> bool:
        """Matmul and attention outputs kept, the rest recomputed (``checkpoint == SELECTIVE_OP``)."""
        return self.checkpoint == SELECTIVE_OP

    @property
    def is_root(self) -> bool:
        return self.modules == (ROOT,)

    @property
    def name(self) -> str:
        if self.is_root:
            return "<root>"
        if len(self.modules) == 1:
            return self.modules[0]
        return f"{self.modules[0]}..{self.modules[-1].rsplit('.', 1)[-1]}"


TP_STYLES = ("colwise", "rowwise")


@dataclass(frozen=True, slots=True)
class TPSpec:
    """How tensor parallelism cuts each block: ``layers`` maps a block class to
    ``(submodule path relative to the block, style)`` pairs, style ``"colwise"``
    (``ColwiseParallel``: output features split, input replicated) or ``"rowwise"``
    (``RowwiseParallel``: input features split, output all-reduced). Every module of
    a listed class is parallelised; other modules (embeddings, the head, norms)
    are replicated over the tensor-parallel ranks unless ``sequence_parallel``.
    ``source``: "builtin" (recognised by wrapopt) or "user". See [Note: tensor
    parallel] in tp.py (which recognises and checks these plans).

    ``sequence_parallel``: TorchTitan's sequence parallelism around the split
    projections (norms and residuals on 1/tp of the sequence, the embedding split
    over the vocabulary, the head column-wise); ``loss_parallel``: the logits stay
    split over the vocabulary and the loss runs on the shards; ``async_tp``: the
    tensor-parallel collectives micro-pipelined with the projections' matmuls
    (torch's symmetric memory, NVLink GPUs only). Each is False where absent (plan
    files from before they existed ran without). See [Note: sequence parallel].
    """

    layers: tuple[tuple[str, tuple[tuple[str, str], ...]], ...]
    source: str = "builtin"
    sequence_parallel: bool = False
    loss_parallel: bool = False
    async_tp: bool = False

    def __post_init__(self) -> None:
        for cls, pairs in self.layers:
            bad = [f"{path}={style!r}" for path, style in pairs if style not in TP_STYLES]
            if bad:
                raise ValueError(f"TP plan for {cls}: unknown style(s) {', '.join(bad)}; "
                                 f"use one of {', '.join(TP_STYLES)}")
            if not pairs:
                raise ValueError(f"TP plan for {cls} lists no submodules")

    def styles(self, cls: str) -> dict[str, str]:
        """The plan of one block class (empty when the class is not listed)."""
        return dict(next((p for c, p in self.layers if c == cls), ()))

    def switches(self) -> str:
        """"sequence and loss parallel, async TP": the switches as a phrase for reports."""
        on = [w for w, f in (("sequence", self.sequence_parallel), ("loss", self.loss_parallel)) if f]
        text = f"{' and '.join(on)} parallel" if on else "no sequence or loss parallel"
        return text + (", async TP" if self.async_tp else "")

    def to_json(self) -> dict[str, Any]:
        return {"source": self.source, "layers": {cls: dict(pairs) for cls, pairs in self.layers},
                "sequence_parallel": self.sequence_parallel, "loss_parallel": self.loss_parallel,
                "async_tp": self.async_tp}


PP_SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B")


@dataclass(frozen=True, slots=True)
class PipelineSpec:
    """Pipeline stages and their schedule (a plan on a mesh with ``pp_size > 1``).

    ``stages`` lists, per stage in the order the data flows, the modules the stage
    owns (module paths; the first stage holds the embeddings and its first blocks, the last
    its last blocks, the final norm and the head). With ``len(stages) == k * pp_size``
    (``k`` virtual stages per rank, interleaved schedules) stage ``s`` runs on pipeline rank
    ``s % pp_size``, as torch's looped schedules place them. ``schedule`` names a
    ``torch.distributed.pipelining`` schedule (``Schedule`` + the name); ``microbatches`` is
    the number of micro-batches one step splits each rank's batch into. See the pipeline
    notes (cost/pipeline.py).
    """

    stages: tuple[tuple[str, ...], ...]
    schedule: str = "1F1B"
    microbatches: int = 1

    def __post_init__(self) -> None:
        check_count(self.microbatches, "PipelineSpec.microbatches")
        if self.schedule not in PP_SCHEDULES:
            raise OptionError(f"unknown pipeline schedule {self.schedule!r}; use one of {', '.join(PP_SCHEDULES)}")
        if len(self.stages) < 2:
            raise OptionError(f"a pipeline needs at least 2 stages, got {len(self.stages)}")
        empty = [i for i, s in enumerate(self.stages) if not s]
        if empty:
            raise OptionError(f"pipeline stage(s) {empty} own no modules")

    def virtual_stages(self, pp_size: int) -> int:
        """Stages per pipeline rank (1 unless the schedule is interleaved)."""
        return len(self.stages) // pp_size

    def stage_of(self) -> dict[str, int]:
        """Each listed module's stage."""
        return {m: i for i, mods in enumerate(self.stages) for m in mods}

    def to_json(self) -> dict[str, Any]:
        return {"schedule": self.schedule, "microbatches": self.microbatches,
                "stages": [list(s) for s in self.stages]}


@dataclass(frozen=True, slots=True)
class PlanSpec:
    """A complete wrapping decision: the units (root last) and the mesh."""

    units: tuple[UnitSpec, ...]
    mesh: MeshSpec
    # Explicit forward prefetch depth (``set_modules_to_forward_prefetch``);
    # 0 leaves FSDP2's implicit behaviour.
    forward_prefetch: int = 0
    label: str = ""
    # Tensor parallelism inside blocks; set exactly when ``mesh.tp_size > 1``.
    tp: TPSpec | None = None
    # Pipeline stages and schedule; set exactly when ``mesh.pp_size > 1``. The units then
    # cover every stage, none across two, and the root unit's choices are each stage root's.
    pipeline: PipelineSpec | None = None
    # FSDP2's CPUOffloadPolicy on every unit: sharded parameters, gradients and optimizer
    # state in host memory, the optimizer stepping on the CPU. GPU meshes only. See
    # [Note: CPU offload] in cost/state.py.
    offload: bool = False

    def __post_init__(self) -> None:
        if (self.tp is not None) != (self.mesh.tp_size > 1):
            raise ValueError(f"a plan on a mesh with tp_size {self.mesh.tp_size} needs "
                             f"{'a' if self.mesh.tp_size > 1 else 'no'} TPSpec (PlanSpec.tp)")
        if (self.pipeline is not None) != (self.mesh.pp_size > 1):
            raise ValueError(f"a plan on a mesh with pp_size {self.mesh.pp_size} needs "
                             f"{'a' if self.mesh.pp_size > 1 else 'no'} PipelineSpec (PlanSpec.pipeline)")
        if self.pipeline is not None and len(self.pipeline.stages) % self.mesh.pp_size:
            raise OptionError(f"{len(self.pipeline.stages)} pipeline stages do not share out over "
                              f"{self.mesh.pp_size} pipeline ranks; use a multiple of {self.mesh.pp_size}")

    @property
    def root(self) -> UnitSpec:
        return self.units[-1]
