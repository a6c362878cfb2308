"""`python -m kvbench.report` = `kvbench-report`."""

from kvbench.report.cli import main

if __name__ == "__main__":
    main()
