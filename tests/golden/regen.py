"""Rewrite the golden files from this checkout's code:

    PYTHONPATH=$PWD python -m tests.golden.regen [--from-dumps ESTIMATES.json SEARCH.json]

Only right when a change of numbers is intended: say in the commit message
which numbers change and why. ``--from-dumps`` builds them from full dumps
(``python -m tests.golden.estimates --out``, ``python -m tests.golden.searches
--out``, or the old ``benchmarks/*_dump.py`` of a checkout before this module).
"""

from __future__ import annotations

import argparse
import json

from tests.golden import estimates, heldout, searches
from tests.golden.digest import write_golden


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--from-dumps", nargs=2, metavar=("ESTIMATES", "SEARCH"), default=None)
    args = ap.parse_args()
    if args.from_dumps:
        with open(args.from_dumps[0]) as f:
            est_rows = json.load(f)
        with open(args.from_dumps[1]) as f:
            search_rows = json.load(f)
    else:
        est_rows, search_rows = estimates.dump(), searches.run()
    golden = [("estimates", estimates.entries(est_rows)), ("search", searches.entries(search_rows)),
              ("heldout", heldout.entries(heldout.dump()))]
    for name, entries in golden:
        print(f"{len(entries)} entries -> {write_golden(name, entries)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
