"""The host side of a GPU node, for CPU offload: the link to each GPU, each GPU's share of the
host memory bandwidth (both stated with the GPU preset) and the host memory (stated by the user).
See [Note: CPU offload] in cost/state.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from wrapopt.errors import OptionError
from wrapopt.hardware.profiles import FabricProfile

__all__ = ["HostSpec", "host_for"]


@dataclass(frozen=True, slots=True)
class HostSpec:
    """What CPU offload runs on, per GPU: achieved figures, with where they come from."""

    link_bytes_per_s: float  # host <-> one GPU, one direction (PCIe), achieved
    memory_bandwidth_bytes_per_s: float  # one GPU's share of the host DRAM bandwidth, achieved
    memory_bytes_per_node: int  # host memory the job may use on one node (stated by the user)
    ranks_per_node: int
    source: str

    @property
    def memory_bytes_per_rank(self) -> float:
        return self.memory_bytes_per_node / self.ranks_per_node


def host_for(fabric: FabricProfile | None, *, host_memory_bytes: int | None, ranks_per_node: int) -> HostSpec:
    """The host of ``fabric``'s stated GPU with ``host_memory_bytes`` per node; ``OptionError`` saying
    what to give when the fabric states no host (a measured fabric, a file without the fields) or
    the host memory is not known."""
    spec: Any = (fabric.meta.get("compute") if fabric is not None and fabric.kind == "analytical" else None) or {}
    link, dram = spec.get("host_link_bytes_per_s"), spec.get("host_memory_bandwidth_bytes_per_s")
    if not link or not dram:
        raise OptionError("CPU offload is priced from a stated GPU's host link and host memory bandwidth; "
                          f"{'this fabric' if fabric is None else fabric.label} states none: use --gpu with a "
                          "preset, or add host_link_bytes_per_s and host_memory_bandwidth_bytes_per_s to the GPU "
                          "file")
    if not host_memory_bytes:
        raise OptionError("CPU offload needs the host memory it may fill: give --host-memory (per node, e.g. "
                          "--host-memory 1.5TB on a DGX with 2 TB)")
    return HostSpec(float(link), float(dram), int(host_memory_bytes), ranks_per_node,
                    str(spec.get("host_source", "stated with the GPU preset")))
