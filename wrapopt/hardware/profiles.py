"""Fabric profiles: the measured (or stated) collective costs the cost model uses.

A ``FabricProfile`` holds, per mesh axis, the latency of each collective per
message size; it answers ``collective_s(...)`` for the cost model through a
monotone piecewise log-log interpolator, and keeps an alpha-beta summary
(latency + bytes / bandwidth) for reports and extrapolation. A profile is
either ``measured`` (``wrapopt profile-fabric``) or ``analytical`` (built from
stated latency and bandwidth numbers); the kind is shown wherever it is used.

Message size convention: ``nbytes`` is always the *unsharded* size of the
tensor, i.e. the all-gather output, the reduce-scatter input, the all-reduce
buffer. That is the number the cost model knows for a unit.

The compute side (``ComputeProfile``) lives in ``compute_profile.py`` and is
re-exported here, where the cost model and the reports import both from.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import Any

from wrapopt.errors import ProfileError
from wrapopt.fileio import JsonReader, atomic_write_json, read_json
from wrapopt.hardware.compute_profile import PROFILE_HINT, ComputeProfile

__all__ = ["COLLECTIVES", "CollectiveCurve", "AxisProfile", "FabricProfile", "ComputeProfile", "AnalyticalLink",
           "ring_time"]

COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce")
FABRIC_FORMAT = "wrapopt.fabric/1"


def _pava(values: list[float]) -> list[float]:
    """Isotonic (non-decreasing) least-squares fit: pool adjacent violators.

    Raw per-size figures are noisy; the interpolator must not let a larger message be
    predicted faster than a smaller one (the search would exploit the noise).
    """
    blocks: list[list[float]] = []  # [sum, count]
    for v in values:
        blocks.append([v, 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s, c = blocks.pop()
            blocks[-1][0] += s
            blocks[-1][1] += c
    out: list[float] = []
    for s, c in blocks:
        out.extend([s / c] * int(c))
    return out


@dataclass(frozen=True, slots=True)
class CollectiveCurve:
    """Latency of one collective on one axis, per message size."""

    sizes_bytes: tuple[int, ...]
    latency_s: tuple[float, ...]  # mean over repeats of the max over ranks (measured; older files: the median)
    spread: tuple[float, ...] = ()  # (p90 - p10) / median over repeats, per size
    # Derived, not serialised: isotonic fit in log-log space and alpha-beta.
    _log_sizes: tuple[float, ...] = field(default=(), compare=False, repr=False)
    _log_lat: tuple[float, ...] = field(default=(), compare=False, repr=False)
    alpha_s: float = field(default=0.0, compare=False)
    bandwidth_bytes_per_s: float = field(default=math.inf, compare=False)
    fit_error: float = field(default=0.0, compare=False)  # median relative error of alpha-beta

    def __post_init__(self) -> None:
        if len(self.sizes_bytes) != len(self.latency_s) or not self.sizes_bytes:
            raise ProfileError("a collective curve needs as many latencies as sizes, and at least one")
        if any(b <= a for a, b in zip(self.sizes_bytes, self.sizes_bytes[1:])):
            raise ProfileError("collective curve sizes must be strictly increasing")
        if any(not (t > 0 and math.isfinite(t)) for t in self.latency_s):
            raise ProfileError("collective latencies must be positive and finite")
        mono = _pava(list(self.latency_s))
        object.__setattr__(self, "_log_sizes", tuple(math.log(s) for s in self.sizes_bytes))
        object.__setattr__(self, "_log_lat", tuple(math.log(t) for t in mono))
        alpha, bw, err = _fit_alpha_beta(self.sizes_bytes, self.latency_s)
        object.__setattr__(self, "alpha_s", alpha)
        object.__setattr__(self, "bandwidth_bytes_per_s", bw)
        object.__setattr__(self, "fit_error", err)

    def time_s(self, nbytes: float) -> tuple[float, bool]:
        """Latency for ``nbytes``; the flag says it was extrapolated past the largest size."""
        if nbytes <= 0:
            return 0.0, False
        xs, ys = self._log_sizes, self._log_lat
        if nbytes <= self.sizes_bytes[0]:
            return math.exp(ys[0]), False  # latency-bound below the smallest size
        if nbytes > self.sizes_bytes[-1]:
            # Past the table: the last point plus the extra bytes at the fitted bandwidth.
            extra = (nbytes - self.sizes_bytes[-1]) / self.bandwidth_bytes_per_s
            return math.exp(ys[-1]) + extra, True
        lx = math.log(nbytes)
        i = bisect.bisect_left(xs, lx)
        if xs[i] == lx:
            return math.exp(ys[i]), False
        w = (lx - xs[i - 1]) / (xs[i] - xs[i - 1])
        return math.exp(ys[i - 1] + w * (ys[i] - ys[i - 1])), False

    def to_json(self) -> dict[str, Any]:
        return {
            "sizes_bytes": list(self.sizes_bytes),
            "latency_s": list(self.latency_s),
            "spread": list(self.spread),
            "alpha_s": self.alpha_s,
            "bandwidth_bytes_per_s": self.bandwidth_bytes_per_s,
            "fit_error": self.fit_error,
        }


def _fit_alpha_beta(sizes: tuple[int, ...], lat: tuple[float, ...]) -> tuple[float, float, float]:
    """Least squares of ``t = alpha + n / bw`` weighted by 1/t (relative error)."""
    w = [1.0 / t for t in lat]
    sw = sum(wi * wi for wi in w)
    sx = sum(wi * wi * n for wi, n in zip(w, sizes))
    sy = sum(wi * wi * t for wi, t in zip(w, lat))
    sxx = sum(wi * wi * n * n for wi, n in zip(w, sizes))
    sxy = sum(wi * wi * n * t for wi, n, t in zip(w, sizes, lat))
    det = sw * sxx - sx * sx
    if len(sizes) < 2 or det <= 0:
        # One size cannot separate latency from bandwidth, and extrapolation must not be free:
        return lat[0], sizes[-1] / lat[-1], 0.0  # all of its time as transfer, a bound on the bandwidth
    slope = (sw * sxy - sx * sy) / det
    alpha = (sy - slope * sx) / sw
    if slope <= 0:
        # No bandwidth term visible (latency-bound range or noisy medians): the same lower
        # bound on the bandwidth, never a near-infinite one that makes extrapolation free.
        slope = lat[-1] / sizes[-1]
        alpha = (sy - slope * sx) / sw
    alpha = max(alpha, 0.0)
    errs = sorted(abs(alpha + slope * n - t) / t for n, t in zip(sizes, lat))
    return alpha, 1.0 / slope, errs[len(errs) // 2]


@dataclass(frozen=True, slots=True)
class AxisProfile:
    """Collectives measured on one kind of process group.

    ``group_size`` ranks take part; ``ranks_per_node_in_group`` of them share a
    node (``group_size`` for an intra-node group, 1 for a group with one rank
    per node).
    """

    name: str  # "intra", "inter", "world", or a stated name
    group_size: int
    ranks_per_node_in_group: int
    curves: tuple[tuple[str, CollectiveCurve], ...]

    def curve(self, collective: str) -> CollectiveCurve:
        for name, c in self.curves:
            if name == collective:
                return c
        raise ProfileError(f"axis {self.name!r} has no {collective} measurements")


@dataclass(frozen=True, slots=True)
class AnalyticalLink:
    """Stated latency and achieved bandwidth of one level of the fabric."""

    latency_s: float  # per ring step
    bandwidth_bytes_per_s: float  # achieved per GPU (bus bandwidth)
    source: str


@dataclass(frozen=True)
class FabricProfile:
    """Collective latencies per axis, measured or analytical.

    See [Note: collective cost lookup] in ``collective_s``.
    """

    kind: str  # "measured" or "analytical"
    name: str
    backend: str
    world_size: int
    ranks_per_node: int
    axes: tuple[AxisProfile, ...]
    # [Note: overlap factor] Collectives in flight slow compute down (they
    # occupy SMs on a GPU, cores on a CPU) and compute slows collectives. Both
    # are measured by running each alone and both together; 0 = no slowdown.
    overlap_compute_slowdown: float = 0.0
    overlap_comm_slowdown: float = 0.0
    # Copies of its unsharded size a collective allocates while it runs, beside its input and
    # output (gloo's all-gather and reduce-scatter copy: 1, as measure_fabric records it; NCCL
    # works in its own buffers: 0). See [Note: collective copies] in cost/step.py.
    collective_copies: float = 0.0
    meta: dict[str, Any] = field(default_factory=dict, compare=False)
    intra: AnalyticalLink | None = None  # only for analytical profiles
    inter: AnalyticalLink | None = None
    _cache: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.kind not in ("measured", "analytical"):
            raise ProfileError(f"fabric kind must be 'measured' or 'analytical', got {self.kind!r}")
        if self.kind == "analytical" and (self.intra is None or self.inter is None):
            raise ProfileError("an analytical fabric needs both intra- and inter-node links")

    @property
    def label(self) -> str:
        return f"{self.name} ({self.kind})"

    def collective_s(
        self, collective: str, group_size: int, ranks_per_node_in_group: int, nbytes: float
    ) -> tuple[float, str | None]:
        """Seconds for one collective on a group; the second item is a caveat or None.

        [Note: collective cost lookup] A measured profile answers only for
        axes it measured (same group size and the same number of ranks per
        node); any other group is rescaled from the closest axis with the ring
        model and the caveat says so. An analytical profile applies the ring
        model to its stated links for any group.
        """
        if group_size <= 1 or nbytes <= 0:
            return 0.0, None
        key = (collective, group_size, ranks_per_node_in_group, int(nbytes))
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        if self.kind == "analytical":
            out = (ring_time(collective, group_size, ranks_per_node_in_group, nbytes, self.intra, self.inter), None)
        else:
            out = self._measured_time(collective, group_size, ranks_per_node_in_group, nbytes)
        self._cache[key] = out
        return out

    def _measured_time(self, collective: str, p: int, rpn: int, nbytes: float) -> tuple[float, str | None]:
        exact = [a for a in self.axes if a.group_size == p and a.ranks_per_node_in_group == rpn]
        if exact:
            t, extrapolated = exact[0].curve(collective).time_s(nbytes)
            caveat = (
                f"{collective} of {nbytes / 2**20:.1f} MiB extrapolated past the largest size measured on axis "
                f"{exact[0].name}"
                if extrapolated
                else None
            )
            return t, caveat
        # Rescale from the nearest axis of the same kind (intra vs inter) by the ring model.
        same_kind = [a for a in self.axes if (a.ranks_per_node_in_group > 1) == (rpn > 1)] or list(self.axes)
        base = min(same_kind, key=lambda a: abs(math.log(a.group_size / p)))
        c = base.curve(collective)
        factor = (p - 1) / p * base.group_size / max(1, base.group_size - 1)
        per_step = c.alpha_s / max(1, base.group_size - 1)
        t = per_step * (p - 1) + factor * (c.time_s(nbytes)[0] - c.alpha_s)
        return max(t, c.alpha_s), (
            f"{collective} on a group of {p} rescaled from axis {base.name} ({base.group_size} ranks) "
            "by the ring model: the profile did not measure this group"
        )

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "format": FABRIC_FORMAT,
            "kind": self.kind,
            "name": self.name,
            "backend": self.backend,
            "world_size": self.world_size,
            "ranks_per_node": self.ranks_per_node,
            "overlap_compute_slowdown": self.overlap_compute_slowdown,
            "overlap_comm_slowdown": self.overlap_comm_slowdown,
            "collective_copies": self.collective_copies,
            "axes": [
                {
                    "name": a.name,
                    "group_size": a.group_size,
                    "ranks_per_node_in_group": a.ranks_per_node_in_group,
                    "collectives": {n: c.to_json() for n, c in a.curves},
                }
                for a in self.axes
            ],
            "meta": self.meta,
        }
        if self.kind == "analytical":
            d["links"] = {
                lvl: {"latency_s": l.latency_s, "bandwidth_bytes_per_s": l.bandwidth_bytes_per_s, "source": l.source}
                for lvl, l in (("intra", self.intra), ("inter", self.inter))
            }
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any], *, source: str = "<dict>") -> "FabricProfile":
        r = JsonReader(d, source, error=ProfileError)
        if r.get("format", str) != FABRIC_FORMAT:
            raise ProfileError(f"{source}: field 'format' is {d.get('format')!r}, expected {FABRIC_FORMAT!r}")
        links: dict[str, AnalyticalLink] = {}
        if r.get("kind", str) == "analytical":
            for lvl in ("intra", "inter"):
                lr = r.sub(f"links.{lvl}")
                links[lvl] = AnalyticalLink(
                    lr.num("latency_s"), lr.num("bandwidth_bytes_per_s", positive=True), str(lr.d.get("source", ""))
                )
        axes = []
        for i, ad in enumerate(r.get("axes", list)):
            ar = JsonReader(ad, f"{source}: axes[{i}]", error=ProfileError)
            curves = []
            for cname, cd in ar.get("collectives", dict).items():
                cr = JsonReader(cd, f"{source}: axes[{i}].collectives.{cname}", error=ProfileError)
                try:
                    curves.append(
                        (
                            cname,
                            CollectiveCurve(
                                tuple(int(x) for x in cr.get("sizes_bytes", list)),
                                tuple(float(x) for x in cr.get("latency_s", list)),
                                tuple(float(x) for x in cd.get("spread", [])),
                            ),
                        )
                    )
                except (ProfileError, TypeError, ValueError) as e:
                    raise ProfileError(f"{cr.where}: {e}") from None
            axes.append(AxisProfile(ar.get("name", str), ar.count("group_size"), ar.count("ranks_per_node_in_group"),
                                    tuple(curves)))
        return cls(
            kind=r.get("kind", str),
            name=r.get("name", str),
            backend=r.get("backend", str),
            world_size=r.count("world_size"),
            ranks_per_node=r.count("ranks_per_node"),
            axes=tuple(axes),
            overlap_compute_slowdown=r.num("overlap_compute_slowdown", 0.0),
            overlap_comm_slowdown=r.num("overlap_comm_slowdown", 0.0),
            collective_copies=r.num("collective_copies", 0.0),
            meta=dict(d.get("meta", {})),
            intra=links.get("intra"),
            inter=links.get("inter"),
        )

    def save(self, path: str) -> None:
        atomic_write_json(path, self.to_json())

    @classmethod
    def load(cls, path: str) -> "FabricProfile":
        d = read_json(path, error=ProfileError, hint=PROFILE_HINT)
        return cls.from_json(d, source=str(path))

    def summary_rows(self) -> list[tuple[str, str, int, float, float, float]]:
        """(axis, collective, group size, alpha us, bandwidth GB/s, fit error) for reports."""
        rows = []
        for a in self.axes:
            for n, c in a.curves:
                rows.append((a.name, n, a.group_size, c.alpha_s * 1e6, c.bandwidth_bytes_per_s / 1e9, c.fit_error))
        return rows


def ring_time(collective: str, p: int, rpn: int, nbytes: float, intra: AnalyticalLink, inter: AnalyticalLink) -> float:
    """Ring-algorithm time on stated links: (p-1) latency steps plus (p-1)/p of
    the bytes at the ring's bandwidth: the intra-node link for a group inside a
    node, else the multi-rail bandwidth of [Note: multi-rail rings].

    [Note: multi-rail rings] A group with ``rpn`` ranks on each of several
    nodes runs NCCL's rings as ``rpn`` channels, each leaving the node through
    the NIC of a different GPU and carrying 1/rpn of the data: the node's
    ``rpn`` NICs work in parallel, so the ring moves ``rpn`` x the per-GPU
    inter-node bandwidth, capped by the intra-node link the data also crosses.
    NCCL's maintainers state it for a node with more NICs ("you should get more
    bandwidth, up to ... the NVLink intra-node bandwidth", NVIDIA/nccl#412), and
    published llm-foundry H100 rows need it (13B, FULL_SHARD, micro-batch 2 on
    16-64 GPUs ran at >100 GB/s of bus bandwidth with 400 Gb/s per GPU). A group
    with one rank per node (HSDP's replicate axis) gets one NIC per ring.
    """
    if rpn >= p:
        latency, bw = intra.latency_s, intra.bandwidth_bytes_per_s
    else:
        latency, bw = inter.latency_s, min(intra.bandwidth_bytes_per_s, max(1, rpn) * inter.bandwidth_bytes_per_s)
    steps = (p - 1) * (2 if collective == "all_reduce" else 1)
    volume = (p - 1) / p * nbytes * (2 if collective == "all_reduce" else 1)
    return steps * latency + volume / bw
