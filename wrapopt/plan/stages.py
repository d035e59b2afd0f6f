"""A pipeline plan's stages against a live model: the block chain, the pieces each stage
may list, and every check that runs before a pipeline plan is applied (local, no collective).

How the plan is then applied is [Note: applying a pipeline plan] in ``plan/pipeline.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from wrapopt.errors import PlanError
from wrapopt.spec import ROOT, PlanSpec

__all__ = ["StageLayout", "block_chains", "stage_layout"]


@dataclass(frozen=True, slots=True)
class StageLayout:
    """What a pipeline plan's stages mean on one model.

    ``pieces`` are the modules a stage may list, in registration (= execution) order: the
    modules around the block chain (embeddings before it, final norm and head after it) and
    the chain's blocks; ``piece_stage`` says which stage owns each listed piece; ``split_points``
    are the first piece of every stage after the first (``pipeline()``'s split points).
    """

    chain: str  # the block chain's container, e.g. "layers"
    pieces: tuple[str, ...]
    piece_stage: dict[str, int]
    split_points: tuple[str, ...]

    def stage_of(self, module: str) -> int:
        """The stage owning ``module`` (a piece or a module inside one); -1 when none does."""
        for piece, s in self.piece_stage.items():
            if module == piece or module.startswith(piece + "."):
                return s
        return -1


def block_chains(model: nn.Module) -> list[str]:
    """The outermost block chains: ``nn.ModuleList`` / ``nn.Sequential`` containers with at least
    two children of one class (as the tracer's ``ModelGraph.blocks`` finds them), not nested in
    another chain's block."""
    found: list[str] = []
    for name, m in model.named_modules():
        if not isinstance(m, (nn.ModuleList, nn.Sequential)) or len(m) < 2:
            continue
        if len({type(c) for c in m.children()}) != 1:
            continue
        if any(name.startswith(c + ".") for c in found):
            continue
        found.append(name)
    return found


def _pieces(model: nn.Module, chain: str) -> tuple[list[str], list[str], list[str]]:
    """(before, blocks, after): the modules around the chain's path from the root, split by
    whether they come before or after the chain in registration order, and the chain's blocks."""
    path = chain.split(".")
    around: list[str] = []
    for depth in range(len(path)):
        parent = ".".join(path[:depth])
        holder = model.get_submodule(parent) if parent else model
        for child, _ in holder.named_children():
            fqn = f"{parent}.{child}" if parent else child
            if child != path[depth]:
                around.append(fqn)
    order = {n: i for i, (n, _) in enumerate(model.named_modules())}
    first_block = order[f"{chain}.0"] if f"{chain}.0" in order else order[chain]
    blocks = [f"{chain}.{c}" for c, _ in model.get_submodule(chain).named_children()]
    before = sorted((p for p in around if order[p] < first_block), key=order.__getitem__)
    after = sorted((p for p in around if order[p] > first_block), key=order.__getitem__)
    return before, blocks, after


def _has_params(model: nn.Module, name: str) -> bool:
    return next(model.get_submodule(name).parameters(), None) is not None


def stage_layout(model: nn.Module, spec: PlanSpec) -> StageLayout:
    """Check ``spec.pipeline``'s stages against ``model`` and return what they mean; ``PlanError``
    naming the module, the stage and what to do otherwise. Local: no collective."""
    pipe = spec.pipeline
    if pipe is None:
        raise PlanError("this plan has no pipeline stages (PlanSpec.pipeline); apply it with apply_plan")
    cls = type(model).__name__
    if spec.mesh.tp_size > 1:
        raise PlanError("a plan with both pipeline stages and tensor parallelism is not applied yet: the stage "
                        "modules pipeline() makes lose their block classes, which the TP plan names; use "
                        "tp_size 1 or pp_size 1")
    own = [n for n, _ in model.named_parameters(recurse=False)]
    if own:
        raise PlanError(f"{cls} holds parameters of its own ({', '.join(own[:4])}), outside any submodule: a "
                        "pipeline stage takes whole modules; move them into a submodule, or apply a 1-D or 2-D "
                        "plan (pp_size 1)")
    chains = block_chains(model)
    if len(chains) != 1:
        why = (f"it has {len(chains)} ({', '.join(chains)}): an encoder-decoder's decoder blocks read the "
               "encoder's output, so the blocks do not run as one chain" if chains else "it has none")
        raise PlanError(f"pipeline parallelism needs the blocks of {cls} to be one sequential chain, but {why}; "
                        "apply a 1-D or 2-D plan (pp_size 1) to this model")
    chain = chains[0]
    before, blocks, after = _pieces(model, chain)
    pieces = before + blocks + after
    modules = dict(model.named_modules())
    last = len(pipe.stages) - 1
    piece_stage: dict[str, int] = {}
    for s, listed in enumerate(pipe.stages):
        for m in listed:
            if m == ROOT or m not in modules:
                raise PlanError(f"pipeline stage {s} lists {m!r}, which this {cls} does not have (or is the root); "
                                f"list its top-level modules and blocks ({blocks[0]} .. {blocks[-1]})")
            if m in piece_stage:
                raise PlanError(f"module {m!r} is in pipeline stages {piece_stage[m]} and {s}; each module belongs "
                                "to one stage: drop it from one")
            if m not in pieces:
                inside = next((p for p in pieces if m.startswith(p + ".")), None)
                if inside is not None:
                    raise PlanError(f"pipeline stage {s} lists {m!r}, a part of {inside!r}: a stage takes whole "
                                    f"blocks and top-level modules; list {inside!r}")
                raise PlanError(f"pipeline stage {s} lists {m!r}, which holds the block chain {chain}: a stage takes "
                                f"whole blocks; list the blocks ({blocks[0]} .. {blocks[-1]}) in the stages instead")
            piece_stage[m] = s
    for i, b in enumerate(blocks):
        if b not in piece_stage:
            near = piece_stage[blocks[i - 1]] if i else next((piece_stage[x] for x in blocks if x in piece_stage), 0)
            raise PlanError(f"block {b!r} is in no pipeline stage; add it to stage {near}")
    for m in before + after:
        want = 0 if m in before else last
        where = "before the first block (embeddings)" if m in before else "after the last block (final norm, head)"
        if m not in piece_stage and _has_params(model, m):
            raise PlanError(f"{m!r} is in no pipeline stage; it runs {where}, so add it to stage {want}")
        if m in piece_stage and piece_stage[m] != want:
            raise PlanError(f"{m!r} runs {where}, so it belongs on pipeline stage {want}, not stage {piece_stage[m]}; "
                            f"move it to stage {want}")
    for prev, b in zip(blocks, blocks[1:]):
        if piece_stage[b] < piece_stage[prev]:
            raise PlanError(f"block {b!r} is on pipeline stage {piece_stage[b]} but {prev!r}, which runs before it, "
                            f"is on stage {piece_stage[prev]}: stages take consecutive blocks in execution order; "
                            "reorder the stages' blocks")
    listed = [p for p in pieces if p in piece_stage]
    for s in range(1, len(pipe.stages)):
        if not any(piece_stage[p] == s for p in blocks) and s != last:
            raise PlanError(f"pipeline stage {s} holds no block; give every stage at least one block")
    split_points = tuple(next(p for p in listed if piece_stage[p] == s) for s in range(1, len(pipe.stages)))
    layout = StageLayout(chain=chain, pieces=tuple(pieces), piece_stage=piece_stage, split_points=split_points)
    _check_units(spec, layout)
    _check_schedule(spec)
    return layout


def _check_units(spec: PlanSpec, layout: StageLayout) -> None:
    for u in spec.units:
        if u.is_root:
            continue
        stages = sorted({layout.stage_of(m) for m in u.modules})
        if -1 in stages:
            m = next(m for m in u.modules if layout.stage_of(m) == -1)
            raise PlanError(f"unit {u.name!r} lists {m!r}, which is in no pipeline stage (it holds modules of several "
                            "stages, or of none); a unit lies inside one stage: split it by stage")
        if len(stages) > 1:
            raise PlanError(f"unit {u.name!r} spans pipeline stages {stages[0]} and {stages[-1]}; a unit lies inside "
                            "one stage: split it at the stage boundary")


def _check_schedule(spec: PlanSpec) -> None:
    pipe, pp = spec.pipeline, spec.mesh.pp_size
    assert pipe is not None
    per_rank = pipe.virtual_stages(pp)
    if pipe.schedule != "Interleaved1F1B" and per_rank != 1:
        raise PlanError(f"schedule {pipe.schedule} runs one stage per pipeline rank, but the plan has "
                        f"{len(pipe.stages)} stages on {pp} ranks; use Interleaved1F1B, or {pp} stages")
    rounds = max(1, pipe.microbatches // pp)
    if pipe.schedule == "Interleaved1F1B" and pipe.microbatches % rounds:
        raise PlanError(f"Interleaved1F1B needs the micro-batches ({pipe.microbatches}) to be a multiple of their "
                        f"rounds ({rounds} = micro-batches // pipeline degree {pp}); use a multiple of {pp}")
