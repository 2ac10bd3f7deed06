"""The RAM tier with two ranks under torchrun (gloo, CPU): one node's ranks write one RAM
checkpoint together and a killed rank's restarted group resumes from memory, bitwise; ranks that
with a RAM folder each (two nodes) keep a copy of every RAM checkpoint on each, so the loss of
either node's memory resumes from the other's.

The RAM root is each test's temporary folder (``UNBROKEN_RAM_ROOT``), never the machine's /dev/shm.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from test_distributed import (ENV, STEPS, all_rows, job, losses, reference,  # noqa: F401 (reference: the fixture)
                              run, same_final, torchrun)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_ddp_rank_killed_resumes_from_ram_on_every_rank_bitwise(reference: Path, tmp_path: Path) -> None:  # noqa: F811 - a pytest fixture
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


def test_on_two_nodes_each_keeps_every_ram_checkpoint_and_a_lost_nodes_memory_comes_from_the_other(
        reference: Path, tmp_path: Path) -> None:  # noqa: F811 - a pytest fixture
    """Each rank with a RAM root of its own (``--ranks-per-node 1``): two nodes as far as the RAM
    tier can tell. Rank 1 is SIGKILLed after step 9 and its node's memory wiped (a lost node
    replaced by a fresh one): the job resumes from step 9 in node 0's memory, copied to the new
    node 1 first. Then rank 0, the coordinator, after step 13, with node 0's memory: the job
    resumes from step 13, which only node 1 holds. Bitwise, every step's loss, as never stopped."""
    env = dict(ENV, UNBROKEN_RAM_ROOT=str(tmp_path / "shm"))
    plan, done = [(1, 9), (0, 13)], []

    def on_line(line: str, proc) -> None:
        if len(done) < len(plan):
            rank, step = plan[len(done)]
            if re.search(rf"rank {rank} step {step + 1}(?!\d)", line):  # step's save returned on that rank
                pid = int((tmp_path / "out" / f"pid-r{rank}").read_text())
                os.kill(pid, signal.SIGKILL)
                shutil.rmtree(tmp_path / "shm" / f"node{rank}")
                done.append(step)

    code, out = run(torchrun(2, *job(tmp_path, "--save-every", "1", "--ram", "50", "--ranks-per-node", "1"),
                             restarts=3), env=env, on_line=on_line)
    assert code == 0 and len(done) == 2, out
    resumed = [(int(r), int(s)) for r, s in re.findall(r"rank (\d): resumed from step (\d+)", out)]
    assert sorted(resumed) == [(0, 9), (0, 13), (1, 9), (1, 13)], out  # not a step lost, twice
    said = [line for line in out.splitlines() if "unbroken: resumed from" in line]
    assert len(said) == 2 and all(f"{tmp_path / 'shm'}" in line for line in said), said  # from memory
    assert len(re.findall(r"copied RAM checkpoint step-0+9 from node 0's memory to node\(s\) 1$", out, re.M)) == 1, out
    assert len(re.findall(r"copied RAM checkpoint step-0+13 from node 1's memory to node\(s\) 0$", out, re.M)) == 1, out
    # (persisted every 50, so 9 and 13 reach the disk only if the survivor, stopped by torchrun, persisted
    # its newest RAM checkpoint as it exited, as close() does: the resumes above still read memory)
    assert same_final(reference, tmp_path / "out")
    for rank in (0, 1):
        assert losses(tmp_path / "out", rank) == losses(reference, rank)
    assert list((tmp_path / "shm").rglob("step-*")) == []  # every node's copies removed at close


def committed(base: Path) -> list[int]:
    return [int(p.name.split("-")[1]) for p in (base / "run").glob("step-*")]


def test_two_nodes_of_two_ranks_background_lazy_saves_a_lost_node_resumes_from_the_other_bitwise(
        tmp_path: Path) -> None:
    """Four ranks, two per node (``--ranks-per-node 2``): each node's ranks write into their node's
    memory, the node leaders exchange the files, from the background save thread (``lazy``). Both
    ranks of node 1 are SIGKILLed after step 6 and its memory wiped: the job resumes on every rank
    from the newest step committed, from node 0's memory, copied to node 1, and ends bitwise equal
    to the same job never stopped."""
    env = dict(ENV, UNBROKEN_RAM_ROOT=str(tmp_path / "shm"))
    args = ("--save-every", "1", "--ram", "50", "--ranks-per-node", "2", "--async-save", "lazy", "--steps", "10",
            "--mode", "fsdp")
    code, out = run(torchrun(4, *job(tmp_path / "ref", *args)), env=env)
    assert code == 0, out
    killed: list[int] = []

    def on_line(line: str, proc) -> None:
        if not killed and re.search(r"rank 3 step 7(?!\d)", line):
            for rank in (2, 3):
                pid = int((tmp_path / "out" / f"pid-r{rank}").read_text())
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            shutil.rmtree(tmp_path / "shm" / "node1")

    code, out = run(torchrun(4, *job(tmp_path, *args), restarts=1), env=env, on_line=on_line)
    assert code == 0 and killed, out
    resumed = {int(r): int(s) for r, s in re.findall(r"rank (\d): resumed from step (\d+)", out)}
    assert set(resumed) == {0, 1, 2, 3} and len(set(resumed.values())) == 1, out
    step = resumed[0]
    assert step in (5, 6), out  # the background save of step 6 may not have committed yet
    assert f"copied RAM checkpoint step-{step:09d} from node 0's memory to node(s) 1" in out
    assert same_final(tmp_path / "ref" / "out", tmp_path / "out")
    for rank in range(4):
        assert losses(tmp_path / "out", rank) == losses(tmp_path / "ref" / "out", rank)
    assert list((tmp_path / "shm").rglob("step-*")) == []


def test_a_node_killed_while_it_receives_the_other_nodes_files_commits_nothing_and_the_job_resumes_bitwise(
        reference: Path, tmp_path: Path) -> None:  # noqa: F811 - a pytest fixture
    """Two nodes (a RAM root per rank). Rank 1 is SIGKILLed in the middle of a RAM save's copy
    between the nodes (after the 7th file it received): that save is committed on no node, the
    restarted job resumes on both ranks from the step before it, node 1's half-received copy is
    removed by its next start, and the job ends bitwise."""
    env = dict(ENV, UNBROKEN_RAM_ROOT=str(tmp_path / "shm"), UNBROKEN_FAULTS="peers.after_file@1=7",
               UNBROKEN_FAULT_ONCE=str(tmp_path / "fired"))
    code, out = run(torchrun(2, *job(tmp_path, "--save-every", "1", "--ram", "50", "--ranks-per-node", "1"),
                             restarts=1), env=env)
    assert code == 0 and (tmp_path / "fired").exists(), out
    resumed = {int(r): int(s) for r, s in re.findall(r"rank (\d): resumed from step (\d+)", out)}
    assert set(resumed) == {0, 1} and resumed[0] == resumed[1], out
    lost = resumed[0] + 1  # the save the kill was in: its step is trained again
    assert len([line for line in losses_rows(tmp_path / "out", 0) if line == lost]) == 2, out
    assert same_final(reference, tmp_path / "out")
    for rank in (0, 1):
        assert losses(tmp_path / "out", rank) == losses(reference, rank)
    assert list((tmp_path / "shm").rglob("*staging*")) == [] and list((tmp_path / "shm").rglob("step-*")) == []


def losses_rows(out: Path, rank: int) -> list[int]:
    return [step for step, _ in all_rows(out, rank)]


def test_a_node_whose_memory_cannot_hold_the_tier_is_refused_at_the_first_save_on_every_rank(tmp_path: Path) -> None:
    """Node 1's RAM root is a 1 MB tmpfs (node 0's is large): its leader checks its own memory as
    the coordinator checks node 0's, so the first RAM save fails on every rank naming node 1 and
    the numbers, and nothing is committed on either node."""
    node1 = tmp_path / "shm" / "node1"
    node1.mkdir(parents=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(node1)], capture_output=True)
    if mounted.returncode != 0:
        pytest.fail(f"cannot mount a tmpfs: {mounted.stderr.decode()}") if os.geteuid() == 0 else pytest.skip("root")
    try:
        env = dict(ENV, UNBROKEN_RAM_ROOT=str(tmp_path / "shm"))
        code, out = run(torchrun(2, *job(tmp_path, "--save-every", "1", "--ram", "50", "--ranks-per-node", "1")),
                        env=env)
        assert code != 0
        assert re.search(r"\[rank1\]: unbroken.errors.InsufficientSpaceError: node 1: the RAM tier in \S+node1 "
                         r"cannot hold .* MB in all; the shared memory filesystem has 1.0 MB free", out), out
        assert re.search(r"\[rank0\]: unbroken.errors.StorageError: checkpoint step-0+1 was not committed: rank 1: "
                         r"InsufficientSpaceError: node 1: ", out), out  # both ranks say it
        assert list((tmp_path / "shm").rglob("step-*")) == [] and list((tmp_path / "shm").rglob("*staging*")) == []
        assert not list((tmp_path / "run").glob("step-*"))
    finally:
        subprocess.run(["umount", "-l", str(node1)], check=False)
