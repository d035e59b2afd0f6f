"""Analytical fabrics and devices: a GPU preset and a network preset, each number with its source.

Used when nothing is measured (planning for a cluster that is not here); every
profile built from these is labelled ``analytical`` wherever it is shown. The
GPUs and networks are in ``catalog.py`` ([Note: GPU and network presets]); a
named fabric is one (GPU, network) pair, and ``GPU+NETWORK`` names any other
(each side a preset name or a file of stated numbers).
"""

from __future__ import annotations

import os
from typing import Any

from wrapopt.checks import check_count
from wrapopt.errors import ProfileError
from wrapopt.fileio import JsonReader, read_json
from wrapopt.hardware.catalog import (
    GPU_FORMAT, GPUS, INTER_LINKS, GpuPreset, check_stated_fields, find_gpu, gpu_from_json, network_links,
    stated_number, stated_peaks, stated_whole,
)
from wrapopt.hardware.profiles import AnalyticalLink, ComputeProfile, FabricProfile

__all__ = ["ANALYTICAL_FABRICS", "DEFAULT_ANALYTICAL", "ANALYTICAL_FORMAT", "NETWORK_FORMAT", "TEMPLATE",
           "NETWORK_TEMPLATE", "analytical_fabric", "analytical_compute", "fabric_compute", "load_analytical",
           "analytical_from_json", "pair_fabric", "FABRIC_PAIRS"]

GPUS_PER_NODE = 8
# The named fabrics of earlier releases, as (GPU, network) pairs: the names keep working.
FABRIC_PAIRS: dict[str, tuple[str, str]] = {
    "h100-nvlink-ib400": ("h100-sxm", "nvlink4-ib400"),
    "a100-nvlink-ib200": ("a100-80gb-sxm", "nvlink3-ib200"),
    "h100-nvlink-eth100": ("h100-sxm", "nvlink4-eth100"),
}
DEFAULT_ANALYTICAL = "h100-nvlink-ib400"
# The inter-node link a GPU gets when only the GPU is named: its DGX/HGX system's.
_DEFAULT_INTER = {"a100-40gb-sxm": "ib200", "a100-80gb-sxm": "ib200"}


def _network(spec: str | FabricProfile, gpu: GpuPreset | None) -> tuple[AnalyticalLink, AnalyticalLink, int, str]:
    """(inside, between, GPUs per node, name) of a network preset name or a stated network file's fabric."""
    if isinstance(spec, FabricProfile):
        return spec.intra, spec.inter, spec.ranks_per_node, spec.meta.get("network", spec.name)  # type: ignore
    intra, inter = network_links(spec, gpu)
    return intra, inter, GPUS_PER_NODE, spec


def pair_fabric(gpu: str | GpuPreset, network: str | FabricProfile | None = None, *, world_size: int,
                ranks_per_node: int | None = None, name: str | None = None) -> FabricProfile:
    """A labelled analytical fabric of one GPU preset and one network preset (names, or what files stated).

    Example:
        >>> f = pair_fabric("a100-40gb-sxm", "ib200", world_size=16)
        >>> f.name, f.meta["compute"]["gpu"]
        ('a100-40gb-sxm+ib200', 'a100-40gb-sxm')
    """
    g = gpu if isinstance(gpu, GpuPreset) else find_gpu(gpu)
    network = network or _DEFAULT_INTER.get(g.name, "ib400")
    intra, inter, gpn, net_name = _network(network, g)
    return FabricProfile(
        kind="analytical", name=name or f"{g.name}+{net_name}", backend="nccl (assumed)", world_size=world_size,
        ranks_per_node=ranks_per_node or gpn, axes=(),
        meta={"description": f"{g.description}, {gpn} per node; network {net_name}", "compute": g.compute_spec(),
              "gpu": g.name, "network": net_name},
        intra=intra, inter=inter)


def _named(name: str, world_size: int, ranks_per_node: int | None) -> FabricProfile:
    if name in FABRIC_PAIRS:
        gpu, net = FABRIC_PAIRS[name]
        return pair_fabric(gpu, net, world_size=world_size, ranks_per_node=ranks_per_node, name=name)
    if "+" in name:  # GPU+NETWORK, each a preset name or a file of stated numbers
        gpu_s, _, net_s = name.partition("+")
        gpu = read_side(gpu_s, world_size=world_size, ranks_per_node=ranks_per_node) or gpu_s
        if isinstance(gpu, FabricProfile):
            raise ProfileError(f"{gpu_s}: states a network or a whole cluster, not a GPU ({GPU_FORMAT!r}); name it "
                               "after the '+'")
        net = read_side(net_s, world_size=world_size, ranks_per_node=ranks_per_node) or net_s
        if isinstance(net, GpuPreset):
            raise ProfileError(f"{net_s}: states a GPU, not a network; name it before the '+'")
        return pair_fabric(gpu, net, world_size=world_size, ranks_per_node=ranks_per_node)
    try:
        return pair_fabric(name, None, world_size=world_size, ranks_per_node=ranks_per_node)
    except ProfileError:
        raise ProfileError(f"unknown analytical fabric {name!r}; choose one of {', '.join(FABRIC_PAIRS)}, a GPU "
                           f"({', '.join(GPUS)}), or GPU+NETWORK (networks: {', '.join(INTER_LINKS)}, or "
                           "nvlink4-ib400 and the like)") from None


# The named fabrics' stated numbers, as ``wrapopt fabric --list`` shows them.
ANALYTICAL_FABRICS: dict[str, dict[str, Any]] = {}
for _n in FABRIC_PAIRS:
    _f = _named(_n, 1, None)
    ANALYTICAL_FABRICS[_n] = {"description": _f.meta["description"], "ranks_per_node": _f.ranks_per_node,
                              "intra": _f.intra, "inter": _f.inter, "compute": _f.meta["compute"],
                              "gpu": FABRIC_PAIRS[_n][0], "network": FABRIC_PAIRS[_n][1]}


def analytical_fabric(name: str = DEFAULT_ANALYTICAL, *, world_size: int, ranks_per_node: int | None = None,
                      gpu: str | None = None, network: str | None = None) -> FabricProfile:
    """A labelled analytical profile for a cluster that is not measured here: a named fabric,
    a GPU preset (with its system's network), ``GPU+NETWORK``, or ``gpu=`` and ``network=``.

    Example:
        >>> f = analytical_fabric("h100-nvlink-ib400", world_size=64)
        >>> f.kind, analytical_fabric(gpu="h200", network="ib400", world_size=16).name
        ('analytical', 'h200+ib400')
    """
    if ranks_per_node is not None:
        check_count(ranks_per_node, "ranks_per_node")
    if gpu is not None or network is not None:
        default_gpu, default_net = FABRIC_PAIRS.get(name, ("h100-sxm", None))
        return pair_fabric(gpu or default_gpu, network or (None if gpu else default_net), world_size=world_size,
                           ranks_per_node=ranks_per_node)
    return _named(name, world_size, ranks_per_node)


def analytical_compute(name: str = DEFAULT_ANALYTICAL, *, dtype: str | None = None) -> ComputeProfile:
    """The stated compute figures of a named fabric's or GPU preset's device.

    ``dtype`` (``"bfloat16"``, ``"float16"``, ``"float32"``) picks the stated peak
    for that compute dtype times the fitted fraction; None keeps the
    headline ``flops_per_s`` (its bf16 rate).

    Example:
        >>> analytical_compute("a100-nvlink-ib200").kind
        'analytical'
    """
    fab = _named(name, 1, None)
    return _compute(name, fab.meta["compute"], dtype, f"analytical fabric {name!r}")


def fabric_compute(fabric: FabricProfile, *, dtype: str | None = None) -> ComputeProfile:
    """The stated device of an analytical fabric (built in, or read from a file by
    ``load_analytical``), computing in ``dtype``."""
    spec = fabric.meta.get("compute")
    if fabric.kind != "analytical" or not isinstance(spec, dict):
        raise ProfileError(f"fabric {fabric.label} states no device; give a compute profile (--compute)")
    return _compute(fabric.meta.get("gpu") or fabric.name, spec, dtype,
                    fabric.meta.get("source_file") or f"analytical fabric {fabric.name!r}")


def _compute(name: str, spec: dict[str, Any], dtype: str | None, where: str) -> ComputeProfile:
    flops, source = spec["flops_per_s"], spec["source"]
    peaks = spec.get("peak_flops_per_s") or {}
    frac, att = spec["achievable_fraction"], spec.get("attention_fraction", spec["achievable_fraction"])
    attention = flops * att / frac
    if dtype is not None and peaks:
        if dtype not in peaks:
            raise ProfileError(f"{where}: field 'peak_flops_per_s' states no {dtype} rate (it has "
                               f"{', '.join(peaks)}); add one, or train in one of those")
        flops, attention = peaks[dtype] * frac, peaks[dtype] * att
        source += (f"; computing in {dtype}: {peaks[dtype] / 1e12:g} TFLOP/s peak x {frac:g} (GEMMs), x {att:g} "
                   "(attention)")
    return ComputeProfile(
        matmul_flops_per_s=flops,  # See [Note: kernel roofline] in cost/roofline.py
        attention_flops_per_s=attention,
        num_sms=int(spec.get("num_sms", 0)),
        kind="analytical",
        device=name,
        flops_per_s=flops,
        memory_bandwidth_bytes_per_s=spec["memory_bandwidth_bytes_per_s"],
        memory_capacity_bytes=spec["memory_capacity_bytes"],
        op_bandwidth_bytes_per_s=spec["memory_bandwidth_bytes_per_s"],  # See [Note: memory-bound ops]
        unit_overhead_s=20e-6,
        module_overhead_s=5e-6,
        meta={"source": source, **({"dtype": dtype, "peak_flops_per_s": peaks[dtype]} if dtype and peaks else {}),
              **_knob_meta(spec, frac)},
    )


def _knob_meta(spec: dict[str, Any], frac: float) -> dict[str, Any]:
    """What the throughput knobs are priced with (See [Note: float8 costs] in cost/fused.py): the
    achieved FP8 GEMM rate (0: no FP8 tensor cores) and compile's fitted share; absent: not stated."""
    if "fp8_peak_flops_per_s" not in spec:
        return {}
    return {"fp8_flops_per_s": spec["fp8_peak_flops_per_s"] * frac * spec["float8_fraction"],
            "fp8_peak_flops_per_s": spec["fp8_peak_flops_per_s"], "compile_fraction": spec["compile_fraction"],
            "knobs_source": spec["knobs_source"], "gpu": spec.get("gpu")}


# -- analytical fabrics from a file: See [Note: stated fabric file] ----------------------------

# [Note: stated fabric file] Users describe a cluster they have not measured in a
# small JSON file of stated numbers (``wrapopt fabric --template`` prints one):
# GPUs per node; per level (intra-node, inter-node) the achieved bus bandwidth
# per GPU and the latency of one ring step; dense peak FLOP/s per compute dtype
# and the fraction of it a training step achieves; memory bandwidth (achieved)
# and capacity per GPU. Collectives then follow the ring model
# (``profiles.ring_time``), compute the achieved rate, exactly as for the
# built-in fabrics; everything made from it is labelled ``analytical``. A file
# can also state one side only: a GPU (``wrapopt.gpu/1``, ``catalog.GPU_TEMPLATE``)
# or a network (``wrapopt.network/1``, ``NETWORK_TEMPLATE``), paired with a preset
# of the other side as ``GPU+NETWORK``. A missing or negative number is named with its unit, a
# count (GPUs per node, multiprocessors) that is not a positive whole number likewise, and a
# field the format does not have is refused with the close match (``num_sm``: did you mean
# ``num_sms``?), so that a misspelt key never leaves its default in place silently. A network
# file's GPUs per node bound the mesh's ranks per node, as a cluster file's do.
ANALYTICAL_FORMAT = "wrapopt.analytical/1"
NETWORK_FORMAT = "wrapopt.network/1"
_H100 = GPUS["h100-sxm"]
TEMPLATE: dict[str, Any] = {
    "format": ANALYTICAL_FORMAT,
    "name": "my-cluster",
    "description": "8x H100 SXM per node, NVLink 4 inside, 400 Gb/s InfiniBand per GPU between nodes",
    "gpus_per_node": 8,
    "intra_node": {"bandwidth_bytes_per_s": 360e9, "latency_s": 5e-6, "source": "NVLink 4 450 GB/s x 80%"},
    "inter_node": {"bandwidth_bytes_per_s": 40e9, "latency_s": 10e-6, "source": "400 Gb/s NDR per GPU x 80%"},
    "peak_flops_per_s": dict(_H100.peak_flops_per_s),
    "achievable_fraction": _H100.matmul_fraction,
    "memory_bandwidth_bytes_per_s": _H100.compute_spec()["memory_bandwidth_bytes_per_s"],
    "memory_capacity_bytes": _H100.memory_capacity_bytes,
    "source": "H100 SXM datasheet; achievable fraction from wrapopt's h100-sxm preset",
}
NETWORK_TEMPLATE: dict[str, Any] = {k: TEMPLATE[k] for k in ("gpus_per_node", "intra_node", "inter_node")}
NETWORK_TEMPLATE = {"format": NETWORK_FORMAT, "name": "my-network", **NETWORK_TEMPLATE}
# The fields each file may hold; any other is refused, with the close match: See [Note: stated fabric file].
_ANALYTICAL_FIELDS = (*TEMPLATE, "num_sms")
_NETWORK_FIELDS = (*NETWORK_TEMPLATE, "description", "source")
_LINK_FIELDS = ("bandwidth_bytes_per_s", "latency_s", "source")


def load_analytical(path: str, *, world_size: int, ranks_per_node: int | None = None) -> FabricProfile:
    """An analytical fabric from a file of stated numbers: See [Note: stated fabric file].
    Errors name the file and the field."""
    return analytical_from_json(read_json(path, error=ProfileError), source=str(path), world_size=world_size,
                                ranks_per_node=ranks_per_node)


def _links(d: Any, source: str) -> tuple[int, dict[str, AnalyticalLink]]:
    """GPUs per node and the two levels' links of a file of stated numbers."""
    gpn = stated_whole(d, "gpus_per_node", source)
    links = {}
    for key in ("intra_node", "inter_node"):
        sub = d.get(key)
        if not isinstance(sub, dict):
            raise ProfileError(f"{source}: missing field {key!r} (an object: bandwidth_bytes_per_s, latency_s)")
        where = f"{source}: {key}"
        check_stated_fields(sub, _LINK_FIELDS, where, "a link (bandwidth_bytes_per_s, latency_s, source)")
        bw = stated_number(sub, "bandwidth_bytes_per_s", where, positive=True)
        lat = stated_number(sub, "latency_s", where)
        links[key] = AnalyticalLink(latency_s=lat, bandwidth_bytes_per_s=bw,
                                    source=str(sub.get("source", "stated in " + source)))
    return gpn, links


def _check_node(gpn: int, ranks_per_node: int | None, source: str) -> None:
    """One rank per GPU: a node of the mesh cannot hold more ranks than the file's node has GPUs."""
    if ranks_per_node is not None and ranks_per_node > gpn:
        raise ProfileError(f"{source}: field 'gpus_per_node' is {gpn}, but the mesh puts {ranks_per_node} ranks "
                           f"on a node (--gpus-per-node; default: the world size up to 8); pass --gpus-per-node "
                           f"{gpn} or fewer, or correct the file")


def analytical_from_json(d: Any, *, source: str, world_size: int, ranks_per_node: int | None = None) -> FabricProfile:
    """A fabric from stated numbers: a whole cluster (``wrapopt.analytical/1``), or a network alone
    (``wrapopt.network/1``, with the default GPU preset until paired as ``GPU+FILE``)."""
    r = JsonReader(d, source, error=ProfileError)
    fmt = r.get("format", str)
    if fmt == NETWORK_FORMAT:
        check_stated_fields(d, _NETWORK_FIELDS, source, f"a network file ({NETWORK_FORMAT})")
        gpn, links = _links(d, source)
        _check_node(gpn, ranks_per_node, source)
        net = FabricProfile(kind="analytical", name=str(d.get("name", source)), backend="nccl (assumed)",
                            world_size=world_size, ranks_per_node=ranks_per_node or gpn, axes=(), meta={},
                            intra=links["intra_node"], inter=links["inter_node"])
        return pair_fabric("h100-sxm", net, world_size=world_size, ranks_per_node=ranks_per_node)
    if fmt == GPU_FORMAT:
        return pair_fabric(gpu_from_json(d, source=source), None, world_size=world_size, ranks_per_node=ranks_per_node)
    if fmt != ANALYTICAL_FORMAT:
        raise ProfileError(f"{source}: field 'format' is {fmt!r}; this version of wrapopt reads stated numbers in "
                           f"format {ANALYTICAL_FORMAT!r} (or {GPU_FORMAT!r}, {NETWORK_FORMAT!r} for one side; "
                           "`wrapopt fabric --template` prints one)")
    check_stated_fields(d, _ANALYTICAL_FIELDS, source, f"a cluster file ({ANALYTICAL_FORMAT})")
    gpn, links = _links(d, source)
    _check_node(gpn, ranks_per_node, source)
    peaks = stated_peaks(d, source)
    frac = stated_number(d, "achievable_fraction", source, "a fraction of peak, in (0, 1]", positive=True)
    if frac > 1:
        raise ProfileError(f"{source}: field 'achievable_fraction' (a fraction of peak) must be in (0, 1], got {frac}")
    head = peaks.get("bfloat16") or next(iter(peaks.values()))
    compute = {"flops_per_s": head * frac, "peak_flops_per_s": peaks, "achievable_fraction": frac,
               "attention_fraction": frac,
               "memory_bandwidth_bytes_per_s": stated_number(d, "memory_bandwidth_bytes_per_s", source,
                                                             "bytes/s, achieved", positive=True),
               "memory_capacity_bytes": int(stated_number(d, "memory_capacity_bytes", source, "bytes", positive=True)),
               "source": str(d.get("source", "stated in " + source)),
               **({"num_sms": stated_whole(d, "num_sms", source)} if "num_sms" in d else {})}
    name = r.get("name", str) if "name" in d else source
    return FabricProfile(kind="analytical", name=name, backend="nccl (assumed)", world_size=world_size,
                         ranks_per_node=gpn if ranks_per_node is None else ranks_per_node, axes=(),
                         meta={"description": str(d.get("description", "")), "compute": compute, "source_file": source,
                               "gpus_per_node": gpn},
                         intra=links["intra_node"], inter=links["inter_node"])


def read_side(text: str, *, world_size: int, ranks_per_node: int | None) -> FabricProfile | GpuPreset | None:
    """A file of stated numbers named as one side of ``GPU+NETWORK``: the GPU it states, or its network;
    None when ``text`` is not a file."""
    if not os.path.exists(text):
        return None
    d = read_json(text, error=ProfileError)
    if isinstance(d, dict) and d.get("format") == GPU_FORMAT:
        return gpu_from_json(d, source=text)
    return analytical_from_json(d, source=text, world_size=world_size, ranks_per_node=ranks_per_node)
