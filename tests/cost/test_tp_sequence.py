"""Sequence parallel, loss parallel and async TP in the tensor-parallel view (cost/tp.py), and
their refusals (wrapopt/tp.py). See [Note: sequence parallel costs] and [Note: async tensor parallel]."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from wrapopt import zoo
from wrapopt.cost.tp import async_tp_support, tp_roles, tp_view, with_async
from wrapopt.errors import PlanError
from wrapopt.hardware import analytical_compute, analytical_fabric
from wrapopt.tp import builtin_tp_plan, check_tp, outside_roles, vocab_size
from wrapopt.trace import trace_model


def _graph(name):
    model, x = zoo.build(name, "meta")
    return trace_model(model, x)


@pytest.fixture(scope="module")
def llama():
    return _graph("llama-tiny")


@pytest.fixture(scope="module")
def gpt():
    return _graph("gpt-tiny")


def _numel(graph, fqn):
    return next(math.prod(s) for f, s, _ in graph.param_shapes if f == fqn)


def _with_module(graph, info, parent):
    """``graph`` with the module ``info`` added under ``parent`` (a shape the zoo does not have)."""
    tree = graph.tree.copy()
    tree.add_node(info.fqn, info=info)
    tree.add_edge(parent, info.fqn)
    return replace(graph, modules=graph.modules + (info,), tree=tree)


def _sp(graph, **kw):
    return replace(builtin_tp_plan(graph), sequence_parallel=True, loss_parallel=True, **kw)


def test_outside_roles_find_embedding_head_and_norms(llama, gpt):
    assert outside_roles(llama, _sp(llama)) == {"embed_tokens": "vocab", "norm": "sequence", "lm_head": "head"}
    # gpt-tiny: a positional embedding on the sequence, a tied head (its weight counted at wte)
    assert outside_roles(gpt, _sp(gpt)) == {"wte": "vocab", "wpe": "sequence", "ln_f": "sequence",
                                            "lm_head": "head"}
    assert vocab_size(gpt, _sp(gpt)) == next(s[0] for f, s, _ in gpt.param_shapes if f == "wte.weight")
    assert outside_roles(llama, builtin_tp_plan(llama)) == {}  # neither switch: everything outside replicated


def test_sequence_parallel_holds_a_tp_share_of_the_norms(llama):
    spec = _sp(llama)
    fabric, compute = analytical_fabric(world_size=8), analytical_compute()
    view, comp, _ = tp_view(llama, compute, fabric, spec, 2)
    norm, norm0 = view.info("layers.0.input_layernorm"), llama.info("layers.0.input_layernorm")
    assert (norm.saved_bytes * 2, norm.output_bytes * 2) == (norm0.saved_bytes, norm0.output_bytes)
    block, block0 = view.info("layers.0"), llama.info("layers.0")
    assert block.output_bytes * 2 == block0.output_bytes  # a checkpointed block keeps 1/tp of its input
    for name in ("embed_tokens.weight", "lm_head.weight"):  # split over the vocabulary
        assert _numel(view, name) * 2 == _numel(llama, name)
    assert _numel(view, "layers.0.input_layernorm.weight") == _numel(llama, "layers.0.input_layernorm.weight")
    # loss parallel: the logits and what the loss keeps are the rank's vocabulary shard
    assert view.root.output_bytes * 2 == llama.root.output_bytes
    assert view.loss_saved_bytes * 2 == llama.loss_saved_bytes
    # collectives: the attention's all-gather in and the output projection's reduce-scatter out replace
    # the all-reduce of the output projection; backward mirrors them
    times = {f: (a, b) for f, a, b in comp.module_times}
    _, c_off, _ = tp_view(llama, compute, fabric, builtin_tp_plan(llama), 2)
    before = {f: (a, b) for f, a, b in c_off.module_times}
    attn0, o0 = llama.info("layers.0.self_attn"), llama.info("layers.0.self_attn.o_proj")
    ag = fabric.collective_s("all_gather", 2, 2, attn0.input_bytes)[0]
    rs = fabric.collective_s("reduce_scatter", 2, 2, o0.output_bytes)[0]
    ar = fabric.collective_s("all_reduce", 2, 2, o0.output_bytes)[0]
    assert times["layers.0.self_attn.o_proj"][0] == pytest.approx(before["layers.0.self_attn.o_proj"][0] - ar + rs)
    assert times["layers.0.self_attn"][0] == pytest.approx(before["layers.0.self_attn"][0] + ag)
    norm_ar = fabric.collective_s("all_reduce", 2, 2, norm0.own_bytes)[0]  # its weight's partial gradient
    assert times["layers.0.input_layernorm"][1] == pytest.approx(before["layers.0.input_layernorm"][1] / 2 + norm_ar)
    assert times["layers.0.self_attn"][1] == pytest.approx(
        before["layers.0.self_attn"][1] + fabric.collective_s("reduce_scatter", 2, 2, attn0.input_bytes)[0])


def test_async_overlaps_only_on_nvlink_gpus(llama):
    gpu, h100 = analytical_compute("h100-sxm"), analytical_fabric("h100-sxm+ib400", world_size=16)
    assert async_tp_support(gpu, h100) is None
    a100 = analytical_fabric("a100-80gb-sxm+ib200", world_size=16)
    assert "NVLink 4" in async_tp_support(analytical_compute("a100-80gb-sxm"), a100)
    spec = _sp(llama)
    on, note = with_async(spec, "auto", gpu, h100)
    assert on.async_tp and note is None
    off, note = with_async(spec, "auto", analytical_compute("a100-80gb-sxm"), a100)
    assert not off.async_tp and "off" in note
    no_sp, _ = with_async(replace(spec, sequence_parallel=False), "auto", gpu, h100)
    assert not no_sp.async_tp
    _, c_sync, _ = tp_view(llama, gpu, h100, spec, 2, batch_scale=64)
    _, c_async, _ = tp_view(llama, gpu, h100, on, 2, batch_scale=64)
    t_sync = sum(f + b for _, f, b in c_sync.module_times)
    t_async = sum(f + b for _, f, b in c_async.module_times)
    assert t_async < t_sync


def test_experts_are_refused_for_tp_by_name():
    g = _graph("moe-tiny")  # a bench model in the zoo: experts as nn.Linears under ".experts."
    with pytest.raises(PlanError, match=r"holds experts .*--ep splits the experts over ranks"):
        builtin_tp_plan(g)


def test_a_degree_that_does_not_divide_the_vocabulary_is_named(llama):
    spec = _sp(llama)
    shrunk = replace(llama, param_shapes=tuple((f, ((s[0] - 1,) + tuple(s[1:])) if f == "lm_head.weight" else s, d)
                                               for f, s, d in llama.param_shapes))
    with pytest.raises(PlanError, match=r"does not divide the vocabulary of \d+ .* for loss parallel; degrees that "
                                        r"do: .*--no-loss-parallel"):
        check_tp(shrunk, spec, 2)
    check_tp(shrunk, replace(spec, loss_parallel=False, sequence_parallel=False), 2)


def test_a_module_sequence_parallel_cannot_place_is_named(llama):
    spec = _sp(llama)
    roles = tp_roles(llama, spec)
    assert roles["layers.0.input_layernorm"] == "sequence" and roles["layers.0"] == "sequence"
    # a parameterised module of the block outside the split regions: a made-up "gate" Linear on the block
    info = llama.info("layers.0.input_layernorm")
    fake = replace(info, fqn="layers.0.adapter", cls="Adapter", parent="layers.0")
    g = _with_module(llama, fake, "layers.0")
    with pytest.raises(PlanError, match=r"block layers.0 \(LlamaBlock\): layers.0.adapter \(Adapter\) .*"
                                        r"--no-sequence-parallel"):
        check_tp(g, spec, 2)


def test_stacked_experts_of_a_hugging_face_moe_are_refused_for_tp():
    transformers = pytest.importorskip("transformers")
    from wrapopt.trace import trace_model as trace

    cfg = transformers.MixtralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, vocab_size=1000, num_local_experts=4,
                                     num_experts_per_tok=2, max_position_embeddings=256)
    import torch

    with torch.device("meta"):
        model = transformers.MixtralForCausalLM(cfg)
    g = trace(model, (torch.zeros(1, 16, dtype=torch.long, device="meta"),))
    with pytest.raises(PlanError, match=r"block model.layers.0 \(MixtralDecoderLayer\) holds experts "
                                        r"\(model.layers.0.mlp.experts \(4 stacked experts\)\)"):
        builtin_tp_plan(g)


def test_a_parameterised_module_inside_a_split_region_is_refused(llama):
    """Qwen3's per-head q_norm: each tensor-parallel rank would apply it to its own heads, and
    nothing sums its gradient over the ranks."""
    info = llama.info("layers.0.input_layernorm")
    fake = replace(info, fqn="layers.0.self_attn.q_norm", cls="Qwen3RMSNorm", parent="layers.0.self_attn")
    g = _with_module(llama, fake, "layers.0.self_attn")
    with pytest.raises(PlanError, match=r"layers.0.self_attn.q_norm \(Qwen3RMSNorm\) holds parameters inside "
                                        r"layers.0.self_attn, which tensor parallelism splits"):
        check_tp(g, builtin_tp_plan(llama), 2)


def test_a_module_inside_a_split_region_holds_its_share(llama):
    """Hugging Face's MLPs call their activation as a module (``act_fn``): it runs on the rank's
    share of the hidden features, so it holds and saves 1/tp of what it did."""
    act = replace(llama.info("layers.0.input_layernorm"), fqn="layers.0.mlp.act_fn", cls="SiLUActivation",
                  parent="layers.0.mlp", own_numel=0, own_bytes=0, total_numel=0, total_bytes=0)
    g = _with_module(llama, act, "layers.0.mlp")
    spec = builtin_tp_plan(llama)
    assert tp_roles(g, spec)["layers.0.mlp.act_fn"] == "inner"
    view, _, _ = tp_view(g, analytical_compute(), analytical_fabric(world_size=8), spec, 2)
    assert view.info("layers.0.mlp.act_fn").saved_bytes * 2 == act.saved_bytes
