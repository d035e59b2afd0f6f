"""A pipeline in ``--current``: the schedule's names, TorchTitan's stage split, and the plan built from them.

[Note: a pipeline described] ``--current "..., pp 8, Interleaved1F1B, local batch 32"`` describes
a pipeline as TorchTitan runs it, and the plan is built the way TorchTitan builds it, not the way
wrapopt's search would:

- the schedule by name, case and spaces aside (``SCHEDULES``: ``1F1B``, TorchTitan's default when
  none is named; ``Interleaved1F1B``, ``interleaved 1f1b``; ``GPipe``); TorchTitan's other
  schedules (``LoopedBFS``, ``InterleavedZeroBubble``, ``ZBVZeroBubble``, ``DualPipeV``) are not in
  wrapopt's pipeline model and are refused by name;
- stages per rank: 1 for the single-stage schedules, 2 for ``Interleaved1F1B`` (TorchTitan's
  default for looped schedules), or ``N stages per rank``;
- the blocks split over the ``pp x stages per rank`` stages by count, as TorchTitan's
  ``generate_llm_fqn_per_model_part`` does: the embedding and the final norm and head weigh one
  block each, every stage gets ``(blocks + 2) / stages`` of that weight, the first stages one more
  while some is left over (``torchtitan_split``);
- one FSDP unit per block, kept unsharded after forward unless ``reshard`` is said (TorchTitan's
  default policy under pipelining), each block checkpointed as the description says;
- micro-batches of ``pipeline_parallel_microbatch_size`` sequences (``micro-batch N``; default 1,
  TorchTitan's) and ``local batch / micro-batch`` of them a step (``training.local_batch_size``:
  sequences per data-parallel rank per forward and backward). The count is fixed when the
  comparison knows the global batch ([Note: the current configuration and a pipeline] in
  search/current.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from wrapopt.errors import PlanError
from wrapopt.search.stages import pipeline_layout, stage_modules
from wrapopt.spec import ROOT, SELECTIVE_OP, MeshSpec, ModelGraph, PlanSpec, UnitSpec
from wrapopt.spec.plan import PipelineSpec
from wrapopt.tp import TPSpec

__all__ = ["SCHEDULES", "OTHER_SCHEDULES", "PipelineWords", "read_schedule", "torchtitan_split", "pipeline_current",
           "block_checkpoints"]

# A schedule's name with case, spaces, dashes and underscores dropped -> wrapopt's (torch's) name.
SCHEDULES = {"1f1b": "1F1B", "interleaved1f1b": "Interleaved1F1B", "gpipe": "GPipe"}
# TorchTitan's other schedules: named so that the refusal says which is not modelled.
OTHER_SCHEDULES = {"loopedbfs": "LoopedBFS", "interleavedzerobubble": "InterleavedZeroBubble",
                   "zbvzerobubble": "ZBVZeroBubble", "dualpipev": "DualPipeV", "zerobubble": "ZeroBubble"}
_SCHEDULE_PREFIX = re.compile(r"^(?:pipelineparallelschedule|ppschedule|schedule)[=:]?")


@dataclass(frozen=True, slots=True)
class PipelineWords:
    """What a description says of its pipeline (See [Note: a pipeline described])."""

    pp: int
    schedule: str  # one of SCHEDULES' values
    stages_per_rank: int | None  # None: the schedule's default
    microbatches: int | None  # a count said ("32 micro-batches"); None: local batch / micro-batch


def read_schedule(item: str) -> str | None:
    """The schedule ``item`` names (None: it names none); ``ValueError`` for one of TorchTitan's
    schedules that wrapopt does not model."""
    key = _SCHEDULE_PREFIX.sub("", re.sub(r"[\s_\-]", "", item.lower()))
    if key in SCHEDULES:
        return SCHEDULES[key]
    if key in OTHER_SCHEDULES:
        raise ValueError(f"schedule {OTHER_SCHEDULES[key]} is not in wrapopt's pipeline model; one of "
                         f"{', '.join(SCHEDULES.values())}")
    return None


def torchtitan_split(num_blocks: int, num_stages: int) -> tuple[int, ...]:
    """Blocks per stage as TorchTitan's ``generate_llm_fqn_per_model_part`` splits them (input and
    output weights 1); ``ValueError`` when a stage would get no block."""
    effective = num_blocks + 2
    per, extra = divmod(effective, num_stages)
    sizes = []
    for s in range(num_stages):
        k = per + (1 if s < extra else 0)
        sizes.append(k - (s == 0) - (s == num_stages - 1))
    if per == 0 or min(sizes) < 1:
        raise ValueError(f"{num_stages} stages split by count (the embedding and the head weighing one block each) "
                         f"leave a stage of the {num_blocks} blocks without a block; fewer stages")
    return tuple(sizes)


def pipeline_current(graph: ModelGraph, mesh: MeshSpec, words: PipelineWords, *, tp: int, shard: int | None,
                     reshard: bool | None, checkpoints: dict[int, bool | str], micro_batch: int,
                     local_batch: int | None, tp_spec: TPSpec | None, label: str) -> PlanSpec:
    """The plan of a described pipeline on ``mesh`` (the whole world, no tensor or pipeline axis):
    See [Note: a pipeline described]. ``checkpoints`` maps a block's index (in the chain) to its
    checkpoint choice (absent: none). The micro-batch count is ``words.microbatches``, else
    ``local_batch / micro_batch``, else the degree (set again by the comparison). Raises
    ``ValueError`` with the reason."""
    pp = words.pp
    if mesh.world_size % (pp * tp):
        raise ValueError(f"pp {pp} x tp {tp} does not divide the world of {mesh.world_size} ranks")
    dp = mesh.world_size // (pp * tp)
    if shard is not None and dp % shard:
        raise ValueError(f"shard {shard} does not divide the {dp} data-parallel ranks of each stage")
    try:
        layout = pipeline_layout(graph)
    except PlanError as e:
        raise ValueError(str(e)) from None
    single = words.schedule != "Interleaved1F1B"
    v = words.stages_per_rank or (1 if single else 2)
    if single and v != 1:
        raise ValueError(f"{words.schedule} runs one stage per rank; {v} stages per rank need Interleaved1F1B")
    sizes = torchtitan_split(len(layout.blocks), pp * v)
    m = words.microbatches
    if m is None and local_batch is not None:
        if local_batch % micro_batch:
            raise ValueError(f"local batch {local_batch} is not a whole number of micro-batches of {micro_batch}")
        m = local_batch // micro_batch
    m = m or pp
    if local_batch is not None and words.microbatches is not None and m * micro_batch != local_batch:
        raise ValueError(f"{m} micro-batches of {micro_batch} are not the local batch {local_batch}")
    if not single and m % max(1, m // pp):
        raise ValueError(f"Interleaved1F1B runs rounds of {pp} micro-batches; {m} micro-batches are not whole "
                         f"rounds: use a multiple of {pp}")
    full = MeshSpec(world_size=mesh.world_size, ranks_per_node=mesh.ranks_per_node, shard_size=shard or dp,
                    tp_size=tp, pp_size=pp)
    keep = reshard if reshard is not None else False  # TorchTitan keeps blocks unsharded under pipelining
    units = [UnitSpec((b,), keep, checkpoints.get(i, False)) for i, b in enumerate(layout.blocks)]
    units.append(UnitSpec((ROOT,), False))
    return PlanSpec(units=tuple(units), mesh=full, tp=tp_spec if tp > 1 else None, label=label,
                    pipeline=PipelineSpec(stages=stage_modules(layout, sizes), schedule=words.schedule,
                                          microbatches=m))


def block_checkpoints(num_blocks: int, every: int) -> dict[int, bool | str]:
    """Per block index its checkpoint for the description's choice (``every``: 0 none, -1
    selective-op on every block, K every K-th block, full)."""
    if every < 0:
        return {i: SELECTIVE_OP for i in range(num_blocks)}
    if every == 0:
        return {}
    return {i: True for i in range(every - 1, num_blocks, every)}
