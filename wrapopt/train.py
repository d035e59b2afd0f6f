"""The training step a plan is made for: mixed precision, gradient accumulation, optimizer.

``TrainConfig`` is accepted by ``optimize_wrap(train=...)``, ``wrapopt.estimate``,
``wrapopt search``/``estimate`` (``--precision``, ``--accumulation``,
``--optimizer``, ``--sync``), recorded in the plan file (``"train"``) and
applied by ``plan.apply`` (the mixed precision) and ``wrapopt.train_step``
(accumulation the way the plan was scored). ``sim_options`` maps it onto the
simulator's ``SimOptions``.

Example:
    >>> from wrapopt.train import TrainConfig
    >>> cfg = TrainConfig.preset("bf16", grad_accumulation=4)
    >>> cfg.param_dtype, cfg.reduce_dtype, cfg.precision
    ('bfloat16', 'float32', 'bf16')
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, Iterable

import torch

from wrapopt.checks import check_count
from wrapopt.choices import OPTIMIZERS, PRECISIONS
from wrapopt.errors import OptionError, PlanError
from wrapopt.fileio import JsonReader
from wrapopt.spec import FLOAT8_RECIPES, SYNC_MODES, SimOptions

__all__ = ["TrainConfig", "FLOAT8_RECIPES", "FLOAT8_AUTO", "PRECISIONS", "OPTIMIZERS", "DTYPE_NAMES", "DTYPE_BYTES",
           "SYNC_MODES", "dtype_name",
           "model_dtype"]

# Canonical dtype names (as in the plan file) and the spellings accepted for them.
DTYPE_NAMES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
               "float16": "float16", "fp16": "float16", "half": "float16"}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
FLOAT8_AUTO = "auto"  # ``float8="auto"``: searched (See [Note: knob defaults] in search/knobs.py)



def dtype_name(value: Any, *, what: str = "dtype") -> str | None:
    """The canonical name of a dtype given as a name or a ``torch.dtype``; None stays None.
    Raises OptionError (a ValueError) with one line listing the accepted names."""
    if value is None:
        return None
    if isinstance(value, torch.dtype):
        for name, dt in TORCH_DTYPES.items():
            if dt == value:
                return name
        raise OptionError(f"unknown {what} {value}; accepted: {', '.join(TORCH_DTYPES)}")
    name = DTYPE_NAMES.get(str(value).strip().lower())
    if name is None:
        raise OptionError(f"unknown {what} {value!r}; accepted: {', '.join(DTYPE_NAMES)}")
    return name


def model_dtype(model: Any) -> str:
    """The name of the dtype ``model``'s floating parameters are stored in (float32 when
    it has none, or one wrapopt does not plan for)."""
    for p in model.parameters():
        if p.is_floating_point():
            for name, dt in TORCH_DTYPES.items():
                if dt == p.dtype:
                    return name
            break
    return "float32"


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """How each training step runs. The defaults are the model as it is (no
    mixed precision), one batch per step and AdamW.

    Args:
        param_dtype: dtype of the gathered parameters and of the forward and
            backward compute (FSDP2 ``MixedPrecisionPolicy.param_dtype``); None:
            the model's own.
        reduce_dtype: dtype of the gradient reduction; None: ``param_dtype``.
        output_dtype: dtype the model's outputs are cast to; None: no cast.
        grad_accumulation: micro-batches per optimizer step (the traced batch
            is one micro-batch).
        optimizer: one of ``OPTIMIZERS``.
        accumulation_sync: ``"every"`` micro-batch reduce-scatters its
            gradients; ``"last"``: only the last does, the others run under
            ``set_requires_gradient_sync(False)`` and hold unsharded gradients;
            None: chosen per plan, the faster that fits the memory budget.
        micro_batch: sequences (samples) per data-parallel rank in one micro-batch (with tensor
            parallelism: per tensor-parallel group; under a pipeline plan: per pipeline
            micro-batch); None: the traced batch. Set by a search at a fixed global batch, so
            that the data loader can follow the plan.
        global_batch: sequences per optimizer step over all data-parallel ranks (``micro_batch x
            grad_accumulation x data-parallel ranks``; under a pipeline plan ``micro_batch x
            microbatches x data-parallel ranks``, with ``grad_accumulation`` 1); None: not fixed.
        compile: each block compiled with ``torch.compile(fullgraph=True)`` after ``fully_shard``, as
            TorchTitan does (``--compile``; False: eager, ``--no-compile``); None: on where it applies,
            settled by ``wrapopt.job.prepare`` (See [Note: knob defaults] in search/knobs.py; until then
            priced eager). See [Note: compile costs] in cost/fused.py.
        float8: torchao float8 training of the eligible linears, one of ``FLOAT8_RECIPES``
            (``"none"``: off; ``--float8``), or ``"auto"``: searched on a GPU with FP8 tensor cores
            (See [Note: knob defaults]). See [Note: float8 costs] in cost/fused.py.
        float8_all_gather: FSDP2 all-gathers the float8 weights (1 byte per element plus a scale;
            ``--float8-all-gather``); needs ``float8`` on.
    """

    param_dtype: str | None = None
    reduce_dtype: str | None = None
    output_dtype: str | None = None
    grad_accumulation: int = 1
    optimizer: str = "adamw"
    accumulation_sync: str | None = None
    micro_batch: int | None = None
    global_batch: int | None = None
    compile: bool | None = None
    float8: str = "none"
    float8_all_gather: bool = False

    def __post_init__(self) -> None:
        for f in ("param_dtype", "reduce_dtype", "output_dtype"):
            object.__setattr__(self, f, dtype_name(getattr(self, f), what=f))
        check_count(self.grad_accumulation, "gradient accumulation (grad_accumulation, --accumulation)")
        for f in ("micro_batch", "global_batch"):
            if getattr(self, f) is not None:
                check_count(getattr(self, f), f"{f} (--batch, --global-batch)")
        name = str(self.optimizer).strip().lower()
        if name not in OPTIMIZERS:
            raise OptionError(f"unknown optimizer {self.optimizer!r}; accepted: {', '.join(OPTIMIZERS)}")
        object.__setattr__(self, "optimizer", name)
        if self.accumulation_sync is not None and self.accumulation_sync not in SYNC_MODES:
            raise OptionError(f"unknown accumulation sync {self.accumulation_sync!r}; "
                              f"accepted: {', '.join(SYNC_MODES)} (or auto: searched per plan)")
        recipe = str(self.float8 or "none").strip().lower()
        if recipe not in (*FLOAT8_RECIPES, FLOAT8_AUTO):
            raise OptionError(f"unknown float8 recipe {self.float8!r} (float8, --float8); "
                              f"accepted: {', '.join(FLOAT8_RECIPES)}, {FLOAT8_AUTO} (searched)")
        object.__setattr__(self, "float8", recipe)
        object.__setattr__(self, "compile", None if self.compile is None else bool(self.compile))
        object.__setattr__(self, "float8_all_gather", bool(self.float8_all_gather))
        if self.float8_all_gather and recipe != "tensorwise":
            searched = " (--float8 auto searches the all-gather itself)" if recipe == FLOAT8_AUTO else ""
            raise OptionError("the float8 all-gather (float8_all_gather, --float8-all-gather) needs tensorwise float8 "
                              "training (torchao's enable_fsdp_float8_all_gather): give --float8 tensorwise, or drop "
                              f"--float8-all-gather{searched}")

    # -- making one ---------------------------------------------------------------------------

    @classmethod
    def preset(cls, precision: str = "none", **kw: Any) -> "TrainConfig":
        """A named precision (``PRECISIONS``, or ``none``: no policy) with the other fields as given."""
        key = str(precision).strip().lower()
        if key == "none":
            return cls(**kw)
        if key not in PRECISIONS:
            raise OptionError(f"unknown precision {precision!r}; accepted: none, {', '.join(PRECISIONS)}")
        p, r, o = PRECISIONS[key]
        return cls(param_dtype=p, reduce_dtype=r, output_dtype=o, **kw)

    @classmethod
    def from_policy(cls, policy: Any, **kw: Any) -> "TrainConfig":
        """From an FSDP2 ``MixedPrecisionPolicy`` (its param, reduce and output dtypes)."""
        return cls(param_dtype=policy.param_dtype, reduce_dtype=policy.reduce_dtype,
                   output_dtype=policy.output_dtype, **kw)

    @classmethod
    def parse(cls, *, precision: Any = None, accumulation: int | None = None, optimizer: str | None = None,
              sync: str | None = None, compile: bool | None = None, float8: str | None = None,
              float8_all_gather: bool = False) -> "TrainConfig":
        """From the command line's flags: a preset name or a ``MixedPrecisionPolicy`` for
        ``precision``; ``sync`` "every", "last", or "auto"/None (searched); ``compile`` None: on where
        it applies; ``float8`` "auto": searched (See [Note: knob defaults] in search/knobs.py)."""
        kw: dict[str, Any] = {"grad_accumulation": 1 if accumulation is None else accumulation,
                              "optimizer": optimizer or "adamw",
                              "accumulation_sync": None if sync in (None, "auto") else sync,
                              "compile": compile, "float8": float8 or "none", "float8_all_gather": float8_all_gather}
        if precision is None or isinstance(precision, str):
            return cls.preset(precision or "none", **kw)
        return cls.from_policy(precision, **kw)

    # -- what it means ------------------------------------------------------------------------

    @property
    def precision(self) -> str:
        """The preset this is, "none" (no policy), or "custom"."""
        mine = (self.param_dtype, self.reduce_dtype, self.output_dtype)
        if mine == (None, None, None):
            return "none"
        return next((k for k, v in PRECISIONS.items() if v == mine), "custom")

    def compute_dtype(self, model_dtype: str = "float32") -> str:
        """The dtype the forward and backward run in: ``param_dtype``, else the model's."""
        return self.param_dtype or model_dtype

    @property
    def sync_chosen(self) -> bool:
        """Whether the sync mode is settled (or irrelevant: one micro-batch)."""
        return self.grad_accumulation == 1 or self.accumulation_sync is not None

    def mixed_precision(self) -> dict[str, str | None]:
        """The plan file's ``mixed_precision`` object."""
        return {"param_dtype": self.param_dtype, "reduce_dtype": self.reduce_dtype, "output_dtype": self.output_dtype}

    def mp_policy(self) -> Any:
        """The FSDP2 ``MixedPrecisionPolicy`` (all None: no casting)."""
        from torch.distributed.fsdp import MixedPrecisionPolicy  # documented lazy load: torch.distributed.fsdp is heavy

        return MixedPrecisionPolicy(**{k: TORCH_DTYPES[v] if v else None for k, v in self.mixed_precision().items()})

    @property
    def knobs_settled(self) -> bool:
        """Whether compile and float8 are settled (not None / "auto": See [Note: knob defaults])."""
        return self.compile is not None and self.float8 != FLOAT8_AUTO

    def with_knobs(self, other: "TrainConfig") -> "TrainConfig":
        """This step with ``other``'s compile, float8 and float8 all-gather (the ones a search settled)."""
        return replace(self, compile=other.compile, float8=other.float8, float8_all_gather=other.float8_all_gather)

    def settled_by(self, other: "TrainConfig") -> "TrainConfig":
        """This step with the knobs it leaves unsettled (compile None, float8 "auto") as ``other`` (a
        plan's step) settles them; the others stay this step's."""
        kw: dict[str, Any] = {} if self.compile is not None else {"compile": other.compile}
        if self.float8 == FLOAT8_AUTO:
            kw.update(float8=other.float8, float8_all_gather=other.float8_all_gather)
        return replace(self, **kw) if kw else self

    def check_scorable(self) -> None:
        """Refuse ``float8`` "auto" where one step is scored (``wrapopt estimate``): a search settles it."""
        if self.float8 == FLOAT8_AUTO:
            raise OptionError("float8 auto (--float8 auto) is chosen by a search (wrapopt search, optimize_wrap); to "
                              f"score one step give --float8 {', '.join(FLOAT8_RECIPES)}")

    def sim_options(self, *, batch_scale: float = 1.0, memory_budget: float | None = None) -> SimOptions:
        """The simulator's options for this step; ``memory_budget`` decides an unset sync mode. An
        unsettled compile is priced eager; ``float8`` "auto" is refused (a search settles it)."""
        self.check_scorable()
        param = DTYPE_BYTES[self.param_dtype] if self.param_dtype else None
        reduce = DTYPE_BYTES[self.reduce_dtype] if self.reduce_dtype else None
        out = DTYPE_BYTES[self.output_dtype] if self.output_dtype else None
        return SimOptions(optimizer=OPTIMIZERS[self.optimizer][0], param_dtype_bytes=param, reduce_dtype_bytes=reduce,
                          grad_accumulation=self.grad_accumulation, batch_scale=batch_scale,
                          accumulation_sync=self.accumulation_sync if self.grad_accumulation > 1 else "last",
                          memory_budget_bytes=memory_budget, activation_dtype_bytes=param, output_dtype_bytes=out,
                          compile=bool(self.compile), float8=self.float8, float8_all_gather=self.float8_all_gather)

    def make_optimizer(self, params: Iterable[Any], *, lr: float = 1e-3, **kw: Any) -> torch.optim.Optimizer:
        """The torch optimizer this config names (``sgd-momentum``: momentum 0.9)."""
        _kind, cls_name, extra = OPTIMIZERS[self.optimizer]
        return getattr(torch.optim, cls_name)(params, lr=lr, **{**extra, **kw})

    def describe(self, model_dtype: str = "float32", *, pipeline_microbatches: int | None = None) -> str:
        """One line for reports, naming the four dtypes of the step: the parameters as
        stored and sharded (the master weights, ``model_dtype``: a policy never changes
        them), the compute (and all-gathers), the gradient reduction and the optimizer state.
        ``pipeline_microbatches``: a pipeline plan's micro-batch count (its micro-batches are
        ``micro_batch`` sequences each, per pipeline)."""
        compute = self.compute_dtype(model_dtype)
        dtypes = (f"parameters {model_dtype} (master), compute {compute}, reduction {self.reduce_dtype or compute}, "
                  f"optimizer state {model_dtype}" + (f", output {self.output_dtype}" if self.output_dtype else ""))
        prec = ("none (no mixed precision: the model's own dtype; " if self.precision == "none" else
                f"{self.precision} (") + dtypes + ")"
        sync = ("" if self.grad_accumulation == 1 else
                f", sync {self.accumulation_sync}" if self.accumulation_sync else ", sync searched per plan")
        where = "pipeline" if pipeline_microbatches else "data-parallel rank"
        batch = (f" of {self.micro_batch} per {where}" if self.micro_batch else "") + (
            f" (global batch {self.global_batch})" if self.global_batch else "")
        count = (f"{pipeline_microbatches} pipeline micro-batches" + (
            f" x {self.grad_accumulation}" if self.grad_accumulation > 1 else "") if pipeline_microbatches
            else f"{self.grad_accumulation} micro-batch{'es' if self.grad_accumulation > 1 else ''}")
        knobs = ("" if self.float8 == "none" else ", float8 searched" if self.float8 == FLOAT8_AUTO else
                 f", float8 {self.float8}" + (" (float8 all-gather)" if self.float8_all_gather else ""))
        knobs += ", compiled per block" if self.compile else ""
        return f"precision {prec}, {count}{batch} per step{sync}, optimizer {self.optimizer}{knobs}"

    def differences(self, other: "TrainConfig") -> list[str]:
        """``field (this -> other)`` for every field that differs; an unset sync mode, micro-batch,
        global batch or compile, or a searched float8 (and its all-gather), on either side differs from nothing."""
        out = []
        searched = FLOAT8_AUTO in (self.float8, other.float8)
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if f.name in ("accumulation_sync", "micro_batch", "global_batch", "compile") and (a is None or b is None):
                continue
            if searched and f.name in ("float8", "float8_all_gather"):
                continue
            if a != b:
                out.append(f"{f.name} ({a} in the plan, {b} given)")
        return out

    def with_sync(self, mode: str | None) -> "TrainConfig":
        return replace(self, accumulation_sync=mode if self.grad_accumulation > 1 else None)

    # -- the plan file --------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        return {"precision": self.precision, "param_dtype": self.param_dtype, "reduce_dtype": self.reduce_dtype,
                "output_dtype": self.output_dtype, "grad_accumulation": self.grad_accumulation,
                "optimizer": self.optimizer, "accumulation_sync": self.accumulation_sync,
                **{k: v for k, v in (("micro_batch", self.micro_batch), ("global_batch", self.global_batch),
                                     ("float8_all_gather", self.float8_all_gather)) if v},
                **({"compile": self.compile} if self.compile is not None else {}),  # settled: on or off
                **({"float8": self.float8} if self.float8 != "none" else {})}

    @classmethod
    def from_json(cls, d: Any, *, source: str = "<plan>") -> "TrainConfig":
        """Read the plan file's ``train`` object; errors name the file and the field."""
        r = JsonReader(d, f"{source}: train", error=PlanError)
        kw: dict[str, Any] = {}
        for key in ("param_dtype", "reduce_dtype", "output_dtype", "accumulation_sync", "micro_batch", "global_batch"):
            kw[key] = r.d.get(key)
        kw["grad_accumulation"] = r.d.get("grad_accumulation", 1)
        kw["optimizer"] = r.d.get("optimizer", "adamw")
        kw["float8"] = r.d.get("float8", "none")  # absent (older plan files): off
        for key in ("compile", "float8_all_gather"):
            if not isinstance(r.d.get(key, False), bool):
                raise PlanError(f"{r.where}: {key} must be true or false, got {r.d[key]!r}")
            kw[key] = r.d.get(key, False)
        # absent: not settled (older plan files; applied eager): See [Note: knob defaults] in search/knobs.py
        kw["compile"] = r.d.get("compile")
        try:
            return cls(**kw)
        except ValueError as e:
            raise PlanError(f"{r.where}: {e}") from None

    @classmethod
    def from_mixed_precision(cls, mp: dict[str, Any] | None) -> "TrainConfig":
        """What an older plan file (``mixed_precision`` only) was made for."""
        mp = mp or {}
        return cls(param_dtype=mp.get("param_dtype"), reduce_dtype=mp.get("reduce_dtype"),
                   output_dtype=mp.get("output_dtype"))
