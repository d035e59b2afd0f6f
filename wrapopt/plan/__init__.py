"""plan: the plan file (pure data), and applying it to a model with fully_shard (or as an FSDP1 policy)."""

from wrapopt.plan.apply import apply_plan, build_mesh, materialize_sharded
from wrapopt.plan.file import PLAN_FORMAT, WrapPlan
from wrapopt.plan.step import train_step

__all__ = ["WrapPlan", "PLAN_FORMAT", "apply_plan", "build_mesh", "materialize_sharded", "train_step"]
