"""The training step: TrainConfig, its simulator options, the sync modes, the plan file's
``train``, the default budget, stated fabrics, ``wrapopt estimate`` and bad input."""

from __future__ import annotations

import json

import pytest
import torch

from wrapopt.api import MEMORY_HEADROOM, resolve_budget
from wrapopt.cli.main import main
from wrapopt.cost import Simulator
from wrapopt.cost.dtypes import in_compute_dtype
from wrapopt.errors import InfeasibleError, PlanError, ProfileError
from wrapopt.fingerprint import model_fingerprint
from wrapopt.hardware.presets import TEMPLATE, analytical_compute, analytical_fabric, load_analytical
from wrapopt.plan.file import WrapPlan
from wrapopt.plan.step import train_step
from wrapopt.search.baselines import baselines
from wrapopt.spec import MeshSpec, OptimizerKind, SimOptions, factored_state_numel
from wrapopt.train import OPTIMIZERS, PRECISIONS, TrainConfig

MESH8 = MeshSpec(world_size=8, ranks_per_node=8, shard_size=8)


# -- the optimizer table against the real torch optimizers ------------------------------------


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_optimizer_state_matches_torch(name):
    """Step each torch optimizer once on a matrix and a vector; the state it keeps (the scalar
    ``step`` aside) is what the simulator counts per element."""
    kind = OPTIMIZERS[name][0]
    mat = torch.nn.Parameter(torch.randn(64, 32))
    vec = torch.nn.Parameter(torch.randn(32))
    opt = TrainConfig(optimizer=name).make_optimizer([mat, vec], lr=1e-3)
    (mat.sum() + vec.square().sum()).backward()
    opt.step()
    for p in (mat, vec):
        state = [t for k, t in opt.state[p].items() if isinstance(t, torch.Tensor) and k != "step"]
        nbytes = sum(t.numel() * t.element_size() for t in state)
        if kind is OptimizerKind.ADAFACTOR:
            assert nbytes == factored_state_numel(tuple(p.shape)) * 4
        else:
            assert nbytes == kind.states_per_param * p.numel() * 4, (name, nbytes)


# -- TrainConfig --------------------------------------------------------------------------------


def test_presets_and_policy():
    from torch.distributed.fsdp import MixedPrecisionPolicy

    assert TrainConfig.preset("bf16").mixed_precision() == {"param_dtype": "bfloat16", "reduce_dtype": "float32",
                                                            "output_dtype": None}
    pol = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    assert TrainConfig.from_policy(pol) == TrainConfig.preset("bf16")
    assert TrainConfig.from_policy(pol).precision == "bf16"
    assert TrainConfig(param_dtype="fp16", reduce_dtype="bf16").precision == "custom"
    assert {TrainConfig.preset(p).precision for p in PRECISIONS} == set(PRECISIONS)
    assert TrainConfig.preset("none") == TrainConfig() and TrainConfig().precision == "none"
    back = TrainConfig.preset("bf16").mp_policy()
    assert back.param_dtype == torch.bfloat16 and back.reduce_dtype == torch.float32


@pytest.mark.parametrize("kw, words", [
    (dict(param_dtype="bf8"), ["bf8", "bfloat16", "float32"]),
    (dict(optimizer="lion"), ["lion", "adamw", "adafactor", "sgd-momentum"]),
    (dict(grad_accumulation=0), ["accumulation", "positive integer"]),
    (dict(accumulation_sync="sometimes"), ["sometimes", "every", "last"]),
])
def test_bad_config_one_line(kw, words):
    with pytest.raises(ValueError) as e:
        TrainConfig(**kw)
    assert "\n" not in str(e.value)
    for w in words:
        assert w in str(e.value)
    with pytest.raises(ValueError, match="bf16-pure"):
        TrainConfig.preset("bf17")


def test_sim_options_of_bf16():
    o = TrainConfig.preset("bf16", grad_accumulation=4, optimizer="sgd-momentum").sim_options(memory_budget=1e9)
    assert (o.param_dtype_bytes, o.reduce_dtype_bytes, o.activation_dtype_bytes) == (2, 4, 2)
    assert o.optimizer is OptimizerKind.SGD_MOMENTUM and o.grad_accumulation == 4
    assert o.accumulation_sync is None and o.memory_budget_bytes == 1e9
    assert TrainConfig().sim_options() == SimOptions(memory_budget_bytes=None)


# -- the simulator: sync modes, dtypes, optimizers -----------------------------------------------


def _est(graph, plan, **kw):
    fab = analytical_fabric(world_size=8)
    return Simulator(graph, fab, analytical_compute(), SimOptions(**kw)).simulate(plan)


def test_sync_modes(llama_tiny):
    _m, _x, g = llama_tiny
    plan = baselines(g, MESH8)["per-block"]
    one = _est(g, plan)
    last = _est(g, plan, grad_accumulation=4, accumulation_sync="last")
    every = _est(g, plan, grad_accumulation=4, accumulation_sync="every")
    assert one.accumulation_sync is None and (last.accumulation_sync, every.accumulation_sync) == ("last", "every")
    bl, be = dict(last.peak_breakdown), dict(every.peak_breakdown)
    grads = sum(u.param_bytes for u in last.units)  # unsharded gradients, fp32 like the parameters
    assert bl["accumulated_grads"] == grads > 0  # no-sync holds every unit's unsharded gradients
    assert be["accumulated_grads"] == 0 and be["sharded_grads"] >= g.trainable_bytes // 8
    assert every.comm_s == pytest.approx(4 * one.comm_s)  # a reduce-scatter round per micro-batch
    assert every.step_s == pytest.approx(4 * (one.step_s - one.optim_s) + one.optim_s)
    assert last.peak_bytes > every.peak_bytes
    # Unset: the faster that fits; a budget between the two peaks leaves only "every".
    auto = _est(g, plan, grad_accumulation=4, accumulation_sync=None)
    assert auto.step_s == min(last.step_s, every.step_s)
    mid = (last.peak_bytes + every.peak_bytes) / 2
    tight = _est(g, plan, grad_accumulation=4, accumulation_sync=None, memory_budget_bytes=mid)
    assert tight.accumulation_sync == "every" and tight.peak_bytes == every.peak_bytes


def test_bf16_halves_gathers_and_activations(llama_tiny):
    _m, _x, g = llama_tiny
    plan = baselines(g, MESH8)["per-block"]
    fp32 = dict(_est(g, plan).peak_breakdown)
    bf16 = dict(_est(g, plan, **TrainConfig.preset("bf16").sim_options().__dict__).peak_breakdown)
    assert bf16["sharded_params"] == fp32["sharded_params"]  # fp32 master weights stay
    assert bf16["unsharded_params"] == pytest.approx(fp32["unsharded_params"] / 2, rel=0.01)
    assert bf16["activations"] < fp32["activations"]
    # A float32 trace scored in bf16: the model's activations halve; the loss computes in fp32 as traced
    # (See [Note: compute dtype] in wrapopt/cost/dtypes.py).
    half = in_compute_dtype(g, 2, None)
    assert sum(m.saved_bytes for m in half.modules) == pytest.approx(sum(m.saved_bytes for m in g.modules) / 2,
                                                                     rel=1e-3)
    assert (half.loss_saved_bytes, half.loss_peak_bytes, half.loss_grad_bytes) == (
        g.loss_saved_bytes, g.loss_peak_bytes, g.loss_grad_bytes)
    assert in_compute_dtype(g, None, None) is g


def test_optimizer_state_by_kind(llama_tiny):
    _m, _x, g = llama_tiny
    plan = baselines(g, MESH8)["per-block"]
    state = {k: dict(_est(g, plan, optimizer=k).peak_breakdown)["optimizer_state"] for k in OptimizerKind}
    assert state[OptimizerKind.ADAM] == state[OptimizerKind.ADAMW] == 2 * state[OptimizerKind.SGD_MOMENTUM]
    assert state[OptimizerKind.SGD] == state[OptimizerKind.NONE] == 0
    assert 0 < state[OptimizerKind.ADAFACTOR] < state[OptimizerKind.SGD_MOMENTUM] / 4


# -- the plan file ------------------------------------------------------------------------------------


def test_plan_file_records_train(gpt_tiny, tmp_path):
    model, _x, g = gpt_tiny
    train = TrainConfig.preset("bf16", grad_accumulation=4, accumulation_sync="last", optimizer="adafactor")
    plan = WrapPlan(spec=baselines(g, MESH8)["per-block"], model=model_fingerprint(model), train=train)
    path = tmp_path / "plan.json"
    plan.save(path)
    data = json.loads(path.read_text())
    assert data["train"]["precision"] == "bf16" and data["mixed_precision"]["param_dtype"] == "bfloat16"
    back = WrapPlan.load(path)
    assert back.train == train and back.train_config == train
    # An older file (no "train"): fp32, one micro-batch, AdamW.
    del data["train"]
    data["mixed_precision"] = {"param_dtype": None, "reduce_dtype": None}
    path.write_text(json.dumps(data))
    old = WrapPlan.load(path)
    assert old.train is None and old.train_config == TrainConfig()
    # A bad field names the file and the field.
    data["train"] = {"optimizer": "lion"}
    path.write_text(json.dumps(data))
    with pytest.raises(PlanError, match=r"plan.json: train.*lion.*adamw"):
        WrapPlan.load(path)


def test_apply_refuses_another_training_step(gpt_tiny):
    from wrapopt.models import zoo

    _m, _x, g = gpt_tiny
    model = zoo.get_entry("gpt-tiny").build("cpu")
    plan = WrapPlan(spec=baselines(g, MeshSpec(world_size=2, ranks_per_node=2, shard_size=2))["per-block"],
                    model=model_fingerprint(model), train=TrainConfig.preset("bf16", grad_accumulation=4))
    with pytest.raises(PlanError) as e:
        plan.apply(model, train=TrainConfig(grad_accumulation=2))
    msg = str(e.value)
    for word in ("param_dtype", "reduce_dtype", "grad_accumulation", "override_train=True"):
        assert word in msg


def test_train_step_accumulates_like_one_batch():
    torch.manual_seed(0)
    a = torch.nn.Linear(8, 3)
    b = torch.nn.Linear(8, 3)
    b.load_state_dict(a.state_dict())
    x = torch.randn(12, 8)

    def loss(out, inputs):
        return out.square().mean()

    oa, ob = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)
    la = train_step(a, oa, [(x,)], loss)
    lb = train_step(b, ob, [(c,) for c in x.chunk(4)], loss, train=TrainConfig(grad_accumulation=4))
    assert la == pytest.approx(lb, rel=1e-6)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.allclose(p, q, atol=1e-6)
    with pytest.raises(PlanError, match="4 micro-batches"):
        train_step(b, ob, [(x,)], loss, train=TrainConfig(grad_accumulation=4))


# -- budget, fabric files, knobs --------------------------------------------------------------------


def test_default_budget_is_the_device():
    comp = analytical_compute()
    assert resolve_budget(None, comp) == pytest.approx(MEMORY_HEADROOM * 80 * 2**30)
    assert resolve_budget("none", comp) is None
    assert resolve_budget("1GiB", comp) == 2**30
    from dataclasses import replace

    assert resolve_budget(None, replace(comp, memory_capacity_bytes=None)) is None


def test_stated_fabric_file(tmp_path, capsys):
    path = tmp_path / "my.json"
    path.write_text(json.dumps(TEMPLATE))
    f = load_analytical(str(path), world_size=16)
    assert f.kind == "analytical" and f.ranks_per_node == 8
    bad = dict(TEMPLATE)
    bad["inter_node"] = {"latency_s": 1e-5}
    path.write_text(json.dumps(bad))
    with pytest.raises(ProfileError, match=r"my.json: inter_node.*bandwidth_bytes_per_s"):
        load_analytical(str(path), world_size=16)
    assert main(["fabric", "--list"]) == 0
    out = capsys.readouterr().out
    for name in ("h100-nvlink-ib400", "a100-nvlink-ib200", "h100-nvlink-eth100", "bfloat16 989"):
        assert name in out


def test_search_on_stated_fabric_in_bf16(tmp_path, capsys):
    path = tmp_path / "my.json"
    spec = dict(TEMPLATE, memory_capacity_bytes=40 * 2**30)
    path.write_text(json.dumps(spec))
    rc = main(["search", "zoo:llama-tiny", "--world-size", "16", "--fabric", str(path), "--precision", "bf16",
               "--accumulation", "4", "--trials", "0", "--out", str(tmp_path / "plan.json")])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "36.00 GiB per rank = 90% of the device's 40.00 GiB" in out
    assert "my-cluster (analytical)" in out and "scored both ways" in out
    plan = WrapPlan.load(tmp_path / "plan.json")
    assert plan.train.param_dtype == "bfloat16" and plan.train.accumulation_sync in ("every", "last")


def test_the_model_is_traced_in_the_steps_compute_dtype(tmp_path, capsys, monkeypatch):
    """``wrapopt search``/``estimate`` and ``optimize_wrap`` (a plan file's step when none is given)
    trace in the step's ``param_dtype``: See [Note: tracing in the compute dtype] in wrapopt/trace/record.py."""
    import wrapopt.api
    import wrapopt.job
    from wrapopt import optimize_wrap, zoo

    seen = []

    def traced(real):
        def trace(*args, **kwargs):
            graph = real(*args, **kwargs)
            seen.append(graph.compute_dtype)
            return graph
        return trace

    for module in (wrapopt.api, wrapopt.job):  # optimize_wrap traces in api (before measuring), the rest in job
        monkeypatch.setattr(module, "trace_model", traced(module.trace_model))
    plan = str(tmp_path / "p.json")
    assert main(["search", "zoo:gpt-tiny", "--world-size", "2", "--precision", "bf16", "--trials", "0",
                 "--out", plan]) == 0
    assert main(["estimate", "zoo:gpt-tiny", "--world-size", "2", "--precision", "fp32"]) == 0
    assert main(["estimate", "zoo:gpt-tiny", "--plan", plan]) == 0  # the plan file's step: bf16
    model, x = zoo.build("gpt-tiny", "meta")
    optimize_wrap(model, x, plan=plan)
    capsys.readouterr()
    assert seen == ["bfloat16", "float32", "bfloat16", "bfloat16"]


def test_nothing_fits_names_the_knobs(llama_tiny):
    from wrapopt.api import ParallelRequest, plan_model, prepare

    model, _x, g = llama_tiny
    fab = analytical_fabric(world_size=8)
    comp = analytical_compute(dtype="float32")
    with pytest.raises(InfeasibleError) as e:
        request = ParallelRequest(mesh=MESH8, memory_budget=2**20,
                                  train=TrainConfig(grad_accumulation=2, accumulation_sync="last"))
        plan_model(prepare(request, model, graph=g, fabric=fab, compute=comp))
    msg = str(e.value)
    # the knobs are priced, and only those that fit (else the closest) are named: tests/reliability/test_r3_advice.py
    assert "smallest predicted peak" in msg and "Remedies, each alone on per-block,ckpt" in msg
    assert "none fits alone; the closest is" in msg


# -- the CLI: estimate and bad input ---------------------------------------------------------------


def test_estimate_cli(tmp_path, capsys):
    args = ["estimate", "zoo:gpt-tiny", "--plan", "per-block", "--world-size", "8", "--precision", "bf16",
            "--accumulation", "4", "--sync", "last"]
    assert main(args) == 0
    out = capsys.readouterr().out
    for text in ("tokens/s per GPU", "MFU", "parameters without embeddings", "6 N + 12 L d T",
                 "unsharded gradients held across micro-batches", "memory budget: 72.00 GiB"):
        assert text in out, out
    assert main(args + ["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["train"]["accumulation_sync"] == "last" and data["tokens_per_s_per_gpu"] > 0 and 0 < data["mfu"] < 1
    assert main(args + ["--json", "--checkpoint", "blocks"]) == 0
    ck = json.loads(capsys.readouterr().out)
    assert ck["peak_breakdown"]["activations"] < data["peak_breakdown"]["activations"]
    assert ck["step_s"] > data["step_s"]
    # a plan file brings its training step
    assert main(["search", "zoo:gpt-tiny", "--world-size", "8", "--precision", "bf16", "--trials", "0",
                 "--out", str(tmp_path / "p.json")]) == 0
    capsys.readouterr()
    assert main(["estimate", "zoo:gpt-tiny", "--plan", str(tmp_path / "p.json"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["train"]["precision"] == "bf16"


@pytest.mark.parametrize("extra, code, words", [
    (["--precision", "bf8"], 1, ["bf8", "bf16-pure", "fp32", "none"]),
    (["--optimizer", "lion"], 1, ["lion", "adafactor"]),
    (["--accumulation", "0"], 2, ["--accumulation", "positive integer"]),  # argparse's type= refuses it
    (["--batch", "0"], 2, ["--batch", "positive integer"]),
    (["--sync", "sometimes"], 1, ["sometimes", "every, last"]),
])
@pytest.mark.parametrize("command", ["search", "estimate"])
def test_bad_flags_one_line(command, extra, code, words, capsys):
    args = [command, "zoo:gpt-tiny", "--world-size", "2"] + (["--trials", "0"] if command == "search" else [])
    try:
        got = main(args + extra)
    except SystemExit as e:  # argparse: usage errors exit 2
        got = e.code
    assert got == code
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith(f"wrapopt {command}: error:")
    for w in words:
        assert w in err, err


def test_memory_none_means_no_limit(capsys):
    assert main(["estimate", "zoo:gpt-tiny", "--world-size", "2", "--memory", "none"]) == 0
    out = capsys.readouterr().out
    assert "memory budget: none (--memory none)" in out and "no limit" in out

