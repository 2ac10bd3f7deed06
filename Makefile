# Two commands on a fresh machine: `make demo` and `make test`. Each creates the
# virtual environment it needs. constraints.txt keeps pip on the CPU build of torch.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q --disable-pip-version-check -c constraints.txt
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
# The suite runs its files in parallel (pytest-xdist; one file's tests stay on one worker): most of
# its time is spent waiting on the subprocesses it starts, so more workers than cores pay off.
TEST_JOBS ?= 3

.PHONY: demo test install bench clean system-deps test-slurm

$(STAMP): pyproject.toml constraints.txt Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) torch==2.13.0
	$(PIP) -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/unbroken demo

system-deps:
	sh scripts/install_system_deps.sh

test: $(STAMP) system-deps
	$(PY) -m pytest -q -ra -n $(TEST_JOBS) --dist loadfile --durations=25 $(PYTEST_ARGS)

test-slurm: $(STAMP) system-deps
	$(PY) -m pytest -q -ra -m slurm $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) benchmarks/bench_save_load.py
	$(PY) benchmarks/bench_train_overhead.py
	$(PY) benchmarks/bench_recovery.py
	$(PY) benchmarks/bench_format.py
	$(PY) benchmarks/bench_data_resume.py
	$(PY) benchmarks/bench_incremental.py
	$(PY) benchmarks/bench_goodput.py

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info src/*.egg-info
