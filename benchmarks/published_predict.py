"""The simulator on published GPU runs: each row's plan, hardware and step, predicted.

Used by ``benchmarks/published.py``. [Note: a published row as a simulation]
A row of the llm-foundry tables becomes:

- the MPT of its size and sequence length (``published_rows.build_mpt``),
  traced on meta at the row's micro-batch (no ``batch_scale``: tracing costs
  the same at any batch on meta, and per-step constants such as the embedding
  gradient are then not scaled with the batch), in bf16 so activations are
  what mixed precision computes, with llm-foundry's fused cross-entropy, and
  fp32 master weights (``with_master_weights``);
- the plan the row ran: one FSDP unit per MPT block plus the root,
  ``reshard_after_forward`` True for FULL_SHARD and False for SHARD_GRAD_OP,
  every block checkpointed when the row says so, FSDP over all GPUs;
- mixed precision: bf16 gathered parameters; gradients reduced in fp32
  (Composer's DEFAULT) or bf16 (PURE); AdamW;
- the hardware's stated numbers: peak bf16 FLOP/s times one efficiency
  constant per GPU type (the only fitted number), HBM bandwidth at the
  project's ~80% achieved for memory-bound ops and the optimizer, the
  built-in analytical fabric of that generation (8 GPUs per node);
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
    Published, PublishedRow, Skipped, build_mpt, count_params, fused_cross_entropy, with_master_weights,
)
from wrapopt.cost import Simulator
from wrapopt.errors import InfeasibleError
from wrapopt.evaluation.evaluate import spearman
from wrapopt.hardware.budget import MEMORY_HEADROOM
from wrapopt.hardware.profiles import AnalyticalLink, ComputeProfile, FabricProfile
from wrapopt.hardware.presets import analytical_compute, analytical_fabric
from wrapopt.search.driver import SearchOptions, search_plan
from wrapopt.trace.meta import trace_model
from wrapopt.spec import ROOT, CostEstimate, MeshSpec, ModelGraph, OptimizerKind, PlanSpec, SimOptions, UnitSpec

__all__ = ["GPUS", "GpuSpec", "Predictor", "Prediction", "SearchRow", "fit_efficiency", "errors_of"]

GPUS_PER_NODE = 8


@dataclass(frozen=True, slots=True)
class GpuSpec:
    name: str
    peak_flops: float  # dense bf16, stated
    hbm_bytes_per_s: float  # stated
    capacity_bytes: int
    fabric: str  # a built-in analytical fabric
    source: str


_HBM_ACHIEVED = 0.8  # the analytical presets' convention (wrapopt/hardware/presets.py)
GPUS = {
    "a100_40gb": GpuSpec("A100 40GB", 312e12, 1.555e12, 40 * 2**30, "a100-nvlink-ib200",
                         "A100 SXM datasheet: 312 TFLOP/s dense bf16, HBM2 1,555 GB/s, 40 GiB"),
    "a100_80gb": GpuSpec("A100 80GB", 312e12, 2.039e12, 80 * 2**30, "a100-nvlink-ib200",
                         "A100 SXM datasheet: 312 TFLOP/s dense bf16, HBM2e 2,039 GB/s, 80 GiB"),
    "h100_80gb": GpuSpec("H100 80GB", 989e12, 3.35e12, 80 * 2**30, "h100-nvlink-ib400",
                         "H100 SXM datasheet: 989 TFLOP/s dense bf16, HBM3 3.35 TB/s, 80 GiB"),
}


def compute_profile(gpu: GpuSpec, efficiency: float) -> ComputeProfile:
    """The project's analytical compute profile with this GPU's stated numbers."""
    bw = gpu.hbm_bytes_per_s * _HBM_ACHIEVED
    base = analytical_compute(gpu.fabric)
    return dataclasses.replace(
        base, device=gpu.name, flops_per_s=gpu.peak_flops * efficiency, memory_bandwidth_bytes_per_s=bw,
        op_bandwidth_bytes_per_s=bw, memory_capacity_bytes=gpu.capacity_bytes,
        meta={"source": f"{gpu.source}; {efficiency:.3f} of peak (fitted); HBM at {_HBM_ACHIEVED:.0%}"})


def fabric_at(gpu: GpuSpec, world_size: int, inter_gbit_per_gpu: float | None = None) -> FabricProfile:
    """The built-in analytical fabric, or the same with another inter-node bandwidth per GPU."""
    fab = analytical_fabric(gpu.fabric, world_size=world_size, ranks_per_node=GPUS_PER_NODE)
    if inter_gbit_per_gpu is None:
        return fab
    link = AnalyticalLink(fab.inter.latency_s, inter_gbit_per_gpu / 8 * 1e9 * 0.8,
                          f"{inter_gbit_per_gpu:g} Gb/s per GPU, ~80% achieved")
    return dataclasses.replace(fab, name=f"{fab.name}@{inter_gbit_per_gpu:g}Gb", inter=link, _cache={})


def row_plan(graph: ModelGraph, row: PublishedRow) -> PlanSpec:
    """The plan the row ran: See [Note: a published row as a simulation]."""
    mesh = MeshSpec(world_size=row.num_gpus, ranks_per_node=GPUS_PER_NODE, shard_size=row.num_gpus)
    reshard = row.sharding == "FULL_SHARD"
    units = tuple(UnitSpec((b,), reshard, row.checkpointing) for b in graph.blocks) + (UnitSpec((ROOT,), False),)
    return PlanSpec(units=units, mesh=mesh, label=f"per-block {row.sharding}{' +AC' if row.checkpointing else ''}")


def sim_options(row: PublishedRow) -> SimOptions:
    return SimOptions(optimizer=OptimizerKind.ADAMW, param_dtype_bytes=2,
                      reduce_dtype_bytes=2 if row.mp_mode == "PURE" else 4)


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
    attention_share: float  # attention FLOP time / compute time
    memory_bound_share: float  # memory-bound op time / compute time
    estimate: CostEstimate

    @property
    def ratio(self) -> float:
        return self.tokens_per_s / self.row.tokens_per_s_per_gpu


@dataclass(frozen=True, slots=True)
class SearchRow:
    row: PublishedRow
    row_fits_budget: bool
    chosen: str  # a short description, or why nothing was chosen
    speedup: float  # row plan step / chosen plan step (nan when nothing fits)
    seconds: float
    max_group: int
    blocks: int = 0  # blocks of the model
    checkpointed: int = 0  # blocks the chosen plan checkpoints


class Predictor:
    """Builds, traces (cached per model, sequence and micro-batch) and simulates rows."""

    def __init__(self, published: Published, *, progress: Callable[[str], None] = lambda s: None):
        self.published = published
        self._graphs: dict[tuple[str, int, int], ModelGraph] = {}
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
        key = (row.model, row.seq_len, row.micro_batch)
        g = self._graphs.get(key)
        if g is None:
            import time

            import torch

            t0 = time.perf_counter()
            model = build_mpt(self.published.shapes[row.model], vocab=self.published.vocab, seq_len=row.seq_len)
            tokens = torch.zeros(row.micro_batch, row.seq_len, dtype=torch.long)
            g = with_master_weights(trace_model(model, (tokens,), loss_fn=fused_cross_entropy, fx=False))
            self._graphs[key] = g
            self.trace_s += time.perf_counter() - t0
            self.progress(f"traced {row.model} seq {row.seq_len} batch {row.micro_batch} ({len(self._graphs)} models)")
        return g

    def simulate(self, row: PublishedRow, efficiency: float,
                 fabric: FabricProfile | None = None) -> tuple[CostEstimate, float]:
        gpu = GPUS[row.gpu]
        g = self.graph(row)
        fab = fabric or fabric_at(gpu, row.num_gpus)
        est = Simulator(g, fab, compute_profile(gpu, efficiency), sim_options(row)).simulate(row_plan(g, row))
        return est, step_s(est, row.grad_accum)

    def tokens_per_s(self, row: PublishedRow, efficiency: float, fabric: FabricProfile | None = None) -> float:
        _est, step = self.simulate(row, efficiency, fabric)
        return row.micro_batch * row.seq_len * row.grad_accum / step

    def predict(self, row: PublishedRow, efficiency: float, role: str) -> Prediction:
        est, step = self.simulate(row, efficiency)
        gpu = GPUS[row.gpu]
        g = self.graph(row)
        flops_s = gpu.peak_flops * efficiency
        recompute = 1.0 if row.checkpointing else 0.0
        attn = (sum((m.fwd_flops * (1 + recompute) + m.bwd_flops) for m in g.modules if m.cls == "MptAttention")
                / flops_s)
        mem = (sum(m.fwd_bytes * (1 + recompute) + m.bwd_bytes for m in g.modules)
               / (gpu.hbm_bytes_per_s * _HBM_ACHIEVED))
        compute = max(est.compute_s, 1e-12)  # one micro-batch (the simulated step)
        return Prediction(row, role, row.micro_batch * row.seq_len * row.grad_accum / step, step, est.peak_bytes,
                          est.peak_bytes <= gpu.capacity_bytes, est.exposed_comm_s / est.step_s, attn / compute,
                          mem / compute, est)

    def search(self, row: PublishedRow, efficiency: float, *, max_group: int = 8) -> SearchRow:
        """wrapopt's own search on the row's hardware, step and budget (capacity x headroom)."""
        import time

        gpu = GPUS[row.gpu]
        g = self.graph(row)
        sim = Simulator(g, fabric_at(gpu, row.num_gpus), compute_profile(gpu, efficiency), sim_options(row))
        plan = row_plan(g, row)
        mine = sim.simulate(plan)
        budget = gpu.capacity_bytes * MEMORY_HEADROOM
        t0 = time.perf_counter()
        try:
            res = search_plan(g, sim, plan.mesh, memory_budget=budget,
                              options=SearchOptions(trials=0, max_group=max_group))
        except InfeasibleError as e:
            return SearchRow(row, mine.peak_bytes <= budget, f"nothing fits: {str(e).splitlines()[0][:80]}", math.nan,
                             time.perf_counter() - t0, max_group)
        best = res.best
        p = best.plan
        units = [u for u in p.units if not u.is_root]
        ck_mods = [m for u in units if u.checkpoint for m in u.modules]
        ck = sum(any(m == b or m.startswith(b + ".") for m in ck_mods) for b in g.blocks)  # blocks checkpointed
        keep = sum(u.reshard_after_forward is False for u in units)
        hsdp = f", HSDP {p.mesh.replicate_size}x{p.mesh.shard_size}" if p.mesh.is_hsdp else ""
        desc = (f"{p.label or 'wrapopt'}: {len(units)} units{hsdp}, {keep} kept after forward, "
                f"{ck} blocks checkpointed")
        speedup = step_s(mine, row.grad_accum) / step_s(best.estimate, row.grad_accum)
        return SearchRow(row, mine.peak_bytes <= budget, desc, speedup, time.perf_counter() - t0, max_group,
                         len(g.blocks), ck)


def fit_efficiency(predictor: Predictor, rows: list[PublishedRow], *, lo: float = 0.2, hi: float = 1.0,
                   iterations: int = 12) -> float:
    """The efficiency at which the median predicted/published ratio over ``rows`` is 1 (bisection:
    predicted throughput rises with the efficiency)."""
    for _ in range(iterations):
        mid = (lo + hi) / 2
        med = statistics.median(predictor.tokens_per_s(r, mid) / r.tokens_per_s_per_gpu for r in rows)
        if med < 1.0:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def errors_of(preds: list[Prediction]) -> dict[str, Any]:
    """Median and max |pred/pub - 1|, Spearman of predicted vs published tokens/s, count."""
    if not preds:
        return {"n": 0, "median": math.nan, "max": math.nan, "spearman": math.nan, "over_20": 0}
    errs = [abs(p.ratio - 1) for p in preds]
    rho = (spearman([p.tokens_per_s for p in preds], [p.row.tokens_per_s_per_gpu for p in preds]) if len(preds) > 2
           else math.nan)
    return {"n": len(preds), "median": statistics.median(errs), "max": max(errs), "spearman": rho,
            "over_20": sum(e > 0.2 for e in errs), "median_ratio": statistics.median(p.ratio for p in preds)}
