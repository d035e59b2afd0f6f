"""WrapPlan: the plan file (versioned JSON), checked against a model, applied and exported.

Reading the file's fields, and their errors, lives in ``fields.py``: nothing in
the file is unpickled or evaluated, and every load error names the file and
the field. Loading a plan for another model names the parameters that differ.

Example:
    >>> plan = WrapPlan.load("results/demo/plan.json")  # doctest: +SKIP
    >>> model = plan.apply(model)  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import datetime
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch.nn as nn

from wrapopt.assumptions import Assumptions
from wrapopt.consensus import every_rank
from wrapopt.errors import PlanError, PlanMismatchError
from wrapopt.fileio import atomic_write_json, read_json
from wrapopt.fingerprint import model_fingerprint
from wrapopt.plan.apply import apply_plan, warn_pipeline_knobs
from wrapopt.plan.check import check_plan
from wrapopt.plan.cp import cp_context, cp_mesh_of
from wrapopt.plan.fields import PLAN_FORMAT, read_plan_fields
from wrapopt.plan.fsdp1 import fsdp1_checkpoint_fn, fsdp1_policy
from wrapopt.plan.pipeline import PipelineRun, apply_pipeline
from wrapopt.plan.schema import plan_schema, schema_errors
from wrapopt.spec import CostEstimate, MeshSpec, PlanSpec, UnitSpec
from wrapopt.train import TrainConfig
from wrapopt.version import __version__

__all__ = ["WrapPlan", "PLAN_FORMAT", "plan_schema", "schema_errors", "current_plan_loader"]


def _version() -> str:
    return __version__


@dataclass
class WrapPlan:
    """A wrapping plan with everything needed to apply and to judge it.

    ``spec`` is what ``fully_shard`` needs; the rest is provenance: the model
    it was made for, the prediction, the fabric it was scored on, and the
    baselines' predictions on the same fabric.
    """

    spec: PlanSpec
    model: dict[str, Any]  # model_fingerprint(...)
    prediction: dict[str, Any] = field(default_factory=dict)
    fabric: dict[str, Any] = field(default_factory=dict)
    baselines: dict[str, Any] = field(default_factory=dict)
    mixed_precision: dict[str, str | None] = field(default_factory=lambda: {"param_dtype": None, "reduce_dtype": None})
    created: str = ""
    wrapopt_version: str = ""
    # What the prediction rested on (loss, optimizer, precision, batch, budget, fabric); None in
    # hand-written plans and in files written before it was recorded.
    assumptions: Assumptions | None = None
    # The training step it was scored for; None in files from before it was recorded.
    # When set, ``mixed_precision`` repeats its dtypes (what FSDP1 exports and old readers use).
    train: TrainConfig | None = None
    # The file it was read from (``load``, ``from_json``), for messages; "" for a plan made in memory.
    source: str = field(default="", compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.train is not None:
            self.mixed_precision = self.train.mixed_precision()

    @property
    def units(self) -> tuple[UnitSpec, ...]:
        return self.spec.units

    @property
    def mesh(self) -> MeshSpec:
        return self.spec.mesh

    @classmethod
    def from_search(
        cls,
        spec: PlanSpec,
        model: nn.Module,
        estimate: CostEstimate,
        *,
        fabric: dict[str, Any],
        baselines: dict[str, Any],
        mixed_precision: dict[str, str | None] | None = None,
        param_users: tuple[tuple[str, str], ...] = (),
        assumptions: Assumptions | None = None,
        train: TrainConfig | None = None,
    ) -> "WrapPlan":
        fingerprint = model_fingerprint(model)  # + the trace's pairs, for apply: [Note: parameter users]
        if param_users:
            fingerprint["param_users"] = [list(p) for p in param_users]
        if train is not None:
            mixed_precision = train.mixed_precision()
        return cls(
            spec=spec,
            model=fingerprint,
            prediction=estimate.to_json(),
            fabric=fabric,
            baselines=baselines,
            mixed_precision=mixed_precision or {"param_dtype": None, "reduce_dtype": None},
            created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            wrapopt_version=_version(),
            assumptions=assumptions,
            train=train,
        )

    # -- file format ----------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        out = {
            "format": PLAN_FORMAT,
            "wrapopt_version": self.wrapopt_version or _version(),
            "created": self.created,
            "label": self.spec.label,
            "model": self.model,
            "mesh": self.spec.mesh.to_json(),
            **({"tp": self.spec.tp.to_json()} if self.spec.tp is not None else {}),
            **({"pipeline": self.spec.pipeline.to_json()} if self.spec.pipeline is not None else {}),
            "units": [
                {"modules": list(u.modules), "reshard_after_forward": u.reshard_after_forward,
                 "checkpoint": u.checkpoint}
                for u in self.spec.units
            ],
            "forward_prefetch": self.spec.forward_prefetch,
            **({"offload": True} if self.spec.offload else {}),
            "mixed_precision": self.mixed_precision,
            **({"train": self.train.to_json()} if self.train is not None else {}),
            "prediction": self.prediction,
            "fabric": self.fabric,
            "baselines": self.baselines,
        }
        if self.assumptions is not None:
            out["assumptions"] = self.assumptions.to_json()
        return out

    def save(self, path: str | os.PathLike) -> None:
        """Write the plan atomically as JSON."""

        atomic_write_json(path, self.to_json())

    @classmethod
    def given(cls, plan: "WrapPlan | str | os.PathLike | None", model: nn.Module, graph: Any) -> "WrapPlan | None":
        """A plan (or its file) to apply instead of searching, checked against ``model`` and its traced
        ``graph``; None: search."""
        given = cls.load(plan) if isinstance(plan, (str, os.PathLike)) else plan
        if given is not None:  # a hand-written plan may part a module from its parameters' user
            check_plan(given, model=model, graph=graph)  # See [Note: one plan check] in plan/check.py
        return given

    @classmethod
    def load(cls, path: str | os.PathLike) -> "WrapPlan":
        """Read and validate a plan file; errors name the file and the field."""
        path = os.fspath(path)
        data = read_json(path, error=PlanError, hint="make one with `wrapopt search MODEL --out {path}`")
        return cls.from_json(data, source=path)

    @classmethod
    def from_json(cls, data: Any, *, source: str = "<plan>") -> "WrapPlan":
        """A plan from the parsed JSON of the file ``source``; ``PlanError`` naming the bad field."""
        f = read_plan_fields(data, source=source)
        return cls(spec=f.spec, model=f.model, prediction=f.prediction, fabric=f.fabric, baselines=f.baselines,
                   mixed_precision=f.mixed_precision, created=f.created, wrapopt_version=f.wrapopt_version,
                   assumptions=f.assumptions, train=f.train, source=source)

    # -- checking and applying --------------------------------------------------------

    def check_model(self, model: nn.Module) -> None:
        """Raise ``PlanMismatchError`` naming the modules that differ if ``model`` is not the planned model.

        Compared: every parameter's name, shape and dtype, and the module
        names the plan's units use. Module classes (when the plan records
        them) are named in the message but do not refuse on their own: the
        same weights under another class (eager vs SDPA attention, a subclass
        of the root) take the same plan. Local work only (no collective), so
        under ``torchrun`` every rank raises the same error.
        """
        mine = self.model.get("params", {})
        here = model_fingerprint(model)
        theirs = here["params"]
        missing = sorted(set(mine) - set(theirs))
        extra = sorted(set(theirs) - set(mine))
        changed = sorted(n for n in set(mine) & set(theirs) if mine[n] != theirs[n])
        unknown = sorted({m for u in self.units for m in u.modules} - {n for n, _ in model.named_modules()})
        recast = _class_changes(self.model.get("module_classes"), here["module_classes"])
        if not (missing or extra or changed or unknown):
            return
        differ = sorted(set(unknown) | set(recast) | {_module_of(n) for n in missing + extra + changed})
        parts = [f"modules that differ: {_names(differ)}"]
        if unknown:
            parts.append(f"modules in the plan but not in the model: {_names(unknown)}")
        if recast:
            parts.append("modules whose class differs: " + _names([f"{n} ({recast[n]})" for n in sorted(recast)]))
        if missing:
            parts.append(f"parameters only in the plan: {_names(missing)}")
        if extra:
            parts.append(f"parameters only in the model: {_names(extra)}")
        if changed:
            parts.append("parameters whose shape or dtype differ: " + _names([
                f"{n} {mine[n]['shape']}->{theirs[n]['shape']}" if mine[n]["shape"] != theirs[n]["shape"]
                else f"{n} {mine[n]['dtype']}->{theirs[n]['dtype']}" for n in changed]))
        only_dtype = not (missing or extra or unknown) and all(mine[n]["shape"] == theirs[n]["shape"] for n in changed)
        dtypes = {mine[n]["dtype"] for n in changed}
        todo = "Re-run the search for this model"
        if only_dtype and len(dtypes) == 1:
            (dt,) = dtypes
            todo = (f"Only the dtype differs: the plan was made for master weights in {dt} (a search's "
                    f"--master-dtype); cast the model with model.to(torch.{dt}) before applying, or re-run the search")
        raise PlanMismatchError(
            f"this plan was made for {self.model.get('class')} with {self.model.get('num_params')} parameters, "
            f"not for this {type(model).__name__}; " + "; ".join(parts)
            + f". {todo}, or pass strict=False to apply by module names only."
        )

    def apply(self, model: nn.Module, mesh: Any = None, *, strict: bool = True, train: TrainConfig | None = None,
              override_train: bool = False, example_inputs: Sequence[Any] | None = None,
              loss_fn: Callable[[Any, Any], Any] | None = None) -> nn.Module | PipelineRun:
        """Shard ``model`` in place with FSDP2 following this plan and return it.

        ``mesh`` is a ``DeviceMesh`` of the plan's shape; by default one is
        built from the plan's mesh on the current process group.
        ``strict=False`` skips the fingerprint check and applies the plan by
        module names only (the names must still exist). Every check runs
        before the first collective. A model on the meta device is sharded
        as it is; give it storage and values afterwards with
        ``wrapopt.plan.apply.materialize_sharded``.

        A pipeline plan (``spec.pipeline``) splits the model into stages and returns this rank's
        ``PipelineRun`` (stages, schedule, ``step``) instead of the model; it needs
        ``example_inputs`` (one micro-batch of the model's positional inputs) and
        ``loss_fn(output, target)`` (See [Note: applying a pipeline plan] in plan/pipeline.py).

        A plan whose tensor parallelism keeps the logits split over the vocabulary
        (``tp.loss_parallel``) needs the loss and its backward run under ``loss_context()``.

        The mixed precision is the plan's (``train``). Passing ``train`` checks
        that the plan was scored for that step: a plan made for another one
        raises ``PlanError`` naming the fields, unless ``override_train=True``,
        which applies the given configuration's mixed precision instead.

        Example:
            >>> model = WrapPlan.load("plan.json").apply(model)  # doctest: +SKIP
        """

        with every_rank("checking the plan file against the model"):  # See [Note: every rank explains]
            check_plan(self, model=model, strict=strict)  # See [Note: one plan check] in plan/check.py
            mp = self.train_config.mixed_precision()
            if train is not None:
                differ = self.train_config.differences(train)
                if differ and not override_train:
                    raise PlanError(
                        "the plan was scored for another training step: " + "; ".join(differ)
                        + ". Re-run the search with these settings, or pass override_train=True to apply anyway"
                    )
                mp = train.mixed_precision()
        users = self.model.get("param_users") or ()
        # a step that leaves compile or float8 to the search: the plan's (See [Note: knob defaults] in search/knobs.py)
        train = train.settled_by(self.train_config) if train is not None else None
        if self.spec.pipeline is not None:
            warn_pipeline_knobs(train if train is not None else self.train_config)  # float8, compile: not yet
            return apply_pipeline(model, self.spec, example_inputs=example_inputs, loss_fn=loss_fn, mesh=mesh,
                                  mixed_precision=mp, param_users=users)
        return apply_plan(model, self.spec, mesh=mesh, mixed_precision=mp, param_users=users,
                          train=train if train is not None else self.train_config)  # float8, compile

    def loss_context(self) -> Any:
        """The context the loss and its backward must run in: ``loss_parallel()`` where this plan's
        tensor parallelism keeps the logits split over the vocabulary (``tp.loss_parallel``), else a
        ``nullcontext``. See [Note: applying sequence parallel] in plan/tp.py.

        Example:
            >>> with plan.loss_context():  # doctest: +SKIP
            ...     loss_fn(model(x), x).backward()
        """
        if self.spec.tp is not None and self.spec.tp.loss_parallel:
            from torch.distributed.tensor.parallel import loss_parallel

            return loss_parallel()
        return contextlib.nullcontext()

    def train_context(self, model: Any = None, *, buffers: Sequence[Any] = (), seq_dims: Sequence[int] = (),
                      no_restore: Sequence[Any] = (), rotate_method: str = "allgather",
                      load_balance: bool = True) -> Any:
        """The context each forward and backward must run in, as TorchTitan's ``train_context``:
        ``loss_context()``, and under context parallelism (``mesh.cp_size > 1``) torch's
        ``context_parallel`` on the cp axis of ``model`` (the model ``apply`` returned). It shards
        ``buffers`` (input ids, labels, position buffers such as ``freqs_cis``) on their
        ``seq_dims`` in place, restoring them after except those in ``no_restore``, and runs SDPA as
        ring attention rotated by ``rotate_method`` ("allgather" or "alltoall"). Each sequence dim
        must divide into 2 x cp chunks: the head-tail load balancer, for causal attention;
        ``load_balance=False`` (non-causal attention) keeps contiguous 1/cp shards. The loss
        inside is the mean over this rank's tokens. See [Note: applying context parallelism] in
        plan/cp.py. Without cp, ``model`` and the buffers are not used.

        Example:
            >>> with plan.train_context(model, buffers=[x, y], seq_dims=[1, 1], no_restore=[x, y]):  # doctest: +SKIP
            ...     loss_fn(model(x), y).backward()
        """
        if getattr(self.spec.mesh, "cp_size", 1) == 1:
            return self.loss_context()
        cp_mesh = cp_mesh_of(model)

        @contextlib.contextmanager
        def around_step() -> Any:
            with self.loss_context(), cp_context(cp_mesh, buffers, seq_dims, no_restore=no_restore,
                                                 rotate_method=rotate_method, load_balance=load_balance):
                yield

        return around_step()

    @property
    def micro_batch(self) -> int | None:
        """Sequences per data-parallel rank per micro-batch the plan was scored at (a search at a
        fixed global batch chose it; a pipeline plan: per pipeline micro-batch, so that each
        pipeline's step takes ``micro_batch x spec.pipeline.microbatches``); None: the traced
        batch. The data loader should follow it."""
        return self.train.micro_batch if self.train is not None else None

    @property
    def accumulation(self) -> int:
        """Micro-batches per optimizer step the plan was scored at."""
        return self.train_config.grad_accumulation

    @property
    def global_batch(self) -> int | None:
        """Sequences per optimizer step, when the search fixed it."""
        return self.train.global_batch if self.train is not None else None

    @property
    def train_config(self) -> TrainConfig:
        """The training step the plan was scored for (files without one: from ``mixed_precision``)."""
        return self.train if self.train is not None else TrainConfig.from_mixed_precision(self.mixed_precision)

    def to_fsdp1_policy(self, *, split_groups: bool = False):
        """An ``auto_wrap_policy`` for FSDP1 that wraps exactly this plan's units.

        Per unit it sets what FSDP1 can express (sharding strategy from
        ``reshard_after_forward`` and the mesh, mixed precision, forward
        prefetch) and warns about the rest; see ``wrapopt.plan.fsdp1.fsdp1_policy``
        and [Note: what FSDP1 can express]. A unit grouping several modules
        raises ``PlanError`` unless ``split_groups=True``.

        Example:
            >>> policy = plan.to_fsdp1_policy()  # doctest: +SKIP
            >>> model = FullyShardedDataParallel(model, auto_wrap_policy=policy, **policy.root_kwargs)  # doctest: +SKIP
        """

        return fsdp1_policy(self.spec, mixed_precision=self.mixed_precision, split_groups=split_groups)

    def fsdp1_checkpoint_fn(self, model: nn.Module):
        """``check_fn`` for FSDP1's ``apply_activation_checkpointing``: the modules of
        the units this plan checkpoints."""

        return fsdp1_checkpoint_fn(self.spec, model)


def current_plan_loader(model: nn.Module, graph: Any, mesh: MeshSpec) -> Callable[[str], tuple]:
    """``load_plan`` for ``search --current FILE`` (``parse_current``): the file read and checked
    against the model, its trace and the search's mesh (See [Note: one plan check] in
    plan/check.py); returns its ``PlanSpec``, recorded micro-batch and the gradient-sync mode it
    records under accumulation (None without accumulation: the current job then syncs every
    micro-batch, as a plain FSDP2 loop does)."""

    def load(path: str) -> tuple[Any, int | None, str | None]:
        plan = WrapPlan.load(path)
        check_plan(plan, model=model, graph=graph, world_size=mesh.world_size, ranks_per_node=mesh.ranks_per_node,
                   given="the search's --world-size")
        train = plan.train
        sync = train.accumulation_sync if train is not None and train.grad_accumulation > 1 else None
        return plan.spec, plan.micro_batch, sync

    return load


def _module_of(param: str) -> str:
    return param.rsplit(".", 1)[0] if "." in param else "<root>"


def _class_changes(planned: Any, here: dict[str, list[str]]) -> dict[str, str]:
    """``{module: "PlanClass in the plan, ModelClass here"}`` for modules present in both
    whose class differs (plans written before classes were recorded give nothing)."""
    if not isinstance(planned, dict):
        return {}

    def by_module(table: dict[str, list[str]]) -> dict[str, str]:
        return {m: cls.rsplit(".", 1)[-1] for cls, mods in table.items() if isinstance(mods, list) for m in mods}

    a, b = by_module(planned), by_module(here)
    return {m or "<root>": f"{a[m]} in the plan, {b[m]} here" for m in set(a) & set(b) if a[m] != b[m]}


def _names(items: list[str], k: int = 6) -> str:
    shown = ", ".join(items[:k])
    return shown + (f" (and {len(items) - k} more)" if len(items) > k else "")

