"""Human-readable reports of a ``FabricProfile``.

``format_fabric()`` is what ``wrapopt profile-fabric`` prints after measuring
and what ``wrapopt show fabric.json`` prints for a saved profile. It reads a
profile and measures nothing, so it needs no process group.
"""

from __future__ import annotations

from wrapopt.fileio import fmt_bytes
from wrapopt.hardware.profiles import COLLECTIVES, FabricProfile

__all__ = ["format_fabric", "format_stated"]


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def fmt(r: list[str]) -> str:  # the first column left-aligned, the numbers right-aligned
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))

    return [fmt(header), fmt(["-" * w for w in widths]), *(fmt(r) for r in rows)]


def format_fabric(profile: FabricProfile) -> str:
    """A human-readable report: the kind first, the alpha-beta summary, then latency per size.

    Used by ``wrapopt profile-fabric`` and ``wrapopt show fabric.json``.

    Example:
        >>> from wrapopt.hardware import analytical_fabric
        >>> print(format_fabric(analytical_fabric(world_size=16)).splitlines()[0])
        fabric h100-nvlink-ib400: ANALYTICAL (stated numbers, not measured)
    """
    m = profile.meta
    lines: list[str] = []
    if profile.kind == "analytical":
        lines.append(f"fabric {profile.name}: ANALYTICAL (stated numbers, not measured)")
        if m.get("description"):
            lines.append(f"  {m['description']}")
    else:
        sim = "  [nodes simulated on one host]" if m.get("simulated_nodes") else ""
        lines.append(f"fabric {profile.name}: MEASURED{sim}")
        hosts = sorted(set(h for h in m.get("hosts", []) if h))
        lines.append(f"  hosts {', '.join(hosts) or '?'}; torch {m.get('torch_version', '?')}"
                     + (f", NCCL {m['nccl_version']}" if m.get("nccl_version") else "")
                     + f"; {m.get('dtype', '?')}; {m.get('date', '?')}")
        lines.append(f"  {m.get('statistic', 'median')}, {m.get('repeats', '?')} repeats after "
                     f"{m.get('warmup', '?')} warm-up")
    lines.append(f"  backend {profile.backend}, {profile.world_size} ranks, {profile.ranks_per_node} per node")
    if profile.kind == "analytical":
        lines.append(f"  overlap (stated): compute {profile.overlap_compute_slowdown:.0%} slower with collectives "
                     f"in flight, collectives {profile.overlap_comm_slowdown:.0%} slower under compute")
    elif m.get("overlap_measured", True):
        lines.append(f"  overlap: compute {profile.overlap_compute_slowdown:.0%} slower with collectives in flight, "
                     f"collectives {profile.overlap_comm_slowdown:.0%} slower under compute")
    else:
        lines.append("  overlap: not measured (taken as perfect: no slowdown)")
    if profile.kind == "analytical":
        for lvl, link in (("intra", profile.intra), ("inter", profile.inter)):
            assert link is not None  # FabricProfile.__post_init__ checks it
            lines.append(f"  {lvl}: {link.latency_s * 1e6:.1f} us per ring step, "
                         f"{link.bandwidth_bytes_per_s / 1e9:.1f} GB/s  ({link.source})")
        intra_p = min(profile.ranks_per_node, profile.world_size)
        groups = [("intra", intra_p, intra_p)]
        if profile.world_size > profile.ranks_per_node:
            groups.append(("world", profile.world_size, profile.ranks_per_node))
        short = {"all_gather": "AG", "reduce_scatter": "RS", "all_reduce": "AR"}
        sizes = [2**20 * 4**i for i in range(6)]
        rows = [[fmt_bytes(n)] + [f"{profile.collective_s(c, p, r, n)[0] * 1e3:.3f}"
                                  for _, p, r in groups for c in COLLECTIVES]
                for n in sizes]
        header = ["size"] + [f"{g}({p}) {short[c]}" for g, p, _ in groups for c in COLLECTIVES]
        lines += ["", "latency per message size, ms (ring model, analytical; AG all-gather, RS reduce-scatter, "
                  "AR all-reduce):", *_table(header, rows)]
        return "\n".join(lines)

    rows = [[a, c, str(p), f"{alpha:.1f}", f"{bw:.3f}", f"{err:.0%}"]
            for a, c, p, alpha, bw, err in profile.summary_rows()]
    lines += ["", *_table(["axis", "collective", "ranks", "alpha us", "GB/s", "fit err"], rows)]
    for axis in profile.axes:
        names = [n for n, _ in axis.curves]
        sizes = sorted({s for _, c in axis.curves for s in c.sizes_bytes})
        rows = []
        for n in sizes:
            row = [fmt_bytes(n)]
            for _, c in axis.curves:
                i = c.sizes_bytes.index(n) if n in c.sizes_bytes else -1
                spread = f" ({c.spread[i]:.0%})" if 0 <= i < len(c.spread) else ""
                row.append(f"{c.latency_s[i] * 1e3:.3f}{spread}" if i >= 0 else "-")
            rows.append(row)
        lines += ["", f"axis {axis.name}: {axis.group_size} ranks, {axis.ranks_per_node_in_group} per node; "
                  "latency ms ((p90 - p10) / median)", *_table(["size", *names], rows)]
    return "\n".join(lines)


def format_stated(f: FabricProfile) -> str:
    """One analytical fabric's stated numbers, a few lines."""
    c = f.meta.get("compute", {})
    peaks = c.get("peak_flops_per_s") or {}
    intra, inter = f.intra, f.inter
    assert intra is not None and inter is not None  # an analytical fabric states both
    rate = ", ".join(f"{k} {v / 1e12:g}" for k, v in peaks.items()) or f"{c.get('flops_per_s', 0) / 1e12:g} achieved"
    lines = [f"{f.name}: {f.meta.get('description', '')}",
             f"  {f.meta.get('gpus_per_node', f.ranks_per_node)} GPUs per node; "
             f"intra-node {intra.bandwidth_bytes_per_s / 1e9:g} GB/s per GPU, {intra.latency_s * 1e6:g} us per step; "
             f"inter-node {inter.bandwidth_bytes_per_s / 1e9:g} GB/s per GPU, {inter.latency_s * 1e6:g} us per step",
             f"  peak TFLOP/s: {rate}; achievable {c.get('achievable_fraction', '-')} (GEMMs), "
             f"{c.get('attention_fraction', c.get('achievable_fraction', '-'))} (attention); memory "
             f"{fmt_bytes(c.get('memory_capacity_bytes') or 0)} at "
             f"{c.get('memory_bandwidth_bytes_per_s', 0) / 1e12:g} TB/s"]
    return "\n".join(lines)
