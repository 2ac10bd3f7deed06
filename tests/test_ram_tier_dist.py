"""The RAM tier with two ranks under torchrun (gloo, CPU): one node's ranks write one RAM
checkpoint together and a killed rank's restarted group resumes from memory, bitwise; ranks that
do not share the RAM folder (as on several nodes) are refused on every rank.

The RAM root is each test's temporary folder (``UNBROKEN_RAM_ROOT``), never the machine's /dev/shm.
"""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest

from test_distributed import (ENV, STEPS, all_rows, job, losses, reference,  # noqa: F401 (reference: the fixture)
                              run, same_final, torchrun)

pytestmark = pytest.mark.e2e


def test_ddp_rank_killed_resumes_from_ram_on_every_rank_bitwise(reference: Path, tmp_path: Path) -> None:
    env = dict(ENV, UNBROKEN_RAM_ROOT=str(tmp_path / "shm"))
    target, killed = 9, []

    def on_line(line: str, proc) -> None:
        if not killed and f"rank 1 step {target}" in line:
            pid = int((tmp_path / "out" / "pid-r1").read_text())
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

    code, out = run(torchrun(2, *job(tmp_path, "--save-every", "1", "--ram", "4"), restarts=2), env=env,
                    on_line=on_line)
    assert code == 0 and killed, out
    resumed = {int(r): int(s) for r, s in re.findall(r"rank (\d): resumed from step (\d+)", out)}
    assert set(resumed) == {0, 1} and resumed[0] == resumed[1] >= target - 1, out  # at most a step lost
    said = [line for line in out.splitlines() if "unbroken: resumed from" in line]
    assert said and all(f"{tmp_path / 'shm'}" in line for line in said), said  # read from the RAM folder
    assert same_final(reference, tmp_path / "out")
    for rank in (0, 1):
        assert losses(tmp_path / "out", rank) == losses(reference, rank)
        assert len(all_rows(tmp_path / "out", rank)) > STEPS
    assert list((tmp_path / "shm").iterdir()) == []  # removed at close, with the per-user folder
    assert (tmp_path / "run" / f"step-{STEPS:09d}").is_dir()  # the last state persisted


def test_ranks_that_do_not_share_the_ram_folder_are_refused_on_every_rank(tmp_path: Path) -> None:
    env = dict(ENV, UNBROKEN_RAM_ROOT=str(tmp_path / "shm"))
    code, out = run(torchrun(2, *job(tmp_path, "--save-every", "1", "--ram", "4", "--ram-root-per-rank")), env=env)
    assert code != 0
    assert len(re.findall(r"ConfigurationError: the RAM tier needs every rank on one node", out)) == 2, out
    assert "rank(s) 1 cannot see" in out
    assert not list((tmp_path / "run").glob("step-*"))  # nothing was saved anywhere
