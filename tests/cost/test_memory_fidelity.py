"""The simulator's peak memory against live tensor bytes of real FSDP2 steps.

The shared spawn of 2 gloo ranks (See tests/ranks.py) runs one step of several plans of three models that
exercise the memory notes: tied embeddings whose gradient lives through
backward (gpt-tiny, t5-tiny, and tx-tied, built from the stock
``nn.TransformerEncoderLayer`` and ``nn.MultiheadAttention``: issue 33), a cross-entropy loss whose saved output and
temporaries are larger than a block's activations, two block chains
(t5-tiny), checkpointing (full, and selective-op: matmul and attention outputs
kept), keeping parameters after forward, every leaf its own unit. The cost
model's target is 10%; these plans are held to 5%, which the accounting of
the notes meets with room (errors here are under 1%).

Each plan's peak is read from ONE steady step that balances on every rank (``steady_step_peak`` with
``tries=1``: it runs more steps, up to 8, only while some rank missed a free, See [Note: missed frees] in
evaluation/memtrack.py): a balanced step's peak is the step's, so the two extra steps the default takes to
pick the lowest of three balanced peaks only cost time (18 plans, two steps each saved).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tests.ranks import two_rank_case
from wrapopt.models import zoo
from wrapopt.spec import ROOT, SELECTIVE_OP, MeshSpec, PlanSpec, UnitSpec

MODELS = ("gpt-tiny", "t5-tiny", "tx-tied")
MESH2 = MeshSpec(world_size=2, ranks_per_node=2, shard_size=2)


def _plans(graph, mesh: MeshSpec) -> list[PlanSpec]:
    from wrapopt.search.baselines import baselines

    b = baselines(graph, mesh)
    root = UnitSpec((ROOT,), False)
    pairs = [c[i:i + 2] for c in graph.block_chains for i in range(0, len(c), 2)]
    return [
        b["per-block"], b["size-1e8"], b["every-leaf"],
        PlanSpec(tuple(UnitSpec((blk,), True, True) for blk in graph.blocks) + (root,), mesh, label="ckpt"),
        PlanSpec(tuple(UnitSpec((blk,), True, SELECTIVE_OP) for blk in graph.blocks) + (root,), mesh, label="sac"),
        PlanSpec(tuple(UnitSpec(p, False) for p in pairs) + (root,), mesh, label="pairs,keep"),
    ]


def _worker(rank: int, world: int) -> list[tuple[str, str, int, int]]:
    from wrapopt.cost import Simulator
    from wrapopt.evaluation.bench import _step
    from wrapopt.evaluation.memtrack import steady_step_peak
    from wrapopt.hardware.presets import analytical_compute, analytical_fabric
    from wrapopt.plan.apply import apply_plan
    from wrapopt.trace.meta import trace_model

    torch.set_num_threads(1)
    out = []
    for name in MODELS:
        e = zoo.get_entry(name)
        x = e.inputs()
        graph = trace_model(e.build("meta"), x, loss_fn=e.loss, fx=False)
        sim = Simulator(graph, analytical_fabric(world_size=world),
                        replace(analytical_compute(), device="cpu", runs_ahead=False))
        for plan in _plans(graph, MESH2):
            model = e.build("cpu", seed=0)
            apply_plan(model, plan)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            _step(model, opt, x, e.loss)  # the optimizer state exists from the second step on
            peak = steady_step_peak(lambda: _step(model, opt, x, e.loss), model, opt, "cpu", tries=1)
            peak = torch.tensor([float(peak)], dtype=torch.float64)
            torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)
            out.append((name, plan.label, sim.simulate(plan).peak_bytes, int(peak.item())))
    return out


@two_rank_case
def memory_fidelity_case(rank: int, world: int, tmp: str, out: dict) -> None:
    out["memory_fidelity"] = _worker(rank, world)


@pytest.fixture(scope="module")
def measured(two_rank_cases):
    return two_rank_cases[0]["memory_fidelity"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("model", MODELS)
def test_predicted_peak_within_5_percent_of_real_steps(measured, model):
    rows = [r for r in measured if r[0] == model]
    assert len(rows) == 6
    errors = {label: pred / meas - 1 for _, label, pred, meas in rows}
    assert all(abs(err) < 0.05 for err in errors.values()), errors


@pytest.mark.multiprocess
def test_checkpointing_is_predicted_to_save_what_it_saves(measured):
    """The saving is a difference of two measured peaks, each read to within ~5% of the peak
    (a free on gloo's worker thread can go unrecorded: [Note: missed frees] in evaluation/memtrack.py), so
    it is judged against 5% of the per-block peak, not 5% of the saving itself (t5-tiny missed
    that by 7% once in a clean-clone run: predicted 4.21 MB saved, measured 4.51 MB)."""
    for model in MODELS:
        rows = {label: (pred, meas) for name, label, pred, meas in measured if name == model}
        saved_pred = rows["per-block"][0] - rows["ckpt"][0]
        saved_meas = rows["per-block"][1] - rows["ckpt"][1]
        assert saved_meas > 0 and saved_pred > 0, (model, saved_pred, saved_meas)
        assert abs(saved_pred - saved_meas) <= 0.05 * rows["per-block"][1], (model, saved_pred, saved_meas)


@pytest.mark.multiprocess
def test_selective_checkpointing_lies_between_none_and_full(measured):
    """selective-op keeps more than full checkpointing and less than none, measured and
    predicted, and predicts its own saving against per-block as the test above does for full."""
    for model in MODELS:
        rows = {label: (pred, meas) for name, label, pred, meas in measured if name == model}
        for k in (0, 1):
            assert rows["ckpt"][k] < rows["sac"][k] < rows["per-block"][k], (model, k, rows)
        saved_pred = rows["per-block"][0] - rows["sac"][0]
        saved_meas = rows["per-block"][1] - rows["sac"][1]
        assert abs(saved_pred - saved_meas) <= 0.05 * rows["per-block"][1], (model, saved_pred, saved_meas)


def test_tracer_separates_the_loss_from_the_root():
    from wrapopt.trace.meta import trace_model

    e = zoo.get_entry("gpt-tiny")
    graph = trace_model(e.build("meta"), e.inputs(), loss_fn=e.loss, fx=False)
    batch, seq = e.inputs()[0].shape
    vocab = graph.info("lm_head").output_bytes // (batch * seq * 4)
    log_softmax_out = batch * (seq - 1) * vocab * 4  # what cross-entropy saves
    assert graph.loss_saved_bytes == pytest.approx(log_softmax_out, rel=0.01)
    assert graph.loss_peak_bytes >= 2 * log_softmax_out  # the flattened copy beside it
    assert graph.root.saved_bytes < log_softmax_out / 10


def test_tied_gradient_appears_at_the_head_and_accumulates_at_the_embedding():
    from wrapopt.cost.calls import gradient_sites
    from wrapopt.trace.meta import trace_model

    e = zoo.get_entry("gpt-tiny")
    graph = trace_model(e.build("meta"), e.inputs(), loss_fn=e.loss, fx=False)
    grad_at, acc_at = gradient_sites(graph)
    numel = graph.info("wte").own_trainable_numel
    assert numel > 0 and grad_at.get("lm_head") == numel and grad_at.get("wte", 0) == 0
    assert acc_at == {"wte": numel}
