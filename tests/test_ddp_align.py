"""DDP on four ranks (torchrun, gloo): a rank SIGKILLed, the job restarted, the end bitwise equal to
the job never stopped, because the first step after the resume sums the gradients as the
uninterrupted run sums that step (:mod:`unbroken.dist.ddpalign`). Without that alignment
(``UNBROKEN_DDP_ALIGN=0``, the negative control) the same resume differs in the last bits. The same
with the constructor options that change the buckets or the buffers and are aligned (issue 33 §6;
the table of every option is in docs/distributed.md): small buckets and gradients as bucket views,
no buffer broadcast and no initial sync.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from test_distributed import ENV, job, kill_at, losses, run, same_final, torchrun

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
ARGS = ("--steps", "10", "--save-every", "1")


@pytest.fixture(scope="module")
def reference4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("ddp4-reference")
    code, out = run(torchrun(4, *job(base, *ARGS)), env=ENV)
    assert code == 0, out
    return base / "out"


def resumed_after_kill(base: Path, env: dict[str, str], *extra: str) -> str:
    """The job, rank 2 SIGKILLed right after step 6's save returned, restarted once."""
    on_line, killed = kill_at(base, 2, 7)
    code, out = run(torchrun(4, *job(base, *ARGS, *extra), restarts=1), env=env, on_line=on_line)
    assert code == 0 and killed, out
    resumed = {int(r): int(s) for r, s in re.findall(r"rank (\d): resumed from step (\d+)", out)}
    assert resumed == {0: 6, 1: 6, 2: 6, 3: 6}, out
    return out


def test_ddp_on_four_ranks_resumes_bitwise(reference4: Path, tmp_path: Path) -> None:
    resumed_after_kill(tmp_path, ENV)
    assert same_final(reference4, tmp_path / "out")
    for rank in range(4):
        assert losses(tmp_path / "out", rank) == losses(reference4, rank)


def test_without_the_alignment_the_same_resume_differs_in_the_last_bits(reference4: Path, tmp_path: Path) -> None:
    resumed_after_kill(tmp_path, dict(ENV, UNBROKEN_DDP_ALIGN="0"))
    assert not same_final(reference4, tmp_path / "out")  # the negative control: the test above can fail


OPTIONS = {"small-buckets-as-views": {"bucket_cap_mb": 0.002, "gradient_as_bucket_view": True},
           "no-buffer-broadcast-no-init-sync": {"broadcast_buffers": False, "init_sync": False}}


@pytest.mark.parametrize("name", list(OPTIONS))
def test_aligned_ddp_options_resume_bitwise_and_not_without_the_alignment(name: str, tmp_path: Path) -> None:
    options = ("--ddp-options", json.dumps(OPTIONS[name]))
    code, out = run(torchrun(4, *job(tmp_path / "reference", *ARGS, *options)), env=ENV)
    assert code == 0, out
    reference = tmp_path / "reference" / "out"
    out = resumed_after_kill(tmp_path / "aligned", ENV, *options)
    assert "not aligned" not in out, out  # no warning: these options are aligned
    assert same_final(reference, tmp_path / "aligned" / "out")
    for rank in range(4):
        assert losses(tmp_path / "aligned" / "out", rank) == losses(reference, rank)
    resumed_after_kill(tmp_path / "control", dict(ENV, UNBROKEN_DDP_ALIGN="0"), *options)
    assert not same_final(reference, tmp_path / "control" / "out")  # the negative control
