"""Frozen dataclasses passed between the pipeline stages.

Stages import this module (and ``fabric``, ``errors``), never each other; see
``docs/design.md`` for who produces and who consumes each type.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import networkx as nx

from wrapopt.checks import check_count
from wrapopt.errors import OptionError

__all__ = [
    "ModuleInfo",
    "ModelGraph",
    "MeshSpec",
    "UnitSpec",
    "PlanSpec",
    "OptimizerKind",
    "SYNC_MODES",
    "factored_state_numel",
    "SimOptions",
    "UnitCost",
    "UnitCosts",
    "TimelineEvent",
    "CostEstimate",
    "ROOT",
]

ROOT = ""  # the FQN of the root module, as in ``named_modules()``


@dataclass(frozen=True, slots=True)
class ModuleInfo:
    """What the tracer learned about one module. FLOPs and bytes are *self*
    figures (this module's own ops, children excluded) unless named ``total_``."""

    fqn: str
    cls: str
    parent: str | None  # None for the root
    children: tuple[str, ...]
    depth: int
    # Parameters registered directly on this module, after de-duplication of
    # tied parameters (a tied parameter is counted at its first FQN only).
    own_numel: int
    own_bytes: int
    own_trainable_numel: int
    own_trainable_bytes: int
    own_bytes_by_dtype: tuple[tuple[str, int], ...]
    total_numel: int  # own + all descendants, de-duplicated
    total_bytes: int
    fwd_flops: float  # summed over all calls of this module in one step
    bwd_flops: float
    saved_bytes: int  # activations saved for backward by this module's own ops
    output_bytes: int  # bytes of the module's outputs (first call)
    order: int  # position of the first call in forward order; -1 if never called
    num_calls: int
    input_bytes: int = 0  # bytes of the module's floating-point inputs (first call)
    # Bytes moved by its ops that have no FLOP formula (memory-bound: norms, activations,
    # adds, copies), summed over calls; See [Note: memory-bound ops] in trace/op_bytes.py.
    fwd_bytes: int = 0
    bwd_bytes: int = 0
    # Experts whose weights this module holds stacked (a 3-D parameter whose leading dimension
    # its forward's grouped or batched matmul splits per expert); 0 for other modules.
    # See [Note: experts on meta] in trace/ops.py.
    experts: int = 0


@dataclass(frozen=True, slots=True)
class ModelGraph:
    """The model as the later stages see it: a module tree with costs.

    ``tree`` is a networkx DiGraph with parent -> child edges keyed by FQN; the
    node attribute ``info`` holds the ``ModuleInfo``. ``modules`` lists the
    same infos in ``named_modules()`` order.
    """

    model_class: str
    modules: tuple[ModuleInfo, ...]
    tree: nx.DiGraph = field(compare=False, repr=False)
    # Groups of FQNs of one shared parameter (tied embeddings, shared layers).
    tied_groups: tuple[tuple[str, ...], ...]
    # Repeated-block chains: runs of same-class siblings in a ModuleList or
    # Sequential ("transformer blocks"), each in execution order; an
    # encoder-decoder has two. Chains never nest.
    block_chains: tuple[tuple[str, ...], ...]
    param_shapes: tuple[tuple[str, tuple[int, ...], str], ...]  # (fqn, shape, dtype)
    input_bytes: int
    estimates: tuple[str, ...] = ()  # figures that are estimates, and why
    # The model's torch.fx GraphModule from torch.export on fake tensors, when the
    # tracer kept one; each call_function node has meta["module_fqn"].
    fx_graph: Any = field(default=None, compare=False, repr=False)
    # Module dataflow: an edge A -> B (bytes, num_values, first_op) when a value an op
    # of module A produced is read by an op of module B; nodes are the innermost
    # modules owning ops ("" for the root's own ops). See [Note: dataflow] in trace_fx.
    dataflow: nx.DiGraph | None = field(default=None, compare=False, repr=False)
    # The loss runs after forward, outside every module: what it saves for backward
    # (e.g. log_softmax's output) and the most bytes it creates alive at once.
    loss_saved_bytes: int = 0
    loss_peak_bytes: int = 0
    # (module, user): the forward of ``user`` reads parameters registered on ``module``
    # (another module, not tied to it): nn.MultiheadAttention reads its out_proj's weight.
    # FSDP2 gathers a unit's parameters when one of its modules' forward runs, so such a
    # module must share its user's unit. See [Note: parameter users] in units.py.
    param_users: tuple[tuple[str, str], ...] = ()
    # The loss the trace ran, as the report names it, and its kind (losses.LOSS_KINDS):
    # the user's loss_fn, the model's own, or a default. See [Note: the assumed loss] in losses.py.
    loss: str = ""
    loss_kind: str = ""
    # The traced per-rank batch: the first input's leading dim, and the sequence length
    # when an input is 2-D integer tokens (0: unknown / not a token model).
    batch_size: int = 0
    seq_len: int = 0
    # (module, heads, key-value heads) of attention modules, read from their attributes
    # (n_heads / num_heads / num_attention_heads, n_kv / num_key_value_heads): a
    # tensor-parallel degree must divide both. See [Note: tensor parallel] in tp.py.
    attention_heads: tuple[tuple[str, int, int], ...] = ()

    @property
    def blocks(self) -> tuple[str, ...]:
        return tuple(b for chain in self.block_chains for b in chain)

    @property
    def block_classes(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(self.info(c[0]).cls for c in self.block_chains))

    def info(self, fqn: str) -> ModuleInfo:
        return self.tree.nodes[fqn]["info"]

    @property
    def root(self) -> ModuleInfo:
        return self.info(ROOT)

    @property
    def num_params(self) -> int:
        return self.root.total_numel

    @property
    def param_bytes(self) -> int:
        return self.root.total_bytes

    @property
    def trainable_bytes(self) -> int:
        return sum(m.own_trainable_bytes for m in self.modules)

    def subtree(self, fqn: str) -> list[str]:
        """FQNs of ``fqn`` and all its descendants, in ``named_modules()`` order."""
        if fqn == ROOT:
            return [m.fqn for m in self.modules]
        prefix = fqn + "."
        return [m.fqn for m in self.modules if m.fqn == fqn or m.fqn.startswith(prefix)]

    @property
    def multi_called(self) -> tuple[str, ...]:
        """Modules called more than once in one forward (shared layers, loops)."""
        return tuple(m.fqn for m in self.modules if m.num_calls > 1)

    @property
    def never_called(self) -> tuple[str, ...]:
        """Modules that did not run in forward, other than containers some of whose parts ran."""
        has_called_part = set()
        for m in self.modules:
            if m.order >= 0:
                parts = m.fqn.split(".")
                has_called_part.update(".".join(parts[:i]) for i in range(1, len(parts)))
        return tuple(m.fqn for m in self.modules if m.order < 0 and m.fqn != ROOT and m.fqn not in has_called_part)

    def call_order(self) -> list[ModuleInfo]:
        """Modules that ran, in forward order of their first call."""
        return sorted((m for m in self.modules if m.order >= 0), key=lambda m: m.order)


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
    [Note: tensor parallel] in tp.py.
    """

    world_size: int
    ranks_per_node: int
    shard_size: int
    tp_size: int = 1

    def __post_init__(self) -> None:
        for name in ("world_size", "ranks_per_node", "shard_size", "tp_size"):
            check_count(getattr(self, name), f"MeshSpec.{name}")
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
        dp = self.world_size // self.tp_size
        if self.shard_size > dp or dp % self.shard_size:
            raise OptionError(
                f"shard group of {self.shard_size} ranks does not divide the {dp} data-parallel ranks "
                f"(world {self.world_size} / tensor-parallel degree {self.tp_size}); use a divisor of {dp}"
            )

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks: the world over the tensor-parallel degree."""
        return self.world_size // self.tp_size

    @property
    def replicate_size(self) -> int:
        return self.world_size // (self.shard_size * self.tp_size)

    @property
    def num_nodes(self) -> int:
        return max(1, self.world_size // self.ranks_per_node)

    @property
    def is_hsdp(self) -> bool:
        return self.replicate_size > 1

    def data_parallel(self) -> "MeshSpec":
        """The FSDP part alone: one rank of each tensor-parallel group, ``ranks_per_node /
        tp_size`` of them per node. The simulator scores FSDP's collectives on it."""
        if self.tp_size == 1:
            return self
        return MeshSpec(world_size=self.dp_size, ranks_per_node=max(1, self.ranks_per_node // self.tp_size),
                        shard_size=self.shard_size)

    def with_tp(self, tp_size: int) -> "MeshSpec":
        """This data-parallel mesh with a tensor-parallel axis of ``tp_size`` under it
        (``world_size`` and ``ranks_per_node`` multiplied by it)."""
        return MeshSpec(world_size=self.world_size * tp_size, ranks_per_node=self.ranks_per_node * tp_size,
                        shard_size=self.shard_size, tp_size=self.tp_size * tp_size)

    @property
    def shape(self) -> tuple[int, ...]:
        """The ``DeviceMesh`` shape, outermost first, matching ``axis_names``."""
        return tuple(n for n, keep in ((self.replicate_size, self.is_hsdp), (self.shard_size, True),
                                       (self.tp_size, self.tp_size > 1)) if keep)

    @property
    def axis_names(self) -> tuple[str, ...]:
        return tuple(n for n, keep in (("replicate", self.is_hsdp), ("shard", True), ("tp", self.tp_size > 1)) if keep)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "world_size": self.world_size,
            "ranks_per_node": self.ranks_per_node,
            "shard_size": self.shard_size,
        }
        if self.tp_size > 1:
            out["tp_size"] = self.tp_size
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
    checkpoint: bool = False  # activation checkpointing of the unit's modules

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
    tp: Any = None  # a ``wrapopt.tp.TPSpec``

    def __post_init__(self) -> None:
        if (self.tp is not None) != (self.mesh.tp_size > 1):
            raise ValueError(f"a plan on a mesh with tp_size {self.mesh.tp_size} needs "
                             f"{'a' if self.mesh.tp_size > 1 else 'no'} TPSpec (PlanSpec.tp)")

    @property
    def root(self) -> UnitSpec:
        return self.units[-1]


class OptimizerKind(enum.Enum):
    """The optimizer the step ends with. Its state, per trainable parameter element,
    in the parameter's storage dtype, as the torch optimizers keep it (checked
    against them by ``tests/test_train.py``); the scalar ``step`` tensor per
    parameter tensor is not counted."""

    ADAMW = "adamw"  # exp_avg, exp_avg_sq
    ADAM = "adam"  # the same two
    SGD_MOMENTUM = "sgd-momentum"  # momentum_buffer
    SGD = "sgd"  # no state
    ADAFACTOR = "adafactor"  # factored: a row and a column vector per matrix, a full one per vector
    NONE = "none"  # no optimizer step at all

    @property
    def states_per_param(self) -> int:
        """Elementwise states (Adafactor's factored state is counted from the shapes:
        ``factored_state_numel``)."""
        return _STATES[self]


_STATES = {OptimizerKind.ADAMW: 2, OptimizerKind.ADAM: 2, OptimizerKind.SGD_MOMENTUM: 1, OptimizerKind.SGD: 0,
           OptimizerKind.ADAFACTOR: 0, OptimizerKind.NONE: 0}


def factored_state_numel(shape: tuple[int, ...]) -> int:
    """Elements of Adafactor's state for a parameter of ``shape`` (``torch.optim.Adafactor``:
    ``row_var`` and ``col_var`` over the last two dims of a matrix, ``variance`` of a vector)."""
    if len(shape) < 2:
        return math.prod(shape)
    lead = math.prod(shape[:-2])
    return lead * shape[-2] + lead * shape[-1]


SYNC_MODES = ("every", "last")  # gradient synchronisation under accumulation: See [Note: accumulation sync]


@dataclass(kw_only=True)
class SimOptions:
    """Knobs of the step being simulated (not of the plan)."""

    optimizer: OptimizerKind = OptimizerKind.ADAMW
    param_dtype_bytes: int | None = None  # mixed precision: bytes per gathered element
    reduce_dtype_bytes: int | None = None  # bytes per reduce-scattered element
    grad_accumulation: int = 1  # micro-batches per step
    batch_scale: float = 1.0  # per-rank batch relative to the traced batch
    # With grad_accumulation > 1: reduce-scatter after every micro-batch ("every"), or
    # after the last only, holding unsharded gradients in between ("last"); None: the
    # faster that fits memory_budget_bytes, per plan. See [Note: accumulation sync].
    accumulation_sync: str | None = "last"
    memory_budget_bytes: float | None = None  # only for accumulation_sync=None; None: no limit
    # Bytes per element of the activations (the forward runs in param_dtype under FSDP2's
    # mixed precision) and of the model's output (output_dtype); None: as traced.
    activation_dtype_bytes: int | None = None
    output_dtype_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.grad_accumulation < 1:
            raise ValueError(f"grad_accumulation must be >= 1, got {self.grad_accumulation}")
        if self.batch_scale <= 0:
            raise ValueError(f"batch_scale must be positive, got {self.batch_scale}")
        if self.accumulation_sync is not None and self.accumulation_sync not in SYNC_MODES:
            raise ValueError(f"accumulation_sync must be one of {', '.join(SYNC_MODES)} or None, got {self.accumulation_sync!r}")


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
