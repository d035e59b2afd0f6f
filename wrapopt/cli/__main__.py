# The ranks' library and profiler output: See [Note: quiet ranks] in wrapopt/launch.py.
from wrapopt.cli.main import main

raise SystemExit(main())
