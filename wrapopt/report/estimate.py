"""``wrapopt estimate``: one plan's predicted step, throughput, MFU and memory, as text or JSON.

[Note: model FLOPs] MFU counts the FLOPs the model needs, not the ones the
plan spends (recomputation under checkpointing is not counted). For a token
model (one integer input of shape batch x sequence) a step of ``tokens``
tokens needs ``(6 N + 12 L d T) tokens``: N the parameters without
embeddings (tied output heads go with them), L the repeated blocks, d the
embedding width, T the sequence length (PaLM, appendix B; the attention term
counts the QK^T and AV matmuls forward and backward). For other models the
tracer's forward FLOPs times 3 (forward + twice that in backward). The peak
is the device's stated dense peak in the compute dtype for an analytical
device, the measured matmul rate for a measured one (then MFU is against
what this device achieves, not a datasheet).

[Note: active parameters] In a mixture of experts a token runs through
top-k of the n experts, so N counts the parameters a token uses: the stacked
expert weights (``ModuleInfo.experts``, See [Note: experts on meta] in
trace/ops.py) count k/n of their size, and so do experts held as an
``experts`` ``nn.ModuleList`` of modules of one class (each its own weights). k is the router's: a ``top_k`` or
``num_experts_per_tok`` on the experts module or a module above it, else the
model config's ``num_experts_per_tok`` (Hugging Face); without one, the share
the trace priced (the experts' forward FLOPs over 2 x tokens, at most the
whole). Counting every expert would put a Mixtral (top-2 of 8) at 3-4x its
MFU, past 100%.

[Note: one step's work] Throughput and MFU are the model's work in one
optimizer step on one GPU (one micro-batch's tokens and FLOPs times the
accumulation) over a step time: ``StepWork``. ``estimate`` divides it by its
plan's step, ``search`` by each row's, the rows of one table running the same
global batch (their steps cover it all), so one formula serves both.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn as nn

from wrapopt.fileio import fmt_bytes
from wrapopt.hardware.profiles import ComputeProfile
from wrapopt.spec import CostEstimate, MeshSpec, ModelGraph

__all__ = ["EstimateReport", "ModelFlops", "StepWork", "model_flops", "active_expert_share", "infer_model_flops",
           "peak_rate", "step_work", "format_estimate", "format_breakdown", "BREAKDOWN_NAMES", "scale_flops"]

BREAKDOWN_NAMES = {
    "sharded_params": "sharded parameters",
    "sharded_grads": "sharded gradients",
    "optimizer_state": "optimizer state",
    "accumulated_grads": "unsharded gradients held across micro-batches (no-sync)",
    "unsharded_params": "gathered (unsharded) parameters",
    "all_gather_buffer": "all-gather buffer",
    "unsharded_grads": "unsharded gradients awaiting reduce-scatter",
    "activations": "saved activations",
    "working_set": "working set",
}


@dataclass(frozen=True, slots=True)
class ModelFlops:
    """The FLOPs one micro-batch of the model needs: See [Note: model FLOPs] and [Note: active parameters]."""

    flops: float  # forward + backward, one micro-batch on one rank
    tokens: int  # tokens in one micro-batch (0: not a token model)
    samples: int
    formula: str  # how ``flops`` was counted, with the figures used


def model_flops(graph: ModelGraph, *, non_embedding_params: int, tokens: int, seq_len: int, samples: int,
                width: int, inactive_params: int = 0, experts_note: str = "") -> ModelFlops:
    """See [Note: model FLOPs]; ``tokens == 0`` for a model without token inputs. ``inactive_params``:
    expert weights a token does not use, left out of N (See [Note: active parameters])."""
    if tokens and seq_len and width:
        layers = len(graph.blocks)
        active = non_embedding_params - inactive_params
        per_token = 6 * active + 12 * layers * width * seq_len
        what = (f"{active:,} active parameters without embeddings ({experts_note})" if inactive_params
                else f"{active:,} parameters without embeddings")
        return ModelFlops(per_token * tokens, tokens, samples,
                          f"(6 N + 12 L d T) per token, N = {what}, L = {layers} blocks, d = {width}, T = {seq_len}")
    fwd = sum(m.fwd_flops for m in graph.modules)
    return ModelFlops(3 * fwd, 0, samples, f"3 x the traced forward FLOPs ({fwd:.3g} per micro-batch)")


def scale_flops(flops: ModelFlops, scale: float) -> ModelFlops:
    """``flops`` for ``scale`` times the traced micro-batch (``SimOptions.batch_scale``)."""
    if scale == 1.0:
        return flops
    return replace(flops, flops=flops.flops * scale, tokens=round(flops.tokens * scale),
                   samples=max(1, round(flops.samples * scale)))


def infer_model_flops(model: nn.Module, example_inputs: tuple[Any, ...] | Any, graph: ModelGraph) -> ModelFlops:
    """``model_flops`` with its figures read from the model and one micro-batch of inputs: a
    token model has a first integer input of shape batch x sequence and no other integer input but
    its labels and masks (``_BESIDE_TOKENS``); its width is the
    widest ``nn.Embedding``, whose weights are left out of N (See [Note: model FLOPs])."""
    inputs = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    first = inputs[0] if inputs and isinstance(inputs[0], torch.Tensor) else None
    token_model = (first is not None and first.dim() == 2 and not first.is_floating_point()
                   and all(name in _BESIDE_TOKENS for name, x in _named_inputs(model, inputs)[1:]
                           if isinstance(x, torch.Tensor) and not x.is_floating_point()))
    embeds = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    params = {id(p): p.numel() for p in model.parameters()}
    emb_ids = {id(m.weight) for m in embeds}
    width = max((m.embedding_dim for m in embeds), default=0)
    tokens = first.numel() if token_model else 0
    inactive, note = active_expert_share(model, graph, tokens) if tokens else (0, "")
    return model_flops(graph, non_embedding_params=sum(n for i, n in params.items() if i not in emb_ids),
                       tokens=tokens, seq_len=first.shape[1] if token_model else 0,
                       samples=first.shape[0] if first is not None and first.dim() else 1, width=width,
                       inactive_params=inactive, experts_note=note)


_TOP_K = ("top_k", "num_experts_per_tok")  # what routers call the experts a token uses


def _top_k(model: nn.Module, fqn: str) -> int | None:
    """The experts per token of the experts module ``fqn``: its own or an ancestor's ``top_k`` /
    ``num_experts_per_tok``, else the model config's. See [Note: active parameters]."""
    parts = fqn.split(".") if fqn else []
    for i in range(len(parts), -1, -1):
        try:
            mod = model.get_submodule(".".join(parts[:i]))
        except AttributeError:
            continue
        for where in (mod, getattr(mod, "config", None)):
            for name in _TOP_K:
                k = getattr(where, name, None)
                if isinstance(k, int) and not isinstance(k, bool) and k > 0:
                    return k
    return None


def active_expert_share(model: nn.Module, graph: ModelGraph, tokens: int) -> tuple[int, str]:
    """The stacked expert weights a token does not use (parameters), and how the experts were
    counted ("experts: top-2 of 8"). See [Note: active parameters]."""
    inactive, ks = 0, set()
    for info in graph.modules:
        if not info.experts:
            continue
        n = info.experts
        try:
            mod = model.get_submodule(info.fqn)
        except AttributeError:
            continue
        stacked = sum(p.numel() for p in mod.parameters(recurse=False) if p.dim() and p.shape[0] == n)
        if not stacked:
            continue
        k = _top_k(model, info.fqn)
        if k is not None:
            used = stacked * min(k, n) / n
            ks.add(f"top-{min(k, n)} of {n}")
        else:  # the share the trace priced: 2 FLOPs per weight per routed token
            used = min(stacked, info.fwd_flops / (2 * tokens)) if tokens else stacked
            ks.add(f"{used / stacked * n:.2g} of {n} as traced")
        inactive += int(round(stacked - used))
    for fqn, n, numel in _listed_experts(model, graph):  # experts as a list of modules, each its own weights
        k = _top_k(model, fqn)
        if k is not None:
            used = numel * min(k, n) / n
            ks.add(f"top-{min(k, n)} of {n}")
        else:
            flops = sum(graph.info(f).fwd_flops for f in graph.subtree(fqn))
            used = min(numel, flops / (2 * tokens)) if tokens else numel
            ks.add(f"{used / numel * n:.2g} of {n} as traced")
        inactive += int(round(numel - used))
    return inactive, ("experts: " + ", ".join(sorted(ks))) if ks else ""


def _listed_experts(model: nn.Module, graph: ModelGraph) -> list[tuple[str, int, int]]:
    """(name, experts, parameters) of each ``experts`` ``nn.ModuleList`` of two or more modules of one
    class holding parameters (a mixture whose experts are modules, each running on its routed tokens
    only): See [Note: active parameters]."""
    known = {m.fqn for m in graph.modules}
    out = []
    for name, mod in model.named_modules():
        if (name.rsplit(".", 1)[-1] != "experts" or not isinstance(mod, nn.ModuleList) or len(mod) < 2
                or name not in known or len({type(e) for e in mod}) != 1):
            continue
        numel = sum(p.numel() for p in mod.parameters())
        if numel:
            out.append((name, len(mod), numel))
    return out


# Integer inputs that come with a token sequence without being another one (a Hugging Face causal or
# masked LM's labels and masks): beside them the model is still a token model of its first input.
_BESIDE_TOKENS = frozenset({"labels", "attention_mask", "token_type_ids", "position_ids"})


def _named_inputs(model: nn.Module, inputs: tuple[Any, ...]) -> list[tuple[str, Any]]:
    """The positional inputs with the names ``forward`` gives them (``?`` where it has none)."""
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        params = []
    names = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return [(names[i] if i < len(names) else "?", x) for i, x in enumerate(inputs)]


def peak_rate(compute: ComputeProfile, dtype: str) -> tuple[float, str]:
    """The FLOP rate MFU is measured against, and where it comes from: the stated dense peak
    in ``dtype`` for an analytical device, else the measured (or stated achieved) matmul rate."""
    peak = compute.meta.get("peak_flops_per_s") or compute.flops_per_s
    source = (f"stated dense {dtype} peak" if compute.meta.get("peak_flops_per_s")
              else "the measured matmul rate" if compute.kind == "measured" else "the stated achieved rate")
    return float(peak), source


@dataclass(frozen=True, slots=True)
class StepWork:
    """The model's work in one optimizer step on one GPU: what throughput and MFU divide by a
    step time. See [Note: one step's work]."""

    flops: ModelFlops  # one micro-batch on one GPU
    accumulation: int  # micro-batches per step
    peak_flops_per_s: float
    peak_source: str

    def tokens_per_s(self, step_s: float) -> float:
        """Per GPU (0 for a model without token inputs)."""
        return self.flops.tokens * self.accumulation / step_s

    def samples_per_s(self, step_s: float) -> float:
        """Per GPU."""
        return self.flops.samples * self.accumulation / step_s

    def mfu(self, step_s: float) -> float:
        return self.flops.flops * self.accumulation / step_s / self.peak_flops_per_s

    def rate(self, step_s: float) -> str:
        """"6,331 tok/s  37.0%": per GPU, and MFU (samples/s without token inputs)."""
        speed = (f"{self.tokens_per_s(step_s):,.0f}" if self.flops.tokens else f"{self.samples_per_s(step_s):,.2f}")
        return f"{speed:>10} {self.mfu(step_s) * 100:5.1f}%"

    def rate_head(self) -> str:
        return f"{'tok/s/GPU' if self.flops.tokens else 'smp/s/GPU':>10} {'MFU':>6}"

    def legend(self) -> str:
        """What the rate columns measure, one line."""
        what = "tokens" if self.flops.tokens else "samples"
        return (f"{what}/s per GPU and MFU against {self.peak_flops_per_s / 1e12:,.1f} TFLOP/s ({self.peak_source}); "
                f"model FLOPs {self.flops.formula}")

    def to_json(self, step_s: float) -> dict[str, float | None]:
        return {"tokens_per_s_per_gpu": self.tokens_per_s(step_s) or None,
                "samples_per_s_per_gpu": self.samples_per_s(step_s), "mfu": self.mfu(step_s)}


def step_work(model: nn.Module, example_inputs: tuple[Any, ...] | Any, graph: ModelGraph, compute: ComputeProfile,
              *, accumulation: int, batch_scale: float, compute_dtype: str, float8: str | None = None) -> StepWork:
    """One optimizer step's work on one GPU at ``batch_scale`` times the traced micro-batch
    (``SimOptions.batch_scale``), against ``compute``'s peak in ``compute_dtype``: See
    [Note: one step's work]. Under float8 training (``float8``: its recipe) the peak stays the
    compute dtype's, as TorchTitan reports MFU, and the source says so."""
    peak, source = peak_rate(compute, compute_dtype)
    if float8 and float8 != "none":
        source += f"; float8 {float8} GEMMs counted against it, as TorchTitan reports MFU"
    return StepWork(scale_flops(infer_model_flops(model, example_inputs, graph), batch_scale), accumulation, peak,
                    source)


@dataclass(frozen=True)
class EstimateReport:
    """What ``wrapopt.estimate`` returns: one plan's prediction with throughput and MFU."""

    model: str
    plan_label: str
    num_units: int
    mesh: MeshSpec
    train: Any  # TrainConfig (the sync mode as chosen)
    fabric: str
    compute: str
    estimate: CostEstimate = field(repr=False)
    flops: ModelFlops
    peak_flops_per_s: float
    peak_source: str
    memory_budget: float | None
    notes: tuple[str, ...] = ()
    budget_note: str = ""  # where the budget came from
    model_dtype: str = "float32"  # the parameters' dtype as stored and sharded (the master weights)
    pipeline_microbatches: int | None = None  # a pipeline plan's micro-batch count (None: no pipeline)

    @property
    def step_s(self) -> float:
        return self.estimate.step_s

    @property
    def work(self) -> StepWork:
        """See [Note: one step's work]."""
        return StepWork(self.flops, self.train.grad_accumulation, self.peak_flops_per_s, self.peak_source)

    @property
    def tokens_per_s(self) -> float:
        """Per GPU (0 for a model without token inputs)."""
        return self.work.tokens_per_s(self.step_s)

    @property
    def samples_per_s(self) -> float:
        """Per GPU."""
        return self.work.samples_per_s(self.step_s)

    @property
    def mfu(self) -> float:
        return self.work.mfu(self.step_s)

    @property
    def fits(self) -> bool:
        return self.memory_budget is None or self.estimate.peak_bytes <= self.memory_budget

    def to_json(self) -> dict[str, Any]:
        e = self.estimate
        return {
            "model": self.model, "plan": self.plan_label, "num_units": self.num_units, "mesh": self.mesh.to_json(),
            "train": self.train.to_json(),
            "training": self.train.describe(self.model_dtype, pipeline_microbatches=self.pipeline_microbatches),
            "fabric": self.fabric, "compute": self.compute,
            "step_s": e.step_s, "tokens_per_s_per_gpu": self.tokens_per_s or None,
            "samples_per_s_per_gpu": self.samples_per_s, "mfu": self.mfu,
            "model_flops_per_step_per_gpu": self.flops.flops * self.train.grad_accumulation,
            "flops_formula": self.flops.formula, "peak_flops_per_s": self.peak_flops_per_s,
            "peak_source": self.peak_source,
            "peak_bytes": e.peak_bytes, "peak_breakdown": dict(e.peak_breakdown),
            "memory_budget": self.memory_budget, "fits": self.fits,
            "fwd_s": e.fwd_s, "bwd_s": e.bwd_s, "optim_s": e.optim_s, "compute_s": e.compute_s, "comm_s": e.comm_s,
            "exposed_comm_s": e.exposed_comm_s, "notes": list(self.notes) + list(e.notes),
        }


def format_estimate(r: EstimateReport) -> str:
    """The text ``wrapopt estimate`` prints."""
    e, m = r.estimate, r.mesh
    lines = [
        f"model: {r.model}   plan: {r.plan_label} ({r.num_units} units)",
        f"mesh: {m.world_size} ranks, {m.ranks_per_node} per node, shard group {m.shard_size}"
        f"{f', tensor parallel {m.tp_size}' if m.tp_size > 1 else ''}"
        f"{f', pipeline {m.pp_size} stages' if m.pp_size > 1 else ''}   fabric: {r.fabric}   "
        f"compute: {r.compute}",
        f"training: {r.train.describe(r.model_dtype, pipeline_microbatches=r.pipeline_microbatches)}",
        f"step: {e.step_s * 1e3:.2f} ms ("
        + (f"{r.train.grad_accumulation} micro-batches; each " if r.train.grad_accumulation > 1 else "")
        + f"forward {e.fwd_s * 1e3:.2f} ms, backward {e.bwd_s * 1e3:.2f} ms; optimizer "
        f"{e.optim_s * 1e3:.2f} ms; exposed communication {e.exposed_comm_s * 1e3:.2f} ms)",
    ]
    if r.flops.tokens:
        lines.append(f"throughput: {r.tokens_per_s:,.0f} tokens/s per GPU ({r.samples_per_s:,.2f} samples/s)")
    else:
        lines.append(f"throughput: {r.samples_per_s:,.2f} samples/s per GPU")
    lines.append(f"MFU: {r.mfu * 100:.3g}% of {r.peak_flops_per_s / 1e12:,.1f} TFLOP/s ({r.peak_source}); "
                 f"model FLOPs {r.flops.formula}")
    budget = ("no limit" if r.memory_budget is None
              else f"budget {fmt_bytes(r.memory_budget)}: " + ("fits" if r.fits else "DOES NOT FIT"))
    lines.append(f"peak memory: {fmt_bytes(e.peak_bytes)} per GPU ({budget})")
    lines += format_breakdown(e)
    for n in list(r.notes) + list(e.notes):
        lines.append(f"note: {n}")
    return "\n".join(lines)


def format_breakdown(e: CostEstimate, indent: str = "  ") -> list[str]:
    """The peak's parts, one line each (parts of zero bytes left out)."""
    return [f"{indent}{fmt_bytes(v):>11}  {BREAKDOWN_NAMES.get(k, k)}" for k, v in e.peak_breakdown if v]
