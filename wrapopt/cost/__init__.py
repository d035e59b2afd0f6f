"""The FSDP2 step simulator: plan -> CostEstimate."""

from wrapopt.cost.oneshot import simulate
from wrapopt.cost.simulate import Simulator

__all__ = ["Simulator", "simulate"]
