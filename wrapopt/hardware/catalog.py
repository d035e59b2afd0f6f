"""The GPUs and networks a user can name, each number with its source: See [Note: GPU and network presets].

[Note: GPU and network presets] A GPU preset states one device: dense peak
FLOP/s per compute dtype, HBM bandwidth and capacity (datasheets), the NVLink
(or PCIe) generation its nodes use inside, and the two constants fitted per
GPU type on published runs (``benchmarks/published.py``, fit half of the rows:
every second usable row of that GPU type in the tables' order): the fraction of
peak the tensor cores reach in a GEMM and the fraction reached by attention
kernels. Nothing else is fitted. A network preset states the links: inside a
node (NVLink generation, or PCIe) and between nodes (InfiniBand, RoCE or
Ethernet, bandwidth per GPU); a name without the inside part (``ib400``)
takes the GPU's own NVLink. Achieved bus bandwidth is ~80% of line rate, the
usual NCCL busbw; HBM likewise ~80% of the stated bandwidth. A GPU without
published rows carries the constants of the GPU of its generation it shares
tensor cores with, and says so. Compute is priced per kernel from these
numbers: See [Note: kernel roofline] in ``cost/roofline.py``.

The tables keep the two kinds of number apart: each ``GpuPreset`` holds a
``Datasheet`` (stated figures and their source) and a ``Fitted`` part (the two
fractions and ``fitted_on``, the rows and rule they were fitted on); each
``LinkPreset`` holds a line rate and a ring-step latency, turned into an
achieved link by the stated conventions (``BUSBW_ACHIEVED``), never fitted.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass
from typing import Any, Iterable

from wrapopt.errors import ProfileError
from wrapopt.hardware.profiles import AnalyticalLink

__all__ = [
    "GpuPreset",
    "Datasheet",
    "Fitted",
    "HostSystem",
    "LinkPreset",
    "GPUS",
    "INTRA_LINKS",
    "INTER_LINKS",
    "NETWORKS",
    "HBM_ACHIEVED",
    "BUSBW_ACHIEVED",
    "find_gpu",
    "network_links",
    "gpu_from_json",
    "GPU_FORMAT",
    "GPU_TEMPLATE",
    "stated_number",
    "stated_whole",
    "stated_peaks",
    "check_stated_fields",
]

HBM_ACHIEVED = 0.8  # achieved / stated HBM bandwidth: the streaming-kernel convention (not fitted)
BUSBW_ACHIEVED = 0.8  # achieved bus bandwidth / line rate: the usual NCCL busbw convention (not fitted)
_DTYPES = ("bfloat16", "float16", "float32")


@dataclass(frozen=True, slots=True, kw_only=True)
class Datasheet:
    """What one GPU's datasheet states; nothing here is fitted."""

    peak_flops_per_s: dict[str, float]  # dense peak per compute dtype; float32 is the TF32 tensor-core rate
    hbm_bytes_per_s: float  # stated HBM bandwidth (the achieved one is HBM_ACHIEVED of it)
    memory_capacity_bytes: int
    num_sms: int = 0  # streaming multiprocessors: a GEMM's tiles fill them in waves
    fp8_flops_per_s: float = 0.0  # dense FP8 (E4M3/E5M2) tensor-core peak; 0: no FP8 tensor cores (A100)
    source: str  # the datasheet, with the figures it gives


@dataclass(frozen=True, slots=True, kw_only=True)
class Fitted:
    """The two constants fitted per GPU type, and the rows they were fitted on: See [Note: GPU and network
    presets]. ``benchmarks.published --refit`` refits both on the same rows."""

    matmul_fraction: float  # achieved / peak tensor-core rate of a compute-bound GEMM
    attention_fraction: float  # achieved / peak rate of the attention kernels' executed FLOPs
    fitted_on: str  # the rows and the rule that chose them, or the GPU whose constants these are
    # The throughput knobs' constants (issue 52), one per knob: See [Note: float8 costs] and
    # [Note: compile costs] in cost/fused.py. None: not fitted (the knob priced with 1.0).
    float8_fraction: float | None = None  # achieved FP8 GEMM rate / the bf16 one's fraction (matmul_fraction)
    compile_fraction: float | None = None  # share of a fused chain's unfused bytes compile still moves
    knobs_fitted_on: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class HostSystem:
    """The reference system's host side, for CPU offload (See [Note: CPU offload] in cost/state.py)."""

    link: str  # the INTRA_LINKS PCIe link between the host and one GPU
    dram_bytes_per_s: float  # one GPU's share of the host DRAM bandwidth: sockets x channels x rate / GPUs per node
    source: str


@dataclass(frozen=True, slots=True, kw_only=True)
class GpuPreset:
    """One GPU type: its datasheet, its fitted constants, the link inside its nodes and its host.
    See [Note: GPU and network presets]."""

    name: str
    description: str
    intra: str  # the INTRA_LINKS name its nodes use inside
    datasheet: Datasheet
    fitted: Fitted
    host: HostSystem | None = None  # None: not stated
    aliases: tuple[str, ...] = ()

    # The fields read most, by their old names.
    peak_flops_per_s = property(lambda self: self.datasheet.peak_flops_per_s)
    hbm_bytes_per_s = property(lambda self: self.datasheet.hbm_bytes_per_s)
    memory_capacity_bytes = property(lambda self: self.datasheet.memory_capacity_bytes)
    num_sms = property(lambda self: self.datasheet.num_sms)
    source = property(lambda self: self.datasheet.source)
    matmul_fraction = property(lambda self: self.fitted.matmul_fraction)
    attention_fraction = property(lambda self: self.fitted.attention_fraction)
    fit_source = property(lambda self: self.fitted.fitted_on)

    def with_fitted(self, **changes: Any) -> GpuPreset:
        """This GPU with some of its fitted constants replaced (a refit): ``matmul_fraction=``,
        ``attention_fraction=``, ``fitted_on=``."""
        return dataclasses.replace(self, fitted=dataclasses.replace(self.fitted, **changes))

    def compute_spec(self) -> dict[str, Any]:
        """The dict an analytical fabric's ``meta["compute"]`` holds (as a file of stated numbers gives it)."""
        peak = self.peak_flops_per_s
        head = peak.get("bfloat16") or next(iter(peak.values()))
        host = self.host
        f8 = self.datasheet.fp8_flops_per_s
        knobs = {"fp8_peak_flops_per_s": f8, "float8_fraction": self.fitted.float8_fraction or 1.0,
                 "compile_fraction": self.fitted.compile_fraction or 1.0,
                 "knobs_source": self.fitted.knobs_fitted_on or "knob constants not fitted (1.0)"}
        return {**knobs, "flops_per_s": head * self.matmul_fraction, "peak_flops_per_s": dict(peak),
                "achievable_fraction": self.matmul_fraction, "attention_fraction": self.attention_fraction,
                "memory_bandwidth_bytes_per_s": self.hbm_bytes_per_s * HBM_ACHIEVED,
                "memory_capacity_bytes": self.memory_capacity_bytes, "gpu": self.name, "num_sms": self.num_sms,
                "source": f"{self.source}; HBM at {HBM_ACHIEVED:.0%}; {self.fit_source}",
                **({"host_link_bytes_per_s": INTRA_LINKS[host.link].bandwidth_bytes_per_s,
                    "host_memory_bandwidth_bytes_per_s": host.dram_bytes_per_s * HBM_ACHIEVED,
                    "host_source": f"{host.source}; DRAM at {HBM_ACHIEVED:.0%}"} if host else {})}


_A100 = {"bfloat16": 312e12, "float16": 312e12, "float32": 156e12}
_H100_SXM = {"bfloat16": 989e12, "float16": 989e12, "float32": 494.5e12}
_H100_NVL = {"bfloat16": 835e12, "float16": 835e12, "float32": 417.5e12}
# [Note: the 500 W H100] TorchTitan's benchmark hardware (benchmarks/llama3_h100_202412_torchtitan.md):
# H100 SXM with 96 GB HBM2e at 2.4 TB/s, run at the default 500 W power limit. Its footnote 2 states
# only that "the actual peak TFLOPs number is between SXM and NVL, and we don't know its exact value".
# No datasheet states the rate at 500 W. Assumption (wrapopt's, not a source's): the sustained
# tensor-core clock, and with it the peak, scales linearly with the power limit between the H100 NVL
# (400 W, 835 TFLOP/s dense bf16, 1,670.5 FP8) and the H100 SXM (700 W, 989 bf16, 1,979 FP8): at 500 W
# one third of the way, 886.3 bf16 and 1,773.3 FP8. It enters as the peak the fitted fractions multiply.
_H100_500W = {"bfloat16": 886.3e12, "float16": 886.3e12, "float32": 443.2e12}


def _fit_half(rows: str) -> str:
    """The rows a shipped pair of constants was fitted on, and the rule that picked them."""
    return (f"fitted on the fit half of results/published.md's {rows} rows (llm-foundry MPT, every second usable "
            "row; `python -m benchmarks.published --refit`)")


# No published rows: the constants of the GPU of the generation it shares tensor cores with.
_CARRIED_H100 = "no published rows: the H100 SXM's fitted constants (same Hopper tensor cores and attention kernels)"
_DGX_A100 = HostSystem(link="pcie4", dram_bytes_per_s=51.2e9, source=(
    "DGX A100: each GPU on PCIe Gen4 x16; 2x AMD EPYC 7742, 8 channels DDR4-3200 each = 409.6 GB/s per node, "
    "51.2 GB/s per GPU"))
_DGX_H100 = HostSystem(link="pcie5", dram_bytes_per_s=76.8e9, source=(
    "DGX H100/H200: each GPU on PCIe Gen5 x16; 2x Intel Xeon Platinum 8480C, 8 channels DDR5-4800 each = "
    "614.4 GB/s per node, 76.8 GB/s per GPU"))
# The knob constants the other Hopper presets carry (same tensor cores and kernels): the earlier
# three-row fit on TorchTitan's Table 1, which held the attention fraction at the H100 SXM's 0.200,
# the fraction these presets keep. The 500 W preset's own four constants are fitted together on four
# rows (See [Note: the TorchTitan fit] in benchmarks/torchtitan_fit.py).
_KNOBS_FIT = ("float8_fraction and compile_fraction fitted on TorchTitan's Table 1 (Llama 3.1 8B, 8 H100 500 W; "
              "one row each, bisection to pred/pub 1, with the H100 SXM's attention fraction 0.200)")
_KNOBS = {"float8_fraction": 1.209, "compile_fraction": 2.902}
_KNOBS_CARRIED = {**_KNOBS, "knobs_fitted_on": "carried from h100-hbm2e-500w's three-row fit: " + _KNOBS_FIT}
_FIT_500W = ("fitted jointly on four TorchTitan rows (Llama 3.1 8B, 8 H100 500 W), one constant each: Table 1's "
             "FSDP (GEMM fraction), + torch.compile (compile_fraction), + float8 (float8_fraction), Table 2's "
             "32768-token row (attention fraction); See [Note: the TorchTitan fit] in benchmarks/torchtitan_fit.py, "
             "`python -m benchmarks.torchtitan_fit`")
_H100_FITTED = Fitted(matmul_fraction=0.593, attention_fraction=0.200, fitted_on=_fit_half("H100 80GB"),
                      **_KNOBS_CARRIED)

# See [Note: GPU and network presets]; `python -m benchmarks.published --refit` refits the Fitted parts.
GPUS: dict[str, GpuPreset] = {p.name: p for p in (
    GpuPreset(
        name="a100-40gb-sxm", description="NVIDIA A100 SXM 40GB", intra="nvlink3", aliases=("a100-40gb",),
        datasheet=Datasheet(
            peak_flops_per_s=_A100, hbm_bytes_per_s=1.555e12, memory_capacity_bytes=40 * 2**30, num_sms=108,
            source="A100 SXM datasheet: 312 TFLOP/s dense BF16/FP16, 156 TF32 (no FP8 tensor cores); HBM2 1,555 GB/s; "
                   "40 GB; 108 SMs"),
        fitted=Fitted(matmul_fraction=0.717, attention_fraction=0.350, fitted_on=_fit_half("A100 40GB")),
        host=_DGX_A100),
    GpuPreset(
        name="a100-80gb-sxm", description="NVIDIA A100 SXM 80GB", intra="nvlink3", aliases=("a100-80gb", "a100"),
        datasheet=Datasheet(
            peak_flops_per_s=_A100, hbm_bytes_per_s=2.039e12, memory_capacity_bytes=80 * 2**30, num_sms=108,
            source="A100 SXM datasheet: 312 TFLOP/s dense BF16/FP16, 156 TF32 (no FP8 tensor cores); HBM2e 2,039 GB/s; "
                   "80 GB; 108 SMs"),
        fitted=Fitted(matmul_fraction=0.757, attention_fraction=0.350, fitted_on=_fit_half("A100 80GB")),
        host=_DGX_A100),
    GpuPreset(
        name="h100-sxm", description="NVIDIA H100 SXM5 80GB", intra="nvlink4", aliases=("h100", "h100-80gb"),
        datasheet=Datasheet(
            peak_flops_per_s=_H100_SXM, hbm_bytes_per_s=3.35e12, memory_capacity_bytes=80 * 2**30, num_sms=132,
            fp8_flops_per_s=1979e12,
            source="H100 SXM datasheet: 989 TFLOP/s dense BF16/FP16, 1,979 dense FP8 (3,958 with sparsity), "
                   "494.5 TF32; HBM3 3.35 TB/s; 80 GB; 132 SMs"),
        fitted=_H100_FITTED,
        host=_DGX_H100),
    GpuPreset(
        name="h100-hbm2e-500w", description="NVIDIA H100 SXM 96GB HBM2e at the 500 W power limit (TorchTitan's "
        "benchmark hardware, Grand Teton)", intra="nvlink4", aliases=("h100-96gb-500w", "grand-teton"),
        datasheet=Datasheet(
            peak_flops_per_s=_H100_500W, hbm_bytes_per_s=2.4e12, memory_capacity_bytes=96 * 2**30, num_sms=132,
            fp8_flops_per_s=1773.3e12,
            source="H100 SXM 96GB HBM2e: 2.4 TB/s, 96 GB (TorchTitan's benchmark hardware section); peaks at 500 W "
                   "interpolated between the H100 NVL and SXM datasheets' peaks, linear in the power limit: "
                   "886.3 TFLOP/s dense BF16, 1,773.3 FP8 (an assumption: "
                   "See [Note: the 500 W H100] in hardware/catalog.py)"),
        fitted=Fitted(matmul_fraction=0.732, attention_fraction=0.279, float8_fraction=0.990, compile_fraction=2.899,
                      fitted_on=_FIT_500W, knobs_fitted_on=_FIT_500W), host=None),
    GpuPreset(
        name="h100-nvl", description="NVIDIA H100 NVL (94 GB usable of 96 GB HBM; PCIe card, NVLink bridge in pairs)",
        intra="pcie5", aliases=("h100-96gb",),
        datasheet=Datasheet(
            peak_flops_per_s=_H100_NVL, hbm_bytes_per_s=3.9e12, memory_capacity_bytes=94 * 10**9, num_sms=132,
            fp8_flops_per_s=1670.5e12,
            source="H100 NVL datasheet: 835 TFLOP/s dense BF16/FP16 (1,671 with sparsity), 1,670.5 dense FP8 "
                   "(3,341 with sparsity), 417.5 TF32; HBM3 3.9 TB/s; 94 GB; 132 SMs"),
        fitted=dataclasses.replace(_H100_FITTED, fitted_on=_CARRIED_H100),
        host=HostSystem(link="pcie5", dram_bytes_per_s=76.8e9, source=(
            "PCIe Gen5 x16 card; host DRAM per GPU taken as a DGX H100's (the host varies: state yours in a file)"))),
    GpuPreset(
        name="h200", description="NVIDIA H200 SXM 141GB", intra="nvlink4", aliases=("h200-sxm",),
        datasheet=Datasheet(
            peak_flops_per_s=_H100_SXM, hbm_bytes_per_s=4.8e12, memory_capacity_bytes=141 * 10**9, num_sms=132,
            fp8_flops_per_s=1979e12,
            source="H200 SXM datasheet: 989 TFLOP/s dense BF16/FP16, 1,979 dense FP8 (3,958 with sparsity), 494.5 "
                   "TF32; HBM3e 4.8 TB/s; 141 GB; 132 SMs"),
        fitted=dataclasses.replace(_H100_FITTED, fitted_on=_CARRIED_H100),
        host=_DGX_H100),
)}
GPU_ALIASES = {a: p.name for p in GPUS.values() for a in p.aliases}


@dataclass(frozen=True, slots=True, kw_only=True)
class LinkPreset:
    """One link as stated: its line rate (datasheet) and the latency of one ring step; the achieved
    bandwidth is BUSBW_ACHIEVED of the line rate, shared by the GPUs behind it. Nothing is fitted."""

    line_rate_bytes_per_s: float  # one direction, per GPU (per NIC when GPUs share one)
    latency_s: float  # one ring step (nccl-tests small messages; TCP for Ethernet)
    gpus_sharing: int = 1  # GPUs behind one such NIC
    source: str

    def link(self) -> AnalyticalLink:
        """The achieved link the ring model prices collectives on."""
        return AnalyticalLink(latency_s=self.latency_s, source=self.source,
                              bandwidth_bytes_per_s=self.line_rate_bytes_per_s * BUSBW_ACHIEVED / self.gpus_sharing)


# Links inside a node, per GPU.
_INTRA: dict[str, LinkPreset] = {
    "nvlink3": LinkPreset(line_rate_bytes_per_s=300e9, latency_s=5e-6, source=(
        "NVLink 3: 300 GB/s per direction per GPU (NVIDIA A100 datasheet); ~80% achieved busbw; ~5 us per ring "
        "step (nccl-tests small messages)")),
    "nvlink4": LinkPreset(line_rate_bytes_per_s=450e9, latency_s=5e-6, source=(
        "NVLink 4: 450 GB/s per direction per GPU (NVIDIA H100/H200 SXM datasheets); ~80% achieved busbw; ~5 us "
        "per ring step (nccl-tests)")),
    "pcie5": LinkPreset(line_rate_bytes_per_s=64e9, latency_s=10e-6, source=(
        "PCIe Gen5 x16: 64 GB/s per direction (a ring over more than the NVLink-bridged pair crosses PCIe); ~80% "
        "achieved; ~10 us per step")),
    "pcie4": LinkPreset(line_rate_bytes_per_s=32e9, latency_s=10e-6, source=(
        "PCIe Gen4 x16: 32 GB/s per direction; ~80% achieved; ~10 us per step")),
}
# Links between nodes, per GPU (one NIC per GPU unless gpus_sharing says otherwise).
_INTER: dict[str, LinkPreset] = {
    "ib800": LinkPreset(line_rate_bytes_per_s=100e9, latency_s=10e-6, source=(
        "800 Gb/s XDR InfiniBand (ConnectX-8) per GPU = 100 GB/s; ~80% achieved; ~10 us per inter-node ring step")),
    "ib400": LinkPreset(line_rate_bytes_per_s=50e9, latency_s=10e-6, source=(
        "one ConnectX-7 400 Gb/s NDR NIC per GPU = 50 GB/s (DGX H100 datasheet); ~80% achieved; ~10 us per "
        "inter-node ring step")),
    "ib200": LinkPreset(line_rate_bytes_per_s=25e9, latency_s=12e-6, source=(
        "200 Gb/s HDR = 25 GB/s per GPU (DGX A100 datasheet); ~80% achieved; ~12 us per inter-node ring step")),
    "ib100": LinkPreset(line_rate_bytes_per_s=12.5e9, latency_s=12e-6, source=(
        "100 Gb/s EDR = 12.5 GB/s per GPU; ~80% achieved; ~12 us per step")),
    "roce400": LinkPreset(line_rate_bytes_per_s=50e9, latency_s=15e-6, source=(
        "400 GbE RoCE v2 per GPU = 50 GB/s; ~80% achieved; ~15 us per step")),
    "roce200": LinkPreset(line_rate_bytes_per_s=25e9, latency_s=15e-6, source=(
        "200 GbE RoCE v2 per GPU = 25 GB/s; ~80% achieved; ~15 us per step")),
    "eth100": LinkPreset(line_rate_bytes_per_s=12.5e9, latency_s=30e-6, gpus_sharing=8, source=(
        "one 100 Gb/s Ethernet NIC per node = 12.5 GB/s shared by 8 GPUs; ~80% achieved; TCP ~30 us per step")),
}
INTRA_LINKS: dict[str, AnalyticalLink] = {k: p.link() for k, p in _INTRA.items()}
INTER_LINKS: dict[str, AnalyticalLink] = {k: p.link() for k, p in _INTER.items()}
# Network presets: "INTRA-INTER" names (nvlink4-ib400) and INTER names alone (ib400: the GPU's own NVLink).
NETWORKS: tuple[str, ...] = tuple([f"{a}-{b}" for a in INTRA_LINKS for b in INTER_LINKS] + list(INTER_LINKS))


def find_gpu(name: str) -> GpuPreset:
    """The GPU preset of a name or alias; an unknown name lists the ones that exist."""
    key = GPU_ALIASES.get(name, name)
    if key not in GPUS:
        raise ProfileError(f"unknown GPU preset {name!r}; choose one of {', '.join(GPUS)} (aliases: "
                           f"{', '.join(sorted(GPU_ALIASES))}), or a file of stated numbers (`wrapopt fabric "
                           "--template-gpu`)")
    return GPUS[key]


def network_links(name: str, gpu: GpuPreset | None) -> tuple[AnalyticalLink, AnalyticalLink]:
    """(inside a node, between nodes) of a network preset; a bare inter-node name takes the GPU's link inside."""
    intra, _, inter = name.rpartition("-")
    if inter not in INTER_LINKS or (intra and intra not in INTRA_LINKS):
        raise ProfileError(f"unknown network preset {name!r}; choose one of {', '.join(INTER_LINKS)} (inside the "
                           f"node: the GPU's own link), or INSIDE-BETWEEN with INSIDE one of {', '.join(INTRA_LINKS)} "
                           "(e.g. nvlink4-ib400)")
    return INTRA_LINKS[intra or (gpu.intra if gpu else "nvlink4")], INTER_LINKS[inter]


# -- a GPU from a file of stated numbers ------------------------------------------------------

GPU_FORMAT = "wrapopt.gpu/1"
GPU_TEMPLATE: dict[str, Any] = {
    "format": GPU_FORMAT, "name": "my-gpu", "description": "as the H100 SXM preset",
    "peak_flops_per_s": dict(_H100_SXM), "matmul_fraction": _H100_FITTED.matmul_fraction,
    "attention_fraction": _H100_FITTED.attention_fraction, "hbm_bytes_per_s": GPUS["h100-sxm"].hbm_bytes_per_s,
    "memory_capacity_bytes": GPUS["h100-sxm"].memory_capacity_bytes, "intra": "nvlink4", "num_sms": 132,
    "source": "H100 SXM datasheet; fractions from wrapopt's h100-sxm preset",
}
_UNITS = {"hbm_bytes_per_s": "bytes/s, the stated HBM bandwidth", "memory_capacity_bytes": "bytes",
          "matmul_fraction": "a fraction of peak, in (0, 1]", "attention_fraction": "a fraction of peak, in (0, 1]",
          "bandwidth_bytes_per_s": "bytes/s per GPU, achieved", "latency_s": "seconds per ring step",
          "gpus_per_node": "GPUs", "num_sms": "streaming multiprocessors"}


def stated_number(d: Any, key: str, where: str, unit: str | None = None, *, positive: bool = False) -> float:
    """A field of a file of stated numbers; a missing, non-numeric or negative one is named with its unit."""
    unit = unit or _UNITS.get(key) or ("FLOP/s" if "flops" in key else "")
    if not isinstance(d, dict) or key not in d:
        raise ProfileError(f"{where}: missing field {key!r} ({unit})")
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or v in (float("inf"), float("-inf")):
        raise ProfileError(f"{where}: field {key!r} ({unit}) must be a number, got {v!r}")
    if v < 0 or (positive and v == 0):
        raise ProfileError(f"{where}: field {key!r} ({unit}) must be {'positive' if positive else 'at least 0'}, "
                           f"got {v!r}")
    return float(v)


def stated_whole(d: Any, key: str, where: str, unit: str | None = None) -> int:
    """A field of a file of stated numbers that counts something (GPUs, multiprocessors): a positive
    whole number; ``stated_number``'s errors, and a fraction (13.5) named with its unit."""
    v = stated_number(d, key, where, unit, positive=True)
    if v != int(v):
        raise ProfileError(f"{where}: field {key!r} ({unit or _UNITS.get(key, '')}) must be a whole number, got {v:g}")
    return int(v)


def check_stated_fields(d: dict[str, Any], known: Iterable[str], where: str, what: str) -> None:
    """Refuse a field a file of stated numbers does not have: a misspelt key (``num_sm``) would
    otherwise be ignored and its default used. The close match is suggested (``difflib``)."""
    known = sorted(known)
    for key in d:
        if key in known:
            continue
        close = difflib.get_close_matches(str(key), known, n=1, cutoff=0.6)
        hint = f"did you mean {close[0]!r}?" if close else f"the fields are {', '.join(known)}"
        raise ProfileError(f"{where}: field {key!r} is not a field of {what}; {hint} (fix or drop it)")


def stated_peaks(d: dict[str, Any], source: str) -> dict[str, float]:
    """A stated-number file's ``peak_flops_per_s``: dense peak FLOP/s per dtype, at least one."""
    peaks_d = d.get("peak_flops_per_s")
    if not isinstance(peaks_d, dict) or not peaks_d:
        raise ProfileError(f"{source}: field 'peak_flops_per_s' (FLOP/s per dtype: bfloat16, float16, float32) "
                           "must name at least one dtype")
    peaks = {}
    for k in peaks_d:
        if k not in _DTYPES:
            raise ProfileError(f"{source}: field 'peak_flops_per_s.{k}' is not a dtype; use {', '.join(_DTYPES)}")
        peaks[k] = stated_number(peaks_d, k, f"{source}: peak_flops_per_s", "dense peak FLOP/s", positive=True)
    return peaks


def gpu_from_json(d: Any, *, source: str) -> GpuPreset:
    """A GPU preset from a file of stated numbers (``GPU_TEMPLATE``); errors name the field and its unit."""
    if not isinstance(d, dict) or d.get("format") != GPU_FORMAT:
        got = d.get("format") if isinstance(d, dict) else type(d).__name__
        raise ProfileError(f"{source}: field 'format' is {got!r}, expected {GPU_FORMAT!r}")
    check_stated_fields(d, GPU_TEMPLATE, source, f"a GPU file ({GPU_FORMAT})")
    peaks = stated_peaks(d, source)
    fr = {k: stated_number(d, k, source, positive=True) for k in ("matmul_fraction", "attention_fraction")}
    for k, v in fr.items():
        if v > 1:
            raise ProfileError(f"{source}: field {k!r} ({_UNITS[k]}) must be at most 1, got {v}")
    intra = str(d.get("intra", "nvlink4"))
    if intra not in INTRA_LINKS:
        raise ProfileError(f"{source}: field 'intra' is {intra!r}; choose one of {', '.join(INTRA_LINKS)}")
    sms = stated_whole(d, "num_sms", source) if "num_sms" in d else 0  # absent: unknown, the roofline's default
    return GpuPreset(
        name=str(d.get("name", source)), description=str(d.get("description", "")), intra=intra,
        datasheet=Datasheet(peak_flops_per_s=peaks, hbm_bytes_per_s=stated_number(d, "hbm_bytes_per_s", source,
                                                                                  positive=True),
                            memory_capacity_bytes=int(stated_number(d, "memory_capacity_bytes", source, positive=True)),
                            num_sms=sms, source=str(d.get("source", "stated in " + source))),
        fitted=Fitted(matmul_fraction=fr["matmul_fraction"], attention_fraction=fr["attention_fraction"],
                      fitted_on="stated in " + source))
