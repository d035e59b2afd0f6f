"""A module that raises while importing (a model source whose module is broken)."""

raise RuntimeError("a module-level setting is missing")
