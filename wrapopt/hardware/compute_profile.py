"""The compute profile: how fast one device computes, measured (``measure_device``) or stated (``presets``).

``ComputeProfile`` holds the throughput, bandwidths and fixed costs the cost model prices a
step's compute with, and reads and writes them as a ``wrapopt.compute/1`` file. The fabric
side lives in ``profiles.py``, which re-exports this class.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from wrapopt.errors import ProfileError
from wrapopt.fileio import JsonReader, atomic_write_json, read_json

__all__ = ["ComputeProfile", "COMPUTE_FORMAT", "PROFILE_HINT"]

COMPUTE_FORMAT = "wrapopt.compute/1"
PROFILE_HINT = "create one with `wrapopt profile-fabric --out {path}`"


@dataclass(frozen=True)
class ComputeProfile:
    """How fast one device computes, measured or stated.

    ``module_times`` (optional) are measured self times per module at the
    traced batch; the cost model prefers them to FLOP-based estimates.
    """

    kind: str  # "measured" or "analytical"
    device: str
    flops_per_s: float  # achieved dense matmul throughput
    memory_bandwidth_bytes_per_s: float
    memory_capacity_bytes: int | None = None
    unit_overhead_s: float = 0.0  # fixed cost per FSDP unit per all-gather (hooks, copy-in, copy-out), seconds
    param_overhead_s: float = 0.0  # and per parameter tensor of the unit: [Note: per-parameter overhead]
    byte_overhead_s: float = 0.0  # and per byte it gathers: See [Note: per-byte overhead] in hardware/measure_fsdp.py
    module_overhead_s: float = 0.0  # fixed cost per module call (kernel launches / op dispatch), seconds
    # Optimizer step cost per parameter tensor on FSDP2-sharded (DTensor) parameters (small models: per-tensor
    # dispatch, not bytes); on a 2-D (replicate, shard) mesh (HSDP, no-shard) more per op. 0: optimizer_tensor_s.
    optimizer_tensor_s: float = 0.0
    optimizer_tensor_2d_s: float = 0.0
    # Effective bandwidth of the optimizer step, counted as (2 + 2 * states) bytes per parameter byte: AdamW's
    # foreach ops stream the tensors more times than that, so it runs below the copy bandwidth. 0: memory bandwidth.
    optimizer_bandwidth_bytes_per_s: float = 0.0
    # Bandwidth at which ops without a FLOP formula (norms, activations, adds, copies) move their bytes: See [Note:
    # memory-bound ops] in trace/op_bytes.py. 0: only module_overhead_s (measured CPU profiles' module times hold them).
    op_bandwidth_bytes_per_s: float = 0.0
    loss_s: float = 0.0  # forward + backward of the loss, which runs outside the model's modules
    # What activation checkpointing adds per checkpointed module beyond re-running its forward (saved-tensor hooks,
    # the recompute's bookkeeping), seconds, and of that what its first forward pays (the rest: its recompute).
    checkpoint_overhead_s: float = 0.0
    checkpoint_forward_s: float = 0.0
    selective_op_overhead_s: float = 0.0  # per forward op of a selective-op unit, forward and recompute (selective.py)
    module_times: tuple[tuple[str, float, float], ...] = ()  # (fqn, fwd_s, bwd_s)
    batch_fixed_share: float = 0.0  # of module_times, the share a batch's size does not scale: [Note: batch scaling]
    pipeline_action_s: float = 0.0  # host work per forward or backward action of torch's pipeline schedule
    # Whether the host runs ahead of the device, so that a unit's all-gather is issued while the previous unit
    # computes (a GPU stream); False on a CPU, whose collectives block: [Note: blocking collectives] in cost/step.py.
    runs_ahead: bool = True
    # (tensor-parallel degree, throughput of a projection split that many ways / unsplit):
    # measured on the model's largest projection; none: split matmuls are taken to run
    # as fast per FLOP as whole ones (a stated caveat). See [Note: tensor parallel costs] in cost/tp.py.
    split_efficiency: tuple[tuple[int, float], ...] = ()
    # (forward, backward) seconds per call of a tensor-parallel projection beyond its matmul and
    # all-reduce (DTensor dispatch and hooks), measured by measure_split.measure_tp_overhead.
    tp_overhead_s: tuple[float, float] = (0.0, 0.0)
    # The kernel roofline (stated GPUs): achieved tensor-core FLOP/s of a compute-bound GEMM, of the
    # attention kernels, and the multiprocessors a GEMM's tiles fill in waves. 0: one rate for all
    # FLOPs (flops_per_s; measured profiles). See [Note: kernel roofline] in cost/roofline.py.
    matmul_flops_per_s: float = 0.0
    attention_flops_per_s: float = 0.0
    num_sms: int = 0
    meta: dict[str, Any] = field(default_factory=dict, compare=False)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": COMPUTE_FORMAT,
            "kind": self.kind,
            "device": self.device,
            "flops_per_s": self.flops_per_s,
            "memory_bandwidth_bytes_per_s": self.memory_bandwidth_bytes_per_s,
            "memory_capacity_bytes": self.memory_capacity_bytes,
            "unit_overhead_s": self.unit_overhead_s,
            "param_overhead_s": self.param_overhead_s,
            "byte_overhead_s": self.byte_overhead_s,
            "module_overhead_s": self.module_overhead_s,
            "optimizer_tensor_s": self.optimizer_tensor_s,
            "optimizer_tensor_2d_s": self.optimizer_tensor_2d_s,
            "optimizer_bandwidth_bytes_per_s": self.optimizer_bandwidth_bytes_per_s,
            "op_bandwidth_bytes_per_s": self.op_bandwidth_bytes_per_s,
            "loss_s": self.loss_s,
            "checkpoint_overhead_s": self.checkpoint_overhead_s,
            "checkpoint_forward_s": self.checkpoint_forward_s,
            "selective_op_overhead_s": self.selective_op_overhead_s,
            "module_times": [list(t) for t in self.module_times],
            "batch_fixed_share": self.batch_fixed_share,
            "pipeline_action_s": self.pipeline_action_s,
            "runs_ahead": self.runs_ahead,
            "split_efficiency": [list(t) for t in self.split_efficiency],
            "tp_overhead_s": list(self.tp_overhead_s),
            "matmul_flops_per_s": self.matmul_flops_per_s,
            "attention_flops_per_s": self.attention_flops_per_s,
            "num_sms": self.num_sms,
            "meta": self.meta,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any], *, source: str = "<dict>") -> "ComputeProfile":
        r = JsonReader(d, source, error=ProfileError)
        if r.get("format", str) != COMPUTE_FORMAT:
            raise ProfileError(f"{source}: field 'format' is {d.get('format')!r}, expected {COMPUTE_FORMAT!r}")
        cap = None if d.get("memory_capacity_bytes") is None else int(r.num("memory_capacity_bytes", positive=True))
        return cls(
            kind=r.get("kind", str),
            device=r.get("device", str),
            flops_per_s=r.num("flops_per_s", positive=True),
            memory_bandwidth_bytes_per_s=r.num("memory_bandwidth_bytes_per_s", positive=True),
            memory_capacity_bytes=cap,
            unit_overhead_s=r.num("unit_overhead_s", 0.0),
            param_overhead_s=r.num("param_overhead_s", 0.0),
            byte_overhead_s=r.num("byte_overhead_s", 0.0),
            module_overhead_s=r.num("module_overhead_s", 0.0),
            optimizer_tensor_s=r.num("optimizer_tensor_s", 0.0),
            optimizer_tensor_2d_s=r.num("optimizer_tensor_2d_s", 0.0),
            optimizer_bandwidth_bytes_per_s=r.num("optimizer_bandwidth_bytes_per_s", 0.0),
            op_bandwidth_bytes_per_s=r.num("op_bandwidth_bytes_per_s", 0.0),
            loss_s=r.num("loss_s", 0.0),
            checkpoint_overhead_s=r.num("checkpoint_overhead_s", 0.0),
            checkpoint_forward_s=r.num("checkpoint_forward_s", 0.0),
            selective_op_overhead_s=r.num("selective_op_overhead_s", 0.0),
            module_times=tuple((str(a), float(b), float(c)) for a, b, c in d.get("module_times", [])),
            batch_fixed_share=r.num("batch_fixed_share", 0.0),
            pipeline_action_s=r.num("pipeline_action_s", 0.0),
            # files written before the field existed: a CPU device was the one that does not run ahead
            runs_ahead=bool(d.get("runs_ahead", not str(d.get("device", "")).startswith("cpu"))),
            split_efficiency=tuple((int(a), float(b)) for a, b in d.get("split_efficiency", [])),
            tp_overhead_s=tuple(float(v) for v in d.get("tp_overhead_s", (0.0, 0.0)))[:2],  # type: ignore[arg-type]
            matmul_flops_per_s=float(d.get("matmul_flops_per_s", 0.0)),
            attention_flops_per_s=float(d.get("attention_flops_per_s", 0.0)),
            num_sms=int(d.get("num_sms", 0)),
            meta=dict(d.get("meta", {})),
        )

    def save(self, path: str) -> None:
        atomic_write_json(path, self.to_json())

    @classmethod
    def load(cls, path: str) -> "ComputeProfile":
        return cls.from_json(read_json(path, error=ProfileError, hint=PROFILE_HINT), source=str(path))
