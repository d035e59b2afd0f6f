"""The collectives the measurements time, under the names this torch version has, and a barrier.

torch 2.13 deprecates the ``*_into_tensor`` / ``*_tensor`` names for the single-tensor
all-gather and reduce-scatter; both spellings keep working here (torch >= 2.6).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["all_gather_single", "reduce_scatter_single", "barrier"]

all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def barrier() -> None:
    """A barrier on the world group; under NCCL it names this rank's device, else NCCL guesses (and warns)
    from the rank."""
    if dist.get_backend() == "nccl":
        dist.barrier(device_ids=[torch.cuda.current_device()])
    else:
        dist.barrier()
