"""One recorded training step of the tracer: forward, loss and backward under the
``Recorder`` (``trace/ops.py``), with module hooks and a saved-tensor hook, on meta
stand-ins for the model's tensors (and the fallbacks of [Note: tracer fallback] in
trace/meta.py). ``trace_model`` turns the ``StepRecord`` into a ``ModelGraph``.

[Note: early stop] torch's non-reentrant checkpoint (``torch.utils.checkpoint``
with ``use_reentrant=False``, the composable ``checkpoint`` that ``apply`` uses, and
FSDP1's ``checkpoint_wrapper`` with ``NO_REENTRANT``) stops its recompute as soon as
every tensor the forward saved for backward has been saved again (``early_stop``,
on by default since torch 2.1). Autograd saves an op's inputs before the kernel
runs, so the ops after the last save of a checkpointed module's forward never
rerun: in a transformer block, the MLP's last linear layer (its input was the
last tensor saved) and the residual add after it, a third of the block's GEMM
FLOPs (llama's SwiGLU: 2 of its 7 d x d-sized GEMMs). ``early_stop_skips`` finds
them in the recorded forward (the saved-tensor hook marks each save, parameters
included, as torch counts them) and keeps, per module, the share of each
module in its subtree that the recompute of a checkpoint around it skips (by
FLOPs; by bytes for a module without FLOPs). The step simulator recomputes a
checkpointed module's forward less those shares: See ``ckpt_fwd_s`` in
``cost/step_inputs.py``. ``tests/trace/test_early_stop.py`` checks the shares
against the ops torch's recompute runs.

[Note: tracing in the compute dtype] Under FSDP2's
``MixedPrecisionPolicy(param_dtype=...)`` the step computes on the gathered
parameters cast to ``param_dtype`` and, with ``cast_forward_inputs`` (its
default), on the forward's floating inputs cast too; buffers stay as they are
(FSDP2 does not cast them) and the loss gets the batch as given. Given
``compute``, the tracer runs that step: the floating parameters' stand-ins
(meta, or real copies in the real fallback) and the forward's floating inputs
are in that dtype, so every activation is in the dtype the step makes it. Where
a model upcasts on purpose, its tensors stay float32: Hugging Face's RMSNorm
computes in float32 and saves float32 tensors, the loss upcasts the logits; a
float32 trace rescaled by 2/4 would halve those too. The parameter figures (own
and total bytes, ``param_shapes``) are read from the parameters themselves: the
storage (master) dtype, as FSDP2 keeps it. What else depends on the dtype comes
out as the step runs it: the memory-bound ops' bytes (the upcasts' copies among
them), the matmuls' bytes per element, selective-op's kept bytes, the loss on
low-precision logits. One trace in the step's dtype, rather than a float32 trace
and a second one in the compute dtype merged by module name: the same tracing
time, one code path, nothing matched by name. ``ModelGraph.compute_dtype``
records the dtype; a step in another one rescales the graph uniformly
([Note: compute dtype] in cost/dtypes.py). ``benchmarks/bf16_check.py`` checks
the trace against real bf16 steps (``results/bf16.md``). Left out: FSDP2 casts
the floating inputs of every unit's forward, so a float32 tensor one unit hands
to another is cast down at the boundary; the trace casts at the root only (the
blocks of the zoo and of Hugging Face models hand on the compute dtype).

[Note: the loss's gradients] The loss's backward holds gradients beside what the
loss saved: cross-entropy's log_softmax backward holds the gradient arriving
from nll_loss and the one it makes, each the size of the loss's input in the
dtype the loss computes in. A loss that upcasts bf16 logits (the zoo's, Hugging
Face's, TorchTitan's) makes them float32: twice the bytes of the output each,
more than two gradients of the output's size. The tracer measures them: from the
start of the backward until the model's output has its gradient (a hook on each
output tensor), the most bytes of tensors the backward's ops create alive at
once (``ModelGraph.loss_grad_bytes``; storages alive before it, the saved ones
among them, are not counted). The simulator takes the larger of that and two of
the output's size ([Note: loss] in cost/step.py).
"""

from __future__ import annotations

import contextlib
import functools
from collections import defaultdict
from typing import Any, Callable, NamedTuple

import networkx as nx
import torch
import torch.nn as nn
from torch.utils._pytree import tree_map

from wrapopt.errors import TraceError
from wrapopt.losses import scalar_loss
from wrapopt.spec import ROOT
from wrapopt.trace.ops import FusedAttention, Recorder, nbytes, storage_key, tensors_in

__all__ = ["StepRecord", "record_step"]


def record_step(
    model: nn.Module,
    example_inputs: tuple[Any, ...],
    run_kwargs: dict[str, Any],
    loss_fn: Callable[..., torch.Tensor],
    by_id: dict[int, list[str]],
    params: dict[int, nn.Parameter],
    estimates: list[str],
    *,
    compute: torch.dtype | None = None,
) -> StepRecord:
    """One recorded step: on meta, else on meta with the integer inputs real, else for real;
    each fallback says so in ``estimates``. See [Note: tracer fallback] in trace/meta.py.
    ``compute``: the dtype the step computes in (None: the parameters' own); See [Note: tracing
    in the compute dtype]."""
    rec: StepRecord | None = None
    run = functools.partial(_run_step, model, example_inputs, run_kwargs, loss_fn, by_id, params, compute=compute)
    try:
        rec = run(meta=True)
    except _DataDependent as first:  # See [Note: tracer fallback] in trace/meta.py
        e = first
    if rec is None and any(not t.is_floating_point() for t in tensors_in((example_inputs, run_kwargs))):
        try:
            rec = run(meta=True, real_ints=True)
            estimates.append(f"traced with the integer inputs kept real because module {e.module!r} reads their "
                             f"values ({e.cause}); weights stayed on meta")
        except _DataDependent as again:
            e = again
    if rec is None:
        if any(p.is_meta for p in params.values()):
            raise TraceError(
                f"module {e.module!r} runs an op that needs real values ({e.cause}), also with the integer "
                "inputs kept real; the model is on the meta device, so the tracer cannot fall back to a real run. "
                "Pass the value it reads as an input (a real integer tensor, e.g. an attention mask of ones, "
                "which stays real), build the model with real weights (small example inputs suffice), or remove "
                "the data-dependent op from forward."
            ) from None
        rec = run(meta=False)
        estimates.append(
            f"traced with real tensors because module {e.module!r} needs real values ({e.cause}); "
            "figures are exact for the example inputs but the tracer allocated real activations"
        )
    return rec


class _DataDependent(Exception):
    def __init__(self, module: str, cause: str):
        super().__init__(cause)
        self.module, self.cause = module, cause


class StepRecord:
    """What one recorded step counted, per module FQN."""

    def __init__(self) -> None:
        self.order: dict[str, int] = {}
        self.calls: dict[str, int] = defaultdict(int)
        self.out_bytes: dict[str, int] = {}
        self.in_bytes: dict[str, int] = {}
        self.saved: dict[str, int] = defaultdict(int)
        self.fwd: dict[str, float] = {}
        self.bwd_total = 0.0
        self.fwd_bytes: dict[str, int] = {}
        self.bwd_bytes_total = 0
        self.flow: nx.DiGraph = nx.DiGraph()
        self.loss_saved = 0  # saved for backward by the loss (outside every module)
        self.loss_peak = 0  # most bytes of tensors the loss created alive at once
        self.loss_grads = 0  # most bytes of gradients its backward created alive at once: [Note: the loss's gradients]
        self.tail_saved = 0  # saved by root's own ops after its last child returned
        self.tail_peak = 0  # most bytes those ops created alive at once
        self.param_reads: dict[tuple[int, str], None] = {}  # (key in by_id, module whose forward read it)
        self.experts: dict[str, int] = {}  # See [Note: experts on meta] in ops.py
        # See [Note: kernel roofline] in cost/roofline.py: per module, (matmul entry + (calls,)), and attention
        self.matmuls: dict[str, tuple[tuple[float, int, int, int, int], ...]] = {}
        self.attention: dict[str, tuple[float, float, float]] = {}  # (FLOPs counted, FLOPs run, K and V elements)
        # See [Note: selective checkpointing] in wrapopt/selective.py: what selective-op keeps per module
        self.selective_log: list = []  # the saved ops of the forward, in order (SelectiveEvent)
        self.selective_read: dict = {}  # kept storage -> the module stacks of the ops that read it
        self.fwd_ops: dict[str, int] = {}  # aten ops each module's forward ran (its own)
        # See [Note: early stop]: per module, (module of its subtree, share of that one's forward its recompute skips)
        self.early_stop: dict[str, tuple[tuple[str, float], ...]] = {}


def _run_step(
    model: nn.Module,
    inputs: tuple[Any, ...],
    kwargs: dict[str, Any],
    loss_fn: Callable[..., torch.Tensor],
    by_id: dict[int, list[str]],
    params: dict[int, nn.Parameter],
    *,
    meta: bool,
    real_ints: bool = False,
    compute: torch.dtype | None = None,
) -> StepRecord:
    """One forward, loss and backward of ``model`` under the recorder, on meta stand-ins for
    its tensors (``meta``) or on the real ones, in ``compute`` (None: as they are)."""
    rec = StepRecord()
    stack: list[str] = [ROOT]
    st = _step_tensors(model, inputs, kwargs, by_id, params, meta=meta, real_ints=real_ints, compute=compute)
    recorder = Recorder(stack)
    handles = _hook_modules(model, rec, stack, recorder, st.fwd_inputs)
    pack, kept = _saved_bytes_counter(rec, stack, recorder, st.params)
    recorder.meta_wins = real_ints
    recorder.param_key = {id(t): key for key, t in zip(by_id, st.params)}
    rec.order[ROOT] = 0
    rec.calls[ROOT] = 1
    try:
        fused = FusedAttention() if meta else contextlib.nullcontext()
        with fused, recorder, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = _forward(model, st, stack)
            rec.out_bytes[ROOT] = nbytes(out)
            rec.tail_peak = recorder.end_tail()
            stack[:] = [ROOT]
            recorder.record_flow = False
            recorder.loss_before = {storage_key(t) for t in tensors_in((out, st.inputs, st.fwd_inputs))}
            recorder.in_loss = True
            loss = scalar_loss(loss_fn(out, st.inputs), loss_fn)  # the loss gets the batch as given, uncast
            recorder.in_loss = False
        recorder.backward = True
        trainable = [t for t in st.params if t.requires_grad]
        # See [Note: the loss's gradients]: from the loss's backward until the model's output has its gradient.
        ends = [t for t in tensors_in(out) if t.is_floating_point() and t.requires_grad and t is not loss]
        handles += [t.register_hook(recorder.end_loss_grads) for t in ends]
        if ends:
            recorder.start_loss_grads(recorder.loss_before | kept)
        with recorder:
            if loss.requires_grad and trainable:
                torch.autograd.grad(loss, trainable, allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    _keep_recorded(rec, recorder)
    return rec


class _StepTensors(NamedTuple):
    """What one recorded step runs on."""

    replacement: dict[str, torch.Tensor]  # by FQN, for ``functional_call``; empty: the model's own tensors
    inputs: tuple[Any, ...]  # the batch as the loss gets it
    fwd_inputs: tuple[Any, ...]  # as the forward gets it: floating tensors in the compute dtype
    fwd_kwargs: dict[str, Any]
    params: list[torch.Tensor]  # one per parameter object, as the forward reads it


def _step_tensors(
    model: nn.Module,
    inputs: tuple[Any, ...],
    kwargs: dict[str, Any],
    by_id: dict[int, list[str]],
    params: dict[int, nn.Parameter],
    *,
    meta: bool,
    real_ints: bool,
    compute: torch.dtype | None,
) -> _StepTensors:
    """What the step runs on: meta stand-ins (``meta``) or the real tensors, the floating
    parameters and forward inputs cast to ``compute``. See [Note: tracing in the compute dtype]."""

    def cast(x: Any) -> Any:
        return x.to(compute) if compute is not None and isinstance(x, torch.Tensor) and x.is_floating_point() else x

    def stand_in(p: nn.Parameter) -> torch.Tensor:
        dtype = compute if compute is not None and p.is_floating_point() else p.dtype
        if meta:
            return torch.empty_like(p, device="meta", dtype=dtype).requires_grad_(p.requires_grad)
        return p.detach().to(dtype).requires_grad_(p.requires_grad) if dtype != p.dtype else p

    # One replacement tensor per parameter object; tied FQNs follow (functional_call ties).
    replacement = {names[0]: stand_in(params[i]) for i, names in by_id.items()}
    if meta:
        replacement.update({n: torch.empty_like(b, device="meta") for n, b in model.named_buffers()})
        # See [Note: integer inputs stay real] in trace/meta.py.
        keep = lambda x: real_ints and not x.is_floating_point()  # noqa: E731
        to_meta = lambda x: x.to("meta") if isinstance(x, torch.Tensor) and not keep(x) else x  # noqa: E731
        inputs = tree_map(to_meta, inputs)
        kwargs = tree_map(to_meta, kwargs)
    elif all(replacement[names[0]] is params[i] for i, names in by_id.items()):
        replacement = {}  # the real run, nothing cast: the model's own tensors
    param_tensors = [replacement[names[0]] if replacement else params[i] for i, names in by_id.items()]
    return _StepTensors(replacement, inputs, tree_map(cast, inputs), tree_map(cast, kwargs), param_tensors)


def _hook_modules(model: nn.Module, rec: StepRecord, stack: list[str], recorder: Recorder,
                  inputs: tuple[Any, ...]) -> list[Any]:
    """Forward pre/post hooks on every module but the root: first-call order, calls, input and
    output bytes, and the module stack the recorder attributes ops to. Returns the handles."""

    def pre_hook(name: str) -> Callable:
        def hook(_m: nn.Module, args: Any, kwargs: Any) -> None:
            if name not in rec.order:
                rec.order[name] = len(rec.order)
                rec.in_bytes[name] = sum(t.numel() * t.element_size() for t in tensors_in((args, kwargs))
                                         if t.is_floating_point())
            rec.calls[name] += 1
            stack.append(name)
            if not recorder.backward and not recorder.in_loss:  # See [Note: early stop]
                opened.append((name, len(recorder.es_log)))
            if recorder.in_tail:  # root's ops before this module were not the trailing ones
                recorder.end_tail()
                rec.tail_saved = 0

        return hook

    def post_hook(name: str) -> Callable:
        def hook(_m: nn.Module, _args: Any, out: Any) -> None:
            if stack and stack[-1] == name:
                stack.pop()
            if opened and opened[-1][0] == name:
                recorder.es_spans.append((name, opened.pop()[1], len(recorder.es_log)))
            rec.out_bytes.setdefault(name, nbytes(out))
            if stack == [ROOT] and not recorder.backward:  # See [Note: loss inside forward] in trace/meta.py
                recorder.start_tail({storage_key(t) for t in tensors_in((out, inputs))})
                rec.tail_saved = 0

        return hook

    opened: list[tuple[str, int]] = []  # module calls under way: (name, where their ops start in es_log)
    handles = []
    for name, m in model.named_modules():
        if name == ROOT:
            continue  # the root's calls are the step itself
        handles.append(m.register_forward_pre_hook(pre_hook(name), with_kwargs=True, prepend=True))
        handles.append(m.register_forward_hook(post_hook(name)))
    return handles


def _saved_bytes_counter(rec: StepRecord, stack: list[str], recorder: Recorder,
                         param_tensors: list[torch.Tensor]) -> tuple[Callable[[torch.Tensor], torch.Tensor], set[Any]]:
    """The pack hook of ``saved_tensors_hooks``: each storage saved for backward counted once,
    parameters excluded, to the running module (or the loss, or the root's tail); and the set
    of the parameters' storages and those saved so far (the hook adds to it)."""
    param_storages = {storage_key(t) for t in param_tensors}
    seen_saved: set[Any] = set(param_storages)

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not recorder.in_loss and not recorder.backward:  # every saved tensor, parameters too: [Note: early stop]
            recorder.es_log.append(None)
        key = storage_key(t)
        if key not in param_storages and key not in seen_saved:
            seen_saved.add(key)
            try:
                nbytes = t.untyped_storage().nbytes()
            except (NotImplementedError, RuntimeError):
                nbytes = t.numel() * t.element_size()
            if recorder.in_loss:
                rec.loss_saved += nbytes
            else:
                rec.saved[stack[-1]] += nbytes
                rec.tail_saved += nbytes if recorder.in_tail else 0
        return t

    return pack, seen_saved


def _forward(model: nn.Module, st: _StepTensors, stack: list[str]) -> Any:
    """The model's forward; its error is re-raised naming the module it came from
    (``_DataDependent`` for an op that needs real values)."""
    try:
        if st.replacement:
            return torch.func.functional_call(model, st.replacement, st.fwd_inputs, st.fwd_kwargs, tie_weights=True,
                                              strict=False)
        return model(*st.fwd_inputs, **st.fwd_kwargs)
    except Exception as e:  # the model's own error, with the module it came from
        where = stack[-1]
        if _is_data_dependent(e):
            raise _DataDependent(where or "<root>", f"{type(e).__name__}: {str(e).splitlines()[0]}") from None
        cls = type(model.get_submodule(where)).__name__
        raise TraceError(
            f"forward of module {where or '<root>'!r} ({cls}) failed on the example inputs: "
            f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}. "
            "Check that the example inputs match what the model expects."
        ) from e


def _keep_recorded(rec: StepRecord, recorder: Recorder) -> None:
    """Copy what the recorder counted during the step into ``rec``."""
    rec.fwd = dict(recorder.fwd)
    rec.bwd_total = recorder.bwd_total
    rec.fwd_bytes = dict(recorder.fwd_bytes)
    rec.bwd_bytes_total = recorder.bwd_bytes_total
    rec.flow = recorder.flow.graph
    rec.loss_peak = recorder.loss_peak
    rec.loss_grads = recorder.grad_peak
    rec.param_reads = recorder.param_reads
    rec.experts = dict(recorder.experts)
    rec.matmuls = {m: tuple(sorted(k + (n,) for k, n in t.items())) for m, t in recorder.matmuls.items()}
    rec.attention = {m: (a[0], a[1], a[2]) for m, a in recorder.attention.items()}
    rec.selective_log, rec.selective_read = recorder.selective_log, recorder.selective_read
    recorder.selective_hold.clear()
    rec.fwd_ops = dict(recorder.fwd_ops)
    rec.early_stop = early_stop_skips(recorder.es_log, recorder.es_spans, rec.fwd, rec.fwd_bytes)


def early_stop_skips(log: list[tuple[str, float, int] | None], spans: list[tuple[str, int, int]],
                     fwd: dict[str, float], fwd_bytes: dict[str, int]) -> dict[str, tuple[tuple[str, float], ...]]:
    """Per module, what the recompute of a checkpoint around it skips: See [Note: early stop].

    ``log``: the forward's ops in order, (module, FLOPs, bytes), None where a tensor was saved for
    backward; ``spans``: each module call's (module, first op, end). Returns, per module whose
    recompute skips anything, (module of its subtree, share of that module's forward FLOPs (bytes
    for a module without FLOPs) the recompute skips) pairs."""
    tail: dict[str, dict[str, list[float]]] = defaultdict(dict)
    for name, start, end in spans:
        acc = tail[name]
        k = end - 1
        while k >= start and log[k] is not None:  # the ops after the last tensor saved in this call
            mod, flops, nbytes = log[k]
            a = acc.setdefault(mod, [0.0, 0.0])
            a[0] += flops
            a[1] += nbytes
            k -= 1
    out: dict[str, tuple[tuple[str, float], ...]] = {}
    for name, acc in tail.items():
        shares = []
        for mod, (flops, nbytes) in acc.items():
            total_f, total_b = fwd.get(mod, 0.0), fwd_bytes.get(mod, 0)
            share = flops / total_f if total_f > 0 else (nbytes / total_b if total_b > 0 else 0.0)
            if share > 0:
                shares.append((mod, min(1.0, share)))
        if shares:
            out[name] = tuple(sorted(shares))
    return out


def _is_data_dependent(e: Exception) -> bool:
    text = str(e)
    return any(
        s in text
        for s in ("cannot be called on meta tensors", "data-dependent", "Cannot copy out of meta tensor", "meta tensor",
                  "data-independent implementation", "torch.nonzero()")
    ) and "shape" not in text.split("meta")[0][-20:]
