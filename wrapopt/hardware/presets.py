"""Analytical fabrics and devices: stated numbers, each with its source.

Used when nothing is measured (planning for a cluster that is not here); every
profile built from this table is labelled ``analytical`` wherever it is shown.
"""

from __future__ import annotations

from typing import Any

from wrapopt.checks import check_count
from wrapopt.errors import ProfileError
from wrapopt.fileio import JsonReader, read_json
from wrapopt.hardware.profiles import AnalyticalLink, ComputeProfile, FabricProfile

__all__ = ["ANALYTICAL_FABRICS", "DEFAULT_ANALYTICAL", "ANALYTICAL_FORMAT", "TEMPLATE", "analytical_fabric",
           "analytical_compute", "fabric_compute", "load_analytical", "analytical_from_json"]

# Dense peak FLOP/s per compute dtype (datasheets). float32 is the TF32 tensor-core rate, which
# needs torch.set_float32_matmul_precision("high"); PyTorch's default full-fp32 matmul runs at
# 67 (H100 SXM) or 19.5 (A100) TFLOP/s.
_H100 = {"bfloat16": 989e12, "float16": 989e12, "float32": 494.5e12}
_A100 = {"bfloat16": 312e12, "float16": 312e12, "float32": 156e12}

# Named analytical fabrics. Each number is stated with its source; achieved
# bandwidth is taken as ~80% of the link's line rate, the usual NCCL busbw.
ANALYTICAL_FABRICS: dict[str, dict[str, Any]] = {
    "h100-nvlink-ib400": {
        "description": "8x H100 SXM per node, NVLink 4 inside, 8x 400 Gb/s InfiniBand NDR between nodes",
        "ranks_per_node": 8,
        "intra": AnalyticalLink(
            latency_s=5e-6,
            bandwidth_bytes_per_s=360e9,
            source="NVLink 4: 450 GB/s per direction per GPU (NVIDIA H100 datasheet); ~80% achieved busbw; "
                   "~5 us per ring step (nccl-tests small-message latency)",
        ),
        "inter": AnalyticalLink(
            latency_s=10e-6,
            bandwidth_bytes_per_s=40e9,
            source="one ConnectX-7 400 Gb/s NDR NIC per GPU = 50 GB/s (DGX H100 datasheet); ~80% achieved; "
                   "~10 us per inter-node ring step",
        ),
        "compute": {"flops_per_s": 989e12 * 0.45, "memory_bandwidth_bytes_per_s": 3.35e12 * 0.8,
                    "memory_capacity_bytes": 80 * 2**30, "peak_flops_per_s": _H100, "achievable_fraction": 0.45,
                    "source": "H100 SXM dense BF16 989 TFLOP/s at 45% MFU; HBM3 3.35 TB/s at 80%; 80 GiB"},
    },
    "a100-nvlink-ib200": {
        "description": "8x A100 80GB per node, NVLink 3 inside, 200 Gb/s HDR InfiniBand per GPU between nodes",
        "ranks_per_node": 8,
        "intra": AnalyticalLink(5e-6, 240e9,
                                "NVLink 3: 300 GB/s per direction per GPU (A100 datasheet); ~80% achieved"),
        "inter": AnalyticalLink(12e-6, 20e9, "200 Gb/s HDR = 25 GB/s per GPU (DGX A100 datasheet); ~80% achieved"),
        "compute": {"flops_per_s": 312e12 * 0.45, "memory_bandwidth_bytes_per_s": 2.0e12 * 0.8,
                    "memory_capacity_bytes": 80 * 2**30, "peak_flops_per_s": _A100, "achievable_fraction": 0.45,
                    "source": "A100 dense BF16 312 TFLOP/s at 45% MFU; HBM2e 2.0 TB/s at 80%; 80 GiB"},
    },
    "h100-nvlink-eth100": {
        "description": "8x H100 per node, NVLink 4 inside, 100 Gb/s Ethernet (one NIC per node) between nodes",
        "ranks_per_node": 8,
        "intra": AnalyticalLink(5e-6, 360e9, "NVLink 4 as in h100-nvlink-ib400"),
        "inter": AnalyticalLink(30e-6, 12.5e9 * 0.8 / 8,
                                "one 100 Gb/s NIC = 12.5 GB/s shared by 8 GPUs; ~80% achieved; TCP ~30 us per step"),
        "compute": {"flops_per_s": 989e12 * 0.45, "memory_bandwidth_bytes_per_s": 3.35e12 * 0.8,
                    "memory_capacity_bytes": 80 * 2**30, "peak_flops_per_s": _H100, "achievable_fraction": 0.45,
                    "source": "as in h100-nvlink-ib400"},
    },
}
DEFAULT_ANALYTICAL = "h100-nvlink-ib400"


def analytical_fabric(name: str = DEFAULT_ANALYTICAL, *, world_size: int,
                      ranks_per_node: int | None = None) -> FabricProfile:
    """A labelled analytical profile for a cluster that is not measured here.

    Example:
        >>> f = analytical_fabric("h100-nvlink-ib400", world_size=64)
        >>> f.kind
        'analytical'
    """
    if name not in ANALYTICAL_FABRICS:
        raise ProfileError(f"unknown analytical fabric {name!r}; choose one of {sorted(ANALYTICAL_FABRICS)}")
    spec = ANALYTICAL_FABRICS[name]
    rpn = spec["ranks_per_node"] if ranks_per_node is None else check_count(ranks_per_node, "ranks_per_node")
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


def analytical_compute(name: str = DEFAULT_ANALYTICAL, *, dtype: str | None = None) -> ComputeProfile:
    """The stated compute figures of an analytical fabric's device.

    ``dtype`` (``"bfloat16"``, ``"float16"``, ``"float32"``) picks the stated peak
    for that compute dtype times the achievable fraction; None keeps the
    fabric's headline ``flops_per_s`` (its bf16 rate).

    Example:
        >>> analytical_compute("a100-nvlink-ib200").kind
        'analytical'
    """
    if name not in ANALYTICAL_FABRICS:
        raise ProfileError(f"unknown analytical fabric {name!r}; choose one of {sorted(ANALYTICAL_FABRICS)}")
    return _compute(name, ANALYTICAL_FABRICS[name]["compute"], dtype, f"analytical fabric {name!r}")


def fabric_compute(fabric: FabricProfile, *, dtype: str | None = None) -> ComputeProfile:
    """The stated device of an analytical fabric (built in, or read from a file by
    ``load_analytical``), computing in ``dtype``."""
    spec = fabric.meta.get("compute")
    if fabric.kind != "analytical" or not isinstance(spec, dict):
        raise ProfileError(f"fabric {fabric.label} states no device; give a compute profile (--compute)")
    return _compute(fabric.name, spec, dtype, fabric.meta.get("source_file") or f"analytical fabric {fabric.name!r}")


def _compute(name: str, spec: dict[str, Any], dtype: str | None, where: str) -> ComputeProfile:
    flops, source = spec["flops_per_s"], spec["source"]
    peaks = spec.get("peak_flops_per_s") or {}
    if dtype is not None and peaks:
        if dtype not in peaks:
            raise ProfileError(f"{where}: field 'peak_flops_per_s' states no {dtype} rate (it has "
                               f"{', '.join(peaks)}); add one, or train in one of those")
        flops = peaks[dtype] * spec["achievable_fraction"]
        source += f"; computing in {dtype}: {peaks[dtype] / 1e12:g} TFLOP/s peak x {spec['achievable_fraction']:g}"
    return ComputeProfile(
        kind="analytical",
        device=name,
        flops_per_s=flops,
        memory_bandwidth_bytes_per_s=spec["memory_bandwidth_bytes_per_s"],
        memory_capacity_bytes=spec["memory_capacity_bytes"],
        op_bandwidth_bytes_per_s=spec["memory_bandwidth_bytes_per_s"],  # See [Note: memory-bound ops]
        unit_overhead_s=20e-6,
        module_overhead_s=5e-6,
        meta={"source": source, **({"dtype": dtype, "peak_flops_per_s": peaks[dtype]} if dtype and peaks else {})},
    )


# -- analytical fabrics from a file: See [Note: stated fabric file] ----------------------------

# [Note: stated fabric file] Users describe a cluster they have not measured in a
# small JSON file of stated numbers (``wrapopt fabric --template`` prints one):
# GPUs per node; per level (intra-node, inter-node) the achieved bus bandwidth
# per GPU and the latency of one ring step; dense peak FLOP/s per compute dtype
# and the fraction of it a training step achieves; memory bandwidth (achieved)
# and capacity per GPU. Collectives then follow the ring model
# (``profiles.ring_time``), compute the achieved rate, exactly as for the
# built-in fabrics; everything made from it is labelled ``analytical``.
ANALYTICAL_FORMAT = "wrapopt.analytical/1"
TEMPLATE: dict[str, Any] = {
    "format": ANALYTICAL_FORMAT,
    "name": "my-cluster",
    "description": "8x H100 SXM per node, NVLink 4 inside, 400 Gb/s InfiniBand per GPU between nodes",
    "gpus_per_node": 8,
    "intra_node": {"bandwidth_bytes_per_s": 360e9, "latency_s": 5e-6, "source": "NVLink 4 450 GB/s x 80%"},
    "inter_node": {"bandwidth_bytes_per_s": 40e9, "latency_s": 10e-6, "source": "400 Gb/s NDR per GPU x 80%"},
    "peak_flops_per_s": dict(_H100),
    "achievable_fraction": 0.45,
    "memory_bandwidth_bytes_per_s": 3.35e12 * 0.8,
    "memory_capacity_bytes": 80 * 2**30,
    "source": "H100 SXM datasheet; 45% of peak as achieved MFU",
}


def load_analytical(path: str, *, world_size: int, ranks_per_node: int | None = None) -> FabricProfile:
    """An analytical fabric from a file of stated numbers: See [Note: stated fabric file].
    Errors name the file and the field."""
    return analytical_from_json(read_json(path, error=ProfileError), source=str(path), world_size=world_size,
                                ranks_per_node=ranks_per_node)


def analytical_from_json(d: Any, *, source: str, world_size: int, ranks_per_node: int | None = None) -> FabricProfile:
    r = JsonReader(d, source, error=ProfileError)
    if r.get("format", str) != ANALYTICAL_FORMAT:
        raise ProfileError(f"{source}: field 'format' is {d.get('format')!r}; this version of wrapopt reads stated "
                           f"numbers in format {ANALYTICAL_FORMAT!r} (`wrapopt fabric --template` prints one)")
    gpn = r.count("gpus_per_node")
    if ranks_per_node is not None and ranks_per_node > gpn:
        # one rank per GPU: a node of the mesh cannot hold more ranks than the file's node has GPUs
        raise ProfileError(f"{source}: field 'gpus_per_node' is {gpn}, but the mesh puts {ranks_per_node} ranks on a "
                           f"node (--gpus-per-node; default: the world size up to 8); pass --gpus-per-node {gpn} "
                           "or fewer, or correct the file")
    links = {}
    for key in ("intra_node", "inter_node"):
        lr = r.sub(key)
        bw, lat = lr.num("bandwidth_bytes_per_s", positive=True), lr.num("latency_s")
        links[key] = AnalyticalLink(lat, bw, str(lr.d.get("source", "stated in " + source)))
    pr = r.sub("peak_flops_per_s")
    if not pr.d:
        raise ProfileError(f"{source}: field 'peak_flops_per_s' must name at least one dtype "
                           "(bfloat16, float16, float32)")
    peaks = {}
    for k in pr.d:
        if k not in ("bfloat16", "float16", "float32"):
            raise ProfileError(f"{source}: field 'peak_flops_per_s.{k}' is not a dtype; "
                               "use bfloat16, float16 or float32")
        peaks[k] = pr.num(k, positive=True)
    frac = r.num("achievable_fraction")
    if not 0 < frac <= 1:
        raise ProfileError(f"{source}: field 'achievable_fraction' must be in (0, 1], got {frac}")
    head = peaks.get("bfloat16") or next(iter(peaks.values()))
    compute = {"flops_per_s": head * frac,
               "memory_bandwidth_bytes_per_s": r.num("memory_bandwidth_bytes_per_s", positive=True),
               "memory_capacity_bytes": int(r.num("memory_capacity_bytes", positive=True)), "peak_flops_per_s": peaks,
               "achievable_fraction": frac, "source": str(d.get("source", "stated in " + source))}
    name = r.get("name", str) if "name" in d else source
    return FabricProfile(kind="analytical", name=name, backend="nccl (assumed)", world_size=world_size,
                         ranks_per_node=gpn if ranks_per_node is None else ranks_per_node, axes=(),
                         meta={"description": str(d.get("description", "")), "compute": compute, "source_file": source,
                               "gpus_per_node": gpn},
                         intra=links["intra_node"], inter=links["inter_node"])
