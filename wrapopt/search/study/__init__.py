"""search.study: the Optuna study over the general plan space (not named ``optuna``: it would shadow the package)."""

from wrapopt.search.study.run import run_study
from wrapopt.search.study.space import SearchSpace
from wrapopt.search.study.strategy import OptunaStudy

__all__ = ["run_study", "SearchSpace", "OptunaStudy"]
