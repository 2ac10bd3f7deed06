# Two commands on a fresh machine: `make demo` and `make test`. Each creates the
# virtual environment it needs. constraints.txt keeps pip on the CPU build of torch.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q --disable-pip-version-check -c constraints.txt
# The rest of the stack goes through uv, which installs the same versions as pip from the same constraints
# (torch, already installed by pip from this machine's own file, is kept) in seconds instead of a minute;
# --compile-bytecode as pip does: with PYTHONDONTWRITEBYTECODE set, every process would compile its imports.
UV := $(VENV)/bin/uv pip install -q --compile-bytecode --python $(PY) -c constraints.txt
STAMP := $(VENV)/.installed
# The suite's processes (thousands) import unbroken and the tests' helpers: compiled once into __pycache__,
# not again in each process (0.2 s of CPU apiece) where the environment sets PYTHONDONTWRITEBYTECODE.
BYTECODE := PYTHONDONTWRITEBYTECODE=
PYTEST_ARGS ?=
# The suite runs its files in parallel (pytest-xdist; one file's tests stay on one worker): most of
# its time is spent waiting on the subprocesses it starts, so more workers than cores pay off.
TEST_JOBS ?= 3

# What is expensive to build for the tests (the LLaMA-Factory environment, DeepSpeed's compiled op) is
# kept here between runs, under folders keyed by exact pins (tests/buildcache.py): a clean clone on a
# machine that ran the suite before reuses them, a changed pin rebuilds.
export UNBROKEN_TEST_CACHE ?= $(HOME)/.cache/unbroken-test

.PHONY: demo test test-fast test-torch lint docs install bench bench-peers clean system-deps test-slurm

# The demo needs unbroken, its own dependencies (torch, numpy, safetensors, ...) and matplotlib for its
# picture: `make demo` installs those; `make test` adds the test stack (DeepSpeed, transformers, Lightning, ...: ~1.8 GB).
DEMO_STAMP := $(VENV)/.demo-installed

$(DEMO_STAMP): pyproject.toml constraints.txt Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) torch==2.13.0 uv==0.13.9
	$(UV) -e '.[plot]'
	touch $(DEMO_STAMP)

$(STAMP): pyproject.toml constraints.txt Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) torch==2.13.0 uv==0.13.9
	$(UV) -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

demo: $(DEMO_STAMP)
	$(VENV)/bin/unbroken demo

system-deps:
	sh scripts/install_system_deps.sh

# The gates (docs/architecture.md, "Gates"): the linter over the repository, the type checker over src/
# (its cache kept beside the test builds: it checks each file's hash, so a clean clone reuses it safely).
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	MYPY_CACHE_DIR=$(UNBROKEN_TEST_CACHE)/mypy $(VENV)/bin/mypy

# The docs site (mkdocs.yml): every warning an error (a broken link or anchor, a docstring that names a
# parameter the signature lacks); the reference pages come from the docstrings. Output: site/.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

test: $(STAMP) system-deps lint docs
	$(BYTECODE) $(PY) -m pytest -q -ra -n $(TEST_JOBS) --dist loadfile --durations=25 $(PYTEST_ARGS)

# The inner loop: every module, unit tests and single-process end-to-end runs (no several ranks, no
# SLURM, no namespaces, no other framework's jobs, none of the tests that run long): under 5 minutes (docs/testing.md).
test-fast: $(STAMP)
	$(BYTECODE) $(PY) -m pytest -q -ra -n $(TEST_JOBS) --dist loadfile -m "not slow" --durations=10 $(PYTEST_ARGS)

# The fast tier against another torch (docs/testing.md, "Versions"): `make test-torch TORCH=2.14.1` builds
# .venv-torch2.14.1 with that torch (the wheel pip finds for it: a CUDA build runs on CPU too) and the test stack.
TORCH ?= 2.14.1
TVENV := .venv-torch$(TORCH)
test-torch:
	$(PYTHON) -m venv $(TVENV)
	sed 's/^torch==.*/torch==$(TORCH)/' constraints.txt > $(TVENV)/constraints.txt
	$(TVENV)/bin/python -m pip install -q --disable-pip-version-check -c $(TVENV)/constraints.txt torch==$(TORCH)
	$(TVENV)/bin/python -m pip install -q --disable-pip-version-check -c $(TVENV)/constraints.txt -e '.[test]'
	$(BYTECODE) $(TVENV)/bin/python -m pytest -q -ra -n $(TEST_JOBS) --dist loadfile -m "not slow" --durations=10 $(PYTEST_ARGS)

test-slurm: $(STAMP) system-deps
	$(BYTECODE) $(PY) -m pytest -q -ra -m slurm $(PYTEST_ARGS)

# The peers measured alone under the faults the tests put unbroken through (HF, Lightning, Accelerate,
# DeepSpeed, LLaMA-Factory, plain PyTorch): benchmarks, not tests of unbroken; prints their table.
bench-peers: $(STAMP) system-deps
	$(BYTECODE) $(PY) -m pytest -q -rA -n $(TEST_JOBS) --dist loadfile -p no:cacheprovider benchmarks/peers $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) benchmarks/bench_save_load.py
	$(PY) benchmarks/bench_train_overhead.py
	$(PY) benchmarks/bench_recovery.py
	$(PY) benchmarks/bench_restore.py
	$(PY) benchmarks/bench_warm_restart.py
	$(PY) benchmarks/bench_format.py
	$(PY) benchmarks/bench_data_resume.py
	$(PY) benchmarks/bench_incremental.py
	$(PY) benchmarks/bench_goodput.py

clean:
	rm -rf $(VENV) .venv-torch* .pytest_cache build dist site *.egg-info src/*.egg-info
