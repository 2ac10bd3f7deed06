"""Lightning alone on 2 ranks, under the faults of tests/test_integration_lightning_dist.py: what it loses, measured
(moved from that file; the numbers go into the "alone" columns of the docs, and each run still asserts them, so a peer
that changes is noticed). Run by ``make bench-peers`` (benchmarks/peers/conftest.py)."""

from __future__ import annotations

import random
import re
import shutil
import signal
import threading
from pathlib import Path

import pytest
import torch

from test_integration_lightning_dist import (  # noqa: F401 (fixtures)
    ALONE,
    HANG_S,
    STEPS,
    Reference,
    alive,
    at_step,
    compare,
    final,
    job,
    kill_job,
    launch,
    lightning_saved,
    merged,
    reference,
    report,
    resumed_at,
    rows,
    same,
    sigkill_rank,
)
from unbroken.faults import EXIT_PREEMPTED

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.mark.parametrize("reference", ["ddp"], indirect=True)
def test_lightning_alone_under_the_same_faults(reference: Reference, tmp_path: Path) -> None:  # noqa: F811 - a pytest fixture
    """Lightning alone through a kill inside a save, a SIGTERM, a killed rank, and a resume on 1 rank; the numbers
    go to docs/integrations.md. Lightning's uninterrupted run equals the reference (the first launch's losses
    up to its kill are the reference's), so every difference comes from a resume."""
    env = dict(reference.env, TMPDIR=str(tmp_path / "tmp"))  # fsspec's temporary files land here: counted
    (tmp_path / "tmp").mkdir()
    run_dir, out = tmp_path / "run", tmp_path / "out"
    rng = random.Random("lightning-alone")
    # 1. rank 0 SIGKILLed inside the save of step 6: last.ckpt's bytes complete in fsspec's temporary file, the
    # move over last.ckpt not done (the 4th file rank 0 writes: 2 per save, the top-k file first)
    code, log = launch(tmp_path, job(tmp_path, *ALONE, "--lightning-kill-in-save", "4"), env=env)
    assert "KILLED IN SAVE" in log and code != 0, log[-3000:]
    ref0, _ = merged(reference.out, 0)
    assert all(ref0[(r["epoch"], r["batch"])][1] == r["loss"] for r in rows(out, 0))  # the same run until then
    report("kill in save", {"rc": code, "run folder": lightning_saved(run_dir),
                            "last.ckpt": torch.load(run_dir / "last.ckpt", weights_only=False)["global_step"],
                            "temporary files left": len(list((tmp_path / "tmp").iterdir()))})
    # 2. relaunched with a SIGTERM to the job's process
    before, term = len(rows(out, 0)), 8  # the middle of a save interval
    hung: list[bool] = []

    def kill_if_running() -> None:
        if any(alive(int(f.read_text())) for f in out.glob("pid-r*")):
            hung.append(True)
            kill_job(tmp_path)

    watchdog = threading.Timer(HANG_S, kill_if_running)  # the ranks may deadlock (Lightning issue 20806)
    on_line, fired = at_step(tmp_path, term, lambda proc: (proc.send_signal(signal.SIGTERM), watchdog.start()))
    try:
        code, log = launch(tmp_path, job(tmp_path, *ALONE), env=env, on_line=on_line)
    finally:
        watchdog.cancel()
    last = rows(out, 0)[-1]
    report("kill in save, resumed", {"resumed at step": resumed_at(out, before)})
    report("sigterm", {"sent during step": term, "rc": code, "hung": bool(hung),
                       "last micro-batch (epoch, batch, global_step)": (last["epoch"], last["batch"], last["step"]),
                       "run folder": lightning_saved(run_dir), "a rank failed": "Traceback" in log})
    assert fired and code != EXIT_PREEMPTED and f"step={term}" not in " ".join(lightning_saved(run_dir)), log[-3000:]
    # 3. relaunched, rank 1 SIGKILLed at a random step
    before, kill = len(rows(out, 0)), rng.randint(last["step"] + 3, STEPS - 1)
    on_line, fired = at_step(tmp_path, kill, sigkill_rank(tmp_path, 1))
    code, log = launch(tmp_path, job(tmp_path, *ALONE), env=env, on_line=on_line)
    assert fired and code != 0, log[-3000:]
    report("sigterm, resumed", {"resumed at step": resumed_at(out, before)})
    saved_at = torch.load(run_dir / "last.ckpt", weights_only=False)["global_step"]  # Lightning's own pickle
    shutil.copytree(run_dir, tmp_path / "ws" / "run")
    # 4. relaunched to the end, compared with the uninterrupted run
    before = len(rows(out, 0))
    code, log = launch(tmp_path, job(tmp_path, *ALONE), env=env)
    assert code == 0, log[-3000:]
    report("killed rank", {"killed during step": kill, "last.ckpt": saved_at,
                           "resumed at step": resumed_at(out, before)})
    cmp = compare(reference.out, out)
    report("resumed to the end", cmp)
    assert cmp["re-run micro-batches that differ"] and not cmp["final parameters and moments equal"]  # not exact
    # 5. its last.ckpt (the state after step `saved_at`, written by 2 ranks) resumed on 1 rank
    ws = tmp_path / "ws"
    code, log = launch(ws, job(ws, *ALONE, "--dump-restored", devices=1), env=env)
    assert code == 0, log[-3000:]
    restored = same(final(out, f"step-{saved_at}.safetensors"), final(ws / "out", "restored.safetensors"))
    both = [merged(reference.out, r)[0] for r in (0, 1)]
    got, _ = merged(ws / "out", 0)
    samples = all(got[k][2] == (both[0][k][2] + both[1][k][2])[:len(got[k][2])] for k in got)
    report("another world size", {"restored state equal": restored, "same global samples": samples,
                                  "first step": min(v[0] for v in got.values())})



def test_lightning_alone_distributed_checkpoint_killed_inside_a_save(tmp_path: Path) -> None:
    """ModelParallelStrategy (FSDP2) alone: Lightning saves a distributed checkpoint folder, DCP writing into the
    existing ``last.ckpt/`` in place (each rank its file, then the coordinator's ``.metadata``, then rank 0's
    ``meta.pt``). Rank 1 SIGKILLed half-way through its file of step 6's ``last.ckpt``: the folder mixes two saves,
    and the relaunch with ``ckpt_path="last"`` crashes in DCP's load (the files do not change: every relaunch does)."""
    flags = ("--mode", "lightning", "--lightning-kill-in-save", "4", "--kill-rank", "1")  # the 2nd save's last.ckpt
    code, log = launch(tmp_path, job(tmp_path, *flags, strategy="fsdp2"))
    assert "KILLED IN SAVE" in log and code != 0, log[-3000:]
    last = tmp_path / "run" / "last.ckpt"
    sizes = {p.name: p.stat().st_size for p in last.iterdir()}
    complete = {p.name: p.stat().st_size for p in (tmp_path / "run" / "epoch=0-step=6.ckpt").iterdir()}
    assert sizes["__1_0.distcp"] < complete["__1_0.distcp"]  # torn; step 3's .metadata beside step 6's rank-0 file
    code, log = launch(tmp_path, job(tmp_path, "--mode", "lightning", strategy="fsdp2"))
    error = [line for line in log.splitlines() if re.search(r"^\[rank\d\]: \w+Error", line)]
    report("fsdp2 kill in save", {"last.ckpt": sizes, "complete step-6 folder": complete, "relaunch rc": code,
                                  "error": error[-1:]})
    assert code != 0 and "FINISHED" not in log
