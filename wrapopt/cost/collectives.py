"""Collective times as the simulator reads them: ``FabricProfile.collective_s`` per
message size, cached per collective and group in sorted tables.

The times and their caveats are the fabric profile's; this file only caches
them (``lookup`` and ``merge`` from ``kernels.py``, compiled where the
``Backend`` is) and holds no modelling decision. A collective over one rank
moves nothing: it is 0 s, not looked up (See [Note: simulator speed] in
``backend.py``).
"""

from __future__ import annotations

import numpy as np

from wrapopt.cost import kernels
from wrapopt.cost.backend import Backend
from wrapopt.hardware.profiles import FabricProfile

__all__ = ["CollectiveTimes"]


class CollectiveTimes:
    """One ``Simulator``'s collective times by size, on its fabric and backend."""

    __slots__ = ("fabric", "backend", "_colls", "_tables")

    def __init__(self, fabric: FabricProfile, backend: Backend):
        self.fabric, self.backend = fabric, backend
        self._colls: dict[tuple[str, int, int, float], tuple[float, str | None]] = {}  # collective times by size
        self._tables: dict[tuple[str, int, int], tuple[np.ndarray, np.ndarray, dict[float, set[str]]]] = {}  # the same

    def time(self, name: str, group: int, rpn_in_group: int, nbytes: float, notes: set[str]) -> float:
        """Seconds of one collective of ``nbytes``; its caveat, if any, is added to ``notes``."""
        key = (name, group, rpn_in_group, nbytes)
        hit = self._colls.get(key)
        if hit is None:
            if len(self._colls) > 65536:
                self._colls.clear()
            hit = self._colls[key] = self.fabric.collective_s(name, group, rpn_in_group, nbytes)
        t, caveat = hit
        if caveat:
            notes.add(caveat)
        return t

    def times(self, name: str, group: int, rpn_in_group: int, nbytes: np.ndarray, notes: set[str]) -> np.ndarray:
        """``time`` of every size in ``nbytes``, from a table per collective and group:
        its sizes sorted, their times, and the caveats of extrapolated sizes."""
        if group <= 1:  # one rank moves nothing: FabricProfile.collective_s is 0 s with no caveat
            # (the all-reduce of a full-shard plan)
            return np.zeros(nbytes.shape[0])
        key = (name, group, rpn_in_group)
        sizes, times, caveats = self._tables.get(key) or (np.zeros(0), np.zeros(0), {})
        fns = self.backend.kernels
        lookup, merge = (fns.lookup, fns.merge) if fns else (kernels.lookup, kernels.merge)
        try:
            out, missing = lookup(sizes, times, nbytes)
            if missing:  # new sizes: add them to the table
                if len(sizes) > 65536:
                    sizes, times, caveats = np.zeros(0), np.zeros(0), {}
                # the missing sizes once each, ascending (a set: cheaper than np.unique on a few)
                new = sorted(set(nbytes[np.isnan(out)].tolist()))
                made = []
                for b in new:
                    extra: set[str] = set()
                    made.append(self.time(name, group, rpn_in_group, b, extra))
                    if extra:
                        caveats[b] = extra
                sizes, times = merge(sizes, times, np.array(new, dtype=np.float64), np.array(made, dtype=np.float64))
                self._tables[key] = (sizes, times, caveats)
                out, missing = lookup(sizes, times, nbytes)
        except Exception as e:  # noqa: BLE001 - any compile failure: See [Note: compiled step loop]
            if fns is None:
                raise
            self.backend.fall_back(f"{type(e).__name__}: {e}")
            return self.times(name, group, rpn_in_group, nbytes, notes)
        if caveats:  # extrapolated sizes: See FabricProfile.collective_s
            for b in caveats.keys() & set(nbytes.tolist()):
                notes.update(caveats[b])
        return out
