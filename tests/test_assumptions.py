"""The assumptions a prediction rests on are stated, and they are the ones the simulator used.

Each test changes one assumption (loss, optimizer, precision, batch, budget,
fabric), checks that the simulator's prediction moved with it by the stated
amount, and that the stated block changed. Then the default loss: a Hugging
Face causal LM is traced with its own loss, a logits-shaped output gets
cross-entropy, anything else the mean square with a hint. Meta device only.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn as nn

from wrapopt.api import ParallelRequest, assumptions_for, budget_source, plan_model, prepare
from wrapopt.assumptions import LOSS_SHARE_WARN, state_assumptions
from wrapopt.cli.main import main
from wrapopt.cost import Simulator
from wrapopt.hardware.presets import analytical_compute, analytical_fabric
from wrapopt.hardware.profiles import AxisProfile, CollectiveCurve, FabricProfile
from wrapopt.losses import MEAN_SQUARE_HINT, DefaultLoss
from wrapopt.models import zoo
from wrapopt.plan.file import WrapPlan
from wrapopt.search.baselines import baselines
from wrapopt.search.driver import SearchOptions
from wrapopt.spec import MeshSpec, OptimizerKind, SimOptions
from wrapopt.trace.meta import trace_model

MESH = MeshSpec(world_size=2, ranks_per_node=2, shard_size=2)
FAB = analytical_fabric(world_size=2, ranks_per_node=2)
GPU = analytical_compute()


@pytest.fixture(scope="module")
def gpt():
    model, inputs = zoo.build("gpt-tiny", "meta")
    return model, inputs, trace_model(model, inputs, loss_fn=zoo.ZOO["gpt-tiny"].loss, fx=False)


def _stated(graph, options=None, *, fabric=FAB, budget=None, source="none given: every plan fits"):
    sim = Simulator(graph, fabric, GPU, options)
    plan = baselines(graph, MESH)["per-block"]
    est = sim.simulate(plan)
    return assumptions_for(graph, sim, plan, est, memory_budget=budget, source=source), est


def _line(stated, key: str) -> str:
    return next(line for line in stated.lines() if line.strip().startswith(key + ":"))


def test_loss_stated_is_the_traced_one(gpt):
    model, inputs, graph = gpt
    stated, _ = _stated(graph)
    assert stated.loss == "wrapopt.models.entry.lm_loss" and stated.loss_kind == "user"
    assert stated.loss_saved_bytes == graph.loss_saved_bytes > 0
    assert stated.loss_peak_bytes == graph.loss_peak_bytes

    def tiny_loss(out, _inputs):
        return out.sum()

    other = trace_model(model, inputs, loss_fn=tiny_loss, fx=False)
    stated2, _ = _stated(other)
    assert "tiny_loss" in _line(stated2, "loss") and "tiny_loss" not in _line(stated, "loss")
    assert stated2.loss_saved_bytes == other.loss_saved_bytes < graph.loss_saved_bytes


def test_optimizer_state_stated_is_the_simulated_one(gpt):
    graph = gpt[2]
    trainable_numel = sum(m.own_trainable_numel for m in graph.modules)
    for kind in (OptimizerKind.ADAMW, OptimizerKind.SGD_MOMENTUM, OptimizerKind.NONE):
        stated, est = _stated(graph, SimOptions(optimizer=kind))
        state = dict(est.peak_breakdown)["optimizer_state"]
        assert state == pytest.approx(stated.optimizer_state_bytes * trainable_numel / MESH.shard_size)
        assert stated.optimizer == kind.value and stated.optimizer_states == kind.states_per_param
        assert _line(stated, "optimizer").split()[1].rstrip(",") == kind.value
    assert "8 B per trainable parameter" in _line(_stated(graph)[0], "optimizer")


def test_precision_stated_is_the_simulated_one(gpt):
    graph = gpt[2]
    for gather, reduce in ((None, None), (2, None), (2, 4)):
        stated, est = _stated(graph, SimOptions(param_dtype_bytes=gather, reduce_dtype_bytes=reduce))
        assert sum(u.param_bytes for u in est.units) == pytest.approx(stated.gather_bytes * graph.num_params, rel=1e-6)
        assert stated.gather_bytes == (gather or 4) and stated.reduce_bytes == (reduce or gather or 4)
    assert "all-gathered in 16-bit" in _line(_stated(graph, SimOptions(param_dtype_bytes=2))[0], "precision")
    assert "all-gathered in fp32" in _line(_stated(graph)[0], "precision")
    assert "parameters float32" in _line(_stated(graph)[0], "precision")


def test_batch_stated_is_the_simulated_one(gpt):
    graph = gpt[2]
    one, est1 = _stated(graph)
    two, est2 = _stated(graph, SimOptions(batch_scale=2.0))
    assert (graph.batch_size, graph.seq_len) == (4, 64)
    assert one.batch == 4 and two.batch == 8 and two.traced_batch == 4
    assert two.loss_saved_bytes == 2 * one.loss_saved_bytes
    assert est2.peak_bytes > est1.peak_bytes
    assert _line(one, "batch") == ("  batch:      4 sequences x 64 tokens per data-parallel rank "
                                   "(TorchTitan's local_batch_size)")
    assert "8 sequences x 64 tokens per data-parallel rank" in _line(two, "batch")
    assert "(traced at 4 sequences per GPU, the simulator scaled to this)" in _line(two, "batch")


def test_budget_and_its_source_are_stated(gpt):
    model, _, graph = gpt
    quick = SearchOptions(trials=0)
    gpu = analytical_compute()
    cases = [("none", "none"), ("64MiB", "64.00 MiB per rank (given: 64MiB)"), ("auto", "auto: 90% of the device's"),
             (None, "auto: 90% of the device's")]  # the default is auto when the capacity is known
    for raw, expect in cases:
        budget = None if raw == "none" else (64 * 2**20 if raw == "64MiB" else gpu.memory_capacity_bytes * 0.9)
        job = prepare(ParallelRequest(mesh=MESH, memory_budget=raw), model, graph=graph, fabric=FAB, compute=gpu)
        plan, _ = plan_model(job, search=quick)
        assert expect in _line(plan.assumptions, "memory")
        assert plan.assumptions.memory_budget_bytes == budget
    assert budget_source("none", gpu).startswith("none")
    unknown = dataclasses.replace(gpu, memory_capacity_bytes=None)
    assert budget_source(None, unknown).startswith("none: the device's capacity is unknown")


def test_fabric_stated_is_the_one_scored(gpt):
    graph = gpt[2]
    analytical, est_a = _stated(graph)
    curve = CollectiveCurve((4096, 2**24), (1e-3, 5e-2))
    axis = AxisProfile("world", 2, 2, tuple((c, curve) for c in ("all_gather", "reduce_scatter", "all_reduce")))
    slow = FabricProfile(kind="measured", name="slow-table", backend="gloo", world_size=2, ranks_per_node=2,
                         axes=(axis,))
    measured, est_m = _stated(graph, fabric=slow)
    assert est_m.comm_s > est_a.comm_s  # the simulator did use the other fabric
    assert "slow-table, measured" in _line(measured, "fabric")
    assert "h100-nvlink-ib400, analytical: stated numbers, not measured" in _line(analytical, "fabric")


def test_a_large_loss_is_flagged_with_the_peak_under_the_smallest_loss():
    # A wide vocabulary on a tiny model: the cross-entropy's log-softmax dwarfs the rest.
    class WideHead(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(4096, 16)
            self.body = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
            self.head = nn.Linear(16, 4096)

        def forward(self, x):
            return self.head(self.body(self.emb(x)))

    with torch.device("meta"):
        model = WideHead()
    graph = trace_model(model, (torch.zeros(4, 64, dtype=torch.long),), fx=False)
    assert graph.loss_kind == "cross_entropy"
    stated, est = _stated(graph)
    assert stated.loss_share > LOSS_SHARE_WARN and stated.smallest_loss_peak_bytes is not None
    lean = dataclasses.replace(graph, loss_saved_bytes=0, loss_peak_bytes=0)
    plan = baselines(graph, MESH)["per-block"]
    assert stated.smallest_loss_peak_bytes == Simulator(lean, FAB, GPU).simulate(plan).peak_bytes < est.peak_bytes
    text = "\n".join(stated.lines())
    assert "of the predicted peak" in text and "smallest plausible loss" in text

    small = trace_model(model, (torch.zeros(4, 64, dtype=torch.long),), loss_fn=lambda out, _: out.mean(), fx=False)
    quiet, _ = _stated(small)
    assert not quiet.loss_is_large and quiet.smallest_loss_peak_bytes is None
    assert "of the predicted peak" not in "\n".join(quiet.lines())


def test_report_cli_and_plan_file_carry_the_block(gpt, tmp_path, capsys):
    model, _, graph = gpt
    job = prepare(ParallelRequest(mesh=MESH, memory_budget="none"), model, graph=graph, fabric=FAB, compute=GPU)
    plan, result = plan_model(job, search=SearchOptions(trials=0))
    assert plan.assumptions.peak_bytes == result.best.estimate.peak_bytes
    path = tmp_path / "plan.json"
    plan.save(path)
    again = WrapPlan.load(path)
    assert again.assumptions == plan.assumptions
    old = json.loads(path.read_text())
    old.pop("assumptions")
    assert WrapPlan.from_json(old).assumptions is None  # files from before still load
    newer = json.loads(path.read_text())
    newer["assumptions"]["sync_mode"] = "last"  # a later wrapopt's extra field is ignored
    assert WrapPlan.from_json(newer).assumptions == plan.assumptions

    assert main(["search", "zoo:gpt-tiny", "--world-size", "2", "--trials", "0", "--memory", "1GiB"]) == 0
    text = capsys.readouterr().out
    assert "assumptions (the prediction rests on these" in text
    assert "loss:       wrapopt.models.entry.lm_loss" in text and "1.00 GiB per rank (given: 1GiB)" in text
    assert main(["search", "zoo:gpt-tiny", "--world-size", "2", "--trials", "0", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["assumptions"]["loss"] == "wrapopt.models.entry.lm_loss"
    assert out["assumptions"]["memory_budget_bytes"] == 0.9 * 80 * 2**30  # the default: auto
    assert out["assumptions"]["optimizer"] == "adamw"
    assert main(["show", str(path)]) == 0
    assert "assumptions (the prediction rests on these" in capsys.readouterr().out


def test_optimize_wrap_report_states_the_assumptions(monkeypatch):
    from wrapopt.api import optimize_wrap

    monkeypatch.setattr("wrapopt.api.DEFAULT_TRIALS", 0)  # baselines and the exact DP only: fast
    model, inputs = zoo.build("gpt-tiny", "meta")
    res = optimize_wrap(model, inputs, world_size=2, memory_budget="auto")
    text = res.report()
    assert "assumptions (the prediction rests on these" in text
    assert "cross-entropy over the vocabulary" in text  # no loss_fn: the logits got cross-entropy
    assert "auto: 90% of the device's" in text
    assert res.assumptions == res.plan.assumptions


# --- the default loss --------------------------------------------------------------------------


def _hf_causal_lms():
    transformers = pytest.importorskip("transformers")
    llama = transformers.LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2)
    gpt2 = transformers.GPT2Config(vocab_size=512, n_embd=32, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0)
    out = []
    for cfg in (llama, gpt2):
        with torch.device("meta"):
            out.append(transformers.AutoModelForCausalLM.from_config(cfg))
    return out


@pytest.mark.parametrize("which", [0, 1], ids=["llama", "gpt2"])
def test_hf_causal_lm_is_traced_with_its_own_loss(which):
    model = _hf_causal_lms()[which]
    ids = torch.zeros(2, 16, dtype=torch.long)
    graph = trace_model(model, (ids,), fx=False)
    assert graph.loss_kind == "model" and "labels = input_ids" in graph.loss
    # Its cross-entropy keeps a float32 log-softmax of the logits (2 x 16 x 512 x 4 bytes).
    assert graph.loss_saved_bytes == pytest.approx(2 * 16 * 512 * 4, rel=0.05)
    # What the loss saved moved out of the root's activations: the modules keep what they
    # keep when the same forward runs without labels.
    plain = trace_model(model, (ids,), loss_fn=lambda out, _: out.logits.float().sum(), fx=False)
    assert plain.loss_kind == "user"
    assert sum(m.saved_bytes for m in graph.modules) == sum(m.saved_bytes for m in plain.modules)
    assert graph.loss_peak_bytes >= graph.loss_saved_bytes


def test_logits_shaped_output_gets_cross_entropy():
    class TinyLM(nn.Module):  # an Embedding's num_embeddings is the output's last dim
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(300, 8)
            self.head = nn.Linear(8, 300)

        def forward(self, x):
            return self.head(self.emb(x))

    class NoEmbedding(nn.Module):  # (batch, seq, V) beside integer tokens of (batch, seq)
        def __init__(self):
            super().__init__()
            self.table = nn.Parameter(torch.zeros(50, 8))
            self.head = nn.Linear(8, 50)

        def forward(self, x):
            return self.head(self.table[x])

    for cls in (TinyLM, NoEmbedding):
        with torch.device("meta"):
            model = cls()
        graph = trace_model(model, (torch.zeros(2, 10, dtype=torch.long),), fx=False)
        vocab = model.head.out_features
        assert graph.loss_kind == "cross_entropy", cls.__name__
        assert graph.loss_saved_bytes == pytest.approx(2 * 9 * vocab * 4, rel=0.05)  # log-softmax of seq - 1 tokens
        assert "cross-entropy" in graph.loss


def test_other_outputs_get_the_mean_square_with_a_hint():
    class Regressor(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))

        def forward(self, x):
            return self.net(x)

    class Encoder(nn.Module):  # hidden states of the embedding's width are not logits
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(100, 8)
            self.proj = nn.Linear(8, 8)

        def forward(self, x):
            return self.proj(self.emb(x))

    class Classifier(nn.Module):  # (batch, classes) logits are not over a vocabulary, even where an
        def __init__(self):  # embedding has as many rows as there are classes
            super().__init__()
            self.emb = nn.Embedding(2, 8)
            self.head = nn.Linear(8, 2)

        def forward(self, x):
            return self.head(self.emb(x).mean(1))

    cases = ((Regressor(), torch.zeros(3, 8)), (Encoder(), torch.zeros(2, 5, dtype=torch.long)),
             (Classifier(), torch.zeros(2, 5, dtype=torch.long)))
    for model, x in cases:
        graph = trace_model(model.to("meta"), (x,), fx=False)
        assert graph.loss_kind == "mean_square", type(model).__name__
        stated = state_assumptions(graph, SimOptions(), memory_budget=None, memory_budget_source="none",
                                   fabric="f", fabric_kind="analytical", compute="c", compute_kind="analytical")
        text = "\n".join(stated.lines())
        assert "mean square of every output (default)" in text and MEAN_SQUARE_HINT in text


def test_output_carrying_a_loss_is_used():
    loss = DefaultLoss()
    value = torch.ones((), requires_grad=True) * 2
    assert loss({"loss": value, "logits": torch.zeros(2, 3, 5)}, ()) is value
    assert loss.choice.kind == "model"
