"""The HF Trainer integration with DDP on four ranks (torchrun, gloo, CPU), with
``ddp_find_unused_parameters=False`` (as HF sets it under gradient checkpointing; then DDP rebuilds
its buckets after its first iteration): a rank SIGKILLed after step 7, the group restarted, the
job ends bitwise equal to the same job never stopped, every rank's every step included. The
Trainer's DDP wrapper is not in the state unbroken restores (the unwrapped model is): the callback
aligns the wrapper's first step after the resume (:mod:`unbroken.dist.ddpalign`). Without it
(``UNBROKEN_DDP_ALIGN=0``, the negative control) the same resume differs in the last bits. (With
HF's default ``ddp_find_unused_parameters=True`` DDP never rebuilds its buckets, and a resume is
bitwise without any of this: seen, not tested here.)

The job is ``tests/hf_dist_train.py`` (see tests/test_integration_hf_dist.py), at four ranks one
micro-batch of 4 samples per rank per step (the global batch of 16 kept).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from test_distributed import kill_at
from test_integration_hf_dist import differing, launch, rows, torchrun

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
FLAGS = ("--ddp-find-unused-false",)
ENV = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", TRANSFORMERS_VERBOSITY="error")


@pytest.fixture(scope="module")
def reference4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("hf-ddp4-reference")
    code, out = launch(torchrun(4, base, "ddp", "unbroken", *FLAGS), ENV, base)
    assert code == 0, out[-5000:]
    return base / "out"


def killed_and_resumed(base: Path, env: dict[str, str]) -> None:
    on_line, killed = kill_at(base, 1, 7)
    code, out = launch(torchrun(4, base, "ddp", "unbroken", *FLAGS, restarts=1), env, base, on_line)
    assert code == 0 and killed, out[-5000:]
    assert "rank 0: resumed from step 6" in out, out[-5000:]


def test_hf_trainer_ddp_on_four_ranks_resumes_bitwise(reference4: Path, tmp_path: Path) -> None:
    killed_and_resumed(tmp_path, ENV)
    assert not differing(reference4 / "final.safetensors", tmp_path / "out" / "final.safetensors")
    for rank in range(4):
        assert rows(tmp_path / "out", rank) == rows(reference4, rank)


def test_without_the_alignment_the_hf_resume_differs_in_the_last_bits(reference4: Path, tmp_path: Path) -> None:
    killed_and_resumed(tmp_path, dict(ENV, UNBROKEN_DDP_ALIGN="0"))
    assert differing(reference4 / "final.safetensors", tmp_path / "out" / "final.safetensors")
