"""Lightning alone, under the faults of tests/test_integration_lightning.py: what it loses, measured (moved from that
file; the numbers go into the "alone" columns of the docs, and each run still asserts them, so a peer that changes is
noticed). Run by ``make bench-peers`` (benchmarks/peers/conftest.py)."""

from __future__ import annotations

import random
import signal
from pathlib import Path

import pytest

from test_integration_lightning import (  # noqa: F401 (fixtures)
    LIGHTNING,
    SAVE_EVERY,
    STEPS,
    attempt,
    compare,
    finish,
    reference,
    report,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_lightning_alone_sigkill_is_not_exact(reference, tmp_path: Path) -> None:  # noqa: F811 - a pytest fixture
    rng = random.Random(11)
    atts = [attempt(tmp_path, *LIGHTNING, stop_at=t) for t in sorted(rng.sample(range(2, STEPS - 2), 2))]
    assert all(a.rc == -signal.SIGKILL for a in atts)
    atts.append(finish(tmp_path, *LIGHTNING))
    cmp = compare(reference, tmp_path, atts)
    report("lightning sigkill", cmp)
    # the counters come back (global_step, epoch) ...
    assert cmp.global_step == (STEPS, STEPS) and cmp.epoch[0] == cmp.epoch[1]
    assert atts[-1].first_step is not None and atts[-1].first_step % SAVE_EVERY == 0
    # ... but not the RNG: micro-batches re-run after the resume draw other dropout masks
    assert cmp.rerun_disagree > 0 and not cmp.weights and not cmp.optimizer
    assert cmp.losses_equal < cmp.losses_total



def test_lightning_alone_sigterm_exits_0_and_loses_steps(reference, tmp_path: Path) -> None:  # noqa: F811 - a pytest fixture
    att = attempt(tmp_path, *LIGHTNING, "--sigterm-at", "10")
    saved = sorted(p.name for p in (tmp_path / "run").iterdir())
    report("lightning sigterm", {"rc": att.rc, "last step run": max(att.steps_done), "saved": saved})
    assert att.rc == 0  # a scheduler or torchrun sees a finished job
    assert saved == ["epoch=1-step=8.ckpt", "last.ckpt"]  # stopped after step 10 and half of 11: 8 is the newest
    final = finish(tmp_path, *LIGHTNING, "--sigterm-at", "10")
    cmp = compare(reference, tmp_path, [att, final])
    report("lightning sigterm resumed", {"first step": final.first_step, "comparison": cmp})
    assert final.first_step == 8 and not cmp.exact



def test_lightning_alone_exception_checkpoint_is_not_exact(reference, tmp_path: Path) -> None:  # noqa: F811 - a pytest fixture
    """Lightning's OnExceptionCheckpoint saves on the exception, but not the RNG: the resume is not exact."""
    flags = (*LIGHTNING, "--on-exception", "--crash-at", "11")
    att = attempt(tmp_path, *flags)
    assert att.rc == 1 and (tmp_path / "run" / "on_exception.ckpt").exists()
    final = finish(tmp_path, *flags)
    cmp = compare(reference, tmp_path, [att, final])
    report("lightning exception", {"first step": final.first_step, "comparison": cmp})
    assert not cmp.exact and not cmp.weights



def test_lightning_alone_sigkill_inside_a_save_breaks_the_resume(tmp_path: Path) -> None:
    """Killed half-way through writing last.ckpt (its 6th file: step-12's top-k file, then last.ckpt):
    ckpt_path="last" picks the torn file and the resume crashes."""
    att = attempt(tmp_path, *LIGHTNING, "--lightning-kill-in-save", "6")
    assert att.rc == -signal.SIGKILL and "KILLED IN SAVE" in att.stdout
    again = attempt(tmp_path, *LIGHTNING)
    report("lightning kill in save", {"resume rc": again.rc, "error": again.stderr.strip().splitlines()[-1:]})
    assert again.rc != 0 and "FINISHED" not in again.stdout
