"""The compiled step loop (cost/step.py, cost/kernels.py): numba's code and the
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


def test_compiled_and_python_paths_agree_exactly(monkeypatch):
    """See [Note: compiled step loop]: numba's code (step loop, layout kernel, table
    lookup) and the Python path give the same estimate, timeline included, on FSDP,
    HSDP and no-shard plans, GPU and CPU schedules; compiled code that fails falls
    back to Python with a warning."""
    pytest.importorskip("numba")
    from wrapopt.cost import step as steploop
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
    monkeypatch.setattr(steploop, "_JIT", [])
    assert steploop.compiled() is not None
    for comp in (GPU, cpu):
        jit = [Simulator(g, fab, comp, opts).simulate(p, record=True) for p in plans]
        monkeypatch.setattr(steploop, "_JIT", [None])
        py = [Simulator(g, fab, comp, opts).simulate(p, record=True) for p in plans]
        monkeypatch.setattr(steploop, "_JIT", [])
        assert jit == py
        assert all(e.timeline for e in jit)

    def broken(*_a):
        raise TypeError("no matching definition")

    real = steploop.kernels()
    for i in range(len(real)):  # the step loop, the layout kernel, the table lookup
        monkeypatch.setattr(steploop, "_JIT", [real[:i] + (broken,) + real[i + 1:]])
        with pytest.warns(UserWarning, match="compiled code failed"):
            again = Simulator(g, fab, GPU, opts).simulate(plans[0], record=True)
        assert steploop.compiled() is None  # the rest of the process runs Python
        assert again == Simulator(g, fab, GPU, opts).simulate(plans[0], record=True)


def test_size_tables_lookup_and_merge():
    """The simulator's tables of collective times by size: ``lookup`` finds every key
    (NaN and a count for the rest), ``merge`` keeps the table sorted; compiled too."""
    import numpy as np

    from wrapopt.cost import step as steploop

    fns = [(steploop.lookup, steploop.merge)]
    if steploop.kernels() is not None:
        fns.append(steploop.kernels()[2:4])
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
    return (lay.counts.tolist(), lay.times.tolist(), tuple(map(py, lay.loop[0])), tuple(map(py, lay.loop[1])))


def test_layout_kernel_matches_the_fragment_path(monkeypatch):
    """See [Note: layout kernel]: ``layout_kernel`` (run here as Python, as numba compiles
    it) builds exactly the layout of the fragment path, on zoo models cut into
    sub-block units and on fixture models with a layer called three times, frozen
    weights, routed experts and modules that never run; random units, nested in one
    another too."""
    import torch

    from tests.fixtures_models import DIM, AlbertLike, LoRAModel, MoEModel, WithUnused, moe_inputs
    from wrapopt.cost import step as steploop
    from wrapopt.cost.kernels import layout_kernel
    from wrapopt.cost.layout import Layouts
    from wrapopt.search.study.space import SearchSpace

    monkeypatch.setattr(steploop, "_JIT", [None])  # Layouts.build takes the fragment path
    graphs = [trace_model(*zoo.build(name, "meta")) for name in ("t5-tiny", "gpt-tiny")]
    graphs += [trace_model(AlbertLike(num_repeats=3), torch.randn(4, DIM)), trace_model(LoRAModel(), torch.randn(4, DIM)),
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
            layouts = Layouts(g, analytical_compute(), opts)
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
    is scored, so CLI commands and spawned ranks that never score one do not pay it."""
    import subprocess
    import sys

    code = "import sys, wrapopt, wrapopt.cost.simulate, wrapopt.cli; print('numba' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"
