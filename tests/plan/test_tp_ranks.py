"""2-D plans on 4 gloo ranks, (shard 2) x (tp 2), in the shared spawn of 4 ranks (See
tests/ranks.py): training parity with the unsharded model (with sequence and loss parallel too),
the tensor-parallel collectives of one block (with and without sequence parallel), meta-device
initialisation of 2-D parameters, real steps through ``measure_plans``, and a bad plan failing
on every rank before any collective.

[Note: what the TP parity compares] The data-parallel world is 2 (ranks 0, 1 and 2, 3
are the two tensor-parallel groups): each group trains on its data-parallel rank's half
of the global batch, the reference on the whole batch (mean loss). With fp32 and AdamW the
losses match within 1e-5. The final parameters (gathered with ``full_tensor``) are compared
after SGD, within 1e-5: after AdamW they differ by up to ~4e-4, and so does plain 1-D FSDP
(no tensor parallelism) on 4 ranks, ~2e-4: a gradient that is zero in exact arithmetic
(a key projection's bias: softmax ignores a shift shared by all keys) is rounding noise
that depends on the order of the sums, and AdamW divides it by its own size, a step of lr.
AdamW runs on the "groups-of-2" plan alone; the other plans ("some-ckpt", and "sp-lp" with sequence and
loss parallel) run the SGD steps alone (their losses against the reference's SGD losses), to keep
the shared spawn short; so does the Hugging Face Llama's ("hf"),
with sequence and loss parallel, its own loss (labels), per-block units.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import time
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from tests.ranks import (HF_LLAMA_TP, MESH_2X2, TOL, batches, catch, four_rank_case, init_weights, reference,
                         tiny_hf_llama, tp_plan_specs, train, zoo_graph)
from wrapopt.errors import ModelError, PlanError
from wrapopt.fingerprint import model_fingerprint
from wrapopt.launch import dp_rank_size
from wrapopt.models import zoo
from wrapopt.plan.file import WrapPlan
from wrapopt.spec import ROOT, PlanSpec, UnitSpec
from wrapopt.tp import TPSpec

pytestmark = pytest.mark.multiprocess

MODELS = ("llama-tiny", "gpt-tiny")
# The cost model's expectation per block at tp=2 (See [Note: tensor parallel] in wrapopt/tp.py):
# forward one all-reduce after attention and one after the MLP; backward one per colwise projection.
EXPECTED = {"llama-tiny": (2, 5), "gpt-tiny": (2, 4)}
LABELS = ("groups-of-2", "some-ckpt", "sp-lp")  # sp-lp: some-ckpt with sequence and loss parallel
# [Note: the 2-D step's collectives] The whole 2-D model's collectives in one forward and backward are
# counted on the first SGD step of these plans' parity runs (a fresh model, as a separate counted step
# would be): FSDP's collectives are all-gathers and reduce-scatters on the shard axis, so every
# all-reduce is tensor parallelism's.
COUNTED = ("groups-of-2", "some-ckpt")
# Steps of each parity run: the second step's loss is of parameters the first step updated, and its
# gradient of them, so two steps check the update as three did (tests.ranks.STEPS) at two thirds the time.
STEPS_2D = 2


@functools.cache
def _tp_specs(name: str) -> dict:
    """tests.ranks' 2-D plans of ``name``, traced once, on rank 0 (the trace, torch.export, takes a second or
    two, and six cases of this spawn read the same plans), and broadcast to the other ranks."""
    got = [tp_plan_specs(zoo_graph(name)) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(got, src=0)
    return got[0]


def _specs(name: str) -> dict:
    specs = _tp_specs(name)
    ckpt = specs["some-ckpt"]
    return {**specs, "sp-lp": replace(ckpt, tp=replace(ckpt.tp, sequence_parallel=True, loss_parallel=True))}


def _sized_comm_mode():
    from torch.distributed.tensor.debug import CommDebugMode

    class SizedCommDebugMode(CommDebugMode):
        """CommDebugMode that also records each collective's op and bytes."""

        def __init__(self) -> None:
            super().__init__()
            self.sizes: list[tuple[str, int]] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            before = self.get_total_counts()
            out = super().__torch_dispatch__(func, types, args, kwargs)
            if self.get_total_counts() > before:
                t = args[0][0] if isinstance(args[0], (list, tuple)) else args[0]
                self.sizes.append((func._overloadpacket.__name__, t.numel() * t.element_size()))
            return out

    return SizedCommDebugMode()


def _counts(mode) -> dict[str, int]:
    return {str(k).rsplit(".", 1)[-1]: v for k, v in mode.get_comm_counts().items() if v}


def _first_step_in(loss_context, mode):
    """``loss_context`` for ``train``, with ``mode`` (None: nothing) entered around the first step's
    forward, loss and backward alone."""
    steps = []

    @contextlib.contextmanager
    def first_step():
        with contextlib.ExitStack() as stack:
            stack.enter_context(loss_context())
            if mode is not None and not steps:
                stack.enter_context(mode)
            steps.append(True)
            yield

    return first_step


def _parity(rank: int, world: int, out: dict) -> None:
    from wrapopt.debug import full_tensor

    dp_rank, dp_size = dp_rank_size(MESH_2X2)
    for name in MODELS:
        e = zoo.get_entry(name)
        specs = _specs(name)
        ref = reference(name)
        full, mine = (b[:STEPS_2D] for b in batches(name, dp_size, dp_rank))
        trained, by_sgd = copy.deepcopy(ref), copy.deepcopy(ref)
        ref_losses = [float(v) for v in train(trained, full, e.loss)]
        sgd_losses = [float(v) for v in train(by_sgd, full, e.loss, sgd=True)]
        for label, spec in specs.items():
            t0 = time.perf_counter()
            plan = WrapPlan(spec=spec, model=model_fingerprint(ref))
            with_sgd = plan.apply(copy.deepcopy(ref))
            step = _sized_comm_mode() if label in COUNTED else None  # See [Note: the 2-D step's collectives]
            losses = [float(v) for v in train(with_sgd, mine, e.loss, sgd=True,
                                              loss_context=_first_step_in(plan.loss_context, step))]
            if step is not None:
                out[f"comm/{name}/{label}"] = {"counts": _counts(step), "blocks": len(with_sgd.layers),
                                               "ckpt": sum(u.checkpoint for u in spec.units)}
            # AdamW on the first plan alone: the optimizer's path under tensor parallelism does not depend on the
            # cut or the checkpointing (the others run SGD, exact), which keeps the shared spawn short.
            adamw = label == "groups-of-2"
            if adamw:
                model = plan.apply(copy.deepcopy(ref))
                losses = [float(v) for v in train(model, mine, e.loss, loss_context=plan.loss_context)]
            else:
                model = with_sgd
            every = [None] * world
            dist.all_gather_object(every, losses)
            dp_mean = [(a + b) / 2 for a, b in zip(every[0], every[2])]  # one rank of each tensor-parallel group

            def diff(got, want):
                return max(float((full_tensor(got, n) - p.detach()).abs().max()) for n, p in want.named_parameters())

            q = model.layers[0]
            q = q.self_attn.q_proj.weight if name == "llama-tiny" else q.attn.q_proj.weight
            want = ref_losses if adamw else sgd_losses
            out[f"parity/{name}/{label}"] = {
                "losses": every, "dp_mean": dp_mean, "ref": want, "seconds": time.perf_counter() - t0,
                "param_diff_sgd": diff(with_sgd, by_sgd), "param_diff_adamw": diff(model, trained) if adamw else None,
                "loss_diff": max(abs(a - b) for a, b in zip(dp_mean, want)),
                "q_placements": str(q.placements), "q_local": list(q.to_local().shape),
                "tied": name != "gpt-tiny" or model.lm_head.weight is model.wte.weight,
            }


def _hf_parity(rank: int, world: int, out: dict) -> None:
    """The tiny Hugging Face Llama with sequence and loss parallel: its LlamaModel reads the embedding's
    output whole, so the cut is on the first block's input (See [Note: applying sequence parallel])."""
    from wrapopt.debug import full_tensor

    try:
        ref = tiny_hf_llama()
    except ImportError as e:
        out["hf"] = f"transformers is not installed ({e})"
        return
    dp_rank, dp_size = dp_rank_size(MESH_2X2)
    g = torch.Generator().manual_seed(1)
    full = [torch.randint(0, 1000, (2 * dp_size, 16), generator=g) for _ in range(STEPS_2D)]
    by_sgd = copy.deepcopy(ref)
    want = [float(v) for v in train(by_sgd, [{"input_ids": x, "labels": x} for x in full], _hf_loss, sgd=True)]
    tp = TPSpec(layers=(("LlamaDecoderLayer", HF_LLAMA_TP),), source="builtin", sequence_parallel=True,
                loss_parallel=True)
    units = tuple(UnitSpec((f"model.layers.{i}",)) for i in range(2)) + (UnitSpec((ROOT,), False),)
    plan = WrapPlan(spec=PlanSpec(units, MESH_2X2, tp=tp), model=model_fingerprint(ref))
    model = plan.apply(copy.deepcopy(ref))
    seen: dict = {}  # what the embedding puts out, what the second block is fed (local tensors)
    model.model.embed_tokens.register_forward_hook(lambda _m, _a, y: seen.setdefault("embed", list(y.shape)) and None)
    model.model.layers[1].register_forward_pre_hook(lambda _m, a: seen.setdefault("block", list(a[0].shape)) and None)
    mine = [{"input_ids": x.chunk(dp_size)[dp_rank], "labels": x.chunk(dp_size)[dp_rank]} for x in full]
    losses = [float(v) for v in train(model, mine, _hf_loss, sgd=True, loss_context=plan.loss_context)]
    every = [None] * world
    dist.all_gather_object(every, losses)
    out["hf"] = {"losses": every, "dp_mean": [(a + b) / 2 for a, b in zip(every[0], every[2])], "ref": want,
                 "param_diff_sgd": max(float((full_tensor(model, n) - p.detach()).abs().max())
                                       for n, p in by_sgd.named_parameters()), **seen}


def _hf_loss(out, _x):
    return out.loss


def _comm_counts(rank: int, world: int, out: dict) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from wrapopt.plan.sp import SPLayout, block_layout, parallelize_sp
    from wrapopt.plan.tp import parallelize_blocks

    mesh = init_device_mesh("cpu", MESH_2X2.shape, mesh_dim_names=MESH_2X2.axis_names)
    for name in MODELS:
        tp = _tp_specs(name)["groups-of-2"].tp
        for key, seq in (("block", 64), ("sp-block", 32)):  # sequence parallel: the block's input is 1/2 of it
            holder = nn.ModuleList([copy.deepcopy(reference(name).layers[0])])  # one block, tensor parallel only
            if key == "block":
                parallelize_blocks(holder, tp, mesh["tp"])
            else:
                sp = replace(tp, sequence_parallel=True)
                norms, gathers = block_layout("0", holder[0], sp)
                parallelize_sp(holder, sp, SPLayout(None, None, (), None, tuple(f"0.{n}" for n in norms),
                                                    tuple(f"0.{g}" for g in gathers)), mesh["tp"])
            x = torch.randn(2, seq, 64, requires_grad=True)
            fwd = _sized_comm_mode()
            with fwd:
                y = holder[0](x)
            bwd = _sized_comm_mode()
            with bwd:
                y.sum().backward()
            out[f"comm/{name}/{key}"] = {"fwd": _counts(fwd), "bwd": _counts(bwd), "fwd_sizes": fwd.sizes,
                                         "bwd_sizes": bwd.sizes, "activation_bytes": x.numel() * x.element_size(),
                                         "out_shape": list(y.shape)}


def _meta_init(rank: int, world: int, out: dict) -> None:
    from wrapopt.debug import full_tensor
    from wrapopt.plan.apply import materialize_sharded

    for name, label in (("llama-tiny", "groups-of-2"), ("gpt-tiny", "some-ckpt")):
        ref = reference(name)
        model = zoo.get_entry(name).build("meta")
        WrapPlan(spec=_tp_specs(name)[label], model=model_fingerprint(model)).apply(model)
        torch.manual_seed(0)
        materialize_sharded(model, device="cpu", init_fn=init_weights)
        out[f"meta/{name}"] = {
            "differ": [n for n, p in ref.named_parameters() if not torch.equal(full_tensor(model, n), p)],
            "tied": name != "gpt-tiny" or model.lm_head.weight is model.wte.weight,
        }


def _bench(rank: int, world: int, out: dict) -> None:
    from wrapopt.evaluation.bench import measure_plans

    e = zoo.get_entry("gpt-tiny")
    tp_plan = _tp_specs("gpt-tiny")["groups-of-2"]
    # Inputs that differ on every rank: a tensor-parallel group steps on its first rank's.
    mine = tuple(t.roll(rank, dims=0) for t in e.inputs(batch=4))
    got = measure_plans(lambda: e.build("cpu", seed=0), [tp_plan], mine, e.loss, repeats=2, warmup=1)
    out["bench/tuple"] = [m.to_json() for m in got]
    # sequence and loss parallel: the bench steps under loss_parallel()
    sp_plan = replace(tp_plan, tp=replace(tp_plan.tp, sequence_parallel=True, loss_parallel=True))
    by_dp = measure_plans(lambda: e.build("cpu", seed=0), [sp_plan],
                          lambda dp, n: tuple(t.chunk(n)[dp] for t in e.inputs(batch=4)), e.loss,
                          repeats=1, warmup=0, measure_memory=False)
    out["bench/by-dp"] = [m.to_json() for m in by_dp]


def _errors(rank: int, world: int, out: dict) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from wrapopt.plan.tp import parallelize_blocks

    llama = _tp_specs("llama-tiny")["groups-of-2"]
    gpt_plan = _tp_specs("gpt-tiny")["groups-of-2"]
    gpt_units = replace(gpt_plan, tp=llama.tp)  # GPT's units, Llama's TP
    gpt = zoo.get_entry("gpt-tiny").build("cpu")
    out["err/class"] = catch(lambda: WrapPlan(spec=gpt_units, model={}).apply(gpt, strict=False), PlanError)
    model = zoo.get_entry("llama-tiny").build("cpu")
    mesh = init_device_mesh("cpu", MESH_2X2.shape, mesh_dim_names=MESH_2X2.axis_names)
    out["err/flat-mesh"] = catch(lambda: WrapPlan(spec=llama, model={}).apply(
        model, init_device_mesh("cpu", (2, 2), mesh_dim_names=("shard", "other")), strict=False), PlanError)
    parallelize_blocks(model, llama.tp, mesh["tp"])
    out["err/twice"] = catch(lambda: WrapPlan(spec=llama, model={}).apply(model, strict=False), PlanError)
    async_tp = replace(llama, tp=replace(llama.tp, async_tp=True))
    out["err/async"] = catch(lambda: WrapPlan(spec=async_tp, model={}).apply(
        zoo.get_entry("llama-tiny").build("cpu"), strict=False), PlanError)
    sp = replace(gpt_plan, tp=replace(gpt_plan.tp, sequence_parallel=True))
    gpt = WrapPlan(spec=sp, model={}).apply(zoo.get_entry("gpt-tiny").build("cpu"), strict=False)
    out["err/odd-sequence"] = catch(lambda: gpt(torch.zeros(2, 63, dtype=torch.long)), ModelError)
    out["async"] = _async_switches(mesh, llama.tp)
    dist.barrier()  # every rank got here: no bad input left a rank waiting in a collective
    out["err/barrier"] = True


def _async_switches(mesh, tp) -> tuple[bool, bool]:
    """What async TP sets (on gloo too: the device check is apply's): Inductor's micro-pipelining
    and symmetric memory for the tp group; the Inductor switch is put back for the cases after."""
    import torch._inductor.config as inductor_config
    from torch.distributed._symmetric_memory import is_symm_mem_enabled_for_group

    from wrapopt.plan.sp import SPLayout, parallelize_sp

    before = inductor_config._micro_pipeline_tp
    try:
        parallelize_sp(zoo.get_entry("llama-tiny").build("cpu"), replace(tp, async_tp=True),
                       SPLayout(None, None, (), None, (), ()), mesh["tp"])
        return inductor_config._micro_pipeline_tp, is_symm_mem_enabled_for_group(mesh["tp"].get_group().group_name)
    finally:
        inductor_config._micro_pipeline_tp = before


@four_rank_case
def tp_cases(rank: int, world: int, out: dict) -> None:
    for case in (_parity, _hf_parity, _comm_counts, _meta_init, _bench, _errors):
        t0 = time.perf_counter()
        case(rank, world, out)
        out.setdefault("case_s", {})[case.__name__] = round(time.perf_counter() - t0, 2)  # where the spawn's time goes


@pytest.fixture(scope="module")
def four_ranks(four_rank_cases) -> list[dict]:
    return [r[__name__] for r in four_rank_cases]


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("label", LABELS)
def test_2d_training_matches_the_unsharded_model(four_ranks, name, label):
    r = four_ranks[0][f"parity/{name}/{label}"]
    every = r["losses"]
    assert every[0] == every[1] and every[2] == every[3]  # tensor-parallel peers compute one replica's step
    assert every[0] != every[2]  # the two data-parallel ranks see different halves of the batch
    assert r["dp_mean"] == pytest.approx(r["ref"], abs=TOL)
    assert r["loss_diff"] < TOL and r["param_diff_sgd"] < TOL, (r["loss_diff"], r["param_diff_sgd"])
    if label == "groups-of-2":  # the others run SGD alone: their losses are SGD's, against the reference's SGD run
        assert r["param_diff_adamw"] < 1e-2 * 0.1  # See [Note: what the TP parity compares]: a tenth of AdamW's lr
    assert r["ref"][0] != r["ref"][-1]  # it trained
    assert r["tied"]
    # q_proj is 2-D: split by tensor parallelism (colwise, dim 0) and again by FSDP on the shard axis.
    assert "Shard(dim=0)" in r["q_placements"] and r["q_local"] == [16, 64], r["q_placements"]


def test_a_hugging_face_llama_with_sequence_and_loss_parallel_matches_the_unsharded_model(four_ranks):
    r = four_ranks[0]["hf"]
    if isinstance(r, str):
        pytest.skip(r)
    every = r["losses"]
    assert every[0] == every[1] and every[2] == every[3] and every[0] != every[2]
    assert r["dp_mean"] == pytest.approx(r["ref"], abs=TOL) and r["param_diff_sgd"] < TOL, r
    assert r["ref"][0] != r["ref"][-1]  # it trained
    # the embedding's output is whole (batch 2, 16 positions); the blocks run on this rank's 8 of them
    assert r["embed"] == [2, 16, 64] and r["block"] == [2, 8, 64], r


@pytest.mark.parametrize("name", MODELS)
def test_one_blocks_tensor_parallel_collectives_are_as_the_cost_model_expects(four_ranks, name):
    r = four_ranks[0][f"comm/{name}/block"]
    fwd, bwd = EXPECTED[name]
    assert r["fwd"] == {"all_reduce": fwd} and r["bwd"] == {"all_reduce": bwd}, (r["fwd"], r["bwd"])
    # Every one carries the block's full activation (no sequence parallelism).
    assert {b for _, b in r["fwd_sizes"] + r["bwd_sizes"]} == {r["activation_bytes"]}


@pytest.mark.parametrize("name", MODELS)
def test_one_blocks_sequence_parallel_collectives_are_two_all_gathers_and_two_reduce_scatters(four_ranks, name):
    # See [Note: applying sequence parallel] in plan/tp.py: an all-gather into the attention and the
    # MLP, a reduce-scatter out of each; backward the mirror (q, k and v's input gradients summed as
    # Partial: one reduce-scatter). The norms' weight gradients are partial sums left to the optimizer
    # or FSDP's reduction (an all-reduce each there), not run inside the block's backward.
    r = four_ranks[0][f"comm/{name}/sp-block"]
    want = {"all_gather_into_tensor": 2, "reduce_scatter_tensor": 2}
    assert r["fwd"] == want and r["bwd"] == want, (r["fwd"], r["bwd"])
    shard = r["activation_bytes"]  # the block's input: this rank's half of the sequence
    for sizes in (r["fwd_sizes"], r["bwd_sizes"]):
        assert sizes == [("all_gather_into_tensor", shard), ("reduce_scatter_tensor", 2 * shard)] * 2, sizes
    assert r["out_shape"] == [2, 32, 64]  # the output stays on this rank's half of the sequence


@pytest.mark.parametrize("name", MODELS)
def test_a_2d_step_all_reduces_per_block_and_once_more_per_recomputed_block(four_ranks, name):
    # A checkpointed block's recomputation stops early (torch's non-reentrant checkpoint stops once
    # every tensor backward needs is recomputed): the MLP's output is saved by nothing, so its
    # all-reduce is not run again; the attention's is (its output feeds the saved residual sum).
    fwd, bwd = EXPECTED[name]
    for label in ("groups-of-2", "some-ckpt"):
        r = four_ranks[0][f"comm/{name}/{label}"]
        assert r["counts"]["all_reduce"] == r["blocks"] * (fwd + bwd) + r["ckpt"] * (fwd - 1), (label, r)


@pytest.mark.parametrize("name", MODELS)
def test_meta_init_of_2d_parameters_equals_the_unsharded_init(four_ranks, name):
    for r in four_ranks:
        assert r[f"meta/{name}"]["differ"] == [] and r[f"meta/{name}"]["tied"]


def test_measure_plans_runs_a_2d_plan_with_one_batch_per_tensor_parallel_group(four_ranks):
    for key, repeats in (("bench/tuple", 2), ("bench/by-dp", 1)):  # by-dp: with sequence and loss parallel
        got = [r[key][0] for r in four_ranks]
        assert [len(m["times_s"]) for m in got] == [repeats] * 4
        assert got[0]["losses"] == got[1]["losses"] and got[2]["losses"] == got[3]["losses"], key
        assert got[0]["losses"] != got[2]["losses"], key
        assert all(v > 0 for v in got[0]["phase_s"].values())
    assert four_ranks[0]["bench/tuple"][0]["peak_bytes"] > 0


def test_bad_2d_input_fails_on_every_rank_before_any_collective(four_ranks):
    for r in four_ranks:
        assert r["err/barrier"]
        assert "block class LlamaBlock, which this GPT does not have" in r["err/class"]
        assert "axes ('shard', 'other')" in r["err/flat-mesh"] and "('shard', 'tp')" in r["err/flat-mesh"]
        assert "already distributed" in r["err/twice"]
        assert "async tensor parallelism (tp.async_tp), which is GPU-only" in r["err/async"]
        assert "over 2 tensor-parallel ranks, but wte's input has 63 positions" in r["err/odd-sequence"]
        assert r["async"] == (True, True)  # where apply lets it run (CUDA), async TP's two switches are on

