"""Analytical fabrics and devices: stated numbers, each with its source.

Used when nothing is measured (planning for a cluster that is not here); every
profile built from this table is labelled ``analytical`` wherever it is shown.
"""

from __future__ import annotations

from typing import Any

from wrapopt.errors import ProfileError
from wrapopt.hardware.profiles import AnalyticalLink, ComputeProfile, FabricProfile

__all__ = ["ANALYTICAL_FABRICS", "DEFAULT_ANALYTICAL", "analytical_fabric", "analytical_compute"]

# Named analytical fabrics. Each number is stated with its source; achieved
# bandwidth is taken as ~80% of the link's line rate, the usual NCCL busbw.
ANALYTICAL_FABRICS: dict[str, dict[str, Any]] = {
    "h100-nvlink-ib400": {
        "description": "8x H100 SXM per node, NVLink 4 inside, 8x 400 Gb/s InfiniBand NDR between nodes",
        "ranks_per_node": 8,
        "intra": AnalyticalLink(
            latency_s=5e-6,
            bandwidth_bytes_per_s=360e9,
            source="NVLink 4: 450 GB/s per direction per GPU (NVIDIA H100 datasheet); ~80% achieved busbw; ~5 us per ring step (nccl-tests small-message latency)",
        ),
        "inter": AnalyticalLink(
            latency_s=10e-6,
            bandwidth_bytes_per_s=40e9,
            source="one ConnectX-7 400 Gb/s NDR NIC per GPU = 50 GB/s (DGX H100 datasheet); ~80% achieved; ~10 us per inter-node ring step",
        ),
        "compute": {"flops_per_s": 989e12 * 0.45, "memory_bandwidth_bytes_per_s": 3.35e12 * 0.8, "memory_capacity_bytes": 80 * 2**30,
                    "source": "H100 SXM dense BF16 989 TFLOP/s at 45% MFU; HBM3 3.35 TB/s at 80%; 80 GiB"},
    },
    "a100-nvlink-ib200": {
        "description": "8x A100 80GB per node, NVLink 3 inside, 200 Gb/s HDR InfiniBand per GPU between nodes",
        "ranks_per_node": 8,
        "intra": AnalyticalLink(5e-6, 240e9, "NVLink 3: 300 GB/s per direction per GPU (A100 datasheet); ~80% achieved"),
        "inter": AnalyticalLink(12e-6, 20e9, "200 Gb/s HDR = 25 GB/s per GPU (DGX A100 datasheet); ~80% achieved"),
        "compute": {"flops_per_s": 312e12 * 0.45, "memory_bandwidth_bytes_per_s": 2.0e12 * 0.8, "memory_capacity_bytes": 80 * 2**30,
                    "source": "A100 dense BF16 312 TFLOP/s at 45% MFU; HBM2e 2.0 TB/s at 80%; 80 GiB"},
    },
    "h100-nvlink-eth100": {
        "description": "8x H100 per node, NVLink 4 inside, 100 Gb/s Ethernet (one NIC per node) between nodes",
        "ranks_per_node": 8,
        "intra": AnalyticalLink(5e-6, 360e9, "NVLink 4 as in h100-nvlink-ib400"),
        "inter": AnalyticalLink(30e-6, 12.5e9 * 0.8 / 8, "one 100 Gb/s NIC = 12.5 GB/s shared by 8 GPUs; ~80% achieved; TCP ~30 us per step"),
        "compute": {"flops_per_s": 989e12 * 0.45, "memory_bandwidth_bytes_per_s": 3.35e12 * 0.8, "memory_capacity_bytes": 80 * 2**30,
                    "source": "as in h100-nvlink-ib400"},
    },
}
DEFAULT_ANALYTICAL = "h100-nvlink-ib400"


def analytical_fabric(name: str = DEFAULT_ANALYTICAL, *, world_size: int, ranks_per_node: int | None = None) -> FabricProfile:
    """A labelled analytical profile for a cluster that is not measured here.

    Example:
        >>> f = analytical_fabric("h100-nvlink-ib400", world_size=64)
        >>> f.kind
        'analytical'
    """
    if name not in ANALYTICAL_FABRICS:
        raise ProfileError(f"unknown analytical fabric {name!r}; choose one of {sorted(ANALYTICAL_FABRICS)}")
    spec = ANALYTICAL_FABRICS[name]
    rpn = ranks_per_node or spec["ranks_per_node"]
    return FabricProfile(
        kind="analytical",
        name=name,
        backend="nccl (assumed)",
        world_size=world_size,
        ranks_per_node=rpn,
        axes=(),
        meta={"description": spec["description"], "compute": {k: v for k, v in spec["compute"].items()}},
        intra=spec["intra"],
        inter=spec["inter"],
    )


def analytical_compute(name: str = DEFAULT_ANALYTICAL) -> ComputeProfile:
    """The stated compute figures of an analytical fabric's device.

    Example:
        >>> analytical_compute("a100-nvlink-ib200").kind
        'analytical'
    """
    if name not in ANALYTICAL_FABRICS:
        raise ProfileError(f"unknown analytical fabric {name!r}; choose one of {sorted(ANALYTICAL_FABRICS)}")
    spec = ANALYTICAL_FABRICS[name]["compute"]
    return ComputeProfile(
        kind="analytical",
        device=name,
        flops_per_s=spec["flops_per_s"],
        memory_bandwidth_bytes_per_s=spec["memory_bandwidth_bytes_per_s"],
        memory_capacity_bytes=spec["memory_capacity_bytes"],
        unit_overhead_s=20e-6,
        module_overhead_s=5e-6,
        meta={"source": spec["source"]},
    )
