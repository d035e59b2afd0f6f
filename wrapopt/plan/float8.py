"""Float8 training through torchao, applied before ``fully_shard``.

[Note: applying float8]
``convert_float8`` swaps the eligible ``nn.Linear`` modules for torchao's ``Float8Linear``
(``convert_to_float8_training``) with the recipe the plan was scored for ("tensorwise" or
"rowwise", ``Float8LinearConfig.from_recipe_name``). The filter is TorchTitan's
(torchtitan/components/quantization/utils.py ``module_filter_fn``): a linear is converted only
when its in- and out-features are both multiples of 16 (the FP8 tensor cores' requirement) and
its name holds none of ``filter_fqns`` (TorchTitan writes ``["output"]``, the output head). The
output head is skipped here under any name: the last linear when its out-features are an
embedding's vocabulary, or a linear whose weight is tied to an embedding. Small linears are
skipped as the simulator prices them (``wrapopt.cost.fused``, [Note: float8 costs]): torchao's
``_auto_filter_for_recipe`` thresholds (H100-measured), which TorchTitan's ``auto_filter_small_kn``
uses; except under emulation (CPU), which converts every linear of multiples of 16 so that a
check at CPU sizes exercises the conversion (the warning line says so). The conversion must
precede ``fully_shard``: FSDP2 shards the parameters it finds, and with the float8 all-gather
(``enable_fsdp_float8_all_gather``, tensorwise only: torchao refuses it for rowwise scales)
those are torchao's weight wrappers, which FSDP2's all-gather casts to float8 before
communicating. The scales of that all-gather are computed for all the weights at once after each
optimizer step: ``after_optimizer_step(model)`` (``precompute_float8_dynamic_scale_for_fsdp``),
which ``train_step`` calls and a user's own loop must call after ``optimizer.step()``.

Where it runs: a CUDA device of compute capability 8.9 or more (H100, H200, L4, Ada) runs the
float8 GEMMs; on CPU (tests, dry runs) torchao's emulation (``emulate=True``) does the same
casts and scales in high precision, and ``convert_float8`` says so in one warning line; a CUDA
device without FP8 tensor cores (A100, V100) is refused, naming it.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from wrapopt.errors import PlanError
from wrapopt.spec.options import float8_too_small

__all__ = ["FLOAT8_RECIPES", "Float8Applied", "after_optimizer_step", "convert_float8", "float8_filter",
           "float8_state", "output_heads", "torchao_missing", "device_check"]

FLOAT8_RECIPES = ("tensorwise", "rowwise")
_STATE = "_wrapopt_float8"  # the attribute of the converted model that records what was done


@dataclass(frozen=True)
class Float8Applied:
    """What ``convert_float8`` did: the recipe, whether torchao emulates, the linears converted
    and those skipped with the reason (``{name: why}``)."""

    recipe: str
    emulate: bool
    all_gather: bool
    converted: tuple[str, ...]
    skipped: dict[str, str] = field(default_factory=dict)

    @property
    def precompute(self) -> bool:
        """Whether ``after_optimizer_step`` has work: the float8 all-gather's scales (tensorwise)."""
        return self.all_gather and bool(self.converted)


def torchao_missing() -> str | None:
    """Why torchao cannot be used here (a one-line reason), or None."""
    try:
        import torchao.float8  # noqa: F401
    except ImportError as e:
        return f"float8 training needs torchao ({e}): pip install 'wrapopt[float8]'"
    return None


def output_heads(model: nn.Module) -> set[str]:
    """Names of the linears that produce the logits: a weight tied to an embedding's, or the last
    linear registered when its out-features are an embedding's vocabulary."""
    embeds = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    vocab = {m.num_embeddings for m in embeds}
    tied = {id(m.weight) for m in embeds}
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    heads = {n for n, m in linears if id(m.weight) in tied}
    if linears and linears[-1][1].out_features in vocab:
        heads.add(linears[-1][0])
    return heads


def float8_filter(model: nn.Module, *, filter_fqns: tuple[str, ...] = ("output",),
                  small: str | None = None) -> tuple[list[str], dict[str, str]]:
    """The linears ``convert_float8`` converts, and those it skips with the reason; ``small``: a recipe
    whose size thresholds skip small linears (None: keep them). See [Note: applying float8]."""
    heads = output_heads(model)
    keep: list[str] = []
    skip: dict[str, str] = {}
    for name, m in model.named_modules():
        if type(m) is not nn.Linear:
            continue
        n, k = m.out_features, m.in_features
        if name in heads:
            skip[name] = "the output head"
        elif any(f in name for f in filter_fqns):
            skip[name] = f"named in filter_fqns {list(filter_fqns)}"
        elif k % 16 or n % 16:
            skip[name] = f"in {k} x out {n} features: not multiples of 16"
        elif small is not None and float8_too_small(small, n, k):
            skip[name] = f"in {k} x out {n} features: too small to gain from float8 {small} (torchao's thresholds)"
        else:
            keep.append(name)
    return keep, skip


def device_check(device_type: str, recipe: str) -> bool:
    """Whether torchao must emulate; refuses a CUDA device without FP8 tensor cores."""
    if device_type != "cuda":
        return True
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < (8, 9):
        name = torch.cuda.get_device_name()
        raise PlanError(f"float8 {recipe} training needs FP8 tensor cores (compute capability 8.9+: H100, H200, "
                        f"L4); this GPU, {name}, has {major}.{minor}: apply with --float8 none (train.float8)")
    return False


def convert_float8(model: nn.Module, recipe: str, *, all_gather: bool = False, device_type: str = "cpu",
                   filter_fqns: tuple[str, ...] = ("output",), skip_small: bool | None = None) -> Float8Applied:
    """Swap ``model``'s eligible linears for torchao's ``Float8Linear``, in place, before ``fully_shard``;
    ``skip_small`` (None: unless emulating) skips those too small to gain. See [Note: applying float8].
    Returns what was done (also on ``float8_state(model)``)."""
    if recipe not in FLOAT8_RECIPES:
        raise PlanError(f"unknown float8 recipe {recipe!r} (train.float8); accepted: {', '.join(FLOAT8_RECIPES)}")
    if all_gather and recipe != "tensorwise":
        raise PlanError(f"the float8 all-gather (train.float8_all_gather) takes tensorwise scales, not {recipe}: "
                        "use --float8 tensorwise, or drop --float8-all-gather")
    missing = torchao_missing()
    if missing:
        raise PlanError(missing)
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    emulate = device_check(device_type, recipe)
    cfg = Float8LinearConfig.from_recipe_name(recipe)
    if all_gather or emulate:
        from dataclasses import replace

        cfg = replace(cfg, enable_fsdp_float8_all_gather=all_gather, emulate=emulate)
    small = (not emulate) if skip_small is None else skip_small
    keep, skip = float8_filter(model, filter_fqns=filter_fqns, small=recipe if small else None)
    chosen = set(keep)
    convert_to_float8_training(model, config=cfg, module_filter_fn=lambda _m, fqn: fqn in chosen)
    done = Float8Applied(recipe, emulate, all_gather, tuple(keep), skip)
    if emulate:
        warnings.warn(f"wrapopt: float8 {recipe} on {device_type} has no FP8 tensor cores: torchao emulates it "
                      f"(emulate=True) for {len(keep)} linear(s)" + ("" if small else ", small ones too"),
                      stacklevel=2)
    object.__setattr__(model, _STATE, done)  # plain attribute, not a submodule or parameter
    return done


def float8_state(model: nn.Module) -> Float8Applied | None:
    """What ``convert_float8`` did to ``model`` (None: not converted)."""
    return getattr(model, _STATE, None)


def after_optimizer_step(model: Any) -> bool:
    """Call after each ``optimizer.step()`` of a model converted with the float8 all-gather: computes
    every float8 weight's scale at once for the next all-gather
    (``torchao.float8.precompute_float8_dynamic_scale_for_fsdp``). Returns whether it ran; a no-op for
    any other model."""
    state = float8_state(model)
    if state is None or not state.precompute:
        return False
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(model)
    return True
