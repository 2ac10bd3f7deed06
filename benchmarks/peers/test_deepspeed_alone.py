"""DeepSpeed's own checkpointing under the faults of tests/test_deepspeed.py: what it does, measured.

The job is benchmarks/peers/ds_alone_train.py: the job of ds_train.py (ZeRO-2 unless said, 2 ranks, 12
steps) checkpointed by DeepSpeed's documented recipe, ``engine.save_checkpoint(dir,
client_state={"step": ...})`` every 3 steps and ``engine.load_checkpoint(dir)`` on start, with
a DistributedSampler whose consumed micro-batches a resumed process skips. Each test compares
a faulted run with the uninterrupted one and asserts what DeepSpeed alone does, where it is
equal bitwise and where it is not; they document DeepSpeed 0.19's behaviour and fail if it
changes. The column "DeepSpeed + unbroken" of docs/integrations.md is tests/test_deepspeed.py.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import random
import shutil
import signal
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from test_deepspeed import launch, rows, same_tensors

assert importlib.util.find_spec("deepspeed"), "DeepSpeed is missing: `make test` installs it (the test extra)"
pytestmark = [pytest.mark.e2e, pytest.mark.slow]
SCRIPT = str(Path(__file__).parent / "ds_alone_train.py")
STEPS, SAVE_EVERY, CUT = 12, 3, 6


@pytest.fixture(scope="module")
def env(deepspeed_env: dict[str, str]) -> dict[str, str]:
    return deepspeed_env


def torchrun(n: int, base: Path, *extra: str, stage: int = 2, restarts: int = 0) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}",
            f"--max-restarts={restarts}", SCRIPT, "--ckpt-dir", str(base / "ckpt"), "--out", str(base / "out"),
            "--stage", str(stage), "--steps", str(STEPS), "--save-every", str(SAVE_EVERY), *extra]


def latest(base: Path) -> str:
    return (base / "ckpt" / "latest").read_text()


def logged_steps(out: Path, rank: int) -> list[int]:
    """Every step a rank logged, in order (a recomputed step appears twice)."""
    return [json.loads(x)["step"] for x in (out / f"losses-r{rank}.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, env: dict[str, str]) -> Path:
    """The uninterrupted 2-rank ZeRO-2 run, its state dumped after step CUT; its checkpoints kept."""
    base = tmp_path_factory.mktemp("ds-alone-reference")
    code, out = launch(torchrun(2, base, "--dump-at", str(CUT)), env, base)
    assert code == 0, out
    return base


def check_diverged_after(ref: Path, got: Path, resumed: int) -> None:
    """Steps up to ``resumed`` are bitwise the reference's; every later step trains on the same
    samples, but its losses differ from the first recomputed step on, and so do the final
    masters and moments: DeepSpeed's checkpoint holds no RNG state, so dropout draws anew."""
    for rank in (0, 1):
        want, have = rows(ref, rank), rows(got, rank)
        assert sorted(have) == list(range(1, STEPS + 1))
        assert all(have[s] == want[s] for s in range(1, resumed + 1))
        assert all(have[s][1] == want[s][1] for s in have)  # the data position is right
        assert have[resumed + 1][0] != want[resumed + 1][0]  # the dropout masks are not
    differ = same_tensors(ref / "final.safetensors", got / "final.safetensors")
    assert {k for k in differ if k.startswith("fp32/")}, differ
    assert "global_steps" not in differ and "lr" not in differ, differ  # the step count and schedule are restored


def check_lost_steps(out: Path, killed_after: int, resumed: int) -> None:
    """Rank 1 logged steps 1..killed_after (or one more, the kill being asynchronous), then the
    resumed process ran steps resumed+1..STEPS again: the steps since the last save were lost."""
    steps = logged_steps(out, 1)
    first = len(steps) - (STEPS - resumed)
    assert steps[first:] == list(range(resumed + 1, STEPS + 1))
    assert steps[:first] in (list(range(1, killed_after + 1)), list(range(1, killed_after + 2))), steps


def test_a_rank_sigkilled_at_a_random_step_resumes_from_the_last_save_but_not_bitwise(reference, env,
                                                                                       tmp_path) -> None:
    """Measured: killed after step 7, both ranks resumed from step 6 (the steps since the save
    lost and recomputed); the same samples per step, but the losses of every recomputed step and
    the final masters and moments differ from the uninterrupted run (dropout's RNG is not restored)."""
    # one after a save step: the kill lands long before the next save could start
    target = random.Random(7).choice([s for s in range(SAVE_EVERY + 1, STEPS - 1) if s % SAVE_EVERY == 1])
    resumed = target - 1
    killed: list[int] = []

    def on_line(line: str, proc) -> None:
        if not killed and f"rank 1 step {target}" in line:
            killed.append(int((tmp_path / "out" / "pid-r1").read_text()))
            os.kill(killed[0], signal.SIGKILL)

    code, out = launch(torchrun(2, tmp_path, restarts=1), env, tmp_path, on_line)
    assert code == 0 and killed, out
    assert out.count(f"resumed from step {resumed} ") == 2, out
    check_lost_steps(tmp_path / "out", target, resumed)
    check_diverged_after(reference / "out", tmp_path / "out", resumed)


def test_rank_0_killed_inside_a_save_before_latest_resumes_from_the_previous_save(reference, env,
                                                                                  tmp_path) -> None:
    """Rank 0 SIGKILLed in the save of step 6 once its files are written, before it writes
    ``latest``: ``latest`` still names step 3, so the restart resumes from step 3 (3 steps lost),
    not bitwise (as above); the torn ``global_step6/`` is overwritten by the re-run's save."""
    code, out = launch(torchrun(2, tmp_path, "--kill-after-files", str(CUT), restarts=1), env, tmp_path)
    assert code == 0 and "rank 0: killed inside the save of step 6, after its files" in out, out
    assert out.count(f"resumed from step {SAVE_EVERY} ") == 2, out
    check_lost_steps(tmp_path / "out", CUT, SAVE_EVERY)
    check_diverged_after(reference / "out", tmp_path / "out", SAVE_EVERY)


def test_the_only_difference_is_the_rng_a_user_who_saves_it_in_client_state_resumes_bitwise(reference, env,
                                                                                            tmp_path) -> None:
    """The same fault with the RNG state in ``client_state`` (restored after ``iter(loader)``):
    every micro-batch loss and the final masters and moments are bitwise the uninterrupted
    run's (which saved no RNG; saving it changes nothing else), so the differences above come
    from dropout's RNG alone."""
    code, out = launch(torchrun(2, tmp_path, "--kill-after-files", str(CUT), "--rng-in-client-state", restarts=1),
                       env, tmp_path)
    assert code == 0 and out.count(f"resumed from step {SAVE_EVERY} ") == 2, out
    check_lost_steps(tmp_path / "out", CUT, SAVE_EVERY)
    assert not same_tensors(reference / "out" / "final.safetensors", tmp_path / "out" / "final.safetensors")
    for rank in (0, 1):
        assert rows(tmp_path / "out", rank) == rows(reference / "out", rank)


def test_rank_1_killed_inside_a_save_after_rank_0_wrote_latest_crashes_every_restart(env, tmp_path) -> None:
    """Rank 0 writes ``latest`` once its own files are written; nothing waits for the other
    ranks' files. Rank 1 SIGKILLed half-way through its optimizer partition of the save of step
    6, once rank 0 has written ``latest``: ``latest`` names the torn checkpoint, rank 0 loads
    it, and rank 1 crashes in ``load_checkpoint`` at every restart (2 of 2) with
    ``OSError: [Errno 22] Invalid argument`` from ``torch.load`` (rank 0's own partition is
    whole: it loads), until someone repairs the folder."""
    code, out = launch(torchrun(2, tmp_path, "--kill-mid-file", str(CUT), restarts=2), env, tmp_path)
    assert code != 0, out
    assert "rank 1: killed inside the save of step 6, `latest` reads 'global_step6'" in out, out
    assert latest(tmp_path) == f"global_step{CUT}"
    torn = tmp_path / "ckpt" / f"global_step{CUT}" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    with pytest.raises(OSError):
        torch.load(torn, weights_only=False)
    assert "rank 1: resumed" not in out and out.count("[rank1]: OSError: [Errno 22] Invalid argument") == 2, out
    assert "rank 0: done" not in out, out


def test_sigterm_to_every_rank_kills_the_job_and_loses_the_steps_since_the_save(env, tmp_path) -> None:
    """DeepSpeed installs no SIGTERM handler: both ranks die of the signal (exit -15) after
    step 4, nothing is saved, ``latest`` names step 3: the steps since the last save are lost.
    (The ranks wait after step 4 until the signal comes, so a loaded machine cannot let them
    run on to the next save first.)"""
    target, sent = SAVE_EVERY + 1, []

    def on_line(line: str, proc) -> None:
        if not sent and f"rank 1 step {target}" in line:
            for f in sorted((tmp_path / "out").glob("pid-r*")):
                sent.append(int(f.read_text()))
                os.kill(sent[-1], signal.SIGTERM)

    code, out = launch(torchrun(2, tmp_path, "--pause-at", str(target)), env, tmp_path, on_line)
    assert code != 0 and len(sent) == 2, out
    assert "exitcode  : -15" in out and ": done" not in out, out
    assert latest(tmp_path) == f"global_step{SAVE_EVERY}"
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("global_step*")) == [f"global_step{SAVE_EVERY}"]
    assert max(logged_steps(tmp_path / "out", 1)) == target


@pytest.fixture(scope="module")
def zero3_cut(tmp_path_factory: pytest.TempPathFactory, env: dict[str, str]) -> Path:
    """A 2-rank ZeRO-3 run stopped after step CUT, its last checkpoint."""
    base = tmp_path_factory.mktemp("ds-alone-zero3")
    code, out = launch(torchrun(2, base, "--stop-at", str(CUT), stage=3), env, base)
    assert code == 0 and latest(base) == f"global_step{CUT}", out
    return base


@pytest.mark.parametrize("stage,error", [
    (2, "ZeRORuntimeException: The checkpoint being loaded used a DP world size of 2 but the current world size "
        "is 1. Automatic adjustment of ZeRO's optimizer state partitioning with a new world size is not currently "
        "supported."),
    (3, "RuntimeError: The size of tensor a (33) must match the size of tensor b (17) at non-singleton "
        "dimension 0"),
])
def test_a_checkpoint_of_2_ranks_does_not_load_on_1(stage, error, reference, zero3_cut, env, tmp_path) -> None:
    """``load_checkpoint`` at another world size fails loudly (nothing silent): ZeRO-2 refuses the
    DP world size; ZeRO-3 fails copying the saved 17-element partition of the frozen 33-element
    bias into the 33 elements one rank holds. DeepSpeed's answer is its offline universal-
    checkpoint conversion (``ds_to_universal``), not measured here."""
    source = reference if stage == 2 else zero3_cut
    shutil.copytree(source / "ckpt", tmp_path / "ckpt")
    (tmp_path / "ckpt" / "latest").write_text(f"global_step{CUT}")
    code, out = launch(torchrun(1, tmp_path, stage=stage), env, tmp_path)
    assert code != 0 and error in out, out
    assert "resumed from step" not in out and "in load_checkpoint" in out, out


def is_torch_pickle(f: Path) -> bool:
    """A ``torch.save`` file: a zip archive whose object tree is a pickle (``<name>/data.pkl``)."""
    if not zipfile.is_zipfile(f):
        return False
    with zipfile.ZipFile(f) as z:
        return any(n.endswith("/data.pkl") for n in z.namelist())


def test_every_file_of_a_deepspeed_checkpoint_with_state_is_a_pickle(reference) -> None:
    """Each checkpoint is 1 + world ``torch.save`` pickles (the module states and one optimizer
    partition per rank), loaded by DeepSpeed with ``torch.load(weights_only=False)``: the
    optimizer partitions do not even load with ``weights_only=True`` (a pickled
    ``LossScaler``). The folder also gets two Python scripts copied into it."""
    import inspect

    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import (
        TorchCheckpointEngine,
    )

    ckpt = reference / "ckpt"
    tags = sorted(p.name for p in ckpt.glob("global_step*"))
    assert tags == sorted(f"global_step{s}" for s in range(SAVE_EVERY, STEPS + 1, SAVE_EVERY))
    files = sorted(f for tag in tags for f in (ckpt / tag).iterdir())
    assert len(files) == 3 * len(tags) and all(is_torch_pickle(f) for f in files)
    assert sorted(f.name for f in ckpt.iterdir() if f.is_file()) == ["latest", "zero_to_fp32.py", "zero_to_torch.py"]
    optim = [f for f in files if f.name.endswith("optim_states.pt")]
    assert len(optim) == 2 * len(tags)
    for f in optim:
        with pytest.raises(pickle.UnpicklingError, match="Unsupported global: GLOBAL deepspeed.runtime.fp16"):
            torch.load(f, weights_only=True)
    assert "weights_only=False" in inspect.getsource(TorchCheckpointEngine.load)
