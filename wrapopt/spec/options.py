"""The step being simulated, apart from the plan: ``SimOptions`` and the optimizer it ends with."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

__all__ = ["OptimizerKind", "factored_state_numel", "SYNC_MODES", "FLOAT8_RECIPES", "float8_too_small", "SimOptions"]

class OptimizerKind(enum.Enum):
    """The optimizer the step ends with. Its state, per trainable parameter element,
    in the parameter's storage dtype, as the torch optimizers keep it (checked
    against them by ``tests/test_train.py``); the scalar ``step`` tensor per
    parameter tensor is not counted."""

    ADAMW = "adamw"  # exp_avg, exp_avg_sq
    ADAM = "adam"  # the same two
    SGD_MOMENTUM = "sgd-momentum"  # momentum_buffer
    SGD = "sgd"  # no state
    ADAFACTOR = "adafactor"  # factored: a row and a column vector per matrix, a full one per vector
    NONE = "none"  # no optimizer step at all

    @property
    def states_per_param(self) -> int:
        """Elementwise states (Adafactor's factored state is counted from the shapes:
        ``factored_state_numel``)."""
        return _STATES[self]


_STATES = {OptimizerKind.ADAMW: 2, OptimizerKind.ADAM: 2, OptimizerKind.SGD_MOMENTUM: 1, OptimizerKind.SGD: 0,
           OptimizerKind.ADAFACTOR: 0, OptimizerKind.NONE: 0}


def factored_state_numel(shape: tuple[int, ...]) -> int:
    """Elements of Adafactor's state for a parameter of ``shape`` (``torch.optim.Adafactor``:
    ``row_var`` and ``col_var`` over the last two dims of a matrix, ``variance`` of a vector)."""
    if len(shape) < 2:
        return math.prod(shape)
    lead = math.prod(shape[:-2])
    return lead * shape[-2] + lead * shape[-1]


FLOAT8_RECIPES = ("none", "tensorwise", "rowwise")  # torchao's Float8LinearConfig.from_recipe_name names


def float8_too_small(recipe: str, n: int, k: int) -> bool:
    """torchao's ``_auto_filter_for_recipe``: a linear of N x K too small to gain from float8 (its H100
    benchmarks); priced (cost/fused.py) and applied (plan/float8.py) alike."""
    if recipe == "rowwise":
        return n <= 2048 or k <= 1024 or (n <= 4096 and k <= 2048)
    return k <= 4096 and n <= 1024
SYNC_MODES = ("every", "last")  # gradient synchronisation under accumulation: See [Note: accumulation sync]


@dataclass(frozen=True, kw_only=True)
class SimOptions:
    """Knobs of the step being simulated (not of the plan). Frozen: derive a variant
    with ``dataclasses.replace(options, ...)``."""

    optimizer: OptimizerKind = OptimizerKind.ADAMW
    param_dtype_bytes: int | None = None  # mixed precision: bytes per gathered element
    reduce_dtype_bytes: int | None = None  # bytes per reduce-scattered element
    grad_accumulation: int = 1  # micro-batches per step
    batch_scale: float = 1.0  # per-rank batch relative to the traced batch
    # With grad_accumulation > 1: reduce-scatter after every micro-batch ("every"), or
    # after the last only, holding unsharded gradients in between ("last"); None: the
    # faster that fits memory_budget_bytes, per plan. See [Note: accumulation sync].
    accumulation_sync: str | None = "last"
    memory_budget_bytes: float | None = None  # only for accumulation_sync=None; None: no limit
    # Bytes per element of the activations (the forward runs in param_dtype under FSDP2's
    # mixed precision) and of the model's output (output_dtype); None: as traced.
    activation_dtype_bytes: int | None = None
    output_dtype_bytes: int | None = None
    # Every plan priced with FSDP2's CPU offload (as if its ``PlanSpec.offload`` were set): how
    # a search explores offload plans. See [Note: CPU offload] in cost/state.py.
    offload: bool = False
    # Throughput knobs: per-block torch.compile, torchao float8 training ("none", "tensorwise",
    # "rowwise") and FSDP2's float8 all-gather. See [Note: compile costs], [Note: float8 costs].
    compile: bool = False
    float8: str = "none"
    float8_all_gather: bool = False

    def __post_init__(self) -> None:
        if self.grad_accumulation < 1:
            raise ValueError(f"grad_accumulation must be >= 1, got {self.grad_accumulation}")
        if self.batch_scale <= 0:
            raise ValueError(f"batch_scale must be positive, got {self.batch_scale}")
        if self.accumulation_sync is not None and self.accumulation_sync not in SYNC_MODES:
            raise ValueError(f"accumulation_sync must be one of {', '.join(SYNC_MODES)} or None, "
                             f"got {self.accumulation_sync!r}")
        if self.float8 not in FLOAT8_RECIPES:
            raise ValueError(f"float8 must be one of {', '.join(FLOAT8_RECIPES)}, got {self.float8!r}")
