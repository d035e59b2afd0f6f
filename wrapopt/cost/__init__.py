"""The FSDP2 step simulator: plan -> CostEstimate."""

from wrapopt.cost.simulate import Simulator, simulate

__all__ = ["Simulator", "simulate"]
