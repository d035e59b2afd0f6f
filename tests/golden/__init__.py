"""Golden-file tests: the simulator's estimates and the search's answers on fixed sets
must not change unless a change of numbers is intended (see ``digest.py`` for the
file format and ``regen.py`` for the command that rewrites the files)."""
