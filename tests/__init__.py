"""wrapopt's tests, one folder per package: tests/cost/ tests wrapopt/cost/, and so on;
modules at the top level (spec, units, launch, api, ...) are tested at the top level.

A package, so that test modules in different folders may share a basename, spawned
ranks import test workers by their dotted name, and ``tests.fixtures_models`` imports
from anywhere (also as a CLI ``MODEL``)."""
