# kvbench: `make run` installs and runs the default job; `make test` installs and runs the test suite.
PYTHON ?= python3
PIP := $(PYTHON) -m pip

.PHONY: install run test test-all bench

install:
	# The CPU build of torch 2.13.0 first: any other torch spec would pull the CUDA build (gigabytes).
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e ".[dev]"

run: install
	$(PYTHON) -m kvbench.cli

test: install
	$(PYTHON) -m pytest

test-all: install
	$(PYTHON) -m pytest -m "slow or not slow"

bench: install
	$(PYTHON) -m kvbench.bench --quick --out bench.json
