"""The compiled step loop (cost/backend.py, cost/step.py, cost/kernels.py): numba's code and the
Python path give the same estimates, the layout kernel builds the fragment path's
layout, the size tables look up and merge, and importing wrapopt loads no numba."""

from __future__ import annotations

import dataclasses
import random

import pytest

from tests.cost.common import UniformChoices
from wrapopt.cost import Simulator
from wrapopt.hardware.presets import analytical_compute, analytical_fabric
from wrapopt.models import zoo
from wrapopt.search.baselines import baselines
from wrapopt.spec import MeshSpec, SimOptions, UnitSpec
from wrapopt.trace.meta import trace_model

GPU = analytical_compute()


def test_compiled_and_python_paths_agree_exactly():
    """See [Note: compiled step loop]: numba's code (step loop on its named tuples, layout
    kernel, table lookup and merge) and the Python path give the same estimate, timeline
    included, on FSDP, HSDP and no-shard plans, GPU and CPU schedules; compiled code that
    fails falls back to Python with a warning, for the simulator it failed in only."""
    pytest.importorskip("numba")
    from wrapopt.cost.backend import Backend, Kernels, compile_kernels
    from wrapopt.search.study.space import SearchSpace

    model, x = zoo.build("gpt-tiny", "meta")
    g = trace_model(model, x)
    mesh = MeshSpec(world_size=16, ranks_per_node=4, shard_size=16)
    fab = analytical_fabric(world_size=16, ranks_per_node=4)
    src = UniformChoices(1)
    plans = [SearchSpace(g, mesh).decode(src) for _ in range(25)] + list(baselines(g, mesh).values())
    assert len({p.mesh.shard_size for p in plans}) > 2 and any(p.forward_prefetch for p in plans)
    assert any(u.checkpoint for p in plans for u in p.units)
    cpu = dataclasses.replace(GPU, device="cpu", runs_ahead=False)
    opts = SimOptions(param_dtype_bytes=2, reduce_dtype_bytes=4, grad_accumulation=2)
    for comp in (GPU, cpu):
        fast = Simulator(g, fab, comp, opts, backend="compiled")
        jit = [fast.simulate(p, record=True) for p in plans]
        assert fast.backend.name == "compiled" and fast.backend.kernels is not None  # nothing fell back
        py = [Simulator(g, fab, comp, opts, backend="python").simulate(p, record=True) for p in plans]
        assert jit == py
        assert all(e.timeline for e in jit)

    def broken(*_a):
        raise TypeError("no matching definition")

    real = compile_kernels()
    for field in dataclasses.fields(Kernels):  # the step loop, the layout kernel, the table lookup and merge
        sim = Simulator(g, fab, GPU, opts,
                        backend=Backend("compiled", kernels=dataclasses.replace(real, **{field.name: broken})))
        with pytest.warns(UserWarning, match="compiled code failed"):
            again = sim.simulate(plans[0], record=True)
        assert sim.backend.name == "python" and sim.layout.backend is sim.backend, field.name  # Python from now on
        assert again == Simulator(g, fab, GPU, opts, backend="python").simulate(plans[0], record=True)
        assert Simulator(g, fab, GPU, opts).backend.kernels is real  # other simulators still run compiled


def test_backend_choice(monkeypatch):
    """Each ``Simulator`` owns its backend: compiled by default when numba is installed,
    Python under ``WRAPOPT_JIT=0`` or when asked; a wrong name says what is expected."""
    import importlib.util

    from wrapopt.cost.backend import Backend

    g = trace_model(*zoo.build("gpt-tiny", "meta"))
    fab = analytical_fabric(world_size=16, ranks_per_node=4)
    has_numba = importlib.util.find_spec("numba") is not None
    monkeypatch.delenv("WRAPOPT_JIT", raising=False)
    assert Simulator(g, fab, GPU).backend.name == ("compiled" if has_numba else "python")
    assert Simulator(g, fab, GPU, backend="python").backend.name == "python"
    monkeypatch.setenv("WRAPOPT_JIT", "0")
    sim = Simulator(g, fab, GPU)
    assert sim.backend.name == "python" and sim.backend.kernels is None and sim.layout.backend is sim.backend
    if has_numba:
        # asked for: the environment yields
        assert Simulator(g, fab, GPU, backend="compiled").backend.name == "compiled"
    mine = Backend("python")
    assert Simulator(g, fab, GPU, backend=mine).backend is mine
    with pytest.raises(ValueError, match="'compiled' .*or 'python'"):
        Simulator(g, fab, GPU, backend="numba")


def test_size_tables_lookup_and_merge():
    """The simulator's tables of collective times by size: ``lookup`` finds every key
    (NaN and a count for the rest), ``merge`` keeps the table sorted; compiled too."""
    import importlib.util

    import numpy as np

    from wrapopt.cost.backend import compile_kernels
    from wrapopt.cost.kernels import lookup, merge

    fns = [(lookup, merge)]
    if importlib.util.find_spec("numba") is not None:
        compiled = compile_kernels()
        fns.append((compiled.lookup, compiled.merge))
    for lookup, merge in fns:
        keys, values = np.array([2.0, 8.0, 32.0]), np.array([0.2, 0.8, 3.2])
        out, missing = lookup(keys, values, np.array([8.0, 2.0, 8.0, 32.0]))
        assert missing == 0 and out.tolist() == [0.8, 0.2, 0.8, 3.2]
        out, missing = lookup(keys, values, np.array([1.0, 8.0, 64.0, 5.0]))
        assert missing == 3 and out[1] == 0.8 and np.isnan(out[[0, 2, 3]]).all()
        keys, values = merge(keys, values, np.array([1.0, 5.0, 64.0]), np.array([0.1, 0.5, 6.4]))
        assert keys.tolist() == [1.0, 2.0, 5.0, 8.0, 32.0, 64.0] and values.tolist() == [0.1, 0.2, 0.5, 0.8, 3.2, 6.4]
        assert lookup(np.zeros(0), np.zeros(0), np.array([1.0]))[1] == 1


def _layout_values(lay):
    """A layout as plain values, whichever builder made it (numpy arrays or tuples)."""
    py = lambda c: tuple(c.tolist()) if hasattr(c, "tolist") else tuple(c)  # noqa: E731
    return (lay.counts.tolist(), lay.times.tolist(), tuple(map(py, lay.seg_cols)), tuple(map(py, lay.unit_cols)))


def test_layout_kernel_matches_the_fragment_path():
    """See [Note: layout kernel]: ``layout_kernel`` (run here as Python, as numba compiles
    it) builds exactly the layout of the fragment path, on zoo models cut into
    sub-block units and on fixture models with a layer called three times, frozen
    weights, routed experts and modules that never run; random units, nested in one
    another too."""
    import torch

    from tests.fixtures_models import DIM, AlbertLike, LoRAModel, MoEModel, WithUnused, moe_inputs
    from wrapopt.cost.kernels import layout_kernel
    from wrapopt.cost.layout import Layouts
    from wrapopt.cost.backend import Backend
    from wrapopt.search.study.space import SearchSpace

    graphs = [trace_model(*zoo.build(name, "meta")) for name in ("t5-tiny", "gpt-tiny")]
    graphs += [trace_model(AlbertLike(num_repeats=3), torch.randn(4, DIM)),
               trace_model(LoRAModel(), torch.randn(4, DIM)),
               trace_model(MoEModel(dense=True), moe_inputs()), trace_model(WithUnused(), torch.randn(4, DIM))]
    rng = random.Random(0)
    checked = 0
    for g in graphs:
        mesh = MeshSpec(world_size=16, ranks_per_node=4, shard_size=16)
        plans = [p.units for p in baselines(g, mesh).values()]
        if g.blocks:
            src = UniformChoices(2)
            plans += [SearchSpace(g, mesh).decode(src).units for _ in range(15)]
        names = [m.fqn for m in g.modules if m.fqn]
        for _ in range(15):  # any modules, one or several to a unit (not nested within one unit, as legal plans)
            units: list[list[str]] = []
            for m in rng.sample(names, rng.randint(1, len(names))):
                u = units[-1] if units and len(units[-1]) < rng.randint(1, 3) else None
                if u is None or any(m.startswith(o + ".") or o.startswith(m + ".") for o in u):
                    units.append([m])
                else:
                    u.append(m)
            plans.append(tuple(UnitSpec(tuple(u)) for u in units) + (UnitSpec(("",), False),))
        for opts in (SimOptions(), SimOptions(param_dtype_bytes=2, reduce_dtype_bytes=4, batch_scale=1.5)):
            layouts = Layouts(g, analytical_compute(), opts, backend=Backend("python"))  # build: the fragment path
            for units in plans:
                fragments = layouts.build(units)
                kernel = layouts._build_compiled(layout_kernel, units)
                assert _layout_values(kernel) == _layout_values(fragments), units
                assert kernel.segments == fragments.segments
                checked += 1
    assert checked > 300
    unknown = (UnitSpec(("no.such.module",)), UnitSpec(("",), False))
    assert layouts._build_compiled(layout_kernel, unknown) is None  # build() takes the fragment path


def test_import_does_not_load_numba():
    """See [Note: compiled step loop]: numba (~1 s to import) loads when the first plan
    is scored, so CLI commands and spawned ranks that never score one do not pay it
    (building a ``Simulator`` does not load it either)."""
    import subprocess
    import sys

    code = ("import sys, wrapopt, wrapopt.cost.simulate, wrapopt.cli\n"
            "from wrapopt.cost import Simulator\n"
            "from wrapopt.hardware.presets import analytical_compute, analytical_fabric\n"
            "from wrapopt.models import zoo\n"
            "from wrapopt.trace.meta import trace_model\n"
            "Simulator(trace_model(*zoo.build('gpt-tiny', 'meta')), analytical_fabric(world_size=2), "
            "analytical_compute())\n"
            "print('numba' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"
