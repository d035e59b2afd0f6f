"""The simulator on published GPU runs: each row's plan, hardware and step, predicted.

Used by ``benchmarks/published.py``. [Note: a published row as a simulation]
A row of the llm-foundry tables becomes:

- the MPT of its size and sequence length (``published_rows.build_mpt``),
  traced on meta at the row's micro-batch (no ``batch_scale``: tracing costs
  the same at any batch on meta, and per-step constants such as the embedding
  gradient are then not scaled with the batch), in fp32 as FSDP2 keeps its
  shards, with llm-foundry's fused cross-entropy: exactly the model a user
  gives ``wrapopt estimate`` (the step's bf16 activations come from
  ``--precision``, [Note: compute dtype]);
- the plan the row ran: one FSDP unit per MPT block plus the root,
  ``reshard_after_forward`` True for FULL_SHARD and False for SHARD_GRAD_OP,
  every block checkpointed when the row says so, FSDP over all GPUs;
- mixed precision: ``--precision bf16`` (Composer's DEFAULT: fp32
  reduction) or ``bf16-pure`` (PURE); AdamW;
- the hardware: the shipped GPU and network presets (``--gpu``,
  ``--network``), resolved as ``wrapopt estimate`` resolves them, 8 GPUs per
  node; no constant of the benchmark's own;
- gradient accumulation as Composer runs it with FSDP: every micro-batch
  reduce-scatters (Composer's ``no_sync`` path is for DDP only), so a step is
  ``GA`` times the simulated forward + backward plus one optimizer step.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass
from typing import Any, Callable

from benchmarks.published_rows import (
    Published, PublishedRow, Skipped, build_mpt, count_params, fused_cross_entropy,
)
from wrapopt.cost import Simulator
from wrapopt.cost.roofline import kernel_times
from wrapopt.evaluation.stats import spearman
from wrapopt.hardware.profiles import AnalyticalLink, ComputeProfile, FabricProfile
from wrapopt.hardware.catalog import GPUS as GPUS_PRESETS
from wrapopt.hardware.catalog import GpuPreset
from wrapopt.hardware.resolve import compute_for, fabric_name, resolve_fabric
from wrapopt.train import TrainConfig
from wrapopt.trace.meta import trace_model
from wrapopt.spec import ROOT, CostEstimate, MeshSpec, ModelGraph, PlanSpec, SimOptions, UnitSpec

__all__ = ["GPUS", "GpuSpec", "Predictor", "Prediction", "refit", "errors_of", "compute_split"]

GPUS_PER_NODE = 8


@dataclass(frozen=True, slots=True)
class GpuSpec:
    """A GPU type of the tables as the shipped presets name it: See [Note: GPU and network presets]."""

    name: str  # as the tables name it
    preset: str  # the shipped GPU preset (wrapopt/hardware/catalog.py)
    network: str  # the shipped network preset between the rows' nodes

    @property
    def gpu(self) -> GpuPreset:
        return GPUS_PRESETS[self.preset]

    @property
    def capacity_bytes(self) -> int:
        return self.gpu.memory_capacity_bytes

    @property
    def source(self) -> str:
        return f"`--gpu {self.preset} --network {self.network}` ({self.gpu.source})"


# The rows' GPUs and networks (A100 tables: 1600 Gb/s per node of 8 = ib200; H100: unstated, ib400).
GPUS = {
    "a100_40gb": GpuSpec("A100 40GB", "a100-40gb-sxm", "ib200"),
    "a100_80gb": GpuSpec("A100 80GB", "a100-80gb-sxm", "ib200"),
    "h100_80gb": GpuSpec("H100 80GB", "h100-sxm", "ib400"),
}


def train_config(row: PublishedRow) -> TrainConfig:
    """The row's step as ``wrapopt estimate --precision bf16|bf16-pure`` states it (one micro-batch: the
    accumulation is composed by ``step_s``, as Composer runs it)."""
    return TrainConfig.preset("bf16-pure" if row.mp_mode == "PURE" else "bf16")


def fabric_at(gpu: GpuSpec, world_size: int, inter_gbit_per_gpu: float | None = None,
              preset: GpuPreset | None = None) -> FabricProfile:
    """The fabric ``wrapopt estimate --gpu G --network N`` resolves, or the same with another inter-node
    bandwidth per GPU (the sensitivity tables), or with another GPU preset (the refit)."""
    name = fabric_name(fabric=None, gpu=gpu.preset, network=gpu.network)
    fab = resolve_fabric(name, world_size=world_size, ranks_per_node=GPUS_PER_NODE)
    if preset is not None:
        fab = dataclasses.replace(fab, meta={**fab.meta, "compute": preset.compute_spec()}, _cache={})
    if inter_gbit_per_gpu is None:
        return fab
    link = AnalyticalLink(fab.inter.latency_s, inter_gbit_per_gpu / 8 * 1e9 * 0.8,
                          f"{inter_gbit_per_gpu:g} Gb/s per GPU, ~80% achieved")
    return dataclasses.replace(fab, name=f"{fab.name}@{inter_gbit_per_gpu:g}Gb", inter=link, _cache={})


def compute_profile(fab: FabricProfile, row: PublishedRow) -> ComputeProfile:
    """The compute profile ``wrapopt estimate`` takes for this fabric and step (the model stored in bf16)."""
    return compute_for(fab, None, train_config(row), "bfloat16")


def row_plan(graph: ModelGraph, row: PublishedRow) -> PlanSpec:
    """The plan the row ran: See [Note: a published row as a simulation]."""
    mesh = MeshSpec(world_size=row.num_gpus, ranks_per_node=GPUS_PER_NODE, shard_size=row.num_gpus)
    reshard = row.sharding == "FULL_SHARD"
    units = tuple(UnitSpec((b,), reshard, row.checkpointing) for b in graph.blocks) + (UnitSpec((ROOT,), False),)
    return PlanSpec(units=units, mesh=mesh, label=f"per-block {row.sharding}{' +AC' if row.checkpointing else ''}")


def sim_options(row: PublishedRow) -> SimOptions:
    """``TrainConfig.sim_options`` of the row's step (``wrapopt estimate``'s), one micro-batch."""
    return train_config(row).sim_options()


def step_s(est: CostEstimate, grad_accum: int) -> float:
    """Composer with FSDP: every micro-batch syncs; one optimizer step."""
    return grad_accum * (est.step_s - est.optim_s) + est.optim_s


@dataclass(frozen=True, slots=True)
class Prediction:
    row: PublishedRow
    role: str  # "fit" or "held-out"
    tokens_per_s: float
    step_s: float
    peak_bytes: int
    fits: bool  # peak within the GPU's memory
    exposed_share: float  # exposed communication / step
    split: dict[str, float]  # share of the compute time per kernel class (compute_split)
    estimate: CostEstimate

    @property
    def attention_share(self) -> float:
        return self.split.get("attention", 0.0)

    @property
    def memory_bound_share(self) -> float:
        return self.split.get("memory-bound", 0.0)

    @property
    def ratio(self) -> float:
        return self.tokens_per_s / self.row.tokens_per_s_per_gpu


class Predictor:
    """Builds, traces (cached per model, sequence and micro-batch) and simulates rows."""

    def __init__(self, published: Published, *, progress: Callable[[str], None] = lambda s: None):
        self.published = published
        self._graphs: dict[tuple[str, int, int, str | None], ModelGraph] = {}
        self.progress = progress
        self.trace_s = 0.0
        self._counts: dict[tuple[str, int], int] = {}  # parameters of the built MPT per (model, seq)

    def usable(self, rows: tuple[PublishedRow, ...]) -> tuple[list[PublishedRow], list[Skipped]]:
        """Rows that can be predicted, and the others with the reason."""
        ok, skipped = [], []
        for r in rows:
            where = f"{self.published.source}:{r.line}"
            shape = self.published.shapes.get(r.model)
            if r.gpu not in GPUS:
                reason = f"GPU {r.gpu!r} has no stated specification here"
            elif shape is None:
                reason = f"model {r.model!r} is not in the shapes table"
            elif r.precision not in ("bf16", "amp_bf16"):
                reason = f"precision {r.precision}: FP8 compute is not modelled (one bf16 FLOP rate per GPU)"
            elif r.cpu_offload:
                reason = "activation CPU offload is not modelled"
            elif r.sharding not in ("FULL_SHARD", "SHARD_GRAD_OP"):
                reason = f"sharding {r.sharding} is not modelled"
            elif r.num_gpus > GPUS_PER_NODE and r.num_gpus % GPUS_PER_NODE:
                reason = f"{r.num_gpus} GPUs is not whole nodes of {GPUS_PER_NODE}"
            else:
                n = self._counts.get((r.model, r.seq_len))
                if n is None:
                    n = self._counts[(r.model, r.seq_len)] = count_params(
                        build_mpt(shape, vocab=self.published.vocab, seq_len=r.seq_len))
                if n != r.num_params:
                    reason = f"the built MPT has {n:,} parameters, the table says {r.num_params:,}"
                else:
                    ok.append(r)
                    continue
            skipped.append(Skipped(r, where, reason))
        return ok, skipped

    def graph(self, row: PublishedRow) -> ModelGraph:
        dtype = train_config(row).param_dtype  # traced in the step's compute dtype, as `wrapopt estimate` does
        key = (row.model, row.seq_len, row.micro_batch, dtype)
        g = self._graphs.get(key)
        if g is None:
            import time

            import torch

            t0 = time.perf_counter()
            model = build_mpt(self.published.shapes[row.model], vocab=self.published.vocab, seq_len=row.seq_len,
                              dtype=torch.float32)
            tokens = torch.zeros(row.micro_batch, row.seq_len, dtype=torch.long)
            g = trace_model(model, (tokens,), loss_fn=fused_cross_entropy, fx=False, compute_dtype=dtype)
            self._graphs[key] = g
            self.trace_s += time.perf_counter() - t0
            self.progress(f"traced {row.model} seq {row.seq_len} batch {row.micro_batch} ({len(self._graphs)} models)")
        return g

    def simulate(self, row: PublishedRow, fabric: FabricProfile | None = None,
                 preset: GpuPreset | None = None) -> tuple[CostEstimate, float]:
        """The row's simulated step on the shipped presets (or ``fabric``, or another GPU ``preset``)."""
        g = self.graph(row)
        fab = fabric or fabric_at(GPUS[row.gpu], row.num_gpus, preset=preset)
        est = Simulator(g, fab, compute_profile(fab, row), sim_options(row)).simulate(row_plan(g, row))
        return est, step_s(est, row.grad_accum)

    def tokens_per_s(self, row: PublishedRow, fabric: FabricProfile | None = None,
                     preset: GpuPreset | None = None) -> float:
        _est, step = self.simulate(row, fabric, preset)
        return row.micro_batch * row.seq_len * row.grad_accum / step

    def predict(self, row: PublishedRow, role: str) -> Prediction:
        est, step = self.simulate(row)
        gpu = GPUS[row.gpu]
        g = self.graph(row)
        split = compute_split(g, compute_profile(fabric_at(gpu, row.num_gpus), row),
                              recompute=row.checkpointing)
        total = max(sum(split.values()), 1e-12)
        return Prediction(row, role, row.micro_batch * row.seq_len * row.grad_accum / step, step, est.peak_bytes,
                          est.peak_bytes <= gpu.capacity_bytes, est.exposed_comm_s / est.step_s,
                          {k: v / total for k, v in split.items()}, est)


def compute_split(graph: ModelGraph, compute: ComputeProfile, *, recompute: bool) -> dict[str, float]:
    """Seconds of one micro-batch's forward + backward (+ the recompute) per kernel class, as the
    cost model prices them: See [Note: kernel roofline] in wrapopt/cost/roofline.py."""
    out: dict[str, float] = {}
    for m in graph.modules:
        for k, (f, b) in kernel_times(m, compute).items():
            out[k] = out.get(k, 0.0) + f * (2 if recompute else 1) + b
    return out


def refit(predictor: Predictor, rows: list[PublishedRow], gpu: GpuPreset, *, tied: bool = False,
          iterations: int = 12) -> GpuPreset:
    """The GPU preset with its two fitted constants refit on ``rows``: for each attention fraction of a
    coarse grid (or tied to the GEMM fraction), the GEMM fraction at which the median predicted/published
    ratio is 1 (bisection: throughput rises with it); then the pair with the least median |error|."""
    def bisect(att: float | None) -> GpuPreset:
        lo, hi = 0.2, 1.0
        for _ in range(iterations):
            mid = (lo + hi) / 2
            p = gpu.with_fitted(matmul_fraction=mid, attention_fraction=mid if att is None else att)
            med = statistics.median(predictor.tokens_per_s(r, preset=p) / r.tokens_per_s_per_gpu for r in rows)
            lo, hi = (mid, hi) if med < 1.0 else (lo, mid)
        mid = (lo + hi) / 2
        return gpu.with_fitted(matmul_fraction=mid, attention_fraction=mid if att is None else att)

    def err(p: GpuPreset) -> float:
        return statistics.median(abs(predictor.tokens_per_s(r, preset=p) / r.tokens_per_s_per_gpu - 1) for r in rows)

    if tied:
        return bisect(None)
    return min((bisect(a) for a in (0.2, 0.25, 0.3, 0.35, 0.4, 0.45)), key=err)


def errors_of(preds: list[Prediction]) -> dict[str, Any]:
    """Median and max |pred/pub - 1|, Spearman of predicted vs published tokens/s, count."""
    if not preds:
        return {"n": 0, "median": math.nan, "max": math.nan, "spearman": math.nan, "over_20": 0, "p90": math.nan,
                "median_ratio": math.nan}
    errs = [abs(p.ratio - 1) for p in preds]
    rho = (spearman([p.tokens_per_s for p in preds], [p.row.tokens_per_s_per_gpu for p in preds]) if len(preds) > 2
           else math.nan)
    return {"n": len(preds), "median": statistics.median(errs), "max": max(errs), "spearman": rho,
            "over_20": sum(e > 0.2 for e in errs), "median_ratio": statistics.median(p.ratio for p in preds),
            "p90": _quantile(errs, 0.9)}


def _quantile(values: list[float], q: float) -> float:
    """The ``q`` quantile, linear between order statistics (numpy's default)."""
    v = sorted(values)
    x = q * (len(v) - 1)
    i = int(x)
    return v[i] if i + 1 >= len(v) else v[i] + (v[i + 1] - v[i]) * (x - i)
