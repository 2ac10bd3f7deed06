"""The peers measured alone: what HF, Lightning, Accelerate, DeepSpeed, LLaMA-Factory and plain PyTorch
lose under the faults unbroken's tests put unbroken through (the "alone" columns of
docs/integrations.md and docs/distributed.md).

These run *other* libraries, not unbroken, so they are benchmarks, not tests of this project: ``make
bench-peers`` runs them (pytest, as they reuse the tests' jobs, harnesses and fixtures), and each still
asserts what the docs' tables say, so a peer that changes behaviour is noticed. At the end the lines
each measurement printed (``measured, ...``) are printed as one table per file, and written as JSON
with ``--peers-json PATH``."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[2] / "tests"
sys.path.insert(0, str(TESTS))

_spec = importlib.util.spec_from_file_location("unbroken_tests_conftest", TESTS / "conftest.py")
assert _spec is not None and _spec.loader is not None
_tests = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_tests)
# the tests' fixtures these measurements use (their tier check is for the tests only)
deepspeed_env = _tests.deepspeed_env
tmpfs = _tests.tmpfs
_repository_unchanged = _tests._repository_unchanged
_signal_dispositions_restored = _tests._signal_dispositions_restored
_private_cache = _tests._private_cache
_no_process_left_running = _tests._no_process_left_running

_rows: dict[str, list[dict[str, object]]] = {}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--peers-json", default=None, help="write the measured lines of every peer run here")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when != "call" and not (report.when == "setup" and report.outcome != "passed"):
        return
    measured = [line for line in report.capstdout.splitlines() if line.startswith("measured")]
    file, _, name = report.nodeid.partition("::")
    _rows.setdefault(Path(file).name, []).append({"test": name, "outcome": report.outcome, "measured": measured})


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:  # type: ignore[no-untyped-def]
    write = terminalreporter.write_line
    for file in sorted(_rows):
        terminalreporter.section(f"peers measured alone: {file}", sep="-")
        for row in _rows[file]:
            write(f"{row['outcome']:>7}  {row['test']}")
            for line in row["measured"]:  # type: ignore[union-attr]
                write(f"         {line}")
    path = config.getoption("--peers-json")
    if path:
        Path(path).write_text(json.dumps(_rows, indent=1))
        write(f"written: {path}")
