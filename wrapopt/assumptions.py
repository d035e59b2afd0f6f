"""What a prediction rests on, stated: ``Assumptions``.

A plan is chosen for one loss, optimizer, precision, per-rank batch, memory
budget and fabric; change any and another plan may win. ``state_assumptions``
reads them from what the simulator used (the ``ModelGraph`` the tracer made
and the ``SimOptions``), never from what the user meant to pass, and
``Assumptions.lines()`` is the short block that ``OptimizeResult.report()``,
``wrapopt search`` and ``wrapopt show`` print; the plan file records
``to_json()``.

[Note: smallest plausible loss] What the loss keeps for backward depends on
the loss, not on the model: a cross-entropy over a 32 k vocabulary keeps a
float32 copy of the logits, a fused or chunked one (recomputing the softmax
per chunk in backward) keeps next to nothing beyond the model's output,
which forward makes anyway. So "the smallest plausible loss" is one that
keeps nothing and allocates nothing beyond that output:
``loss_saved_bytes = loss_peak_bytes = 0``. When the assumed loss keeps more
than ``LOSS_SHARE_WARN`` of the chosen plan's predicted peak, the block says
so and gives that plan's peak re-simulated under the smallest plausible
loss, the bound a user with a leaner loss can expect.

[Note: batch per data-parallel rank] The simulator's batch is per GPU (the
traced batch x ``SimOptions.batch_scale``); under tensor parallelism t GPUs
share one data-parallel rank's sequences, so a GPU's share is 1/t of them
and reads as a fraction ("0.25 per rank"). The batch line speaks as
TorchTitan's ``local_batch_size`` does instead: sequences per data-parallel
rank per micro-batch, the GPU's share x t; for a pipeline (whose simulator
reads the scale as the rank's share of the pipeline's batch x accumulation,
cost/pipeline.py's ``stage_options``) the pipeline's sequences, in its
micro-batches. A step covers the micro-batches x data-parallel ranks.

A new step option adds a field with a default here and a line in
``lines()``; a reader of a plan file ignores fields it does not know
(``from_json``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

from wrapopt.fileio import fmt_bytes
from wrapopt.losses import MEAN_SQUARE_HINT
from wrapopt.spec import ModelGraph, PlanSpec, SimOptions

__all__ = ["Assumptions", "state_assumptions", "LOSS_SHARE_WARN", "SMALLEST_LOSS"]

LOSS_SHARE_WARN = 0.10  # the loss keeps more than this share of the peak: say so, See [Note: smallest plausible loss]
SMALLEST_LOSS = "keeps nothing beyond the model's output, as a fused or chunked loss"

_DTYPE_BY_BYTES = {1: "8-bit", 2: "16-bit (bf16/fp16)", 4: "fp32", 8: "fp64"}


@dataclass(frozen=True, slots=True)
class Assumptions:
    """Every assumption the prediction rests on, per rank. Bytes are at the planned batch."""

    loss: str  # the loss the trace ran (ModelGraph.loss)
    loss_kind: str  # losses.LOSS_KINDS
    loss_saved_bytes: int  # what it keeps for backward
    loss_peak_bytes: int  # the most it creates alive at once while it runs
    optimizer: str  # OptimizerKind value
    optimizer_states: int  # states per trainable parameter
    optimizer_state_bytes: float  # bytes of state per trainable parameter (the simulator keeps them in storage dtype)
    param_dtype: str  # parameters as stored: "float32", "bfloat16", "bfloat16+float32"
    gather_bytes: float  # bytes per element all-gathered (mixed precision's param_dtype)
    reduce_bytes: float  # bytes per element reduce-scattered (reduce_dtype)
    batch: float  # per-rank batch: the traced batch x SimOptions.batch_scale
    traced_batch: int
    seq: int  # tokens per sample (0: not a token model)
    memory_budget_bytes: float | None  # None: no budget
    memory_budget_source: str  # "given", "auto: 90% of the device's 80.00 GiB", "none"
    fabric: str
    fabric_kind: str  # "measured" or "analytical"
    compute: str
    compute_kind: str
    grad_accumulation: int = 1
    peak_bytes: int = 0  # the chosen plan's predicted peak (0: not known)
    smallest_loss_peak_bytes: int | None = None  # the same plan under the smallest plausible loss, when stated
    # The plan's shape, to state the batch per data-parallel rank: See [Note: batch per data-parallel rank].
    tp_size: int = 1
    pp_size: int = 1
    pipeline_microbatches: int = 0  # 0: no pipeline

    @property
    def loss_share(self) -> float:
        """The loss's saved bytes as a share of the predicted peak."""
        return self.loss_saved_bytes / self.peak_bytes if self.peak_bytes else 0.0

    @property
    def loss_is_large(self) -> bool:
        return self.loss_share > LOSS_SHARE_WARN

    def lines(self) -> list[str]:
        """The short block the reports print, one assumption a line."""
        out = ["assumptions (the prediction rests on these; change one and the plan may change):"]
        out.append(f"  loss:       {self.loss}; keeps {fmt_bytes(self.loss_saved_bytes)} for backward "
                   f"({fmt_bytes(self.loss_peak_bytes)} live while it runs)")
        if self.loss_kind == "mean_square":
            out.append(f"              hint: {MEAN_SQUARE_HINT}")
        if self.loss_is_large and self.smallest_loss_peak_bytes is not None:
            out.append(f"              ! the loss keeps {self.loss_share:.0%} of the predicted peak "
                       f"({fmt_bytes(self.peak_bytes)}); under the smallest plausible loss ({SMALLEST_LOSS}) "
                       f"this plan's peak is {fmt_bytes(self.smallest_loss_peak_bytes)}")
        per_state = self.optimizer_state_bytes / max(1, self.optimizer_states)
        states = (f"{self.optimizer_states} state(s) x {per_state:g} B = {self.optimizer_state_bytes:g} B "
                  "per trainable parameter, sharded") if self.optimizer_states else "no state"
        out.append(f"  optimizer:  {self.optimizer}, {states}")
        out.append(f"  precision:  parameters {self.param_dtype}; all-gathered in {_dtype(self.gather_bytes)}, "
                   f"gradients reduced in {_dtype(self.reduce_bytes)}")
        out.append(f"  batch:      {self.batch_line()}")
        budget = "none" if self.memory_budget_bytes is None else f"{fmt_bytes(self.memory_budget_bytes)} per rank"
        out.append(f"  memory:     {budget} ({self.memory_budget_source})")
        kind = "measured" if self.fabric_kind == "measured" else f"{self.fabric_kind}: stated numbers, not measured"
        out.append(f"  fabric:     {self.fabric}, {kind}; compute: {self.compute}")
        return out

    @property
    def micro_batch(self) -> float:
        """Sequences per data-parallel rank (a pipeline: per pipeline) in one micro-batch, TorchTitan's
        ``local_batch_size`` (a pipeline's: over all its micro-batches, below). See [Note: batch per
        data-parallel rank]."""
        if self.pipeline_microbatches:
            return (self.batch * self.tp_size * self.pp_size * self.grad_accumulation
                    / self.pipeline_microbatches)
        return self.batch * self.tp_size

    def batch_line(self) -> str:
        """The batch in sequences per data-parallel rank: "2 sequences x 8192 tokens per data-parallel rank
        (TorchTitan's local_batch_size), 8 micro-batches per step". See [Note: batch per data-parallel rank]."""
        tokens = f" x {self.seq} tokens" if self.seq else ""
        mb = self.micro_batch
        if self.pipeline_microbatches:
            count = self.pipeline_microbatches * self.grad_accumulation
            line = (f"{_seqs(mb * self.pipeline_microbatches)}{tokens} per pipeline (TorchTitan's local_batch_size), "
                    f"in micro-batches of {_seqs(mb)}, {count} per step")
        else:
            line = (f"{_seqs(mb)}{tokens} per data-parallel rank (TorchTitan's local_batch_size)"
                    + (f", {self.grad_accumulation} micro-batches per step" if self.grad_accumulation > 1 else ""))
        if self.tp_size > 1:
            line += f"; the {self.tp_size} tensor-parallel GPUs of a data-parallel rank share its sequences"
        if not math.isclose(self.batch, self.traced_batch):
            line += f" (traced at {_seqs(self.traced_batch)} per GPU, the simulator scaled to this)"
        return line

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Assumptions":
        """From a plan file's ``assumptions`` (already schema-checked); unknown fields are ignored."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


def state_assumptions(
    graph: ModelGraph,
    options: SimOptions,
    *,
    plan: PlanSpec | None = None,
    memory_budget: float | None,
    memory_budget_source: str,
    fabric: str,
    fabric_kind: str,
    compute: str,
    compute_kind: str,
    peak_bytes: int = 0,
    smallest_loss_peak_bytes: int | None = None,
) -> Assumptions:
    """The assumptions of a prediction, read from what the simulator used.

    Bytes follow the simulator: the loss's figures scale with ``batch_scale``;
    elements are ``param_bytes / num_params`` bytes, optimizer states are kept
    in that storage dtype, gathers in ``param_dtype_bytes`` and reductions in
    ``reduce_dtype_bytes`` when set.
    """
    elem = graph.param_bytes / max(1, graph.num_params)
    gather = options.param_dtype_bytes or elem
    states = options.optimizer.states_per_param
    dtypes = sorted({dt for _, _, dt in graph.param_shapes})
    scale = options.batch_scale
    return Assumptions(
        loss=graph.loss or "not recorded (a graph traced before losses were named)",
        loss_kind=graph.loss_kind,
        loss_saved_bytes=int(graph.loss_saved_bytes * scale),
        loss_peak_bytes=int(graph.loss_peak_bytes * scale),
        optimizer=options.optimizer.value,
        optimizer_states=states,
        optimizer_state_bytes=states * elem,
        param_dtype="+".join(dtypes) or "none",
        gather_bytes=gather,
        reduce_bytes=options.reduce_dtype_bytes or gather,
        batch=graph.batch_size * scale,
        traced_batch=graph.batch_size,
        seq=graph.seq_len,
        memory_budget_bytes=None if memory_budget in (None, float("inf")) else float(memory_budget),
        memory_budget_source=memory_budget_source,
        fabric=fabric,
        fabric_kind=fabric_kind,
        compute=compute,
        compute_kind=compute_kind,
        grad_accumulation=options.grad_accumulation,
        peak_bytes=int(peak_bytes),
        smallest_loss_peak_bytes=None if smallest_loss_peak_bytes is None else int(smallest_loss_peak_bytes),
        tp_size=plan.mesh.tp_size if plan is not None else 1,
        pp_size=plan.mesh.pp_size if plan is not None else 1,
        pipeline_microbatches=plan.pipeline.microbatches if plan is not None and plan.pipeline is not None else 0,
    )


def _seqs(n: float) -> str:
    """``n`` sequences: "1 sequence", "8 sequences", "0.5 sequences" (a fraction only where the
    simulator ran one: a traced batch not scaled to whole sequences)."""
    n = round(n, 6)
    return f"{n:g} sequence" + ("" if n == 1 else "s")


def _dtype(nbytes: float) -> str:
    return _DTYPE_BY_BYTES.get(int(nbytes), f"{nbytes:g} B") if float(nbytes).is_integer() else f"{nbytes:g} B"
