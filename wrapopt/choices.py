"""The names a user chooses among and the defaults the command line shows, in a module that imports no torch.

``wrapopt --help``, ``wrapopt CMD --help`` and an argument error build the parsers and stop, so
every name and default a parser shows is defined here; the library module that uses each one
imports it from here and re-exports it under its old name (``wrapopt.train.PRECISIONS``,
``wrapopt.search.BASELINE_NAMES``, ...). See [Note: first contact] in wrapopt/cli/main.py.
"""

from __future__ import annotations

from typing import Any

from wrapopt.spec import OptimizerKind

__all__ = ["PRECISIONS", "OPTIMIZERS", "DEFAULT_TRIALS", "BASELINE_NAMES", "CURRENT_FORMS", "PICTURES",
           "PLAN_SET_NAMES", "DEMO_OUT_DIR", "FABRIC_TIMEOUT_S"]

# Presets: (param_dtype, reduce_dtype, output_dtype); None keeps the model's own dtype. Without
# one (``TrainConfig()``, ``--precision none``) no policy is applied: the model's own dtype.
# A policy casts the gathered copies, the compute and the reduction only: the sharded parameters
# (master weights), their gradients and the optimizer state stay in the model's dtype (float32 for
# hf: and zoo: models), as FSDP2's MixedPrecisionPolicy keeps them. Pure bf16 training (bf16 master
# weights and optimizer state too) is a model stored in bf16 (``model.to(torch.bfloat16)``) under
# ``--precision none`` or ``bf16-pure``. See [Note: stored dtype is not the training dtype] in models/hf.py.
PRECISIONS: dict[str, tuple[str | None, str | None, str | None]] = {
    "fp32": ("float32", "float32", None),  # float32 compute and reduction, whatever the model is stored in
    # bf16 compute and all-gathers, fp32 gradient reduction (TorchTitan's default)
    "bf16": ("bfloat16", "float32", None),
    # bf16 reduction too (half the reduce-scatter bytes); master weights still the model's dtype
    "bf16-pure": ("bfloat16", "bfloat16", None),
    "fp16": ("float16", "float32", None),  # fp16 compute; needs loss scaling (a GradScaler) to train
}

# Optimizer names -> (kind, torch class, extra keyword arguments).
OPTIMIZERS: dict[str, tuple[OptimizerKind, str, dict[str, Any]]] = {
    "adamw": (OptimizerKind.ADAMW, "AdamW", {}),
    "adam": (OptimizerKind.ADAM, "Adam", {}),
    "sgd": (OptimizerKind.SGD, "SGD", {}),
    "sgd-momentum": (OptimizerKind.SGD_MOMENTUM, "SGD", {"momentum": 0.9}),
    "adafactor": (OptimizerKind.ADAFACTOR, "Adafactor", {}),
}

DEFAULT_TRIALS = 200  # Optuna trials of `wrapopt search` and `plan_model` (the simulator scores ~1000/s)

# The hand-written plans (search/baselines.py builds them): `wrapopt estimate --plan`, `--current`.
BASELINE_NAMES = ("per-block", "per-block,ckpt", "size-1e8", "every-leaf", "root-only", "no-shard")

# What `wrapopt search --current` reads (search/current.py parses it).
CURRENT_FORMS = (
    "a plan file (PATH.json, as `wrapopt search --out` writes), or items separated by commas, in any order: "
    "the units (per-block, every-leaf, size-1e8, root-only, no-shard); checkpointing (no AC, full AC, "
    "selective AC: matmul and attention outputs kept, AC every K: every K-th block); micro-batch N; "
    "reshard or no reshard (after forward, every unit but the root); sync every or sync last (no sync: "
    "gradients reduced on the last micro-batch only; default every, as a plain FSDP2 loop); "
    "shard N (HSDP with shard groups of N ranks); tp N (tensor parallelism inside each node) and its switches "
    "(async TP, no sequence parallel, no loss parallel); "
    "cp N (context parallelism: each sequence split over N ranks, FSDP over shard x cp); "
    "ep N (expert parallelism: experts split over N ranks); "
    "compile (torch.compile per block), float8 tensorwise or float8 rowwise (torchao float8 training), "
    "float8 all-gather; "
    "local batch N (TorchTitan's training.local_batch_size: sequences per data-parallel rank per forward and "
    "backward); pp N (pipeline stages, one unit per block) with a schedule (1F1B, Interleaved1F1B, GPipe), "
    "N stages per rank, and micro-batch N (the pipeline's, default 1). "
    'Example: "per-block, full AC, micro-batch 2" or "per-block, full AC, local batch 32, tp 8, pp 8, '
    'Interleaved1F1B"'
)

PICTURES = ("timeline.png", "pareto.png")  # what `--plot DIR` and the demo draw (evaluation/pictures.py)

# The plan sets `wrapopt bench --plans` measures (evaluation/plan_sets.py builds each).
PLAN_SET_NAMES = ("baselines", "variants", "uniform", "exhaustive", "contenders")

DEMO_OUT_DIR = "results/demo-latest"  # where `wrapopt demo` writes (ignored by git)

FABRIC_TIMEOUT_S = 600.0  # `wrapopt profile-fabric`: limit on every collective (hardware/measure_collectives.py)
