"""evaluation: real steps of plans on live ranks, predicted against measured (wiring, like api and cli)."""

from wrapopt.evaluation.bench import Measured, measure_plans
from wrapopt.evaluation.evaluate import evaluate
from wrapopt.evaluation.evidence import judge

__all__ = ["Measured", "measure_plans", "evaluate", "judge"]
