"""Profiles from what a user names: a fabric given as a profile, a file or an analytical
fabric's name; the compute profile that goes with it; and whether a measured fabric fits
the mesh being planned. Re-exported by ``wrapopt.api``, which wires them."""

from __future__ import annotations

import os

from wrapopt.errors import ProfileError
from wrapopt.fileio import read_json
from wrapopt.hardware.measure_device import measure_compute
from wrapopt.hardware.catalog import GPU_ALIASES, GPU_FORMAT, GPUS, find_gpu, network_links
from wrapopt.hardware.presets import (
    ANALYTICAL_FABRICS,
    ANALYTICAL_FORMAT,
    NETWORK_FORMAT,
    DEFAULT_ANALYTICAL,
    analytical_fabric,
    analytical_from_json,
    fabric_compute,
)
from wrapopt.hardware.profiles import ComputeProfile, FabricProfile
from wrapopt.spec import MeshSpec
from wrapopt.train import TrainConfig

__all__ = ["resolve_fabric", "compute_for", "check_fabric_fits", "fabric_name", "partial_node_note"]


def resolve_fabric(fabric: FabricProfile | str | os.PathLike | None, *, world_size: int,
                   ranks_per_node: int) -> FabricProfile:
    """A profile object from a profile, a file path, or the name of an analytical fabric."""
    if isinstance(fabric, FabricProfile):
        return fabric
    if fabric is None:
        return analytical_fabric(DEFAULT_ANALYTICAL, world_size=world_size, ranks_per_node=ranks_per_node)
    text = os.fspath(fabric)
    if text in ANALYTICAL_FABRICS or find_gpu_name(text) or ("+" in text and not os.path.exists(text)):
        return analytical_fabric(text, world_size=world_size, ranks_per_node=ranks_per_node)
    if not os.path.exists(text):
        raise ProfileError(
            f"--fabric {text!r} is neither a profile file nor a named analytical fabric "
            f"({', '.join(ANALYTICAL_FABRICS)}), a GPU preset ({', '.join(GPUS)}) or GPU+NETWORK (--gpu, "
            "--network); measure one with `wrapopt profile-fabric --out fabric.json`, or state one "
            "(`wrapopt fabric --template`)"
        )
    data = read_json(text, error=ProfileError)
    stated = (ANALYTICAL_FORMAT, GPU_FORMAT, NETWORK_FORMAT)
    families = {f.rsplit("/", 1)[0] + "/" for f in stated}  # any version: the reader names the one it reads
    if isinstance(data, dict) and any(str(data.get("format", "")).startswith(f) for f in families):
        # stated numbers: See [Note: stated fabric file]
        return analytical_from_json(data, source=text, world_size=world_size, ranks_per_node=ranks_per_node)
    return FabricProfile.from_json(data, source=text)


def find_gpu_name(text: str) -> bool:
    """Whether ``text`` names a GPU preset (or its alias)."""
    return text in GPUS or text in GPU_ALIASES


def fabric_name(*, fabric: str | None, gpu: str | None, network: str | None) -> str | None:
    """``--fabric``, or ``--gpu`` and ``--network`` as the ``GPU+NETWORK`` fabric they name (either may be a
    file of stated numbers; the other side defaults to the h100-sxm GPU, or the GPU's own system network)."""
    if gpu is None and network is None:
        return fabric
    if fabric is not None:
        raise ProfileError("give --fabric, or --gpu and --network, not both")
    if gpu is not None and not os.path.exists(gpu):
        find_gpu(gpu)  # an unknown name: the error lists the GPU presets
    if network is not None and not os.path.exists(network):
        network_links(network, None)  # likewise the network presets
    return f"{gpu or 'h100-sxm'}+{network}" if network else gpu


def compute_for(fabric: FabricProfile | None, compute: ComputeProfile | str | None, train: TrainConfig,
                model_dtype: str = "float32") -> ComputeProfile:
    """The compute profile: the one given (or its file), else the analytical fabric's
    device computing in the step's dtype (``param_dtype``, else ``model_dtype``, the
    dtype the model is stored in), else this device measured."""
    if isinstance(compute, ComputeProfile):
        return compute
    if isinstance(compute, str):
        return ComputeProfile.load(compute)
    if fabric is None or fabric.kind == "analytical":
        return fabric_compute(fabric or analytical_fabric(world_size=1), dtype=train.compute_dtype(model_dtype))
    return measure_compute()


def check_fabric_fits(fabric: FabricProfile, mesh: MeshSpec, *, rescale: bool) -> list[str]:
    """A measured profile from another world size or node shape: error, or a stated rescaling."""
    if fabric.kind != "measured":
        return []
    if fabric.world_size == mesh.world_size and fabric.ranks_per_node == mesh.ranks_per_node:
        return []
    msg = (f"the fabric profile was measured on {fabric.world_size} ranks ({fabric.ranks_per_node} per node), "
           f"the plan is for {mesh.world_size} ({mesh.ranks_per_node} per node)")
    if not rescale:
        raise ProfileError(msg + "; measure the target mesh, or pass rescale=True / --rescale-fabric to rescale "
                                 "by the ring model")
    return [msg + "; collective times rescaled by the ring model"]


def partial_node_note(world_size: int | None, gpus_per_node: int | None) -> str | None:
    """The note for a world smaller than the node it runs on (``--gpus-per-node 8 --world-size 2``),
    None otherwise. Not refused: ``torchrun --nproc-per-node 2`` on an 8-GPU node is a legal job.
    The mesh is then one partial node of ``world_size`` ranks (``default_mesh`` takes the smaller),
    so every collective is priced over the link inside the node, and the other GPUs are not planned for."""
    if world_size is None or gpus_per_node is None or world_size >= gpus_per_node:
        return None
    return (f"--world-size {world_size} is less than --gpus-per-node {gpus_per_node}: planned as one partial "
            f"node of {world_size} ranks ({gpus_per_node - world_size} of its GPUs unused), every collective over "
            "the link inside the node")
