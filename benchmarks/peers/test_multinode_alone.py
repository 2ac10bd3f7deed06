"""The job of tests/test_multinode.py checkpointed by PyTorch alone, under the same faults: measured.

The job is benchmarks/peers/multinode_alone_train.py: the same model, data and optimizer, checkpointed as
PyTorch's multinode DDP tutorial does it (rank 0 ``torch.save``s a ``snapshot.pt`` every 4 steps,
every rank loads it at start and skips the batches already done), two nodes of tests/netns.py. The
test asserts what it does; it documents torch 2.13's behaviour (the column "PyTorch alone" of
docs/distributed.md) and fails if that changes. The column "torchrun + unbroken" is
tests/test_multinode.py.
"""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest
import torch

from netns import Cluster
from test_distributed import losses
from test_multinode import ENV, GLOBAL_BATCH, SAVE_EVERY, STEPS, Job, cluster, nodes  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
ALONE = str(Path(__file__).parent / "multinode_alone_train.py")


def test_pytorch_alone_loses_the_steps_since_its_snapshot_resumes_not_bitwise_and_is_stuck_after_a_torn_one(
        nodes: Cluster, tmp_path: Path) -> None:  # noqa: F811 - a pytest fixture
    """The column "PyTorch alone" of docs/distributed.md: the same job checkpointed as PyTorch's
    multinode DDP tutorial does it (benchmarks/peers/multinode_alone_train.py), under the same harness:

    1. SIGTERM to every process on every node after step 6: every process dies of it, no snapshot
       is written, the steps since the snapshot of step 4 are lost;
    2. relaunched, it resumes from step 4 with the same samples but other losses (the snapshot has
       no RNG state: dropout draws anew); node 0 is lost half-way through writing snapshot.pt;
    3. relaunched again, every rank fails to load the torn snapshot.pt: the job cannot go on
       without deleting it by hand (and losing every step)."""
    script = [ALONE, "--run-dir", str(tmp_path / "run"), "--out", str(tmp_path / "out"), "--steps", str(STEPS),
              "--save-every", str(SAVE_EVERY), "--global-batch", str(GLOBAL_BATCH)]
    job = Job(nodes, tmp_path, script=script)
    job.start(1, env=dict(ENV, MULTINODE_STOP_AFTER="6"))  # rank 1 waits after step 6, rank 0 in step 7
    job.start(0)
    (waiting,) = job.until("rank 1 stopped after step 6", nodes.nodes[1].stopped)
    assert len(nodes.signal_all(signal.SIGTERM)) == 4  # two agents, two workers
    os.kill(waiting, signal.SIGCONT)
    assert all(code != 0 for code in job.wait()), job.out
    assert "rank 0: done" not in job.out and "rank 1: done" not in job.out
    first = [losses(tmp_path / "out", r) for r in (0, 1)]
    done = min(max(first[r]) for r in (0, 1))  # the last step every rank finished
    assert done == 6, job.out
    snapshot = tmp_path / "run" / "snapshot.pt"
    assert torch.load(snapshot, weights_only=True)["step"] == SAVE_EVERY  # steps 5..done: lost
    print(f"PyTorch alone, SIGTERM everywhere after step {done}: snapshot of step {SAVE_EVERY}, "
          f"{done - SAVE_EVERY} steps lost")

    job = Job(nodes, tmp_path, script=script)
    job.start(1)
    job.start(0, env=dict(ENV, MULTINODE_FREEZE_IN_SAVE="1"))  # its first snapshot: step 8
    job.until("rank 0 frozen in its snapshot", nodes.nodes[0].stopped)
    nodes.nodes[0].kill_all()
    assert all(code != 0 for code in job.wait()), job.out
    assert all(f"rank {r}: resumed from step {SAVE_EVERY}" in job.out for r in (0, 1)), job.out
    again = [losses(tmp_path / "out", r) for r in (0, 1)]
    redone = [(r, s) for r in (0, 1) for s in range(SAVE_EVERY + 1, done + 1)]
    assert all(again[r][s][1] == first[r][s][1] for r, s in redone)  # the same samples ...
    equal = sum(again[r][s][0] == first[r][s][0] for r, s in redone)
    assert equal < len(redone)  # ... not the same losses
    print(f"PyTorch alone, resumed from step {SAVE_EVERY}: {equal} of {len(redone)} recomputed losses equal")

    job = Job(nodes, tmp_path, script=script)
    job.start(1)
    job.start(0)
    assert all(code != 0 for code in job.wait()), job.out
    # torch 2.13 reading the torn zip archive, on both ranks: "OSError: [Errno 22] Invalid argument"
    assert set(re.findall(r"\[rank(\d)\]: OSError: \[Errno 22\] Invalid argument", job.out)) == {"0", "1"}, job.out
    assert "resumed from step" not in job.out
