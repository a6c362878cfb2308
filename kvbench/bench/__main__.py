"""`python -m kvbench.bench` = `kvbench-bench`."""

import sys

from kvbench.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
