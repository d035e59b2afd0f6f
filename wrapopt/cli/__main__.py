import os

os.environ.setdefault("KINETO_LOG_LEVEL", "5")  # the profiler's start/stop lines, before torch loads

from wrapopt.cli.main import main  # noqa: E402

raise SystemExit(main())
