"""The held-out family's golden answers (issue 51): zoo:mha-tied, a GPT of user blocks around
``nn.MultiheadAttention`` with the head tied to the embedding, kept in a file of its own so the
older golden files stay as they were.

The set: the simulator's estimates of every baseline, the issue's shape (the blocks but the last
in one unit kept unsharded after forward, the last checkpointed) and seeded random plans of the
Optuna space, on 2 ranks and on 64 (8 per node), a GPU (analytical) and the CPU-like profile of
``estimates.py``, two option sets; and the search's answers on those meshes with no budget and
80% of the per-block baseline's predicted peak (the DP alone).

``test_golden.py`` compares it with ``heldout.golden.json``; regenerate with
``PYTHONPATH=$PWD python -m tests.golden.regen`` (it writes every golden file).
"""

from __future__ import annotations

import random

from tests.golden.digest import Entry, canonical_sha256
from tests.golden.estimates import OPTIONS, _cpu_like, _Random
from tests.golden.searches import WORLDS, result_row
from wrapopt import MeshSpec, analytical_compute, analytical_fabric, trace_model, zoo
from wrapopt.cost import Simulator
from wrapopt.errors import InfeasibleError
from wrapopt.search.baselines import baselines
from wrapopt.search.driver import SearchOptions, search_plan
from wrapopt.search.study.space import SearchSpace
from wrapopt.spec import PlanSpec, UnitSpec

MODEL = "mha-tied"
NUM_RANDOM = 8
OPTION_SETS = (0, 1)  # indices into estimates.OPTIONS: fp32; bf16 gathers with 4 micro-batches


def _issue_plan(graph, mesh: MeshSpec) -> PlanSpec:
    """The blocks but the last in one unit kept unsharded after forward, the last checkpointed."""
    per_block = baselines(graph, mesh)["per-block"]
    blocks = [b for c in graph.block_chains for b in c]
    units = (UnitSpec(tuple(blocks[:-1]), False, False), UnitSpec((blocks[-1],), True, True), per_block.units[-1])
    return PlanSpec(units, mesh, label="issue-51")


def dump() -> list:
    """Rows ``["estimate", world, compute, options index, plan label, estimate JSON]`` and
    ``["search", world, budget rule, result row]``."""
    entry = zoo.get_entry(MODEL)
    graph = trace_model(entry.build("meta"), entry.inputs(), loss_fn=entry.loss, fx=False)
    rows: list = []
    for world, rpn in WORLDS:
        mesh = MeshSpec(world_size=world, ranks_per_node=rpn, shard_size=world)
        fabric = analytical_fabric(world_size=world, ranks_per_node=rpn)
        rng = random.Random(7)
        space = SearchSpace(graph, mesh)
        plans = sorted(baselines(graph, mesh).items()) + [("issue-51", _issue_plan(graph, mesh))]
        plans += [(f"random-{i}", space.decode(_Random(rng))) for i in range(NUM_RANDOM)]
        for cname, compute in (("gpu", analytical_compute()), ("cpu", _cpu_like())):
            for k in OPTION_SETS:
                sim = Simulator(graph, fabric, compute, OPTIONS[k])
                rows += [["estimate", world, cname, k, label, sim.simulate(p).to_json()] for label, p in plans]
        sim = Simulator(graph, fabric, analytical_compute())
        per_block = dict(plans)["per-block"]
        for rule, budget in (("none", None), ("80% of per-block", 0.8 * sim.simulate(per_block).peak_bytes)):
            try:
                row = result_row(search_plan(graph, sim, mesh, memory_budget=budget, options=SearchOptions(trials=0)))
            except InfeasibleError as e:
                row = {"infeasible": str(e)}
            rows.append(["search", world, rule, row])
    return rows


def entries(rows: list) -> list[Entry]:
    """The golden entries of ``dump()``'s rows."""
    out = []
    for row in rows:
        if row[0] == "estimate":
            _, world, cname, k, label, est = row
            out.append(Entry(key=f"{MODEL} x{world} {cname} options[{k}] {label}", step_s=repr(est["step_s"]),
                             peak_bytes=est["peak_bytes"], sha256=canonical_sha256(row)))
        else:
            _, world, rule, res = row
            best = res.get("best") or {}
            out.append(Entry(key=f"{MODEL} x{world} search budget={rule}", step_s=best.get("step_s"),
                             peak_bytes=best.get("peak_bytes"), sha256=canonical_sha256(row)))
    return out
