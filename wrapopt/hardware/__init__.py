"""hardware: what the cost model knows of the cluster, measured or stated.

``profiles`` and ``compute_profile`` hold the data (``FabricProfile``,
``ComputeProfile``), ``catalog`` the GPU and network presets and ``presets``
the analytical fabrics built from them or from stated numbers;
``measure_collectives`` (with ``measure_overlap``), ``measure_device`` (with
``measure_overheads``), ``measure_fsdp`` and ``measure_split`` measure them
under a live process group (``timing`` and ``collective_ops`` hold their shared
helpers).
"""

from wrapopt.hardware.presets import (
    ANALYTICAL_FABRICS,
    DEFAULT_ANALYTICAL,
    analytical_compute,
    analytical_fabric,
    fabric_compute,
    load_analytical,
)
from wrapopt.hardware.profiles import COLLECTIVES, AxisProfile, CollectiveCurve, ComputeProfile, FabricProfile

__all__ = [
    "COLLECTIVES",
    "CollectiveCurve",
    "AxisProfile",
    "FabricProfile",
    "ComputeProfile",
    "ANALYTICAL_FABRICS",
    "DEFAULT_ANALYTICAL",
    "analytical_fabric",
    "analytical_compute",
    "fabric_compute",
    "load_analytical",
]
