"""The Lightning FSDP2 export trained for two steps by Lightning itself on 2 gloo ranks: the
Trainer's ModelParallelStrategy calls the generated configure_model, which applies the plan, and
accumulates 2 micro-batches per step with the plan's sync last (FSDP2 reduces on the last only)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.ranks import MESH2
from wrapopt.fingerprint import model_fingerprint
from wrapopt.interop.export import export_plan
from wrapopt.plan.file import WrapPlan
from wrapopt.search.baselines import make_plan
from wrapopt.train import TrainConfig

pytestmark = pytest.mark.multiprocess

_SCRIPT = '''
import sys
import torch
import torch.distributed.fsdp._fully_shard._fsdp_param_group as param_group
import lightning as L
from planned import TRAINER_KWARGS, PlannedModule, make_strategy
from wrapopt.models import zoo

torch.set_num_threads(1)
REDUCES = [0]  # FSDP2's gradient reductions so far (one per unit per synced backward)
_reduce = param_group.foreach_reduce


def counted_reduce(*args, **kwargs):
    REDUCES[0] += 1
    return _reduce(*args, **kwargs)


param_group.foreach_reduce = counted_reduce


class Model(PlannedModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.model, self.inputs = zoo.build("gpt-tiny", "cpu")

    def training_step(self, batch, i):
        loss = zoo.ZOO["gpt-tiny"].loss(self.model(*self.inputs), self.inputs)
        self.print("step", float(loss.detach()), type(self.model.layers[0]).__name__, type(self.model).__name__,
                   REDUCES[0])
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(list(range(8)), batch_size=1)


L.Trainer(accelerator="cpu", strategy=make_strategy(), **TRAINER_KWARGS, max_steps=2, logger=False,
          enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False).fit(Model())
'''


def test_lightning_trains_the_exported_module_on_two_ranks(gpt_tiny, tmp_path, repo_root):
    pytest.importorskip("lightning", reason="the interop extra is not installed: pip install 'wrapopt[interop]'")
    model, _, graph = gpt_tiny
    plan_path = tmp_path / "plan.json"
    WrapPlan(spec=make_plan(graph, MESH2, list(graph.blocks), checkpoint=True), model=model_fingerprint(model),
             train=TrainConfig(grad_accumulation=2, accumulation_sync="last")).save(plan_path)
    out = export_plan(WrapPlan.load(plan_path), to="lightning", source=str(plan_path),
                      out=str(tmp_path / "planned.py"))
    (tmp_path / "planned.py").write_text(out.text)
    (tmp_path / "train.py").write_text(_SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), repo_root]), "OMP_NUM_THREADS": "1"}
    env.pop("MASTER_PORT", None)
    run = subprocess.run([sys.executable, str(tmp_path / "train.py")], cwd=tmp_path, env=env, timeout=240,
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    assert out.exact and out.settings["sync_last_strategy"]
    steps = [line.split() for line in run.stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 4, run.stdout[-2000:]  # 2 optimizer steps of 2 micro-batches
    assert all(s[2] == "FSDPGPTBlock" and s[3] == "FSDPGPT" for s in steps)  # the plan's units, sharded
    units = len(graph.blocks) + 1
    # reductions seen as each micro-batch starts: none after a first micro-batch (sync off), one per
    # unit after a second (a micro-batch that syncs reduces every unit)
    assert [int(s[4]) for s in steps] == [0, 0, units, units]
    assert float(steps[2][1]) < float(steps[0][1])  # the same batch, after one step
