"""Class-based wrap policies: the closest one to a plan (Lightning's FSDP1 strategy) and the
block policy (Accelerate): what each wraps and checkpoints, and what it loses of the plan."""

from __future__ import annotations

from collections import Counter

from wrapopt.errors import PlanError
from wrapopt.interop.common import ClassPolicy, bare, comment, few, module_order
from wrapopt.plan.file import WrapPlan
from wrapopt.spec import UnitSpec

__all__ = ["block_chains", "block_policy", "class_policy"]

# [Note: the closest class policy]
# Candidates are the classes of the plan's unit modules. A class is kept when every instance of it
# is a unit module (wrapping the class then wraps nothing the plan leaves to a parent); a class
# with instances outside the plan is dropped, and its unit modules' parameters fall to the
# enclosing unit (usually the root). Accelerate matches classes by bare name, Lightning by the
# class itself, so the instance sets differ accordingly. A grouped unit of same-class modules
# (consecutive blocks) becomes one unit per module; a grouped unit of mixed classes (tied
# embedding and head) is never split, since splitting it would split the shared parameter: its
# classes are dropped. The one reshard_after_forward and checkpointing setting is the majority
# over the units kept; every unit that differs is named. Subclass instances are not seen (the plan
# records each module's own class), though both tools wrap them too.

def class_policy(plan: WrapPlan, classes: dict[str, list[str]], *, match_by_name: bool) -> ClassPolicy:
    """The closest class-based policy to ``plan``; see [Note: the closest class policy].

    Args:
        classes: ``module_classes(model)`` of the planned model.
        match_by_name: instances are all classes of that bare name (Accelerate)
            rather than of that exact class (Lightning).
    """
    cls_of = _classes_of_units(plan, classes)
    key = bare if match_by_name else (lambda c: c)
    instances: dict[str, set[str]] = {}
    for c, mods in classes.items():
        instances.setdefault(key(c), set()).update(mods)
    units = [u for u in plan.units if not u.is_root]
    unit_mods = {m for u in units for m in u.modules}
    losses: list[str] = []
    mixed_groups = [u for u in units if len(u.modules) > 1 and len({key(cls_of[m]) for m in u.modules}) > 1]
    banned = {key(cls_of[m]) for u in mixed_groups for m in u.modules}
    for u in mixed_groups:
        losses.append(f"the grouped unit {' + '.join(u.modules)} ({', '.join(bare(cls_of[m]) for m in u.modules)}) "
                      "is not wrapped: one class-based policy cannot keep modules of different classes in one unit; "
                      "its parameters go to the enclosing unit")
    in_mixed = {m for u in mixed_groups for m in u.modules}
    kept: list[str] = []
    for c in dict.fromkeys(key(cls_of[m]) for u in units for m in u.modules):
        outside = sorted(instances[c] - unit_mods, key=module_order(classes))
        mine = sorted((instances[c] & unit_mods) - in_mixed, key=module_order(classes))
        if c in banned:
            if mine:
                losses.append(f"{bare(c)} units not wrapped ({few(mine)}): {bare(c)} is also in a grouped unit "
                              "of mixed classes; their parameters go to the enclosing unit")
        elif outside:
            losses.append(f"{bare(c)} units not wrapped ({few(mine)}): wrapping every {bare(c)} would also wrap "
                          f"{len(outside)} module(s) the plan leaves to their parent ({few(outside, 3)}); their "
                          "parameters go to the enclosing unit")
        else:
            kept.append(c)
    kept_units = [u for u in units if key(cls_of[u.modules[0]]) in kept]
    for u in kept_units:
        if len(u.modules) > 1:
            losses.append(f"the grouped unit {' + '.join(u.modules)} becomes {len(u.modules)} units of one "
                          f"{bare(cls_of[u.modules[0]])} each")
    raf, ckpt = _majority_settings(kept_units, losses)
    lost_ck = [u.name for u in units if u.checkpoint and u not in kept_units]
    if lost_ck:
        losses.append(f"checkpointing of the units not wrapped is lost: {few(lost_ck)}")
    return ClassPolicy(tuple(kept), raf, ckpt, tuple(losses))


def _majority_settings(kept_units: list[UnitSpec], losses: list[str]) -> tuple[bool, bool]:
    """The one reshard_after_forward and checkpointing setting for ``kept_units``: the majority;
    every unit that differs is named in ``losses``."""
    raf_votes = Counter(u.reshard_after_forward is not False for u in kept_units)
    raf = raf_votes[True] >= raf_votes[False]
    odd = [u.name for u in kept_units if (u.reshard_after_forward is not False) != raf]
    if odd:
        losses.append(f"units {few(odd)} have reshard_after_forward={not raf} in the plan; the export uses "
                      f"{raf} for every unit")
    hpz = [f"{u.name} ({u.reshard_after_forward})" for u in kept_units if not isinstance(u.reshard_after_forward, bool)]
    if hpz:
        losses.append(f"reshard_after_forward=N (reshard to groups of N ranks) becomes true: {few(hpz)}")
    ck_votes = Counter(u.checkpoint for u in kept_units)
    ckpt = bool(kept_units) and ck_votes[True] > ck_votes[False]
    odd_ck = [u.name for u in kept_units if u.checkpoint != ckpt]
    if odd_ck:
        losses.append(f"activation checkpointing is {'on' if ckpt else 'off'} for every wrapped unit, but the plan "
                      f"has it {'off' if ckpt else 'on'} for {few(odd_ck)}")
    return raf, ckpt


def _classes_of_units(plan: WrapPlan, classes: dict[str, list[str]]) -> dict[str, str]:
    """``{module: class}`` of the model; PlanError when a unit names a module the model lacks."""
    cls_of = {m: c for c, mods in classes.items() for m in mods}
    unknown = sorted({m for u in plan.units if not u.is_root for m in u.modules} - set(cls_of))
    if unknown:
        raise PlanError(f"the plan's units name modules its model does not have: {comment(', '.join(unknown[:6]))}")
    return cls_of


# [Note: the block policy]
# Accelerate (FSDP2) wraps every module of the classes named in fsdp_transformer_layer_cls_to_wrap,
# and checkpoints those same modules when fsdp_activation_checkpointing is on: one class list for
# both. The closest class policy would list every class whose instances are all units, so a plan
# with embed_tokens and each MLP as units wraps and checkpoints Embedding and LlamaMLP and leaves
# the decoder layers to the root. Accelerate's policy is a block policy, so the export is one:
# it wraps the classes of the model's block chains (runs of >= 2 same-class children of a
# ModuleList/Sequential holding parameters, outermost only, as the tracer finds them; read here
# from the plan file's module classes and parameter names) that the plan cuts at or inside. A
# unit of k consecutive blocks becomes k units; a unit inside a block (o_proj, an MLP) becomes
# part of its block; a unit outside the blocks (embeddings, the head, the final norm) goes to the
# root. Checkpointing and reshard_after_forward are the majority over the block units only.
# Every such change is a loss, named. A model without block chains, or a plan that cuts none,
# falls back to [Note: the closest class policy].


def block_chains(classes: dict[str, list[str]], param_names: list[str] | None = None) -> tuple[tuple[str, ...], ...]:
    """The model's repeated-block chains, from ``module_classes`` (and parameter names, when known).

    See [Note: the block policy]; members are ordered by their index in the container.
    """
    cls_of = {m: c for c, mods in classes.items() for m in mods}
    holds = (lambda m: True) if param_names is None else (
        lambda m: any(n.startswith(m + ".") for n in param_names))
    chains: list[tuple[str, ...]] = []
    for box in (m for c in _CONTAINERS for m in classes.get(c, ())):
        prefix = f"{box}." if box else ""
        by_cls: dict[str, list[str]] = {}
        for m, c in cls_of.items():
            if m and m.startswith(prefix) and "." not in m[len(prefix):] and holds(m):
                by_cls.setdefault(c, []).append(m)
        chains += [tuple(sorted(ms, key=_index_key)) for ms in by_cls.values() if len(ms) >= 2]
    outer = [c for c in chains if not any(c is not o and any(c[0].startswith(m + ".") for m in o) for o in chains)]
    return tuple(sorted(outer, key=module_order(classes)))


_CONTAINERS = ("torch.nn.modules.container.ModuleList", "torch.nn.modules.container.Sequential")


def _index_key(fqn: str) -> tuple[int, str]:
    last = fqn.rsplit(".", 1)[-1]
    return (int(last), fqn) if last.isdigit() else (-1, fqn)


def block_policy(plan: WrapPlan, classes: dict[str, list[str]], *,
                 param_names: list[str] | None = None) -> ClassPolicy | None:
    """The block policy of [Note: the block policy]; None when the plan cuts no block chain.

    Args:
        classes: ``module_classes(model)`` of the planned model.
        param_names: the model's parameter names (the plan file's model.params), to tell
            parameter-free containers from blocks.
    """
    cls_of = _classes_of_units(plan, classes)
    chain_of = {b: chain for chain in block_chains(classes, param_names) for b in chain}
    units = [u for u in plan.units if not u.is_root]
    block_units = [u for u in units if all(m in chain_of for m in u.modules)
                   and len({chain_of[m] for m in u.modules}) == 1]
    block_of = {}  # a module inside a block -> the block
    for u in units:
        for m in u.modules:
            block_of[m] = next((b for b in chain_of if m.startswith(b + ".")), None)
    inside = [u for u in units if u not in block_units and all(block_of[m] for m in u.modules)]
    cut = {chain_of[u.modules[0]] for u in block_units} | {chain_of[block_of[u.modules[0]]] for u in inside}
    if not cut:
        return None
    wrapped = tuple(dict.fromkeys(cls_of[c[0]] for c in sorted(cut, key=lambda c: module_order(classes)(c[0]))))
    names = {bare(c) for c in wrapped}
    losses = _block_losses(plan, classes, block_units, inside, names)
    outside = [u for u in units if u not in block_units and u not in inside]
    if outside:
        losses.append(f"units that are not blocks are not wrapped ({few([_label(u) for u in outside])}): Accelerate "
                      f"wraps the block class ({', '.join(sorted(names))}) only; their parameters go to the root unit")
    raf, ckpt = _majority_settings(block_units, losses)
    lost_ck = [_label(u) for u in units if u.checkpoint and u not in block_units]
    if lost_ck:
        losses.append(f"checkpointing of units that are not blocks is lost ({few(lost_ck)}): "
                      "fsdp_activation_checkpointing checkpoints whole blocks"
                      + ("" if ckpt else "; set it to true if the plan's memory needs it"))
    return ClassPolicy(wrapped, raf, ckpt, tuple(losses))


def _block_losses(plan: WrapPlan, classes: dict[str, list[str]], block_units: list[UnitSpec],
                  inside: list[UnitSpec], names: set[str]) -> list[str]:
    """What wrapping the block classes changes for the blocks: groups split, sub-block units
    merged into their block, blocks the plan leaves to the root wrapped, other classes of a name."""
    losses: list[str] = []
    groups = [u for u in block_units if len(u.modules) > 1]
    if groups:
        sizes = sorted({len(u.modules) for u in groups})
        losses.append(f"{len(groups)} grouped unit(s) of {' or '.join(map(str, sizes))} blocks "
                      f"({few([_label(u) for u in groups], 2)}) become one unit per block: Accelerate "
                      "wraps each block on its own, so the grouping's fewer, larger all-gathers and reduce-scatters "
                      "are lost (more collectives per step, each exposed latency paid per block; peak memory is "
                      "lower)")
    if inside:
        losses.append(f"{len(inside)} sub-block unit(s) ({few([_label(u) for u in inside])}) become part of their "
                      "block's unit: Accelerate cannot wrap part of a block with a class list")
    order = module_order(classes)
    planned = {m for u in block_units for m in u.modules}
    same_name = sorted((m for c, mods in classes.items() if bare(c) in names for m in mods), key=order)
    extra = [m for m in same_name if m not in planned]
    if extra:
        losses.append(f"wrapping every {'/'.join(sorted(names))} also wraps {len(extra)} module(s) the plan leaves "
                      f"to a parent unit ({few(extra, 3)})")
    return losses


def _label(unit: UnitSpec) -> str:
    return " + ".join(unit.modules)
