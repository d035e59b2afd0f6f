"""How much the assumed loss moves the plan: one model, four losses, a sweep of budgets.

The model is a Llama-style decoder with a 16,000-token vocabulary (the case of
issue 24), built in bfloat16 on the meta device; the mesh is 8 ranks on one
node of the analytical H100 fabric. It is traced with

- ``mean-square``: the mean square of the output, wrapopt's default before issue 24;
- ``default``: no ``loss_fn`` (today's default: cross-entropy for logits-shaped
  outputs, see [Note: the assumed loss] in wrapopt/losses.py);
- ``user: chunked CE``: the loss the user trains with here, a cross-entropy in
  chunks of 1024 tokens, each recomputed in backward (``torch.utils.checkpoint``),
  so it keeps the logits it was given and little else;
- ``smallest plausible``: the default's trace with the loss's bytes set to zero
  ([Note: smallest plausible loss] in wrapopt/assumptions.py).

For each loss and each per-rank budget the search (baselines and the exact DP, no
Optuna trials) chooses a plan; the table gives its label, units, predicted step and
peak. Search only: nothing runs on ranks.

    python benchmarks/loss_assumption.py [--out results/loss_assumption.md]
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import time

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from wrapopt.api import plan_model
from wrapopt.errors import InfeasibleError
from wrapopt.fileio import atomic_write_text, fmt_bytes
from wrapopt.hardware.presets import analytical_compute, analytical_fabric
from wrapopt.losses import default_loss
from wrapopt.models.zoo import Llama
from wrapopt.search.driver import SearchOptions
from wrapopt.spec import MeshSpec
from wrapopt.trace.meta import trace_model

VOCAB, DIM, LAYERS, HEADS, FFN = 16000, 512, 8, 8, 1408
BATCH, SEQ = 8, 2048
MESH = MeshSpec(world_size=8, ranks_per_node=8, shard_size=8)
BUDGETS_GIB = (2.5, 3.0, 3.5, 4.0, 5.0, 6.0)
CHUNK = 1024


def _ce_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), targets, reduction="sum")


def chunked_cross_entropy(output: torch.Tensor, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Next-token cross-entropy over chunks of ``CHUNK`` positions, each recomputed in backward."""
    vocab = output.shape[-1]
    logits = output.view(-1, vocab)  # a view: the model's output, no copy
    targets = torch.roll(inputs[0], -1, dims=1).view(-1)
    total = sum(checkpoint(_ce_sum, logits[i:i + CHUNK], targets[i:i + CHUNK], use_reentrant=False)
                for i in range(0, logits.shape[0], CHUNK))
    return total / logits.shape[0]


def build() -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            model = Llama(vocab=VOCAB, dim=DIM, n_layers=LAYERS, n_heads=HEADS, n_kv_heads=HEADS, ffn=FFN)
    finally:
        torch.set_default_dtype(old)
    return model, (torch.zeros(BATCH, SEQ, dtype=torch.long),)


def _units(units) -> str:
    def one(u) -> str:
        flags = ("" if u.reshard_after_forward is True else " keep") + (" ckpt" if u.checkpoint else "")
        return u.name + flags

    return "; ".join(one(u) for u in units if not u.is_root) + f" (+ root; {len(units)} units)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="results/loss_assumption.md")
    args = ap.parse_args()
    model, inputs = build()
    fabric = analytical_fabric(world_size=MESH.world_size, ranks_per_node=MESH.ranks_per_node)
    compute = analytical_compute(fabric.name)
    t0 = time.perf_counter()
    graphs = {
        "mean-square (old default)": trace_model(model, inputs, loss_fn=default_loss, fx=False),
        "default (no loss_fn)": trace_model(model, inputs, fx=False),
        "user: chunked CE": trace_model(model, inputs, loss_fn=chunked_cross_entropy, fx=False),
    }
    graphs["smallest plausible"] = dataclasses.replace(graphs["default (no loss_fn)"], loss_saved_bytes=0,
                                                       loss_peak_bytes=0)
    lines = [
        "# How much the assumed loss moves the plan",
        "",
        f"Model: Llama-style decoder, vocabulary {VOCAB:,}, dim {DIM}, {LAYERS} blocks, ffn {FFN}, bfloat16, "
        f"{graphs['default (no loss_fn)'].num_params / 1e6:.1f} M parameters; per-rank batch {BATCH} x {SEQ} tokens; "
        f"{MESH.world_size} ranks on one node, fabric {fabric.name} (analytical), AdamW. Search: baselines and the "
        "exact DP (`SearchOptions(trials=0)`), meta device, nothing run on ranks.",
        "",
        "What each loss keeps (per rank, from the trace):",
        "",
        "| loss | as the report names it | keeps for backward | live while it runs |",
        "|---|---|---:|---:|",
    ]
    for name, g in graphs.items():
        lines.append(f"| {name} | {g.loss} | {fmt_bytes(g.loss_saved_bytes)} | {fmt_bytes(g.loss_peak_bytes)} |")
    lines += ["", "(`smallest plausible` is the default's trace with the loss's bytes set to zero: a loss that keeps "
              "nothing beyond the model's output, as a fused or chunked-and-recomputed one; the step time does not "
              "depend on the loss's bytes, so the steps compare plans, not losses.)"]
    lines += ["", "The plan chosen under each per-rank budget (units: `keep` = not resharded after forward, "
              "`ckpt` = activation checkpointing; step against the plan chosen for the user's loss):", "",
              "| budget | loss | chosen plan | units | pred step | vs user's | pred peak |",
              "|---|---|---|---|---:|---:|---:|"]
    for gib in BUDGETS_GIB:
        rows = {}
        for name, g in graphs.items():
            try:
                rows[name], _ = plan_model(g, model, mesh=MESH, fabric=fabric, compute=compute,
                                           memory_budget=gib * 2**30, search=SearchOptions(trials=0))
            except InfeasibleError:
                rows[name] = None
        user = rows["user: chunked CE"]
        for name, plan in rows.items():
            if plan is None:
                lines.append(f"| {gib} GiB | {name} | no plan fits | | | | |")
                continue
            step = plan.prediction["step_s"]
            vs = f"{step / user.prediction['step_s'] - 1:+.0%}" if user is not None else "-"
            lines.append(f"| {gib} GiB | {name} | {plan.spec.label} | {_units(plan.units)} | {step * 1e3:.1f} ms | "
                         f"{vs} | {fmt_bytes(plan.prediction['peak_bytes'])} |")
    lines += ["", f"Made by `python benchmarks/loss_assumption.py` in {time.perf_counter() - t0:.0f} s on "
              f"{platform.machine()} ({torch.get_num_threads()} threads), torch {torch.__version__}; "
              "predictions only (analytical fabric and compute)."]
    atomic_write_text(args.out, "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
