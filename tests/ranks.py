"""Helpers for tests that train zoo models on 2 gloo ranks.

Sharded training is compared with the unsharded model trained on the whole
batch: with a mean loss the averaged gradients are equal, so the losses match
step for step (fp32, no dropout).

Each spawn of ranks costs seconds, so test modules in several folders register
their multi-process cases with ``@two_rank_case`` and the session fixture
``two_rank_cases`` (tests/conftest.py) runs the cases of every collected module
in one spawn of 2 gloo ranks. A case ``fn(rank, world, tmp, out)`` writes its
results under its own keys of ``out``; the fixture gives ``out`` by rank. Cases
are module-level functions: the spawned ranks import them by name. The 4-rank
cases (tensor parallel 2 x 2, pipeline 2 x 2) do the same with ``@four_rank_case``
and ``four_rank_cases``, each module's results in a dict of its own. Each rank
records every case's seconds under ``case_s``: where the spawn's time goes. With
``PROF_CASES=/some/prefix`` in the environment, rank 0 of each shared spawn also writes its
cProfile to ``prefix.2`` / ``prefix.4`` (read with ``pstats``): what inside a case takes it.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from wrapopt.launch import spawn
from wrapopt.models import zoo
from wrapopt.search.baselines import baselines
from wrapopt.spec import ROOT, MeshSpec, PlanSpec, UnitSpec
from wrapopt.tp import builtin_tp_plan
from wrapopt.trace.meta import trace_model

TOL = 1e-5
STEPS = 3
MESH2 = MeshSpec(world_size=2, ranks_per_node=2, shard_size=2)
MESH_2X2 = MeshSpec(world_size=4, ranks_per_node=4, shard_size=2, tp_size=2)  # FSDP over 2 x tensor parallel 2

# The builtin tensor-parallel plan of a Hugging Face LlamaDecoderLayer (tests/plan/test_tp.py checks it is).
HF_LLAMA_TP = (("self_attn.q_proj", "colwise"), ("self_attn.k_proj", "colwise"), ("self_attn.v_proj", "colwise"),
               ("self_attn.o_proj", "rowwise"), ("mlp.gate_proj", "colwise"), ("mlp.up_proj", "colwise"),
               ("mlp.down_proj", "rowwise"))

_CASES: list[str] = []  # "module:function" of every registered case, in the order the modules were imported


def two_rank_case(fn):
    """Register ``fn(rank, world, tmp, out)`` (module level) to run in the shared spawn."""
    name = f"{fn.__module__}:{fn.__qualname__}"
    if name not in _CASES:
        _CASES.append(name)
    return fn


def _profiled(suffix: str, fn, rank: int, *args):
    """``fn(rank, *args)``; on rank 0 under cProfile when ``PROF_CASES`` is set, written to
    ``PROF_CASES + suffix``."""
    prefix = os.environ.get("PROF_CASES")
    if not prefix or rank != 0:
        return fn(rank, *args)
    import cProfile

    prof = cProfile.Profile()
    try:
        return prof.runcall(fn, rank, *args)
    finally:
        prof.dump_stats(prefix + suffix)


def run_cases(rank: int, world: int, tmp: str, names: tuple[str, ...]) -> dict:
    return _profiled(".2", _run_cases, rank, world, tmp, names)


def _run_cases(rank: int, world: int, tmp: str, names: tuple[str, ...]) -> dict:
    out: dict = {"case_s": {}}  # seconds per case, for ``pytest --durations``-like reading (conftest prints them)
    for name in names:
        module, fn = name.split(":")
        t0 = time.perf_counter()
        getattr(importlib.import_module(module), fn)(rank, world, tmp, out)
        out["case_s"][name] = round(time.perf_counter() - t0, 2)
    return out


def spawn_cases(tmp: str) -> list[dict]:
    """Every registered case, in one spawn of 2 gloo ranks: the ``out`` dict of each rank."""
    return spawn(run_cases, world_size=2, args=(tmp, tuple(_CASES)), timeout_s=600)


_FOUR: list[str] = []  # the same for the shared spawn of 4 ranks


def four_rank_case(fn):
    """Register ``fn(rank, world, out)`` (module level) to run in the shared spawn of 4 gloo
    ranks; ``out`` is its module's own dict (``four_rank_cases[rank][module]``)."""
    name = f"{fn.__module__}:{fn.__qualname__}"
    if name not in _FOUR:
        _FOUR.append(name)
    return fn


def run_four(rank: int, world: int, names: tuple[str, ...]) -> dict:
    return _profiled(".4", _run_four, rank, world, names)


def _run_four(rank: int, world: int, names: tuple[str, ...]) -> dict:
    torch.set_num_threads(1)  # 4 ranks on a machine of a few cores
    res: dict = {"case_s": {}}
    for name in names:
        module, fn = name.split(":")
        t0 = time.perf_counter()
        getattr(importlib.import_module(module), fn)(rank, world, res.setdefault(module, {}))
        res["case_s"][name] = round(time.perf_counter() - t0, 2)
    return res


def spawn_four() -> list[dict]:
    """Every ``four_rank_case``, in one spawn of 4 gloo ranks: each rank's results by module."""
    return spawn(run_four, world_size=4, args=(tuple(_FOUR),), timeout_s=600)


# --- helpers for the cases (module level: spawn pickles them by name) ----------------------------------


@functools.lru_cache(maxsize=None)
def zoo_graph(name: str):
    """The zoo model's trace, once per process (a ``ModelGraph`` is frozen; torch.export takes
    about a second on a tiny model, and the shared spawns' cases read a few models many times)."""
    e = zoo.get_entry(name)
    return trace_model(e.build("meta"), e.inputs(), loss_fn=e.loss)


def plan_specs(graph, mesh: MeshSpec) -> dict[str, PlanSpec]:
    b = baselines(graph, mesh)
    blocks = graph.blocks
    root = UnitSpec((ROOT,), False)
    return {
        "per-block": b["per-block"],
        "groups-of-2": PlanSpec(tuple(UnitSpec(blocks[i:i + 2]) for i in range(0, len(blocks), 2)) + (root,), mesh,
                                label="g2"),
        "keep+ckpt": PlanSpec(tuple(UnitSpec((blk,), False, True) for blk in blocks) + (root,), mesh, label="kc"),
    }


def tp_plan_specs(graph, mesh: MeshSpec = MESH_2X2) -> dict[str, PlanSpec]:
    """2-D plans (the builtin tensor-parallel plan under FSDP): blocks in pairs, and one unit
    per block with checkpointing and resharding on every other block."""
    tp = builtin_tp_plan(graph)
    blocks = graph.blocks
    root = UnitSpec((ROOT,), False)
    return {
        "groups-of-2": PlanSpec(tuple(UnitSpec(blocks[i:i + 2]) for i in range(0, len(blocks), 2)) + (root,), mesh,
                                label="tp-g2", tp=tp),
        "some-ckpt": PlanSpec(tuple(UnitSpec((b,), i % 2 == 0, i % 2 == 0)
                                    for i, b in enumerate(blocks)) + (root,), mesh,
                              label="tp-ckpt", tp=tp),
    }


def tiny_hf_llama(seed: int = 0) -> nn.Module:
    """benchmarks/bf16_check.py's tiny Hugging Face Llama (hidden 64, 2 layers, 4 heads, 2 key-value
    heads, vocabulary 1000), built on CPU from ``seed``; its forward takes ``input_ids`` and ``labels``."""
    import transformers

    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=1000, max_position_embeddings=256)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg)


def init_weights(module: nn.Module) -> None:
    """One module's own parameters, as the examples initialise them."""
    if hasattr(module, "reset_parameters"):
        module.reset_parameters()
    elif isinstance(module, zoo.RMSNorm):
        nn.init.ones_(module.weight)


def _retie(model: nn.Module) -> None:
    # to_empty() on a plain meta model gives each use of a tied parameter its own tensor;
    # re-tie as the model's constructor does (sharded models keep their ties, see the test).
    if isinstance(model, zoo.GPT):
        model.lm_head.weight = model.wte.weight


def reference(name: str, seed: int = 0) -> nn.Module:
    """Built on meta, materialised, initialised module by module in named_modules() order."""
    model = zoo.get_entry(name).build("meta")
    model.to_empty(device="cpu")
    _retie(model)
    torch.manual_seed(seed)
    with torch.no_grad():
        for _, m in model.named_modules():
            init_weights(m)
    return model


def batches(name: str, world: int, rank: int):
    e = zoo.get_entry(name)
    full = [tuple(t.roll(s, dims=0) for t in e.inputs(batch=2 * world)) for s in range(STEPS)]
    mine = [tuple(t.chunk(world)[rank] for t in x) for x in full]
    return full, mine


def train(model, batches, loss_fn, *, sgd: bool = False, loss_context=contextlib.nullcontext) -> list[float]:
    """``STEPS`` steps of AdamW (lr 1e-2), or of plain SGD (lr 0.1): SGD's update is the gradient
    itself, so its final parameters compare gradients, where AdamW's normalisation turns
    rounding-level differences of gradients near zero into steps of size lr. The loss and its
    backward run under ``loss_context()`` (``WrapPlan.loss_context``: loss parallel's context).
    A batch that is a dict is passed by keyword (a Hugging Face model's ``input_ids``, ``labels``)."""
    from torch.distributed.tensor import DTensor

    opt = torch.optim.SGD(model.parameters(), lr=0.1) if sgd else torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for x in batches:
        with loss_context():
            loss = loss_fn(model(**x) if isinstance(x, dict) else model(*x), x)
            loss.backward()
        if isinstance(loss, DTensor):  # loss parallel: a replicated DTensor
            loss = loss.full_tensor()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


def mean_over_ranks(losses, world) -> list[float]:
    t = torch.stack(losses)
    dist.all_reduce(t)
    return [float(v) for v in t / world]


def catch(fn, *exc):
    try:
        fn()
    except exc as e:  # noqa: PERF203
        return f"{type(e).__name__}: {e}"
    return None
