"""hardware: what the cost model knows of the cluster, measured or stated.

``profiles`` holds the data (``FabricProfile``, ``ComputeProfile``), ``presets``
the analytical fabrics built from stated numbers, ``measure_collectives``,
``measure_device`` and ``measure_fsdp`` measure them under a live process group
(``timing`` holds their shared timing helpers).
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
