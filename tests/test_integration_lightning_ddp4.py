"""The Lightning integration with DDP on four ranks (torchrun, gloo, CPU): a rank SIGKILLed after
step 7, the group restarted, the job ends bitwise equal to the same job never stopped, every rank's
every micro-batch included. The strategy's DDP wrapper is not in the state unbroken restores (the
LightningModule is): the callback aligns the wrapper's first step after the resume
(:mod:`unbroken.dist.ddpalign`). Without it (``UNBROKEN_DDP_ALIGN=0``, the negative control) the
same resume differs in the last bits.

The job is ``tests/lightning_dist_train.py`` (see tests/test_integration_lightning_dist.py), at
four ranks 2 samples per rank per micro-batch, 2 micro-batches a step (the global batch of 16 kept).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import jobs
from test_distributed import kill_at
from test_integration_lightning_dist import ENV, final, job, launch, merged, same

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def torchrun4(base: Path, restarts: int = 0) -> list[str]:
    return jobs.torchrun(4, *job(base, devices=4)[1:], restarts=restarts)


@pytest.fixture(scope="module")
def reference4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("lightning-ddp4-reference")
    code, out = launch(base, torchrun4(base), env=ENV)
    assert code == 0, out[-5000:]
    return base / "out"


def killed_and_resumed(base: Path, env: dict[str, str]) -> None:
    on_line, killed = kill_at(base, 1, 7)
    code, out = launch(base, torchrun4(base, restarts=1), env=env, on_line=on_line)
    assert code == 0 and killed, out[-5000:]
    assert re.search(r"unbroken: resumed from \S+step-0+6 \(step 6\)", out), out[-5000:]


def test_lightning_ddp_on_four_ranks_resumes_bitwise(reference4: Path, tmp_path: Path) -> None:
    killed_and_resumed(tmp_path, ENV)
    assert same(final(reference4), final(tmp_path / "out"))
    for rank in range(4):
        assert merged(tmp_path / "out", rank) == (merged(reference4, rank)[0], 0)


def test_without_the_alignment_the_lightning_resume_differs_in_the_last_bits(reference4: Path,
                                                                            tmp_path: Path) -> None:
    killed_and_resumed(tmp_path, dict(ENV, UNBROKEN_DDP_ALIGN="0"))
    assert not same(final(reference4), final(tmp_path / "out"))
