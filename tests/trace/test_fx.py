"""The fx graph and the module dataflow: export on fake tensors (trace/fx.py), kept by
trace_model when cheap, failures recorded rather than raised, weights untouched."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.profiler import ProfilerActivity, profile

from wrapopt.models import zoo
from wrapopt.report.text import format_graph, graph_to_json
from wrapopt.trace.fx import export_fx
from wrapopt.trace.meta import _FX_AUTO_MAX_MODULES, trace_model

BATCH, SEQ, DIM = 4, 64, 64  # gpt-tiny's example batch


@pytest.fixture(scope="module")
def gpt():
    model, inputs = zoo.build("gpt-tiny", "meta")
    return model, inputs, trace_model(model, inputs, loss_fn=zoo.ZOO["gpt-tiny"].loss)


def test_fx_graph_kept_with_every_op_attributed_to_a_module(gpt):
    model, _, graph = gpt
    assert graph.trace.fx_graph is not None
    names = {n for n, _ in model.named_modules()}
    ops = [n for n in graph.trace.fx_graph.graph.nodes if n.op == "call_function"]
    assert ops and all(n.meta["module_fqn"] in names for n in ops)
    # Parameterised ops land in their own leaf module, not in a parent.
    linear_owners = {n.meta["module_fqn"] for n in ops if n.target == torch.ops.aten.linear.default}
    assert "layers.0.attn.q_proj" in linear_owners and "lm_head" in linear_owners
    assert not any(e.startswith("fx graph") for e in graph.estimates)


def test_dataflow_follows_the_block_chain(gpt):
    _, _, graph = gpt
    flow = graph.trace.dataflow
    act = BATCH * SEQ * DIM * 4  # one fp32 hidden state
    for i in range(3):
        # The block's output (its residual add) feeds the next block's norm and residual.
        assert flow.edges[f"layers.{i}", f"layers.{i + 1}.ln_1"]["bytes"] == act
        assert flow.has_edge(f"layers.{i}", f"layers.{i + 1}")
    assert flow.has_edge("layers.0.ln_1", "layers.0.attn.q_proj")
    assert flow.has_edge("layers.3", "ln_f") and flow.has_edge("ln_f", "lm_head")
    assert not flow.has_edge("layers.0", "layers.2")  # no skip connections in GPT
    assert "" in flow and flow.has_edge("", "wpe")  # positions come from an arange in the root's forward


def test_fx_and_op_dataflow_agree(gpt):
    model, inputs, graph = gpt
    from_ops = trace_model(model, inputs, loss_fn=zoo.ZOO["gpt-tiny"].loss, fx=False)
    assert from_ops.trace.fx_graph is None
    a, b = graph.trace.dataflow, from_ops.trace.dataflow
    assert set(a.edges) == set(b.edges)
    assert all(a.edges[e]["bytes"] == b.edges[e]["bytes"] for e in a.edges)


def test_real_weights_allocate_nothing_and_stay_untouched():
    model, inputs = zoo.build("gpt-tiny", "cpu")
    before = {n: (p, p.data_ptr(), p.detach().clone()) for n, p in model.named_parameters(remove_duplicate=False)}
    trace_model(model, inputs, fx=True)  # warm-up: first export initialises torch.export
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        graph = trace_model(model, inputs, fx=True)
    allocated = sum(e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0)
    assert allocated < 4096  # a real forward of this model allocates ~16 MB
    assert graph.trace.fx_graph is not None
    after = dict(model.named_parameters(remove_duplicate=False))
    assert after.keys() == before.keys()
    for name, (p, ptr, value) in before.items():
        q = after[name]
        assert q is p and q.device.type == "cpu" and q.data_ptr() == ptr and torch.equal(q.detach(), value)
        assert isinstance(q, nn.Parameter) and q.grad is None
    assert model.lm_head.weight is model.wte.weight  # still tied
    # The kept graph holds fake tensors only, never the model's storage.
    vals = [n.meta.get("val") for n in graph.trace.fx_graph.graph.nodes if n.op == "placeholder"]
    assert vals and all(type(v).__name__ == "FakeTensor" for v in vals if isinstance(v, torch.Tensor))


class ValueBranch(nn.Module):
    """Python control flow on a tensor's value: meta cannot run it, export cannot trace it."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)
        return self.b(h) if h.sum() > 0 else -self.b(h)


def test_export_failure_is_recorded_not_raised():
    torch.manual_seed(0)
    graph = trace_model(ValueBranch(), torch.randn(2, 8), fx=True)  # real-tensor fallback for the figures
    assert graph.trace.fx_graph is None
    assert any("fx export failed" in e for e in graph.estimates)
    assert graph.trace.dataflow.has_edge("a", "b")  # from the traced ops instead


def test_export_raising_anything_is_recorded(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("export is broken today")

    monkeypatch.setattr(torch.export, "export", broken)
    model, inputs = zoo.build("gpt-tiny", "meta")
    gm, flow, failure = export_fx(model, inputs)
    assert gm is None and flow.number_of_edges() == 0 and "export is broken today" in failure
    graph = trace_model(model, inputs)
    assert graph.trace.fx_graph is None and graph.trace.dataflow.has_edge("layers.0", "layers.1.ln_1")
    assert any("RuntimeError: export is broken today" in e for e in graph.estimates)


def test_large_models_skip_export_unless_asked():
    n = _FX_AUTO_MAX_MODULES + 1
    model = nn.Sequential(*(nn.Linear(4, 4) for _ in range(n)))
    graph = trace_model(model, torch.randn(2, 4))
    assert graph.trace.fx_graph is None
    assert any("fx graph not kept" in e and "fx=True" in e for e in graph.estimates)
    assert all(graph.trace.dataflow.has_edge(str(i), str(i + 1)) for i in range(n - 1))
    assert trace_model(model, torch.randn(2, 4), fx=True).trace.fx_graph is not None
    assert trace_model(zoo.build("gpt-tiny", "meta")[0], zoo.ZOO["gpt-tiny"].inputs(), fx=False).trace.fx_graph is None


def test_hugging_face_model_exports_despite_its_cache_output():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=32)
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(config)
    graph = trace_model(model, torch.randint(0, 100, (1, 16)))  # returns a DynamicCache too
    assert graph.trace.fx_graph is not None, graph.estimates
    assert graph.trace.dataflow.has_edge("transformer.h.0", "transformer.h.1.ln_1")


def test_called_twice_and_never_called():
    model, inputs = zoo.build("t5-tiny", "meta")
    graph = trace_model(model, inputs, fx=False)
    assert graph.multi_called == ("shared",)  # source and target embeddings
    assert graph.never_called == ()
    assert trace_model(WithUnused(), torch.randn(2, 4), fx=False).never_called == ("unused",)


class WithUnused(nn.Module):
    def __init__(self):
        super().__init__()
        self.used = nn.Linear(4, 4)
        self.unused = nn.Linear(4, 4)

    def forward(self, x):
        return self.used(x)


def test_report_shows_dataflow_and_fx(gpt):
    _, _, graph = gpt
    text = format_graph(graph)
    assert "dataflow: 65 edges" in text and "fx graph kept" in text
    assert "layers.0 -> layers.1" in text
    data = graph_to_json(graph)
    assert data["fx_graph"]["kept"] is True
    assert ["layers.0", "layers.1.ln_1", BATCH * SEQ * DIM * 4, 1] in data["dataflow"]
