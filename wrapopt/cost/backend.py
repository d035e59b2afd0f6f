"""How a ``Simulator`` runs its array code: ``Backend`` (compiled by numba, or Python),
the compiled ``Kernels`` and where numba caches them.

[Note: compiled step loop] The step loop (``step.py``) is written over plain
sequences and floats so that numba (the optional ``wrapopt[fast]`` extra) can
compile it unchanged; without numba, or with ``WRAPOPT_JIT=0``, or for a
``Simulator(..., backend="python")``, the same source runs as Python on
tuples. Both give the same floats: the arithmetic is the same operations in
the same order (``tests/cost/test_step.py`` checks the two agree exactly).
The same holds for ``kernels.py``'s layout kernel and size tables. numba is
imported when the first plan is scored, not with wrapopt; compiling costs
7-10 s once per machine (cached on disk, See [Note: numba cache]; loading it
~0.5 s per process), and compiled code that fails falls back to Python with
a warning (for the ``Backend`` it failed in). The loop keeps its state (memory parts,
peak, lane clocks) in one sequence, ``step.new_state()``: a list as Python, whose
numbers stay Python floats, and an array compiled. Its per-event helpers allocate
nothing and compile without reference counting (``register_jitable(_nrt=False)``):
numba otherwise counts each array argument in and out on every call, and with a
call per event that doubled the loop's time. No modelling decision here.

[Note: numba cache] numba caches compiled code beside the source by default
(``__pycache__`` of the installed package), which may be read-only or shared
by several installs. ``numba_cache_dir`` picks the directory instead: the
user's ``NUMBA_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/wrapopt/numba``
(``~/.cache/wrapopt/numba`` without it). ``compile_kernels`` points numba
there while it creates the compiled functions (numba fixes a function's cache
directory then) and compiles without a disk cache when the directory cannot
be created or written.

[Note: simulator speed] The search scores thousands of plans, so with numba
installed three pieces are compiled (``backend.py``, [Note: compiled step loop]):
the step loop, the layout build (``layout.py``, [Note: layout kernel]) and the
lookup of collective times; without numba the same step loop runs as Python
and layouts reuse block cuts across blocks and plans ([Note: cut pieces]).
Per-unit figures are numpy columns, and what does not depend on per-unit
choices is cached: per set of units its layout and sums, per mesh its bytes,
collective times and ``UnitCosts`` (made into ``UnitCost`` items only when
read), and per collective and group a table of times by message size.
Caching never changes a result: a fresh simulator and one that has scored
many other plans agree exactly (``tests/cost/test_simulate.py``). A plan
whose layout is cached scores in ~25 us, so the records made per plan are
named tuples built by ``tuple.__new__`` from their fields in order ([Note:
step loop inputs] in ``step_inputs.py``), and a collective over one rank is not
looked up (it is 0 s). ``benchmarks/sim_speed.py`` measures plans per
second, compiled and Python; ``scripts/sim_speed_ab.py`` compares two
checkouts in paired CPU time.
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from wrapopt.cost.kernels import LAYOUT_HELPERS, PER_SEGMENT_HELPERS, layout_kernel, lookup, merge
from wrapopt.cost.step import EVENT_HELPERS, PHASES, STATE_SIZE, new_state, step_loop
from wrapopt.cost.step_inputs import PlanScalars, Segments, StepConstants, StepResult, UnitLayout, UnitPlan

__all__ = ["Backend", "Kernels", "compile_kernels", "numba_cache_dir"]

_new = tuple.__new__  # a named tuple from a tuple of its fields, the fastest way: See [Note: step loop inputs]


def numba_cache_dir(environ: Mapping[str, str] | None = None) -> str | None:
    """The directory numba caches wrapopt's compiled code in, created if need be, or None
    when it cannot be created or written (then nothing is cached). See [Note: numba cache].

    ``environ``: the environment to read (default ``os.environ``)."""
    env = os.environ if environ is None else environ
    path = env.get("NUMBA_CACHE_DIR") or os.path.join(
        env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "wrapopt", "numba")
    try:
        os.makedirs(path, exist_ok=True)
        tempfile.TemporaryFile(dir=path).close()  # writable: numba checks the same way
    except OSError:
        return None
    return path


@dataclass(frozen=True, slots=True)
class Kernels:
    """The compiled (numba) functions a ``Backend`` runs: See [Note: compiled step loop]."""

    step: Callable  # ``step_loop``, given plain tuples: See [Note: step loop inputs]
    layout: Callable  # ``kernels.layout_kernel``: See [Note: layout kernel] in ``layout.py``
    lookup: Callable
    merge: Callable


_COMPILED: dict[str, Kernels] = {}  # compiled once per process; numba caches them on disk: See [Note: numba cache]


def compile_kernels() -> Kernels:
    """The compiled step loop, layout kernel, ``lookup`` and ``merge``, compiled (or loaded
    from numba's disk cache, See [Note: numba cache]) on the first call in a process.

    numba is imported here, on first use, not with wrapopt (it takes ~1 s): the one
    lazy import of this package. Raises ``ImportError`` without numba."""
    if not _COMPILED:
        import numba
        from numba.extending import overload, register_jitable

        # step_loop calls them: numba compiles them with it (the per-event ones without reference counting)
        for helper in EVENT_HELPERS + PER_SEGMENT_HELPERS:
            register_jitable(_nrt=False)(helper)
        for phase in PHASES:
            register_jitable(phase)
        for helper in LAYOUT_HELPERS:  # layout_kernel's, called a few times per layout
            register_jitable(helper)
        overload(new_state)(lambda: lambda: np.zeros(STATE_SIZE))  # the loop's state as an array
        cache_dir = numba_cache_dir()
        jit = numba.njit(cache=cache_dir is not None)
        # numba fixes each function's cache directory when it is jitted: See [Note: numba cache].
        before, numba.config.CACHE_DIR = numba.config.CACHE_DIR, cache_dir or ""
        try:
            _COMPILED["kernels"] = Kernels(step=jit(step_loop), layout=jit(layout_kernel), lookup=jit(lookup),
                                           merge=jit(merge))
        finally:
            numba.config.CACHE_DIR = before
    return _COMPILED["kernels"]


class Backend:
    """How a ``Simulator`` (and its ``Layouts``) runs the step loop, the layout build and
    the tables of collective times: compiled by numba or as Python. Each ``Simulator``
    owns one. See [Note: compiled step loop].

    ``Backend("compiled")`` compiles on first use (``compile_kernels``);
    ``Backend("compiled", kernels=...)`` runs the given functions (tests use it to
    break one). A compiled backend whose code fails falls back to Python for the rest
    of its life, with a warning (``fall_back``).
    """

    __slots__ = ("_name", "_kernels")

    def __init__(self, name: str = "python", *, kernels: Kernels | None = None):
        if name not in ("compiled", "python"):
            raise ValueError(f"backend {name!r}: expected 'compiled' (numba) or 'python'")
        if name == "compiled" and kernels is None and importlib.util.find_spec("numba") is None:
            raise ValueError("backend 'compiled' needs numba, which is not installed: `pip install wrapopt[fast]`, "
                             "or use backend='python'")
        self._name, self._kernels = name, kernels if name == "compiled" else None

    @classmethod
    def default(cls) -> Backend:
        """Compiled when numba is installed, unless the environment sets ``WRAPOPT_JIT=0``."""
        off = os.environ.get("WRAPOPT_JIT", "1") == "0"
        return cls("python" if off or importlib.util.find_spec("numba") is None else "compiled")

    @classmethod
    def of(cls, backend: str | Backend | None) -> Backend:
        """``backend`` itself, one made from its name, or the default one (None)."""
        if backend is None:
            return cls.default()
        return backend if isinstance(backend, Backend) else cls(backend)

    @property
    def name(self) -> str:
        """'compiled' or 'python' (after a fall-back: 'python')."""
        return self._name

    @property
    def kernels(self) -> Kernels | None:
        """The compiled functions, or None to run Python."""
        if self._name != "compiled":
            return None
        if self._kernels is None:
            try:
                self._kernels = compile_kernels()
            except Exception as e:  # noqa: BLE001 - numba present but failing to import or compile
                self.fall_back(f"{type(e).__name__}: {e}")
                return None
        return self._kernels

    def fall_back(self, reason: str) -> None:
        """Run Python from now on, saying why."""
        if self._name == "compiled":
            warnings.warn(f"wrapopt: compiled code failed ({reason}); using the Python one", stacklevel=3)
        self._name, self._kernels = "python", None

    def step(self, segs: Segments, lay: UnitLayout, units: UnitPlan, plan: PlanScalars,  # noqa: PLR0913
             k: StepConstants, ev: Any) -> StepResult:
        """``step_loop``, compiled or as Python: columns as numpy arrays for the compiled
        one, as tuples or lists for Python (``step_loop`` reads both the same way)."""
        kernels = self._kernels
        if kernels is None and self._name == "compiled":
            kernels = self.kernels
        if kernels is None:
            return _new(StepResult, step_loop(segs, lay, units, plan, k, ev))
        # x[:]: the fields as a plain tuple (cheaper than tuple(x)): See [Note: step loop inputs]
        return _new(StepResult, kernels.step(segs[:], lay[:], units[:], plan[:], k[:], ev))

    def __repr__(self) -> str:
        return f"Backend({self._name!r})"
