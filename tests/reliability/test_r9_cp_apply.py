"""Bad input to context parallelism as plan.apply and train_context meet it (issue #53): attention
that is not SDPA, refused at apply naming the module; buffers whose sequence does not split into
2 x cp chunks, named with the lengths and degrees that would; and the loop's other mistakes. One
line each, before any collective (See [Note: applying context parallelism] in plan/cp.py)."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn as nn

from wrapopt.errors import PlanError
from wrapopt.models import zoo
from wrapopt.plan.apply import apply_plan
from wrapopt.plan.cp import check_cp_buffers, check_cp_model, cp_context
from wrapopt.plan.file import WrapPlan
from wrapopt.spec import ROOT, MeshSpec, PlanSpec, UnitSpec

MESH_CP = MeshSpec(world_size=2, ranks_per_node=2, shard_size=2, cp_size=2)


def _refusal(model: nn.Module) -> str:
    with pytest.raises(PlanError) as e:
        apply_plan(model, PlanSpec((UnitSpec((ROOT,), False),), MESH_CP))  # refused before any process group
    msg = str(e.value)
    assert "\n" not in msg and "F.scaled_dot_product_attention" in msg and "--cp 1" in msg
    return msg


class MHABlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(32, 4, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mha(x, x, x, need_weights=False)[0]


class EagerAttention(nn.Module):
    """Attention written out: softmax(QK^T)V, which the ring never sees."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(32, 96)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return torch.softmax(q @ k.transpose(-1, -2) / 32 ** 0.5, dim=-1) @ v


def test_multihead_attention_is_refused_naming_the_module():
    msg = _refusal(nn.Sequential(nn.Linear(32, 32), MHABlock()))
    assert "module 1.mha (MultiheadAttention)" in msg and "F.multi_head_attention_forward" in msg


def test_attention_written_without_sdpa_is_refused_naming_the_module():
    msg = _refusal(nn.Sequential(nn.Linear(32, 32), nn.Sequential(EagerAttention())))
    assert "module 1.0 (EagerAttention) never calls it" in msg


def test_a_hugging_face_model_without_sdpa_attention_is_refused():
    pytest.importorskip("transformers")
    from tests.ranks import tiny_hf_llama

    model = tiny_hf_llama()
    model.config._attn_implementation = "eager"
    msg = _refusal(model)
    assert "module <root> (LlamaForCausalLM) runs attention 'eager'" in msg and 'attn_implementation="sdpa"' in msg
    model.config._attn_implementation = "sdpa"
    check_cp_model(model)  # the same model with SDPA attention passes


def test_the_zoo_models_attention_passes():
    for name in ("gpt-tiny", "llama-tiny"):
        check_cp_model(zoo.get_entry(name).build("meta"))


class _Mesh:
    """What cp_context reads of a mesh before its first collective."""

    device_type = "cpu"

    def size(self) -> int:
        return 2


@pytest.mark.parametrize("shape, dim", [((2, 30), 1), ((30,), 0)])
def test_a_sequence_not_divisible_by_2_x_cp_is_named_with_what_would_divide(shape, dim):
    x = torch.zeros(shape, dtype=torch.long)
    for call in (lambda: check_cp_buffers([torch.zeros(2, 32), x], [1, dim], 2),
                 lambda: cp_context(_Mesh(), [torch.zeros(2, 32), x], [1, dim]).__enter__()):
        with pytest.raises(PlanError) as e:
            call()
        msg = str(e.value)
        assert "\n" not in msg
        assert f"buffer 1 (shape {shape}) has 30 positions on dim {dim}, not divisible by 2 x cp = 4" in msg
        assert "make the sequence 28 or 32 long, or use cp 1, 3, 5, 15" in msg


def test_without_the_balancer_cp_alone_must_divide_the_sequence():
    check_cp_buffers([torch.zeros(2, 30)], [1], 2, load_balance=False)  # 2 contiguous shards of 15
    with pytest.raises(PlanError, match=r"has 30 positions on dim 1, not divisible by cp = 4: make the sequence 28 "
                                        r"or 32 long, or use cp 1, 2, 3, 5, 6, 10"):
        check_cp_buffers([torch.zeros(2, 30)], [1], 4, load_balance=False)


def test_the_loops_other_mistakes_are_named():
    with pytest.raises(PlanError, match=r"got 2 buffers and 1 sequence dims; give one sequence dim per buffer"):
        check_cp_buffers([torch.zeros(2, 8), torch.zeros(8)], [1], 2)
    with pytest.raises(PlanError, match=r"buffer 0 \(shape \(8,\)\) has no sequence dim 1"):
        check_cp_buffers([torch.zeros(8)], [1], 2)
    with pytest.raises(PlanError, match=r"buffer 1 requires grad; torch resizes the buffers in place"):
        cp_context(_Mesh(), [torch.zeros(8), torch.zeros(8, requires_grad=True)], [0, 0]).__enter__()
    with pytest.raises(PlanError, match=r"unknown context-parallel rotate method 'ring'; use one of allgather, "):
        cp_context(_Mesh(), [torch.zeros(8)], [0], rotate_method="ring").__enter__()


def test_train_context_needs_the_model_the_cp_plan_applied():
    plan = WrapPlan(spec=PlanSpec((UnitSpec((ROOT,), False),), MESH_CP), model={})
    with pytest.raises(PlanError, match=r"not sharded by a context-parallel plan .*pass the model that plan.apply"):
        plan.train_context(nn.Linear(2, 2), buffers=[torch.zeros(8)], seq_dims=[0])
    no_cp = WrapPlan(spec=PlanSpec((UnitSpec((ROOT,), False),), MeshSpec(world_size=2, ranks_per_node=2,
                                                                          shard_size=2)), model={})
    with no_cp.train_context(nn.Linear(2, 2)) as ctx:  # without cp: the loss context alone
        assert ctx is None
    assert isinstance(no_cp.train_context(), contextlib.AbstractContextManager)


def test_optimize_wraps_result_gives_the_context_on_its_own_model():
    from wrapopt.api import OptimizeResult

    plan = WrapPlan(spec=PlanSpec((UnitSpec((ROOT,), False),), MESH_CP), model={})
    res = OptimizeResult(plan=plan, model=nn.Linear(2, 2), baselines={}, search=None, graph=None, fabric=None,
                         compute=None)
    with pytest.raises(PlanError, match=r"not sharded by a context-parallel plan"):
        res.train_context(buffers=[torch.zeros(8)], seq_dims=[0])
