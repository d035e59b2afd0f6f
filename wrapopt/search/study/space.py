"""The general space of plans, and its encoding as Optuna parameters.

[Note: search space] A plan is decided by:

* ``shard``: the shard-group size: a divisor of the world that is a divisor
  of the ranks per node (part of one node, FSDP inside a node) or a multiple
  of it (whole nodes up to the whole world); smaller than the world is HSDP,
  1 is no sharding.
* ``prefetch``: the explicit forward-prefetch depth, 0 to 2.
* per block chain ``k``: ``c{k}.wrap`` (are the blocks units at all),
  ``c{k}.cut{j}`` (a unit starts at block j: every contiguous grouping,
  so every DP answer, is in the space), ``c{k}.u{j}`` (the unit starting at
  block j takes this choice: reshard after forward ``T``, ``F`` or ``node``
  = to the ranks of one node when the shard group spans nodes, each with or
  without ``+ckpt``, activation checkpointing), and ``c{k}.in.{path}``
  (wrap this submodule of every block as its own unit, as FSDP1's size
  policy or "every leaf" do; it takes its block's choices).
* per module outside the chains ``m.{fqn}`` (``off`` or a unit choice), and
  per tied group whose modules sit outside the chains ``tie{t}``: one
  ``fully_shard([a, b])`` unit holding the tied modules.

Only tie-legal modules are offered (a module whose subtree holds part of a
tied group but not all of it never is; tied blocks are never cut apart), so
no sampled plan splits tied parameters. A module and the modules that read
its parameters count as tied ([Note: parameter users] in ``units.py``), so
``nn.MultiheadAttention.out_proj`` is never a unit of its own. Every parameter is suggested in every
trial, used or not: Optuna's genetic sampler only recombines parameters that
every trial has.
"""

from __future__ import annotations

from typing import Any, Protocol

from wrapopt.spec import CHECKPOINT_MODES, ROOT, SELECTIVE_OP, MeshSpec, ModelGraph, PlanSpec, UnitSpec
from wrapopt.units import together_groups

__all__ = ["SearchSpace", "shard_sizes", "UNIT_CHOICES"]

UNIT_CHOICES = ("T", "F", "node", "T+ckpt", "F+ckpt", "node+ckpt")  # without selective-op (the default)
_CK_TAG = {False: "", True: "+ckpt", SELECTIVE_OP: "+sac"}  # a unit choice's checkpointing suffix
_CK_MODE = {"": False, "ckpt": True, "sac": SELECTIVE_OP}
PREFETCH_CHOICES = (0, 1, 2)
_BOOL = (False, True)
_MAX_INNER_DEPTH = 2  # submodules of a block offered as units: children and grandchildren
_MAX_INNER = 32


def shard_sizes(mesh: MeshSpec) -> tuple[int, ...]:
    """Legal shard-group sizes on ``mesh``: part of one node, one node, whole nodes, the world."""
    w, rpn = mesh.world_size, mesh.ranks_per_node
    out = [d for d in range(1, w + 1) if w % d == 0 and (rpn % d == 0 or d % rpn == 0)]
    return tuple(out)


class _Source(Protocol):
    def cat(self, name: str, choices: tuple) -> Any: ...


class _TrialSource:
    def __init__(self, trial):
        self.trial = trial

    def cat(self, name: str, choices: tuple) -> Any:
        return self.trial.suggest_categorical(name, choices)


class _DictSource:
    """Reads parameters from a dict; missing ones take their first choice."""

    def __init__(self, params: dict[str, Any]):
        self.params = params

    def cat(self, name: str, choices: tuple) -> Any:
        v = self.params.get(name, choices[0])
        return choices[choices.index(v)] if v in choices else choices[0]


class SearchSpace:
    """The legal plans of one model on one mesh; see [Note: search space].

    Example:
        >>> from wrapopt import zoo
        >>> from wrapopt.trace import trace_model
        >>> model, x = zoo.build("gpt-tiny", "meta")
        >>> g = trace_model(model, x)
        >>> space = SearchSpace(g, MeshSpec(world_size=16, ranks_per_node=8, shard_size=16))
        >>> plan = space.from_params({})  # every first choice: the root only, shard 1
        >>> space.encode(plan) is not None
        True
    """

    def __init__(self, graph: ModelGraph, mesh: MeshSpec, *, shard_choices: tuple[int, ...] | None = None,
                 checkpoint_modes: tuple[bool | str, ...] = (False, True)):
        self.graph, self.mesh = graph, mesh
        # A unit's choices: UNIT_CHOICES, and "+sac" (selective-op) ones when checkpoint_modes lists it.
        suffixes = tuple(_CK_TAG[m] for m in CHECKPOINT_MODES if m in checkpoint_modes)
        self.unit_choices = tuple(r + s for s in suffixes for r in ("T", "F", "node"))
        self.optional_unit = ("off",) + self.unit_choices
        self.shard_choices = tuple(shard_choices or shard_sizes(mesh))
        owners = list(together_groups(graph))  # tied modules, and modules with their parameters' users
        self._owners = owners
        blocks = {b: (k, j) for k, chain in enumerate(graph.block_chains) for j, b in enumerate(chain)}
        self._block_at = blocks
        self.chains: list[tuple[str, ...]] = []
        self.joined: list[frozenset[int]] = []  # per chain: block indices that may not start a unit
        self.inner: list[tuple[str, ...]] = []
        for chain in graph.block_chains:
            joined, ok = self._tie_joins(chain)
            self.chains.append(chain if ok else ())
            self.joined.append(joined)
            self.inner.append(self._inner_paths(chain) if ok else ())
        in_chain = [b + "." for b in blocks]
        self.outer = tuple(
            m.fqn for m in graph.modules
            if m.fqn != ROOT and m.total_numel > 0 and m.fqn not in blocks
            and not any(m.fqn.startswith(p) for p in in_chain)
            and not any(b.startswith(m.fqn + ".") for b in blocks)
            and self._tie_legal(m.fqn)
        )
        self.tie_units: tuple[tuple[str, ...], ...] = tuple(
            _outermost(group) for group in owners
            if len(_outermost(group)) > 1 and ROOT not in group and not any(_inside_any(o, blocks) for o in group)
        )

    # -- legality -----------------------------------------------------------------------------

    def _tie_legal(self, fqn: str) -> bool:
        """Wrapping ``fqn`` alone keeps every tied group whole: its subtree holds all or none."""
        for group in self._owners:
            inside = [o == fqn or o.startswith(fqn + ".") for o in group]
            if any(inside) and not all(inside):
                return False
        return True

    def _tie_joins(self, chain: tuple[str, ...]) -> tuple[frozenset[int], bool]:
        """Blocks that must share a unit with the block before them, and whether the
        chain can be cut into units at all (not if a tied group reaches outside it)."""
        joined: set[int] = set()
        for group in self._owners:
            idx = []
            for o in group:
                hit = [j for j, b in enumerate(chain) if o == b or o.startswith(b + ".")]
                idx.append(hit[0] if hit else None)
            if all(i is None for i in idx):
                continue
            if any(i is None for i in idx):
                return frozenset(), False
            joined.update(range(min(idx) + 1, max(idx) + 1))
        return frozenset(joined), True

    def _inner_paths(self, chain: tuple[str, ...]) -> tuple[str, ...]:
        first = chain[0]
        rels = []
        for m in self.graph.modules:
            if not m.fqn.startswith(first + ".") or m.total_numel == 0:
                continue
            rel = m.fqn[len(first) + 1:]
            if rel.count(".") >= _MAX_INNER_DEPTH:
                continue
            if all(f"{b}.{rel}" in self.graph.tree and self._tie_legal(f"{b}.{rel}") for b in chain):
                rels.append(rel)
        return tuple(rels[:_MAX_INNER])

    # -- decoding -----------------------------------------------------------------------------

    def _unit(self, tag: str, shard: int) -> tuple[bool | int, bool | str]:
        """(reshard_after_forward, checkpoint) of a unit choice."""
        raf, _, ck = tag.partition("+")
        mode = _CK_MODE[ck]
        rpn = self.mesh.ranks_per_node
        if raf == "F":
            return False, mode
        if raf == "node" and 1 < rpn < shard:
            return rpn, mode
        return True, mode

    def decode(self, src: _Source, label: str = "") -> PlanSpec:
        shard = src.cat("shard", self.shard_choices)
        mesh = MeshSpec(world_size=self.mesh.world_size, ranks_per_node=self.mesh.ranks_per_node, shard_size=shard)
        prefetch = src.cat("prefetch", PREFETCH_CHOICES)
        groups: list[tuple[tuple[str, ...], bool | int, bool]] = []
        for k, chain in enumerate(self.chains):
            if not chain:
                continue
            n = len(chain)
            wrap = src.cat(f"c{k}.wrap", _BOOL)
            cuts = [True] + [src.cat(f"c{k}.cut{j}", _BOOL) and j not in self.joined[k] for j in range(1, n)]
            choice = [src.cat(f"c{k}.u{j}", self.unit_choices) for j in range(n)]
            inner = [rel for rel in self.inner[k] if src.cat(f"c{k}.in.{rel}", _BOOL)]
            starts = [j for j in range(n) if cuts[j]] if wrap else list(range(n))
            for a, b in zip(starts, starts[1:] + [n]):
                raf, ck = self._unit(choice[a], shard)
                if wrap:
                    groups.append((chain[a:b], raf, ck))
                for blk in chain[a:b]:
                    for rel in inner:
                        # Inside a checkpointed block unit the block's checkpoint covers it.
                        groups.append(((f"{blk}.{rel}",), raf, False if wrap else ck))
        for m in self.outer:
            tag = src.cat(f"m.{m}", self.optional_unit)
            if tag != "off":
                groups.append(((m,), *self._unit(tag, shard)))
        for t, mods in enumerate(self.tie_units):
            tag = src.cat(f"tie{t}", self.optional_unit)
            if tag != "off":
                groups.append((mods, *self._unit(tag, shard)))
        info = self.graph.info
        # Bottom-up: deeper units first, then forward order (as ``make_plan``).
        groups.sort(key=lambda g: (-min(info(m).depth for m in g[0]), min(info(m).order for m in g[0])))
        units = tuple(UnitSpec(mods, raf, ck) for mods, raf, ck in groups) + (UnitSpec((ROOT,), False),)
        return PlanSpec(units=units, mesh=mesh, forward_prefetch=prefetch, label=label)

    def suggest(self, trial, label: str = "") -> PlanSpec:
        """The plan an Optuna trial samples (every parameter is suggested)."""
        return self.decode(_TrialSource(trial), label)

    def from_params(self, params: dict[str, Any], label: str = "") -> PlanSpec:
        return self.decode(_DictSource(params), label)

    # -- encoding -----------------------------------------------------------------------------

    def encode(self, plan: PlanSpec) -> dict[str, Any] | None:
        """Parameters that decode to ``plan``, or None when the space cannot express it
        (checked by decoding them again)."""
        if plan.mesh.shard_size not in self.shard_choices or plan.forward_prefetch not in PREFETCH_CHOICES:
            return None
        if plan.mesh.world_size != self.mesh.world_size or plan.mesh.ranks_per_node != self.mesh.ranks_per_node:
            return None
        p: dict[str, Any] = {"shard": plan.mesh.shard_size, "prefetch": plan.forward_prefetch}

        def tag(u: UnitSpec) -> str:
            raf = u.reshard_after_forward
            base = "T" if raf is True else "F" if raf is False else "node"
            return base + _CK_TAG[u.checkpoint]

        inner_seen: list[dict[str, set[int]]] = [dict() for _ in self.chains]
        for u in plan.units[:-1]:
            mods = u.modules
            first = self._block_at.get(mods[0])
            if first is not None and all(m in self._block_at for m in mods):
                k, j0 = first
                if not self.chains[k] or tuple(self.chains[k][j0:j0 + len(mods)]) != mods:
                    return None
                p[f"c{k}.wrap"] = True
                p[f"c{k}.cut{j0}"] = True
                for j in range(j0, j0 + len(mods)):
                    p[f"c{k}.u{j}"] = tag(u)
                continue
            if len(mods) == 1 and mods[0] in self.outer:
                p[f"m.{mods[0]}"] = tag(u)
                continue
            if mods in self.tie_units:
                p[f"tie{self.tie_units.index(mods)}"] = tag(u)
                continue
            hit = self._inner_of(mods[0]) if len(mods) == 1 else None
            if hit is None:
                return None
            k, j, rel = hit
            inner_seen[k].setdefault(rel, set()).add(j)
            if f"c{k}.u{j}" not in p:
                p[f"c{k}.u{j}"] = tag(u)
        for k, chain in enumerate(self.chains):
            for rel, js in inner_seen[k].items():
                if len(js) != len(chain):
                    return None
                p[f"c{k}.in.{rel}"] = True
            if p.get(f"c{k}.wrap"):
                for j in range(1, len(chain)):
                    p.setdefault(f"c{k}.cut{j}", False)
        again = self.from_params(p)
        if not _same_plan(again, plan):
            return None
        return self.complete(p)

    def _inner_of(self, fqn: str) -> tuple[int, int, str] | None:
        for k, chain in enumerate(self.chains):
            for j, b in enumerate(chain):
                if fqn.startswith(b + "."):
                    rel = fqn[len(b) + 1:]
                    return (k, j, rel) if rel in self.inner[k] else None
        return None

    def complete(self, params: dict[str, Any]) -> dict[str, Any]:
        """Every parameter of the space (defaults where ``params`` has none), so that
        an enqueued trial fixes all of them."""
        rec: dict[str, Any] = {}

        class _Rec:
            def cat(_self, name: str, choices: tuple) -> Any:  # noqa: N805
                v = params.get(name, choices[0])
                rec[name] = choices[choices.index(v)] if v in choices else choices[0]
                return rec[name]

        self.decode(_Rec())
        return rec

    @property
    def num_params(self) -> int:
        return len(self.complete({}))


def _inside_any(fqn: str, blocks: dict[str, Any]) -> bool:
    return fqn in blocks or any(fqn.startswith(b + ".") for b in blocks)


def _outermost(mods: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(m for m in mods if not any(o != m and m.startswith(o + ".") for o in mods))


def _same_plan(a: PlanSpec, b: PlanSpec) -> bool:
    key = lambda p: sorted(  # noqa: E731
        (u.modules, u.reshard_after_forward if not isinstance(u.reshard_after_forward, bool)
         else bool(u.reshard_after_forward), u.checkpoint) for u in p.units)
    return a.mesh == b.mesh and a.forward_prefetch == b.forward_prefetch and key(a) == key(b)
