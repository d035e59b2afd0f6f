"""The parallel shape asked for, as one value (``ParallelRequest``), and one resolved layout (``Shape``).

[Note: the parallel request] A training job's layout is one value, as TorchTitan's
``ParallelDims`` is: every parallelism axis (data-parallel shard and replicate, tensor with its
sequence-parallel flag, pipeline, context, expert), each a degree or ``"auto"``, beside the batch,
the memory budget and the training step. The API and the CLI build it once from their arguments;
it is checked once, in ``__post_init__``, and every bad field is named on its own line of one
``OptionError``. Everything below the entry points takes the request (``wrapopt.job.prepare``,
the search) or one resolved ``Shape`` (a cost view, a plan's mesh). A new axis is a field here, a
dimension of the shape generator and a cost view: not a keyword threaded through every layer.

Only what the request alone can tell is checked here (a degree's syntax, that it divides the
world and, for tensor parallelism, the node); what needs the model (heads divisible by the
degree, blocks to pipeline) is checked where the model is known (``search/tp.py``,
``search/pipeline.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from wrapopt.errors import OptionError
from wrapopt.fileio import given_budget
from wrapopt.spec.plan import MeshSpec

__all__ = ["AUTO", "GlobalBatch", "ParallelRequest", "Shape", "parse_degree"]

AUTO = "auto"  # a degree the search chooses


def parse_degree(value: Any, flag: str) -> int | str:
    """``value`` (None, an int, or text such as ``"4"`` or ``"auto"``) as a degree: ``"auto"`` or a
    positive int (None is 1). Raises ``OptionError`` naming ``flag`` otherwise: 2.5 is not cut to 2,
    nor True read as 1."""
    if value is None:
        return 1
    if isinstance(value, str) and value.strip() == AUTO:
        return AUTO
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise OptionError(f"{flag} must be auto or a positive integer, got {value!r}")
    text = str(value).strip()
    if not text.isdigit() or int(text) < 1:
        raise OptionError(f"{flag} must be auto or a positive integer, got {value!r}")
    return int(text)


@dataclass(frozen=True, slots=True, kw_only=True)
class Shape:
    """One layout of the world the search scores: the degree of every axis, in TorchTitan's mesh
    order ``pp x dp_replicate x dp_shard x cp x tp`` (pipeline outermost, tensor innermost)."""

    pp: int = 1
    tp: int = 1
    cp: int = 1
    ep: int = 1  # experts split over ``ep`` ranks of the data-parallel (x cp) ranks, as TorchTitan's ``efsdp x ep``
    micro_batch: int | None = None  # sequences per data-parallel rank per micro-batch (None: the traced batch)
    accumulation: int = 1  # micro-batches per optimizer step

    def dp(self, world_size: int) -> int:
        """Data-parallel ranks (shard x replicate) of ``world_size`` ranks: what FSDP runs over."""
        return world_size // (self.pp * self.tp * self.cp)

    def misfit(self, world_size: int) -> str:
        """Why ``world_size`` ranks cannot take this shape ("" when they can): ``pp x tp x cp`` divides
        them, and ``ep`` divides a stage's data-parallel ranks (the ep view prices tp 1 only)."""
        if world_size % (self.pp * self.tp * self.cp) == 0 and (world_size // (self.pp * self.tp)) % self.ep == 0:
            return ""
        return (f"{self.describe().replace(' ', ' x ')} does not divide the world of {world_size} ranks"
                + (f" (ep within a stage's {world_size // self.pp} ranks)" if self.ep > 1 else ""))

    def describe(self) -> str:
        """``pp2 tp4`` (the axes above 1; ``1-D`` when none is)."""
        axes = [f"{name}{d}" for name, d in (("pp", self.pp), ("tp", self.tp), ("cp", self.cp), ("ep", self.ep))
                if d > 1]
        return " ".join(axes) or "1-D"


@dataclass(frozen=True, slots=True)
class GlobalBatch:
    """A fixed global batch, ``sequences = micro_batch x accumulation x data-parallel ranks``, and
    the part of that split the user fixed (None: chosen by the search). See [Note: global batch
    search] in search/batch.py."""

    sequences: int  # per optimizer step, over every data-parallel rank
    micro_batch: int | None = None  # sequences per data-parallel rank per micro-batch
    accumulation: int | None = None  # micro-batches per optimizer step

    def __post_init__(self) -> None:
        if isinstance(self.sequences, bool) or not isinstance(self.sequences, int) or self.sequences < 1:
            raise OptionError(f"--global-batch must be a positive integer (sequences per step), got {self.sequences!r}")

    def describe_fixed(self) -> str:
        """", micro-batch 2, accumulation 4": what the user fixed, for messages."""
        return (f", micro-batch {self.micro_batch}" if self.micro_batch else "") + (
            f", accumulation {self.accumulation}" if self.accumulation else "")


@dataclass(frozen=True, kw_only=True)
class ParallelRequest:
    """The parallel shape, batch, budget and step a job asks for. See [Note: the parallel request].

    Example:
        >>> from wrapopt.spec import MeshSpec
        >>> req = ParallelRequest(mesh=MeshSpec(world_size=64, ranks_per_node=8, shard_size=64), tp="auto")
        >>> req.searches_tp, req.pp
        (True, 1)
    """

    mesh: MeshSpec  # the world and its nodes; FSDP over every data-parallel rank unless ``dp_shard`` says otherwise
    dp_shard: int | None = None  # the shard group (HSDP below the data-parallel ranks); None: searched
    tp: int | str = 1  # tensor-parallel degree inside a node, or "auto"
    # Under TP (See [Note: sequence parallel] in tp.py): norms and residuals split on the sequence,
    # logits split over the vocabulary, TP's collectives micro-pipelined with the matmuls ("auto": where
    # the GPU supports it). Each is read only when tp is not 1.
    sequence_parallel: bool = True
    loss_parallel: bool = True
    async_tp: bool | str = AUTO
    tp_plan: Any = None  # ``TPSpec``: how blocks split (None: the recognised one, ``tp.builtin_tp_plan``)
    pp: int | str = 1  # pipeline degree, or "auto"
    cp: int | str = 1  # context-parallel degree, or "auto" (See [Note: the cp and ep axes of the mesh] in spec/plan.py)
    ep: int | str = 1  # expert-parallel degree, or "auto"
    global_batch: int | None = None  # sequences per optimizer step, fixed: micro-batch x accumulation chosen
    # bytes, "80GiB", "auto" (the device's capacity less headroom, when known; None says the same) or
    # "none" (no limit); resolved against the compute profile by ``wrapopt.job.prepare``
    memory_budget: float | int | str | None = None
    train: Any = None  # ``TrainConfig``: precision, accumulation, micro-batch, optimizer (None: the default step)
    offload: bool = False  # FSDP2's CPU offload searched too (See [Note: offload search] in search/offload.py)
    host_memory: int | None = None  # bytes of host memory per node for ``offload`` (None: the GPU preset's)

    def __post_init__(self) -> None:
        problems: list[str] = []
        for name, flag in (("tp", "--tp"), ("pp", "--pp"), ("cp", "--cp"), ("ep", "--ep")):
            try:
                object.__setattr__(self, name, parse_degree(getattr(self, name), flag))
            except OptionError as e:
                problems.append(str(e))
        problems += self._axis_problems()
        if self.global_batch is not None and (isinstance(self.global_batch, bool)
                                              or not isinstance(self.global_batch, int) or self.global_batch < 1):
            problems.append(f"--global-batch must be at least 1 (sequences per optimizer step), "
                            f"got {self.global_batch!r}")
        if self.dp_shard is not None and (self.dp_shard < 1 or self.mesh.world_size % self.dp_shard):
            problems.append(f"--shard-size {self.dp_shard} must divide the world of {self.mesh.world_size} ranks")
        if not _budget_word(self.memory_budget):
            try:
                given_budget(self.memory_budget)
            except OptionError as e:
                problems.append(str(e))
        if self.host_memory is not None and not self.offload:
            problems.append("--host-memory is only read with --offload; add --offload to search CPU offload")
        if problems:
            raise OptionError("\n".join(problems) if len(problems) == 1 else
                              "the parallel request has bad fields:\n  " + "\n  ".join(problems))

    def _axis_problems(self) -> list[str]:
        """One line per axis whose degree the mesh alone rules out."""
        out = []
        world, per_node = self.mesh.world_size, self.mesh.ranks_per_node
        if isinstance(self.tp, int) and self.tp > 1 and (per_node % self.tp or world % self.tp):
            out.append(f"--tp {self.tp} does not divide the {per_node} GPUs per node (world {world}): tensor "
                       "parallelism runs inside a node; pass --tp with a divisor of --gpus-per-node, or auto")
        if isinstance(self.pp, int) and self.pp > 1 and world % self.pp:
            works = [k for k in range(2, world + 1) if world % k == 0][:8]
            out.append(f"--pp {self.pp} does not divide the world of {world} ranks; degrees that do: "
                       f"{', '.join(map(str, works))}")
        rest = world  # the ranks the fixed tp and pp degrees leave (those that divide it)
        for d in (self.tp, self.pp):
            rest //= d if isinstance(d, int) and d > 0 and rest % d == 0 else 1
        for name, what in (("cp", "context"), ("ep", "expert")):
            d = getattr(self, name)
            if isinstance(d, int) and d > 1 and rest % d:
                works = [k for k in range(2, rest + 1) if rest % k == 0][:8]
                out.append(f"--{name} {d}: the {what}-parallel degree does not divide the {rest} ranks left by "
                           f"tp and pp (world {world}); degrees that do: {', '.join(map(str, works)) or 'none'}")
        if self.cp != 1 and self.ep != 1 and self.global_batch is not None:
            out.append(f"--cp {self.cp} with --ep {self.ep} and --global-batch: context and expert parallelism "
                       "together are searched per local batch only; drop --global-batch (give --batch), or pass one "
                       "of them as 1")
        for name in ("sequence_parallel", "loss_parallel"):
            if not isinstance(getattr(self, name), bool):
                out.append(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.async_tp not in (True, False, AUTO):
            out.append(f"async_tp must be True, False or \"auto\", got {self.async_tp!r}")
        return out

    @property
    def searches_tp(self) -> bool:
        """The tensor-parallel degree is chosen by the search."""
        return self.tp == AUTO

    @property
    def searches_pp(self) -> bool:
        """The pipeline degree is chosen by the search."""
        return self.pp == AUTO

    @property
    def asks_tp(self) -> bool:
        """Tensor parallelism is asked for (a degree above 1, or auto)."""
        return self.tp != 1

    @property
    def searches_cp(self) -> bool:
        """The context-parallel degree is chosen by the search."""
        return self.cp == AUTO

    @property
    def searches_ep(self) -> bool:
        """The expert-parallel degree is chosen by the search."""
        return self.ep == AUTO

    @property
    def asks_cp(self) -> bool:
        """Context parallelism is asked for (a degree above 1, or auto)."""
        return self.cp != 1

    @property
    def asks_ep(self) -> bool:
        """Expert parallelism is asked for (a degree above 1, or auto)."""
        return self.ep != 1

    @property
    def asks_pp(self) -> bool:
        """A pipeline is asked for (a degree above 1, or auto)."""
        return self.pp != 1

    @property
    def batch(self) -> GlobalBatch | None:
        """The fixed global batch and what of its split the step fixes (None: no global batch fixed):
        the step's micro-batch, and its accumulation when above 1."""
        if self.global_batch is None:
            return None
        return GlobalBatch(self.global_batch, self.micro_batch, self.accumulation if self.accumulation > 1 else None)

    @property
    def micro_batch(self) -> int | None:
        """Sequences per data-parallel rank per micro-batch, when fixed (the training step's)."""
        return getattr(self.train, "micro_batch", None)

    @property
    def accumulation(self) -> int:
        """Micro-batches per optimizer step (the training step's)."""
        return getattr(self.train, "grad_accumulation", 1)


def _budget_word(budget: Any) -> bool:
    """None, "auto" or "none": a budget resolved against the device, not a size."""
    return budget is None or (isinstance(budget, str) and budget.strip().lower() in ("auto", "none"))
