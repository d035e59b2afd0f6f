"""A 2-D or 3-D configuration in ``--current`` (search/current.py, search/current_pp.py): ``pp N``,
the schedule's names, ``local batch N`` and ``N stages per rank`` parsed into the plan TorchTitan
runs, bad phrases named with the accepted forms, and a current pipeline scored whole."""

from __future__ import annotations

import pytest

from wrapopt.cost import Simulator
from wrapopt.errors import OptionError
from wrapopt.hardware.presets import analytical_compute, analytical_fabric
from wrapopt.report.current import format_current
from wrapopt.search.current import CURRENT_FORMS, compare_current, parse_current
from wrapopt.search.current_pp import torchtitan_split
from wrapopt.search.driver import SearchOptions, search_plan
from wrapopt.spec import SELECTIVE_OP, MeshSpec, ParallelRequest
from wrapopt.train import TrainConfig

MESH = MeshSpec(world_size=8, ranks_per_node=4, shard_size=8)


def test_torchtitans_split_by_count():
    # Llama 3 405B, pp 8 x 2 stages per rank: 126 blocks + the embedding and the head as one block each
    assert torchtitan_split(126, 16) == (7,) + (8,) * 14 + (7,)
    # 34 over 8 stages: 4 each and 2 left, to the first two; the ends give one to their modules
    assert torchtitan_split(32, 8) == (4, 5, 4, 4, 4, 4, 4, 3)
    with pytest.raises(ValueError, match="leave a stage of the 6 blocks without a block"):
        torchtitan_split(6, 8)


@pytest.mark.parametrize("schedule, name", [
    ("Interleaved1F1B", "Interleaved1F1B"), ("interleaved 1f1b", "Interleaved1F1B"),
    ("INTERLEAVED_1F1B", "Interleaved1F1B"), ("schedule = interleaved-1F1B", "Interleaved1F1B"),
    ("GPipe", "GPipe"), ("1f1b", "1F1B"),
])
def test_the_schedule_in_any_spelling(llama_tiny, schedule, name):
    _model, _inputs, graph = llama_tiny
    pipe = parse_current(f"pp 2, {schedule}", graph, MESH).plan.pipeline
    assert pipe is not None and pipe.schedule == name
    assert len(pipe.stages) == (4 if name == "Interleaved1F1B" else 2)  # TorchTitan's 2 stages per rank


def test_a_3d_description_gives_torchtitans_layout(llama_tiny):
    _model, _inputs, graph = llama_tiny
    cur = parse_current("per-block, full AC, local batch 8, tp 2, pp 2, Interleaved1F1B", graph, MESH)
    plan, pipe = cur.plan, cur.plan.pipeline
    assert (plan.mesh.pp_size, plan.mesh.tp_size, plan.mesh.dp_size, plan.mesh.world_size) == (2, 2, 2, 8)
    assert plan.tp is not None and pipe.schedule == "Interleaved1F1B"
    # 6 blocks + 2 over 4 stages by count: 1, 2, 2, 1 blocks; the embedding first, the norm and head last
    blocks = [[m for m in s if m in graph.blocks] for s in pipe.stages]
    assert [len(b) for b in blocks] == [1, 2, 2, 1] and sum(blocks, []) == list(graph.blocks)
    assert pipe.stages[0][0] not in graph.blocks and pipe.stages[-1][-1] not in graph.blocks
    # micro-batches of one sequence (TorchTitan's default), local batch / 1 of them
    assert (cur.micro_batch, cur.local_batch, pipe.microbatches) == (1, 8, 8)
    inner = [u for u in plan.units if not u.is_root]
    assert all(u.checkpoint is True and u.reshard_after_forward is False for u in inner)  # kept, as TorchTitan
    said = parse_current("pp 2, sac, reshard, micro-batch 2, local batch 8, 2 stages per rank, interleaved 1f1b",
                         graph, MESH)
    assert said.plan.pipeline.microbatches == 4 and len(said.plan.pipeline.stages) == 4
    assert all(u.checkpoint == SELECTIVE_OP and u.reshard_after_forward for u in said.plan.units if not u.is_root)


@pytest.mark.parametrize("text, words", [
    ("pp 2, LoopedBFS", "schedule LoopedBFS is not in wrapopt's pipeline model"),
    ("Interleaved1F1B", "schedule Interleaved1F1B needs a pipeline degree: add pp N"),
    ("pp 2, every-leaf", "takes one unit per block (per-block), not every-leaf"),
    ("pp 3", "pp 3 x tp 1 does not divide the world of 8 ranks"),
    ("pp 2, 1F1B, 2 stages per rank", "1F1B runs one stage per rank"),
    ("pp 2, interleaved 1f1b, 4 stages per rank", "leave a stage of the 6 blocks without a block"),
    ("pp 2, interleaved 1f1b, local batch 5", "5 micro-batches are not whole rounds"),
    ("pp 2, local batch 5, micro-batch 2", "local batch 5 is not a whole number of micro-batches of 2"),
    ("local batch 4, micro-batch 2", "local batch 4 is the micro-batch without a pipeline"),
    ("pp 0", "'pp 0' needs a positive count"),
    ("pp 2, local batch", "cannot read 'local batch'"),
])
def test_a_bad_pipeline_phrase_is_named(llama_tiny, text, words):
    _model, _inputs, graph = llama_tiny
    with pytest.raises(OptionError) as exc:
        parse_current(text, graph, MESH)
    assert words in str(exc.value) and CURRENT_FORMS in str(exc.value) and str(exc.value).count("\n") == 0


@pytest.fixture(scope="module")
def tiny_a100(llama_tiny):
    _model, _inputs, graph = llama_tiny
    train = TrainConfig()
    sim = Simulator(graph, analytical_fabric("a100+ib200", world_size=8, ranks_per_node=4),
                    analytical_compute("a100"), train.sim_options())
    best = search_plan(graph, sim, MESH, options=SearchOptions(trials=0)).best
    return graph, sim, train, best


def test_a_current_pipeline_is_scored_whole_at_the_global_batch(tiny_a100):
    graph, sim, train, best = tiny_a100
    at_32 = ParallelRequest(mesh=MESH, train=train, global_batch=32)
    text = "per-block, full AC, local batch 16, tp 2, pp 2, Interleaved1F1B"
    one = compare_current(graph, sim, parse_current(text, graph, MESH), best.plan, request=at_32, chosen_micro_batch=4)
    two = compare_current(graph, sim, parse_current(text + ", micro-batch 2", graph, MESH), best.plan,
                          request=at_32, chosen_micro_batch=4)
    # the same 32 sequences: 2 pipelines x 16 micro-batches of 1, or x 8 of 2
    assert (one.current.micro_batch, one.current.accumulation) == (1, 16)
    assert (two.current.micro_batch, two.current.accumulation) == (2, 8)
    assert one.current.plan.pipeline.microbatches == 16
    assert two.current.estimate.peak_breakdown != one.current.estimate.peak_breakdown
    acts = dict(one.current.estimate.peak_breakdown)["activations"]
    assert dict(two.current.estimate.peak_breakdown)["activations"] > acts  # micro-batches twice as large
    (gain,) = one.gains
    assert gain.dimension == "pipeline" and gain.current == "pp2 Interleaved1F1B x2 m16 tp2" and gain.alone is None
    assert one.current.sequences_per_s_per_rank == pytest.approx(32 / (one.current.estimate.step_s * 8))
    assert "16 micro-batches of 1 on each of 2 pipelines (pp 2, tp 2)" in format_current(one)
    # a local batch that is not the global batch's share: one line with both ways out
    with pytest.raises(OptionError, match=r"local batch 8 x 2 data-parallel ranks is 16 sequences a step, not the "
                                          r"global batch 32 .* say local batch 16 or --global-batch 16"):
        compare_current(graph, sim, parse_current("pp 2, tp 2, local batch 8", graph, MESH), best.plan,
                        request=at_32, chosen_micro_batch=4)


def test_a_local_batch_without_a_pipeline_is_the_micro_batch(tiny_a100):
    graph, sim, train, best = tiny_a100
    at_32 = ParallelRequest(mesh=MESH, train=train, global_batch=32)
    cmp = compare_current(graph, sim, parse_current("per-block, local batch 2", graph, MESH), best.plan,
                          request=at_32, chosen_micro_batch=4)
    # TorchTitan's gradient accumulation: global / (local x data-parallel ranks) = 32 / (2 x 8)
    assert (cmp.current.micro_batch, cmp.current.accumulation) == (2, 2)
    tp = compare_current(graph, sim, parse_current("local batch 4, tp 2", graph, MESH), best.plan,
                         request=at_32, chosen_micro_batch=4)
    assert (tp.current.micro_batch, tp.current.accumulation, tp.current.plan.mesh.dp_size) == (4, 2, 4)


def test_tensor_parallel_switches(llama_tiny):
    _model, _inputs, graph = llama_tiny
    spec = parse_current("tp 2, sequence parallel, async TP, no loss parallel", graph, MESH).plan.tp
    assert (spec.sequence_parallel, spec.async_tp, spec.loss_parallel) == (True, True, False)
    spec = parse_current("tp 2, sp, loss parallel", graph, MESH).plan.tp
    assert (spec.sequence_parallel, spec.async_tp, spec.loss_parallel) == (True, False, True)
    for text, words in (("async tp", "async tp needs tensor parallelism: add tp N"),
                        ("tp 2, no sp, async tp", "async tp overlaps sequence parallelism's collectives")):
        with pytest.raises(OptionError, match=words):
            parse_current(text, graph, MESH)


@pytest.mark.parametrize("flags", [("--pp", "2", "--batch", "16"), ("--pp", "2", "--cp", "2")],
                         ids=["pp2-m2-of-16", "pp2-cp2"])
def test_a_search_s_own_pipeline_plan_read_back_scores_as_the_search(flags, tmp_path, capsys):
    """A pipeline plan file records no micro-batch at a local batch: read back as ``--current`` it is
    the search's own share of the traced batch (it was scored at micro-batch 1: x13.6 at batch 16),
    and under cp its pipelines are the ranks that read different sequences (See [Note: the current
    configuration and a pipeline])."""
    import json

    from wrapopt.cli.main import main as cli

    base = ["search", "zoo:llama-tiny", "--world-size", "8", "--trials", "0", "--memory", "none", *flags]
    path = str(tmp_path / "plan.json")
    assert cli([*base, "--out", path]) == 0
    capsys.readouterr()
    assert cli([*base, "--current", path, "--json"]) == 0
    cur = json.loads(capsys.readouterr().out)["search"]["current"]
    assert cur["speedup"] == pytest.approx(1.0, rel=1e-9)
    assert cur["current"]["step_s"] == pytest.approx(cur["wrapopt"]["step_s"], rel=1e-9)
