"""The traced model: ``ModelGraph``, its modules (``ModuleInfo``) and what the tracer
kept beside the figures (``TraceRecord``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import networkx as nx

__all__ = ["ROOT", "TILE", "ModuleInfo", "TraceRecord", "ModelGraph"]

# Output tile edge of the tensor-core GEMM kernels (cuBLAS/CUTLASS bf16 tiles are 128 or 256 wide): the
# tracer counts each matmul's tiles by it (trace/kernels.py) and the tensor-parallel view its split shapes'.
TILE = 128

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
    # Its forward matmuls, (FLOPs, elements of A, B and C, bytes per element, 128x128 output tiles, calls)
    # per shape, and its attention kernels' FLOPs as counted (in fwd_flops) and as run (causal: half):
    # the kernel roofline prices them. See [Note: kernel roofline] in cost/roofline.py.
    matmuls: tuple[tuple[float, int, int, int, int], ...] = ()
    attention_flops: float = 0.0
    attention_run_flops: float = 0.0
    # Elements of K and V its attention kernels read, over all calls (with ``enable_gqa``, at the keys' own
    # heads): what context parallelism gathers. See [Note: context parallel costs] in cost/cp.py.
    attention_kv_elements: float = 0.0
    # Bytes of the outputs of its forward matmuls and attention kernels (each storage once, over all
    # calls): what selective-op checkpointing keeps of it. See [Note: selective checkpointing] in
    # wrapopt/selective.py.
    selective_kept_bytes: int = 0
    # Of those kept bytes, the share no later op of its block reads but additions (torch.compile's partitioner
    # does not save them: See [Note: compile keeps what backward reads] in wrapopt/selective.py); and the share
    # of its forward matmuls' FLOPs selective-op recomputes (every second mm: See [Note: selective checkpointing]).
    selective_unread: float = 0.0
    selective_mm_recompute: float = 0.0
    # Aten ops its forward ran (its own, over all calls), as a dispatch mode sees them: selective-op
    # checkpointing pays a per-op cost for each. See [Note: selective checkpointing] in wrapopt/selective.py.
    fwd_ops: int = 0
    # What non-reentrant checkpoint's early stop leaves out of this module's recompute: (module of its
    # subtree, itself included, share of that module's forward it skips). See [Note: early stop] in
    # trace/record.py.
    early_stop: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True, slots=True)
class TraceRecord:
    """Tracer by-products: graphs the tracer kept beside the figures of ``ModelGraph``,
    for reports and diagnostics. No later stage's figures depend on them."""

    # The model's torch.fx GraphModule from torch.export on fake tensors, when the
    # tracer kept one; each call_function node has meta["module_fqn"].
    fx_graph: Any = None
    # Module dataflow: an edge A -> B (bytes, num_values, first_op) when a value an op
    # of module A produced is read by an op of module B; nodes are the innermost
    # modules owning ops ("" for the root's own ops). See [Note: dataflow] in trace/fx.py.
    dataflow: nx.DiGraph | None = None


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
    # What the tracer kept beside the figures (the fx graph, the module dataflow): read
    # by reports and diagnostics, never by the cost model or the search.
    trace: TraceRecord = field(default_factory=TraceRecord, compare=False, repr=False)
    # The loss runs after forward, outside every module: what it saves for backward
    # (e.g. log_softmax's output) and the most bytes it creates alive at once.
    loss_saved_bytes: int = 0
    loss_peak_bytes: int = 0
    # Its backward: the most bytes of gradients it creates alive at once, down to the model's output's
    # (0: not recorded). See [Note: the loss's gradients] in trace/record.py.
    loss_grad_bytes: int = 0
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
    # The dtype the traced step computed in: its floating parameters and forward inputs cast to it,
    # as FSDP2's MixedPrecisionPolicy(param_dtype=...) casts them, else the parameters' own. The
    # activation figures are in it (float32 where the model upcasts), the parameter figures in the
    # storage dtype. "": not recorded (a graph built by hand): read from the parameters. See
    # [Note: tracing in the compute dtype] in trace/record.py.
    compute_dtype: str = ""

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
