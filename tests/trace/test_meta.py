"""trace_model: parameters, FLOPs, ties, block chains and order, on the zoo,
on tiny fixture models that each exercise one tracer case, and on small
Hugging Face models. Everything runs on meta or on models of a few thousand
parameters; no assertion is about wall time."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from tests.fixtures_models import (
    DIM,
    AlbertLike,
    ItemInForward,
    LoRAModel,
    MLPStack,
    MoEModel,
    NoParams,
    WithUnused,
    make_mlp,
    moe_inputs,
)
from wrapopt.errors import ModelError, TraceError
from wrapopt.models import zoo
from wrapopt.spec import ModelGraph
from wrapopt.trace.meta import trace_model

# llama-70b is left out for time: llama-7b covers the planning-only (bf16, meta) path.
ZOO_NAMES = [n for n in zoo.ZOO if n not in ("llama-70b", "llama3-405b")]


def _dedup_numel(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() de-duplicates tied ones


def _dedup_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _trace_zoo(name: str):
    model, inputs = zoo.build(name, "meta")
    return model, inputs, trace_model(model, inputs, loss_fn=zoo.ZOO[name].loss)


@pytest.fixture(scope="module")
def zoo_traces():
    return {name: _trace_zoo(name) for name in ZOO_NAMES}


# --- the zoo -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ZOO_NAMES)
def test_zoo_parameter_totals_match_deduplicated_count(zoo_traces, name):
    model, _, graph = zoo_traces[name]
    assert isinstance(graph, ModelGraph)
    assert graph.num_params == _dedup_numel(model)
    assert graph.param_bytes == _dedup_bytes(model)
    # Own parameters partition the model: each parameter object counted once.
    assert sum(m.own_numel for m in graph.modules) == _dedup_numel(model)
    assert len(graph.param_shapes) == len(list(model.parameters()))
    # Every module of the model is in the graph, in named_modules() order.
    assert [m.fqn for m in graph.modules] == [n for n, _ in model.named_modules()]


def test_llama_7b_has_llama2_7b_parameter_count(zoo_traces):
    _, _, graph = zoo_traces["llama-7b"]
    assert graph.num_params == 6_738_415_616
    assert {d for m in graph.modules for d, _ in m.own_bytes_by_dtype} == {"bfloat16"}
    assert graph.param_bytes == 2 * 6_738_415_616


@pytest.mark.parametrize("name", ZOO_NAMES)
def test_zoo_forward_flops_match_flop_counter(zoo_traces, name):
    model, inputs, graph = zoo_traces[name]
    meta_inputs = tuple(x.to("meta") for x in inputs)
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model(*meta_inputs)
    expected = counter.get_total_flops()
    got = sum(m.fwd_flops for m in graph.modules)
    assert expected > 0
    assert got == pytest.approx(expected, rel=0.02)


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny", "vit-tiny", "t5-tiny"])
def test_zoo_backward_flops_match_flop_counter(zoo_traces, name):
    # The tracer counts the fused attention backward (which recomputes the
    # scores); the counter on meta runs the math path. They agree within a few %.
    model, inputs, graph = zoo_traces[name]
    meta_inputs = tuple(x.to("meta") for x in inputs)
    loss = zoo.ZOO[name].loss(model(*meta_inputs), meta_inputs)
    counter = FlopCounterMode(display=False)
    with counter:
        loss.backward()
    for p in model.parameters():
        p.grad = None
    assert sum(m.bwd_flops for m in graph.modules) == pytest.approx(counter.get_total_flops(), rel=0.05)


def test_gpt_tiny_tied_embeddings(zoo_traces):
    _, _, graph = zoo_traces["gpt-tiny"]
    assert graph.tied_groups == (("wte.weight", "lm_head.weight"),)
    # The tied weight is counted once, at its first FQN's module.
    assert graph.info("wte").own_numel == 2048 * 64
    assert graph.info("lm_head").own_numel == 0


def test_t5_tiny_tied_embeddings(zoo_traces):
    _, _, graph = zoo_traces["t5-tiny"]
    assert graph.tied_groups == (("shared.weight", "lm_head.weight"),)


@pytest.mark.parametrize("name", ["llama-tiny", "vit-tiny", "llama-7b"])
def test_untied_zoo_models_have_no_tied_groups(zoo_traces, name):
    assert zoo_traces[name][2].tied_groups == ()


def test_gpt_tiny_block_chain(zoo_traces):
    _, _, graph = zoo_traces["gpt-tiny"]
    assert graph.block_chains == (("layers.0", "layers.1", "layers.2", "layers.3"),)
    assert graph.block_classes == ("GPTBlock",)


def test_t5_tiny_has_two_block_chains(zoo_traces):
    _, _, graph = zoo_traces["t5-tiny"]
    assert graph.block_chains == (
        ("encoder.blocks.0", "encoder.blocks.1", "encoder.blocks.2"),
        ("decoder.blocks.0", "decoder.blocks.1", "decoder.blocks.2"),
    )
    assert graph.block_classes == ("T5EncoderBlock", "T5DecoderBlock")


def test_llama_7b_block_chain(zoo_traces):
    _, _, graph = zoo_traces["llama-7b"]
    assert graph.block_chains == (tuple(f"layers.{i}" for i in range(32)),)


@pytest.mark.parametrize("name", ZOO_NAMES)
def test_execution_order_increases_along_blocks(zoo_traces, name):
    _, _, graph = zoo_traces[name]
    assert graph.block_chains, f"{name} should have a block chain"
    for chain in graph.block_chains:
        orders = [graph.info(b).order for b in chain]
        assert all(o >= 0 for o in orders)
        assert orders == sorted(orders) and len(set(orders)) == len(orders)
        # A block's submodules run after the block starts and before the next block starts. Those that
        # never run (order -1: nn.MultiheadAttention's out_proj, whose weight its parent reads) are left out.
        for b, nxt in zip(chain, chain[1:]):
            inner = [graph.info(f).order for f in graph.subtree(b) if f != b and graph.info(f).order >= 0]
            assert inner
            assert all(graph.info(b).order < o < graph.info(nxt).order for o in inner)
    assert graph.root.order == 0 and graph.root.num_calls == 1
    # call_order() lists the modules that ran, by first call, without duplicates.
    seen = [m.order for m in graph.call_order()]
    assert seen == sorted(set(seen))


def test_real_weights_are_not_touched():
    model, inputs = make_mlp()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    graph = trace_model(model, inputs)
    assert graph.num_params == _dedup_numel(model)
    for n, p in model.named_parameters():
        assert p.device.type == "cpu", n
        assert not p.is_meta, n
        assert p.grad is None, n
        assert torch.equal(p, before[n]), n
    assert graph.estimates == ()  # traced on meta, no fallback


def test_real_gpt_tiny_is_not_touched():
    model, inputs = zoo.build("gpt-tiny", "cpu")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    graph = trace_model(model, inputs, loss_fn=zoo.ZOO["gpt-tiny"].loss)
    assert graph.tied_groups == (("wte.weight", "lm_head.weight"),)
    assert model.lm_head.weight is model.wte.weight  # ties survive
    for n, p in model.named_parameters():
        assert p.device.type == "cpu" and p.grad is None and torch.equal(p, before[n]), n


def test_meta_model_stays_on_meta():
    with torch.device("meta"):
        model = MLPStack()
    graph = trace_model(model, torch.randn(4, DIM))
    assert graph.num_params == _dedup_numel(model)
    assert all(p.is_meta for p in model.parameters())
    assert graph.block_chains == (("blocks.0", "blocks.1", "blocks.2"),)


# --- fixture models ------------------------------------------------------------------------------


def _subtree_fwd(graph: ModelGraph, fqn: str) -> float:
    return sum(graph.info(f).fwd_flops for f in graph.subtree(fqn))


def test_albert_layer_called_three_times():
    x = torch.randn(4, DIM)
    graph = trace_model(AlbertLike(num_repeats=3), x)
    single = trace_model(AlbertLike(num_repeats=1), x)
    for fqn in ("layer", "layer.fc1", "layer.fc2"):
        assert graph.info(fqn).num_calls == 3, fqn
        assert single.info(fqn).num_calls == 1, fqn
    for fqn in ("embed", "head"):
        assert graph.info(fqn).num_calls == 1, fqn
    assert _subtree_fwd(single, "layer") > 0
    assert _subtree_fwd(graph, "layer") == pytest.approx(3 * _subtree_fwd(single, "layer"))
    assert graph.info("layer.fc1").fwd_flops == pytest.approx(3 * single.info("layer.fc1").fwd_flops)
    # Order is the first call: the head still comes after the shared layer.
    assert graph.info("embed").order < graph.info("layer").order < graph.info("head").order
    assert graph.num_params == _dedup_numel(AlbertLike())


def test_lora_frozen_base_and_trainable_adapters():
    model = LoRAModel()
    graph = trace_model(model, torch.randn(4, DIM))
    for base in ("l1.base", "l2.base", "frozen_head"):
        info = graph.info(base)
        assert info.own_numel > 0 and info.own_trainable_numel == 0, base
        assert info.own_trainable_numel < info.own_numel and info.own_trainable_bytes == 0, base
    for adapter in ("l1", "l2"):
        info = graph.info(adapter)  # lora_a, lora_b only: all trainable
        assert info.own_numel == info.own_trainable_numel > 0, adapter
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert sum(m.own_trainable_numel for m in graph.modules) == sum(p.numel() for p in trainable)
    assert graph.trainable_bytes == sum(p.numel() * p.element_size() for p in trainable)
    assert graph.trainable_bytes < graph.param_bytes
    assert graph.num_params == _dedup_numel(model)


def test_dense_moe_traces_on_meta_with_expert_chain():
    with torch.device("meta"):
        model = MoEModel(dense=True)
    graph = trace_model(model, moe_inputs())
    experts = tuple(f"moe.experts.{i}" for i in range(4))
    assert graph.block_chains == (experts,)
    assert all(graph.info(e).num_calls == 1 for e in experts)
    assert graph.num_params == _dedup_numel(model)
    assert graph.estimates == ()


def test_routed_moe_with_real_weights_traces_via_fallback():
    model = MoEModel()
    x = moe_inputs()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    graph = trace_model(model, x)
    assert graph.num_params == _dedup_numel(model)
    assert any("real" in e and "'moe'" in e for e in graph.estimates), graph.estimates
    assert graph.block_chains == (tuple(f"moe.experts.{i}" for i in range(4)),)
    for n, p in model.named_parameters():
        assert p.grad is None and torch.equal(p, before[n]), n


def test_routed_moe_on_meta_raises_trace_error_naming_module():
    with torch.device("meta"):
        model = MoEModel()
    with pytest.raises(TraceError, match=r"'moe'"):
        trace_model(model, moe_inputs())


def test_routed_moe_on_meta_error_says_it_needs_real_values():
    with torch.device("meta"):
        model = MoEModel()
    with pytest.raises(TraceError, match=r"'moe'.*needs real values"):
        trace_model(model, moe_inputs())


def test_never_called_module():
    model = WithUnused()
    graph = trace_model(model, torch.randn(4, DIM))
    unused = graph.info("unused")
    assert unused.order == -1 and unused.num_calls == 0
    assert unused.fwd_flops == 0 and unused.bwd_flops == 0
    assert graph.info("used").order > 0 and graph.info("used").num_calls == 1
    assert "unused" not in {m.fqn for m in graph.call_order()}
    assert graph.num_params == _dedup_numel(model)  # its parameters still need a unit


def test_item_with_real_weights_falls_back_and_says_so():
    model = ItemInForward()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    graph = trace_model(model, torch.randn(4, DIM))
    assert len(graph.estimates) == 1
    assert "'scaler'" in graph.estimates[0] and "real" in graph.estimates[0]
    assert graph.num_params == _dedup_numel(model)
    assert graph.info("scaler.proj").fwd_flops > 0
    for n, p in model.named_parameters():
        assert p.grad is None and torch.equal(p, before[n]), n


def test_item_on_meta_raises_trace_error_naming_module():
    with torch.device("meta"):
        model = ItemInForward()
    with pytest.raises(TraceError, match=r"'scaler'") as exc:
        trace_model(model, torch.randn(4, DIM))
    assert "real" in str(exc.value)


def test_wrong_input_shape_names_the_module():
    with pytest.raises(TraceError, match=r"'inp'.*Linear"):
        trace_model(MLPStack(), torch.randn(4, DIM + 3))


def test_wrong_input_shape_deep_in_the_model_names_that_module():
    model, _ = zoo.build("llama-tiny", "meta")
    with pytest.raises(TraceError, match=r"'layers\.0\.self_attn'"):
        trace_model(model, torch.randint(0, 10, (2, 3, 4)))  # one dim too many reaches attention


def test_model_without_parameters_is_a_model_error():
    with pytest.raises(ModelError, match="no parameters"):
        trace_model(NoParams(), torch.randn(4, DIM))


def test_single_tensor_inputs_are_accepted():
    model, x = make_mlp()
    assert trace_model(model, x).num_params == trace_model(model, (x,)).num_params == _dedup_numel(model)


# --- Hugging Face models from small configs -----------------------------------------------------

try:
    import transformers
except ImportError:  # the hf extra is optional; only these tests need it
    transformers = None

_IDS = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))


def _hf_gpt2():
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=16)
    return transformers.GPT2LMHeadModel(cfg), (_IDS,), {}


def _hf_llama():
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                                   num_key_value_heads=2, vocab_size=128, max_position_embeddings=16)
    return transformers.LlamaForCausalLM(cfg), (_IDS,), {}


def _hf_bert():
    cfg = transformers.BertConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                                  vocab_size=128, max_position_embeddings=16)
    return transformers.BertForMaskedLM(cfg), (_IDS,), {}


def _hf_t5():
    cfg = transformers.T5Config(num_layers=2, num_decoder_layers=2, d_model=32, d_ff=64, d_kv=16, num_heads=2,
                                vocab_size=128)
    return transformers.T5ForConditionalGeneration(cfg), (_IDS,), {"decoder_input_ids": _IDS}


def _hf_vit():
    cfg = transformers.ViTConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                                 image_size=16, patch_size=4, num_labels=3)
    return transformers.ViTForImageClassification(cfg), (torch.randn(2, 3, 16, 16),), {}


# (builder, a pair of FQNs that must be in one tied group, or None; number of blocks)
_HF_CASES = {
    "gpt2": (_hf_gpt2, ("transformer.wte.weight", "lm_head.weight"), 2),
    "llama": (_hf_llama, None, 2),
    "bert": (_hf_bert, ("bert.embeddings.word_embeddings.weight", "cls.predictions.decoder.weight"), 2),
    "t5": (_hf_t5, ("shared.weight", "lm_head.weight"), 4),
    "vit": (_hf_vit, None, 2),
}



@pytest.mark.skipif(transformers is None, reason="needs transformers (pip install 'wrapopt[hf]')")
@pytest.mark.parametrize(
    "name", list(_HF_CASES)
)
@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_hugging_face_models_trace(name, device):
    builder, tied, num_blocks = _HF_CASES[name]
    torch.manual_seed(0)
    with torch.device(device):
        model, inputs, kwargs = builder()
    graph = trace_model(model, inputs, example_kwargs=kwargs)
    assert graph.num_params == _dedup_numel(model)
    assert sum(m.own_numel for m in graph.modules) == _dedup_numel(model)
    assert sum(m.fwd_flops for m in graph.modules) > 0
    assert len(graph.blocks) == num_blocks
    if tied is None:
        assert graph.tied_groups == ()
    else:
        assert any(set(tied) <= set(g) for g in graph.tied_groups), graph.tied_groups
    if device == "cpu":
        assert all(p.device.type == "cpu" and p.grad is None for p in model.parameters())


def _real_saved_bytes(model: torch.nn.Module, inputs) -> int:
    """Bytes the model's real forward saves for backward (storages, parameters left out)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(*inputs)
    return sum(seen.values())


@pytest.mark.parametrize("name", ["tx-encoder", "tx-decoder", "gpt-tiny"])
def test_saved_activations_match_a_real_forward(zoo_traces, name):
    # nn.MultiheadAttention's attention runs as the fused kernel on meta too, so no seq x seq
    # matrix is counted: See [Note: attention inside nn.MultiheadAttention] in trace/ops.py.
    _, inputs, graph = zoo_traces[name]
    real = _real_saved_bytes(zoo.ZOO[name].build("cpu"), inputs)
    assert sum(m.saved_bytes for m in graph.modules) == real


def test_multi_head_attention_forward_is_restored_after_tracing(zoo_traces):
    assert torch.nn.functional.scaled_dot_product_attention is torch._C._nn.scaled_dot_product_attention
    attn = zoo_traces["tx-encoder"][2].info("encoder.layers.0.self_attn")
    # q, k, v, the output and its log-sum-exp, the input projection's input: 4 x 64 tokens x 64 features.
    assert attn.saved_bytes < 6 * 4 * 64 * 64 * 4
