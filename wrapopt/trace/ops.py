"""The tracer's dispatch and function modes, and tensor helpers.

``Recorder`` counts FLOPs per innermost module (PyTorch's FLOP formulas, plus
the fused CPU attention kernel's and the grouped matmul's), records the module dataflow, the
parameters each module's forward reads ([Note: who reads a parameter] in
``meta.py``) and the live bytes of the loss; ``FusedAttention`` routes
attention to the fused kernel ([Note: attention on meta]).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from wrapopt.selective import SelectiveEvent, alternates, is_saved_op
from wrapopt.trace.fx import OpDataflow
from wrapopt.trace.kernels import MATMUL_OPS, attention_run_flops, is_attention, matmul_key
from wrapopt.trace.op_bytes import op_bytes

__all__ = ["Recorder", "FusedAttention", "dtype_name", "storage_key", "tensors_in", "nbytes"]

_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
                torch.float64: "float64"}


def dtype_name(dt: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dt, str(dt).replace("torch.", ""))


_FLASH_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def _flash_fwd_flops(q, k, v, *args, out_val=None, **kwargs):
    return sdpa_flop_count(q.shape, k.shape, v.shape)


def _flash_bwd_flops(grad_out, q, k, v, *args, out_val=None, **kwargs):
    return sdpa_backward_flop_count(grad_out.shape, q.shape, k.shape, v.shape)


_GROUPED_MM = torch.ops.aten._grouped_mm
_CTC = (torch.ops.aten._ctc_loss, torch.ops.aten._ctc_loss_backward)  # no meta kernel: See _ctc_on_meta
_PER_EXPERT = (_GROUPED_MM, torch.ops.aten.bmm)  # matmuls that give each slice of a 3-D weight its own tokens
_TO_COPY = torch.ops.aten._to_copy.default
_ADDS = (torch.ops.aten.add, torch.ops.aten.add_)  # See _selective_reads
_META = torch.device("meta")


def _grouped_mm_flops(mat_a, mat_b, *args, out_val=None, **kwargs):
    """Every row of a 2-D operand meets one group's matrix: with a 2-D by 3-D product (the
    experts' forward) that is the routed (token, expert) pairs only. See [Note: experts on meta]."""
    if mat_a.dim() == 2 and mat_b.dim() == 2:  # groups split the inner dim (the weight gradient)
        return 2 * mat_a.shape[0] * mat_a.shape[1] * mat_b.shape[1]
    return 2 * out_val.numel() * mat_a.shape[-1]


# FLOP formulas for the fused CPU attention kernel and the grouped matmul, which PyTorch's registry lacks.
_EXTRA_FLOPS = {
    _FLASH_CPU: _flash_fwd_flops,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _flash_bwd_flops,
    _GROUPED_MM: _grouped_mm_flops,
}


class FusedAttention(TorchFunctionMode):
    """Run ``F.scaled_dot_product_attention`` as the fused (flash-style) kernel.

    [Note: attention on meta] On meta tensors the dispatcher falls back to the
    math path, which saves the seq x seq attention matrix for backward; the
    fused kernels that real GPUs and CPUs run save only the output and the
    log-sum-exp. Tracing the math path would overstate activations by orders
    of magnitude at long sequences, so the tracer routes attention to the
    fused CPU kernel, whose meta implementation saves what the real ones do.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _SDPA:
            return _fused_sdpa(*args, **kwargs)
        if func is _MHA_FORWARD:
            return _mha_forward(*args, **kwargs)
        return func(*args, **kwargs)


# The functions as torch defines them (``_mha_forward`` swaps the first for a moment).
_SDPA = torch.nn.functional.scaled_dot_product_attention
_MHA_FORWARD = torch.nn.functional.multi_head_attention_forward


def _mha_forward(*args: Any, **kwargs: Any) -> Any:
    """``F.multi_head_attention_forward`` with its attention run as the fused kernel.

    [Note: attention inside nn.MultiheadAttention] ``nn.MultiheadAttention`` calls
    ``F.multi_head_attention_forward``, a Python function with its own torch-function
    override, so ``FusedAttention`` sees that call; while a mode handles a call it is
    off, so the ``scaled_dot_product_attention`` inside (``need_weights=False``, as
    ``nn.TransformerEncoderLayer`` and ``DecoderLayer`` call it) would run on the math
    path and the trace would save the seq x seq matrix that the real CPU kernel does not
    (a large share of an encoder layer's activations). The function reads
    ``scaled_dot_product_attention`` from ``torch.nn.functional``'s globals, so for
    this one call that name is the fused routing.
    """
    fn = torch.nn.functional
    fn.scaled_dot_product_attention = _fused_sdpa
    try:
        return _MHA_FORWARD(*args, **kwargs)
    finally:
        fn.scaled_dot_product_attention = _SDPA


def _fused_sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    if attn_mask is not None and attn_mask.requires_grad:
        # A trained mask (T5's relative position bias) needs the math path's mask gradient.
        return _SDPA(
            q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    # With enable_gqa, k and v keep their fewer heads: the fused kernels read them grouped
    # (as the dispatcher passes them) and save them at that size, not repeated.
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = torch.zeros(attn_mask.shape, dtype=q.dtype, device=q.device).masked_fill(~attn_mask, float("-inf"))
    return _FLASH_CPU(q, k, v, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]


class Recorder(TorchDispatchMode):
    """Counts FLOPs per innermost module; knows whether we are in backward.

    [Note: experts on meta] Hugging Face mixture-of-experts layers run their
    experts as grouped matmuls (``torch._grouped_mm``: the tokens sorted by
    expert, one matrix per expert, offsets between the groups). Its meta
    kernel accepts bfloat16 only, so on other dtypes the recorder runs it on
    bfloat16 stand-ins (meta tensors: no data) and hands back the dtype asked
    for. The offsets are never read: every row of the token operand belongs
    to some expert, so the FLOPs counted are those of the routed (token,
    expert) pairs, tokens x top-k, not tokens x every expert; the expert
    weights are parameters of the experts module and count whole in memory.
    A module whose forward hands a 3-D parameter to a grouped or batched
    matmul holds that many experts' weights stacked (``ModuleInfo.experts``,
    shown by ``wrapopt trace``): one tensor, so its experts are one unit's.
    """

    def __init__(self, stack: list[str]):
        super().__init__()
        self.stack = stack
        self.fwd: dict[str, float] = defaultdict(float)
        self.backward = False
        self.bwd_total = 0.0
        self.fwd_bytes: dict[str, int] = defaultdict(int)  # See [Note: memory-bound ops] in op_bytes.py
        # Per module, forward matmuls by shape -> calls, and attention (counted, run) FLOPs and the elements
        # of K and V its kernels read: See [Note: kernel roofline] in cost/roofline.py.
        self.matmuls: dict[str, dict[tuple, int]] = defaultdict(lambda: defaultdict(int))
        self.attention: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
        self.bwd_bytes_total = 0
        self.flow = OpDataflow()
        self.record_flow = True  # the model's forward only: off for the loss and backward
        self.in_loss = False
        self.in_tail = False  # forward, root's own ops after a child returned: See [Note: loss inside forward]
        self.loss_live: dict[Any, int] = {}  # storages the loss created -> bytes
        self.loss_before: set[Any] = set()  # storages that existed before the loss (its views are free)
        self.loss_peak = 0
        # The loss's backward, from its start until the model's output has its gradient: the storages its
        # ops create -> bytes (None: not tracking), those that existed before, and their most at once.
        self.grad_live: dict[Any, int] | None = None
        self.grad_before: set[Any] = set()
        self.grad_peak = 0
        self.param_key: dict[int, int] = {}  # id(parameter tensor) -> its key in ``by_id``
        self.param_reads: dict[tuple[int, str], None] = {}  # (parameter key, reading module), in order
        self.experts: dict[str, int] = {}  # module -> experts its 3-D weights hold
        # Per module, bytes of the outputs of the ops selective-op keeps, each storage once: See
        # [Note: selective checkpointing] in wrapopt/selective.py.
        self.selective_log: list[SelectiveEvent] = []
        self.selective_seen: set[Any] = set()
        self.selective_read: dict[Any, set[tuple[str, ...]]] = {}  # kept storage -> stacks of the ops that read it
        self.selective_via: dict[Any, set[Any]] = {}  # an addition's output -> the kept storages it sums
        self.selective_hold: list[Any] = []  # the kept storages, alive while tracing (their keys stay theirs)
        self.fwd_ops: dict[str, int] = defaultdict(int)  # per module, aten ops its forward ran
        self.meta_wins = False  # ops mixing meta and real tensors run on meta: See [Note: integer inputs stay real]
        # The model's forward in order, for checkpoint's early stop (See [Note: early stop] in record.py): per
        # op (module, FLOPs, bytes), None where a tensor was saved for backward; and each module call's span.
        self.es_log: list[tuple[str, float, int] | None] = []
        self.es_spans: list[tuple[str, int, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.meta_wins:
            args, kwargs = _onto_meta(func, args, kwargs)
        if func._overloadpacket is _GROUPED_MM:
            out = _grouped_mm_on_meta(func, args, kwargs)
        elif func._overloadpacket in _CTC and args[0].is_meta:
            out = _ctc_on_meta(func, args)
        else:
            out = func(*args, **kwargs)
        if self.in_loss or self.in_tail:
            self._track_loss(out)
        if self.grad_live is not None:
            self._track_grads(out)
        kept = False
        if not self.backward and not self.in_loss:
            self.fwd_ops[self.stack[-1]] += 1
            if self.selective_seen:
                self._selective_reads(func, args, kwargs, out)
            kept = is_saved_op(func)
        if self.record_flow:
            self.flow.record(self.stack[-1], args, kwargs, out)
            if self.param_key:  # See [Note: who reads a parameter]
                for t in tensors_in((args, kwargs)):
                    key = self.param_key.get(id(t))
                    if key is not None:
                        self.param_reads.setdefault((key, self.stack[-1]), None)
                if func._overloadpacket in _PER_EXPERT:  # See [Note: experts on meta]
                    for t in tensors_in(args):  # a 3-D parameter, or a view of one (transposed)
                        if t.dim() == 3 and (id(t) in self.param_key or id(t._base) in self.param_key):
                            m = self.stack[-1]
                            self.experts[m] = max(self.experts.get(m, 0), t.shape[0])
        fn = flop_registry.get(func._overloadpacket) or _EXTRA_FLOPS.get(func._overloadpacket)
        if fn is not None:
            flops = float(fn(*args, **kwargs, out_val=out))
            if self.backward:
                self.bwd_total += flops
            else:
                self.fwd[self.stack[-1]] += flops
                self._kernel(func._overloadpacket, args, kwargs, out, flops)
                if not self.in_loss:
                    self.es_log.append((self.stack[-1], flops, 0))
        else:
            flops = 0.0
        if kept:
            self._selective_kept(func, out, flops)
        if fn is None:
            nbytes = op_bytes(func, args, kwargs, out)
            if self.backward:
                self.bwd_bytes_total += nbytes
            else:
                self.fwd_bytes[self.stack[-1]] += nbytes
                if not self.in_loss:
                    self.es_log.append((self.stack[-1], 0.0, nbytes))
        return out

    def _kernel(self, packet: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any, flops: float) -> None:
        """A forward FLOP op's entry in its module's kernel table: See [Note: kernel roofline] in cost/roofline.py."""
        m = self.stack[-1]
        if is_attention(packet) or packet is _FLASH_CPU:
            a = self.attention[m]
            a[0] += flops
            a[1] += attention_run_flops(packet, args, kwargs, flops)
            # K and V as the kernel reads them: with enable_gqa, at their own (fewer) heads. What context
            # parallelism exchanges: See [Note: context parallel costs] in cost/cp.py.
            a[2] += sum(t.numel() for t in args[1:3] if isinstance(t, torch.Tensor))
        elif packet in MATMUL_OPS:
            self.matmuls[m][matmul_key(packet, args, out, flops)] += 1

    def _selective_kept(self, func: Any, out: Any, flops: float) -> None:
        """A saved op's event (its outputs' storages not seen before, counted once): See [Note: selective
        checkpointing] in wrapopt/selective.py."""
        nbytes, keys = 0, []
        for t in tensors_in(out):
            key = storage_key(t)
            if key in self.selective_seen:
                continue
            self.selective_seen.add(key)
            keys.append(key)
            try:
                self.selective_hold.append(t.untyped_storage())
                nbytes += t.untyped_storage().nbytes()
            except (NotImplementedError, RuntimeError):
                nbytes += t.numel() * t.element_size()
        self.selective_log.append(SelectiveEvent(tuple(self.stack), alternates(func), nbytes, tuple(keys), flops))

    def _selective_reads(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        """The ops that read kept storages, directly or through additions (an addition's backward needs no
        input, so it passes its operands on to what reads its sum), views aside: See [Note: compile keeps
        what backward reads] in wrapopt/selective.py."""
        kept: set[Any] = set()
        for t in tensors_in((args, kwargs)):
            key = storage_key(t)
            if key in self.selective_seen:
                kept.add(key)
            kept |= self.selective_via.get(key, set())
        if not kept:
            return
        if func._overloadpacket in _ADDS:
            for t in tensors_in(out):
                key = storage_key(t)
                if key not in self.selective_via:
                    self.selective_hold.append(t.untyped_storage())
                self.selective_via[key] = self.selective_via.get(key, set()) | kept
            return
        stack = tuple(self.stack)
        for key in kept - {storage_key(t) for t in tensors_in(out)}:  # a view aliases what it reads
            self.selective_read.setdefault(key, set()).add(stack)

    def start_tail(self, before: set[Any]) -> None:
        self.in_tail, self.loss_live, self.loss_peak, self.loss_before = True, {}, 0, before

    def end_tail(self) -> int:
        """Stop tracking root's trailing ops; the most bytes they had alive at once."""
        peak = self.loss_peak if self.in_tail else 0
        self.in_tail, self.loss_live, self.loss_peak, self.loss_before = False, {}, 0, set()
        return peak

    def _track_loss(self, out: Any) -> None:
        """Live bytes of the tensors the loss created (views share their base's storage)."""
        self.loss_live = _live_with(out, self.loss_live, self.loss_before)
        self.loss_peak = max(self.loss_peak, sum(self.loss_live.values()))

    def start_loss_grads(self, before: set[Any]) -> None:
        """Track what the loss's backward creates; ``before``: storages alive already (its views are free)."""
        self.grad_live, self.grad_before, self.grad_peak = {}, before, 0

    def end_loss_grads(self, grad: torch.Tensor) -> None:
        """A hook on the model's output: its gradient has arrived, the loss's backward is over."""
        if self.grad_live is not None:
            self._track_grads(grad)
            self.grad_live = None

    def _track_grads(self, out: Any) -> None:
        self.grad_live = _live_with(out, self.grad_live or {}, self.grad_before)
        self.grad_peak = max(self.grad_peak, sum(self.grad_live.values()))


def _live_with(out: Any, live: dict[Any, int], before: set[Any]) -> dict[Any, int]:
    """``live`` (storage -> bytes) with the storages of ``out``'s tensors not in it nor in ``before``
    added, and those freed since dropped."""
    for t in out if isinstance(out, (list, tuple)) else (out,):
        if isinstance(t, torch.Tensor):
            key = storage_key(t)
            if isinstance(key, StorageWeakRef) and key not in live and key not in before:
                live[key] = t.untyped_storage().nbytes()
    return {k: b for k, b in live.items() if not k.expired()}


def _onto_meta(func, args: Any, kwargs: dict) -> tuple[Any, dict]:
    """The real tensors of an op that also takes a meta tensor, moved to meta (the meta kernels
    refuse mixed devices); an op on real tensors alone runs for real, and a real integer tensor
    sent to the meta device (``mask.to(hidden.device)``) stays real, values and all."""
    if (func is _TO_COPY and kwargs.get("device") == _META and not args[0].is_meta
            and not (kwargs.get("dtype") or args[0].dtype).is_floating_point):
        return args, {k: v for k, v in kwargs.items() if k != "device"}
    tensors = tensors_in((args, kwargs))
    if not any(t.is_meta for t in tensors) or all(t.is_meta for t in tensors):
        return args, kwargs
    move = lambda x: x.to("meta") if isinstance(x, torch.Tensor) and not x.is_meta else x  # noqa: E731
    return tree_map(move, args), tree_map(move, kwargs)


def _grouped_mm_on_meta(func, args: Any, kwargs: dict) -> Any:
    """``_grouped_mm`` on meta in any dtype. See [Note: experts on meta]."""
    mat_a = args[0]
    if not mat_a.is_meta or mat_a.dtype == torch.bfloat16:
        return func(*args, **kwargs)
    dtype = kwargs.get("out_dtype") or mat_a.dtype
    bf16 = lambda x: x.to(torch.bfloat16) if isinstance(x, torch.Tensor) and x.is_floating_point() else x  # noqa: E731
    kwargs = {k: v for k, v in kwargs.items() if k != "out_dtype"}
    return func(*tree_map(bf16, args), **tree_map(bf16, kwargs)).to(dtype)


def _ctc_on_meta(func, args: Any) -> Any:
    """The CTC loss (Wav2Vec2ForCTC's) and its gradient by shape: torch has no meta kernel for
    them. Forward: the per-sample loss (N,) and the alignment table (N, T, 2 S + 1) it keeps for
    backward; backward: a gradient shaped as the log-probabilities (T, N, C). Their FLOPs are
    negligible beside the encoder's."""
    log_probs = args[0] if func._overloadpacket is torch.ops.aten._ctc_loss else args[1]
    steps, batch = log_probs.shape[0], log_probs.shape[1] if log_probs.dim() == 3 else 1
    if func._overloadpacket is torch.ops.aten._ctc_loss_backward:
        return torch.empty_like(log_probs)
    targets = args[1]
    width = 2 * (targets.shape[-1] if targets.dim() == 2 else targets.numel()) + 1
    return (log_probs.new_empty((batch,)), log_probs.new_empty((batch, steps, width)))


def storage_key(t: torch.Tensor) -> Any:
    try:
        return StorageWeakRef(t.untyped_storage())
    except (NotImplementedError, RuntimeError):  # tensor subclasses without storage
        return id(t)


def tensors_in(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in tensors_in(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in tensors_in(o)]
    if hasattr(obj, "to_tuple"):  # Hugging Face ModelOutput
        return tensors_in(obj.to_tuple())
    return []


def nbytes(obj: Any, *, floating: torch.dtype | None = None) -> int:
    """Bytes of the tensors in ``obj``; ``floating``: the floating ones counted in that dtype."""
    if isinstance(obj, torch.Tensor):
        if floating is not None and obj.is_floating_point():
            return obj.numel() * floating.itemsize
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(nbytes(o, floating=floating) for o in obj)
    if isinstance(obj, dict):
        return sum(nbytes(o, floating=floating) for o in obj.values())
    if hasattr(obj, "to_tuple"):  # Hugging Face ModelOutput
        return nbytes(obj.to_tuple(), floating=floating)
    return 0
