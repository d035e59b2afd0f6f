"""The plan sets ``evaluate`` predicts and measures beside wrapopt's choice (``PLAN_SETS``).

- ``baselines``: the reference points the search itself scores (``search/baselines.py``);
- ``variants``: the baselines, groupings of 1, 2 and 4 blocks with and without resharding
  after forward and checkpointing (full, and selective-op: ``,sac``), and explicit prefetch;
- ``uniform``: the hand-written contenders of issue 21: every uniform grouping of the
  blocks (groups of 1, 2, 3, 4 and of every size dividing a chain, up to the whole chain),
  each with and without resharding after forward and with no, full or selective-op
  checkpointing, one unit per block with every 2nd or 3rd block fully checkpointed
  (``per-block,ckpt-every-k``), and the baselines;
- ``exhaustive``: every contiguous grouping of every block chain (capped), the
  checkpointed uniform groupings, and the baselines: the measured optimum is the fastest;
- ``contenders``: ``exhaustive`` and ``uniform`` together.
"""

from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Callable

from wrapopt.choices import PLAN_SET_NAMES
from wrapopt.search.baselines import baselines
from wrapopt.search.uniform import CHECKPOINT_EVERY, every_kth_plan
from wrapopt.spec import SELECTIVE_OP, MeshSpec, ModelGraph, PlanSpec, UnitSpec

__all__ = ["PLAN_SETS", "uniform_sizes"]

_CK_LABEL = {False: "", True: ",ckpt", SELECTIVE_OP: ",sac"}  # a label's checkpointing suffix


def _variants(graph: ModelGraph, mesh: MeshSpec) -> list[PlanSpec]:
    """The baselines, groupings of 1, 2 and 4 blocks with and without resharding
    after forward and activation checkpointing, and explicit prefetch."""

    base = baselines(graph, mesh)
    out = list(base.values())
    root = base["root-only"].units[-1]
    for size in (1, 2, 4):
        groups = [c[i:i + size] for c in graph.block_chains for i in range(0, len(c), size)]
        if not groups or (size > 1 and all(len(g) == 1 for g in groups)):
            continue
        for raf, ck in ((True, False), (False, False), (True, True), (True, SELECTIVE_OP)):
            name = f"groups-of-{size}" + ("" if raf else ",keep") + _CK_LABEL[ck]
            out.append(PlanSpec(tuple(UnitSpec(g, raf, ck) for g in groups) + (root,), mesh, label=name))
    blocks = [u for u in out if u.label == "groups-of-1"]
    if blocks:
        out.append(replace(blocks[0], forward_prefetch=1, label="groups-of-1,prefetch"))
    return out


def _baselines(graph: ModelGraph, mesh: MeshSpec) -> list[PlanSpec]:
    return list(baselines(graph, mesh).values())


def _compositions(n: int, max_group: int):
    if n == 0:
        yield ()
        return
    for s in range(1, min(max_group, n) + 1):
        for rest in _compositions(n - s, max_group):
            yield (s,) + rest


def _exhaustive(graph: ModelGraph, mesh: MeshSpec, *, cap: int = 72) -> list[PlanSpec]:
    """Every contiguous grouping of every block chain (uniform reshard choice), the
    checkpointed uniform groupings, and the baselines: the measured optimum is the
    fastest of these. The largest group size is lowered until the set has <= cap plans."""
    base = baselines(graph, mesh)
    root = base["root-only"].units[-1]
    longest = max((len(c) for c in graph.block_chains), default=0)
    for max_group in range(longest, 0, -1):
        per_chain = [list(_compositions(len(c), max_group)) for c in graph.block_chains]
        if 2 * len(list(itertools.product(*per_chain))) <= cap:
            break
    out = list(base.values())
    for combo in itertools.product(*per_chain):
        groups = []
        for chain, sizes in zip(graph.block_chains, combo):
            i = 0
            for s in sizes:
                groups.append(chain[i:i + s])
                i += s
        name = "+".join("-".join(str(s) for s in sizes) for sizes in combo)
        for raf in (True, False):
            out.append(PlanSpec(tuple(UnitSpec(g, raf) for g in groups) + (root,), mesh,
                                label=f"[{name}]" + ("" if raf else ",keep")))
    out += [p for p in _variants(graph, mesh) if "ckpt" in p.label]
    return out




def uniform_sizes(chains: tuple[tuple[str, ...], ...]) -> list[int]:
    """Group sizes of the uniform set: 1 to 4, every size that divides some chain, and the longest chain."""
    longest = max((len(c) for c in chains), default=0)
    sizes = {g for g in range(1, longest + 1) if g <= 4 or any(len(c) % g == 0 for c in chains)}
    return sorted(sizes)


def _key(p: PlanSpec) -> tuple:
    """What makes two plans the same plan (``evaluate`` measures each key once, under its first label)."""
    return (p.units, p.mesh, p.forward_prefetch)


def _uniform(graph: ModelGraph, mesh: MeshSpec) -> list[PlanSpec]:
    """The baselines, then every ``uniform_sizes`` grouping of the block chains (a chain shorter
    than the size is one group; the last group of a chain may be shorter), with and without
    resharding after forward, with and without checkpointing. A plan equal to one before it (a
    baseline: ``uniform-1`` is ``per-block``; a smaller size's grouping) is left out, so the
    baselines keep their names in the rows."""
    out = list(baselines(graph, mesh).values())
    root = out[0].units[-1]
    seen = {_key(p) for p in out}
    for size in uniform_sizes(graph.block_chains):
        groups = [c[i:i + size] for c in graph.block_chains for i in range(0, len(c), size)]
        for ck in (False, True, SELECTIVE_OP):
            for raf in (True, False):
                name = f"uniform-{size}" + ("" if raf else ",keep") + _CK_LABEL[ck]
                plan = PlanSpec(tuple(UnitSpec(g, raf, ck) for g in groups) + (root,), mesh, label=name)
                if groups and _key(plan) not in seen:
                    seen.add(_key(plan))
                    out.append(plan)
    for every in CHECKPOINT_EVERY:
        plan = every_kth_plan(graph, mesh, every, reshard=True)
        if plan is not None and _key(plan) not in seen:
            seen.add(_key(plan))
            out.append(plan)
    return out


def _contenders(graph: ModelGraph, mesh: MeshSpec) -> list[PlanSpec]:
    """``exhaustive`` then the ``uniform`` plans it does not hold."""
    out = _exhaustive(graph, mesh)
    held = {_key(p) for p in out}
    return out + [p for p in _uniform(graph, mesh) if _key(p) not in held]


PLAN_SETS: dict[str, Callable[[ModelGraph, MeshSpec], list[PlanSpec]]] = {
    "baselines": _baselines,
    "variants": _variants,
    "uniform": _uniform,
    "exhaustive": _exhaustive,
    "contenders": _contenders,
}
assert tuple(PLAN_SETS) == PLAN_SET_NAMES, "wrapopt/choices.py names the plan sets `wrapopt bench` offers"
