"""Where each rank's sharded state lives and what stepping it costs: the sharded parameters,
gradients and optimizer state on the GPU, or in host memory under CPU offload.

[Note: CPU offload] With ``fully_shard(..., offload_policy=CPUOffloadPolicy())`` (a plan with
``PlanSpec.offload``) each rank's shards of the parameters, their gradients and the optimizer
state live in pinned host memory, and the optimizer steps on the CPU. The simulator prices it as
FSDP2 runs it:

- before a unit's all-gather, its sharded parameters are copied host-to-device (in their
  storage dtype) on the all-gather's stream, so each all-gather takes that copy longer
  (``storage / shard`` bytes over the host link);
- after a unit's reduce-scatter, its sharded gradients (in the reduce dtype) are copied
  device-to-host on the reduce-scatter's stream: each reduce-scatter takes that copy longer;
- the GPU holds no sharded parameters, sharded gradients or optimizer state: those parts of
  the peak are 0 (the gathered parameters, unsharded gradients and activations are as without
  offload);
- the optimizer step streams the same bytes as on the GPU (``Simulator``'s optimizer model),
  over this GPU's share of the host DRAM bandwidth instead of HBM, with no per-tensor launch
  cost.
- host memory per rank: sharded parameters, gradients (fp32 after the copy) and optimizer
  state; a plan whose node total exceeds the stated host memory does not fit.

The host link and DRAM figures are stated with the GPU preset (``hardware/catalog.py``: the
reference system's PCIe generation and sockets x channels x rate), achieved at 80% as HBM is;
the host memory is the user's (``--host-memory``). Nothing here was measured on a GPU: a task
with one checks an offload plan's peak in ``benchmarks/gpu_check.py``. PyTorch's CPU AdamW is
not always memory-bound, so the CPU step may be slower than priced.
"""

from __future__ import annotations

import numpy as np

from wrapopt.hardware.host import HostSpec
from wrapopt.hardware.profiles import ComputeProfile
from wrapopt.spec import MeshSpec

__all__ = ["static_bytes", "optimizer_s", "copy_times", "cpu_optimizer_s", "host_bytes_per_rank"]


def static_bytes(storage_bytes: float, trainable_bytes: float, states: float, shard: int) -> tuple[float, float]:
    """Sharded parameters and optimizer state on the GPU: See [Note: memory] in step.py. (Sharded
    gradients appear unit by unit as reduce-scatters land: zero_grad(set_to_none=True).)"""
    return storage_bytes / shard, trainable_bytes * states / shard


def optimizer_s(trainable_bytes: float, states: float, mesh: MeshSpec, compute: ComputeProfile, *,
                num_tensors: int, stepping: bool) -> float:
    """The optimizer step on the GPU: read/write the local shard of the trainable parameters and
    its states (memory-bound), plus a fixed dispatch cost per trainable tensor (dominant for small
    models; frozen parameters have no gradient and are skipped). Both calibrated by the profiler's
    AdamW steps on fully_shard parameters, the per-tensor cost separately for 2-D meshes (HSDP,
    no-shard): see hardware/measure_device.py."""
    out = (trainable_bytes / mesh.shard_size) * (2 + 2 * states) / (
        compute.optimizer_bandwidth_bytes_per_s or compute.memory_bandwidth_bytes_per_s)
    if stepping:
        per_tensor = ((compute.optimizer_tensor_2d_s or compute.optimizer_tensor_s) if mesh.is_hsdp
                      else compute.optimizer_tensor_s)
        out += num_tensors * per_tensor
    return out


def copy_times(storage_bytes: np.ndarray, grad_bytes: np.ndarray, shard: int,
               host: HostSpec) -> tuple[np.ndarray, np.ndarray]:
    """Per unit: the host-to-device copy before its all-gather and the device-to-host copy after
    its reduce-scatter (``grad_bytes``: unsharded gradients in the reduce dtype)."""
    return storage_bytes / shard / host.link_bytes_per_s, grad_bytes / shard / host.link_bytes_per_s


def cpu_optimizer_s(trainable_bytes: float, states: float, shard: int, host: HostSpec) -> float:
    """The optimizer step on the CPU: the sharded parameters and their states read and written
    once over this GPU's share of the host DRAM bandwidth."""
    return (trainable_bytes / shard) * (2 + 2 * states) / host.memory_bandwidth_bytes_per_s


def host_bytes_per_rank(storage_bytes: float, trainable_bytes: float, states: float, shard: int) -> float:
    """Host memory one rank fills: sharded parameters, fp32 sharded gradients, optimizer state."""
    return (storage_bytes + trainable_bytes + trainable_bytes * states) / shard
