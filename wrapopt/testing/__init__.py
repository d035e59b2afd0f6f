"""testing: suites that implementations of wrapopt's plug-in points run from their own tests.

``pytest_strategies``: the conformance suite every search strategy must pass
(optuna's ``testing/pytest_samplers.py`` pattern). It imports pytest, so it
is not imported here.
"""
