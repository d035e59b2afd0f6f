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

__all__ = ["EstimateReport", "ModelFlops", "model_flops", "infer_model_flops", "peak_rate", "format_estimate",
           "format_breakdown", "BREAKDOWN_NAMES", "scale_flops"]

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
    """The FLOPs one micro-batch of the model needs: See [Note: model FLOPs]."""

    flops: float  # forward + backward, one micro-batch on one rank
    tokens: int  # tokens in one micro-batch (0: not a token model)
    samples: int
    formula: str  # how ``flops`` was counted, with the figures used


def model_flops(graph: ModelGraph, *, non_embedding_params: int, tokens: int, seq_len: int, samples: int,
                width: int) -> ModelFlops:
    """See [Note: model FLOPs]; ``tokens == 0`` for a model without token inputs."""
    if tokens and seq_len and width:
        layers = len(graph.blocks)
        per_token = 6 * non_embedding_params + 12 * layers * width * seq_len
        return ModelFlops(per_token * tokens, tokens, samples,
                          f"(6 N + 12 L d T) per token, N = {non_embedding_params:,} parameters without embeddings, "
                          f"L = {layers} blocks, d = {width}, T = {seq_len}")
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
    return model_flops(graph, non_embedding_params=sum(n for i, n in params.items() if i not in emb_ids),
                       tokens=first.numel() if token_model else 0, seq_len=first.shape[1] if token_model else 0,
                       samples=first.shape[0] if first is not None and first.dim() else 1, width=width)


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
    def tokens_per_s(self) -> float:
        """Per GPU (0 for a model without token inputs)."""
        return self.flops.tokens * self.train.grad_accumulation / self.step_s

    @property
    def samples_per_s(self) -> float:
        """Per GPU."""
        return self.flops.samples * self.train.grad_accumulation / self.step_s

    @property
    def mfu(self) -> float:
        return self.flops.flops * self.train.grad_accumulation / self.step_s / self.peak_flops_per_s

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
