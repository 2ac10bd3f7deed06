"""The Lightning integration on 2 CPU ranks (gloo), end to end: real jobs of tests/lightning_dist_train.py
started the way users start them (Lightning's own launcher, ``devices=2``; torchrun), hit by a SIGKILL
of one rank, a SIGTERM, a SIGKILL inside a save, and resumed at another world size. Each faulted run
is relaunched until done and compared bitwise with an uninterrupted run: every rank's micro-batch
losses and samples (the re-run ones included), the final parameters and optimizer state, gathered.

Lightning's own launcher does not restart anything: when a rank dies the others fail at their next
collective, rank 0 (the process the user started) kills the rest and exits 1, and the relaunch is
the user's or the scheduler's (the same command). torchrun restarts the group by itself.

The same faults with Lightning's own checkpointing measure what it loses (docs/integrations.md).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import pytorch_lightning  # noqa: F401  (the test extra installs it: a missing one fails, not skips)
import jobs
from test_distributed import run
from unbroken.faults import EXIT_PREEMPTED
from unbroken.store import open_store

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
SCRIPT = str(Path(__file__).with_name("lightning_dist_train.py"))
STEPS, SAVE_EVERY, BATCH = 12, 3, 4  # 2 ranks x 4 samples x 2 micro-batches per step
N_SAMPLES, LAST_BATCH = 100, 12  # 13 micro-batches an epoch: the 13th is 4 samples, padded to 8 by 2 ranks
# Under DeepSpeed, Lightning leaves accumulation to DeepSpeed and counts every micro-batch in global_step
ACCUMULATE = {"ddp": 2, "fsdp2": 2, "fsdp": 2, "deepspeed": 1}
MICRO_BATCHES = {1: STEPS, 2: 23}  # per rank in the 12 steps: 2 per step, and the epoch's 13th alone
ENV = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
for _var in ("UNBROKEN_FAULTS", "MASTER_PORT", "MASTER_ADDR", "WORLD_SIZE", "RANK", "LOCAL_RANK"):
    ENV.pop(_var, None)


# ------------------------------------------------------------------------------ running a job
def job(base: Path, *extra: str, devices: int = 2, strategy: str = "ddp") -> list[str]:
    return [sys.executable, SCRIPT, "--devices", str(devices), "--strategy", strategy, "--run-dir", str(base / "run"),
            "--out", str(base / "out"), "--steps", str(STEPS), "--save-every", str(SAVE_EVERY),
            "--batch", str(BATCH * 2 // devices), "--accumulate", str(ACCUMULATE[strategy]), *extra]


def torchrun_job(base: Path, *extra: str, restarts: int = 0) -> list[str]:
    return jobs.torchrun(2, *job(base, *extra)[1:], restarts=restarts)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def launch(base: Path, cmd: list[str], env: dict[str, str] | None = None, on_line=None,
           timeout: float = 400) -> tuple[int, str]:
    """Run one job to its end (every rank: its output closes), killing what is left after a timeout."""
    return run(cmd, env=env or ENV, timeout=timeout, on_line=on_line, workers=base / "out")  # (tests/jobs.py)


def at_step(base: Path, step: int, action) -> tuple:
    """An ``on_line`` that calls ``action(proc)`` once, when rank 1 starts a micro-batch of optimizer step ``step``
    (``global_step`` = ``step`` - 1 steps done). Returns (on_line, fired)."""
    fired: list[int] = []

    def on_line(line: str, proc) -> None:
        if not fired and re.search(rf"rank 1 step {step - 1}(?!\d)", line):  # the ranks' lines may interleave
            fired.append(step)
            action(proc)

    return on_line, fired


def sigkill_rank(base: Path, rank: int):
    return lambda proc: os.kill(int((base / "out" / f"pid-r{rank}").read_text()), signal.SIGKILL)


# ------------------------------------------------------------------------------ comparing runs
def rows(out: Path, rank: int) -> list[dict]:
    return [json.loads(x) for x in (out / f"losses-r{rank}.jsonl").read_text().splitlines()]


def merged(out: Path, rank: int) -> tuple[dict, int]:
    """(epoch, batch) -> (global_step, loss, samples), the last run of each micro-batch; and how many
    micro-batches ran twice (before and after a resume) with different values."""
    seen: dict = {}
    disagree = 0
    for r in rows(out, rank):
        key, value = (r["epoch"], r["batch"]), (r["step"], r["loss"], r["samples"])
        disagree += key in seen and seen[key] != value
        seen[key] = value
    return seen, disagree


def final(out: Path, name: str = "final.safetensors") -> dict[str, torch.Tensor]:
    return load_file(str(out / name))


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def assert_bitwise(reference: Path, out: Path) -> None:
    for rank in (0, 1):
        ref, _ = merged(reference, rank)
        got, disagree = merged(out, rank)
        assert disagree == 0 and got == ref, rank  # every micro-batch's loss and samples, on every rank
    assert same(final(reference), final(out))  # parameters and AdamW moments, gathered
    assert json.loads((out / "final.json").read_text()) == json.loads((reference / "final.json").read_text())


def committed(run_dir: Path) -> list[str]:
    return open_store(run_dir).list_committed()


def preempted_at(out: str) -> int:
    steps = {int(m) for m in re.findall(r"preempted at step (\d+)", out)}
    assert len(steps) == 1, out[-3000:]  # every rank stopped after the same step
    return steps.pop()


# ------------------------------------------------------------------------------ the references
REFERENCE_DUMP_AT = 2 * SAVE_EVERY  # the reference's full state at this step: the world-size test resumes there


@dataclass
class Reference:
    strategy: str
    base: Path
    env: dict[str, str]

    @property
    def out(self) -> Path:
        return self.base / "out"


@pytest.fixture(scope="module", params=["ddp", "fsdp2", "fsdp", "deepspeed"])
def reference(request, tmp_path_factory: pytest.TempPathFactory) -> Reference:
    """An uninterrupted 2-rank run of each strategy (Lightning's launcher), its state dumped at step 6.
    ``fsdp`` and ``deepspeed`` are Lightning's FSDPStrategy and DeepSpeedStrategy, which Lightning refuses on
    CPU, through the subclasses of lightning_dist_train.py that take only those refusals away."""
    strategy = request.param
    env = dict(request.getfixturevalue("deepspeed_env"), **{k: ENV[k] for k in ("PYTHONWARNINGS",)}) \
        if strategy == "deepspeed" else ENV
    env = {k: v for k, v in env.items() if k not in ("UNBROKEN_FAULTS", "MASTER_PORT", "WORLD_SIZE", "RANK")}
    base = tmp_path_factory.mktemp(f"reference-{strategy}")
    code, out = launch(base, job(base, "--dump-at", str(REFERENCE_DUMP_AT), strategy=strategy), env=env,
                       timeout=900)  # DeepSpeed compiles its CPU communication op at the session's first start
    assert code == 0, out[-3000:]
    assert committed(base / "run") == [f"step-{s:09d}" for s in (6, 9, 12)]  # every 3 steps, keep_last=3
    assert len(rows(base / "out", 0)) == MICRO_BATCHES[ACCUMULATE[strategy]] and not any(base.rglob("*.ckpt"))
    return Reference(strategy, base, env)


# ------------------------------------------------------------------------------ with unbroken
def test_killed_in_a_save_sigterm_and_a_killed_rank_resume_bitwise(reference: Reference, tmp_path: Path) -> None:
    """One run hit by the faults in turn, relaunched after each (Lightning's launcher):

    1. rank 1 SIGKILLed half-way through a tensor file of the 2nd save (step 6): the save never commits,
       rank 0 fails in its next collective and exits non-zero;
    2. relaunched (resumes at 3), a SIGTERM to the job's process (rank 0, as a scheduler sends it): every
       rank finishes the step under way, saves it, and exits 75;
    3. relaunched, one rank SIGKILLed at a random step (rank 1 under DDP, rank 0 -- the launcher itself --
       otherwise): the job exits non-zero;
    4. relaunched to the end: bitwise the uninterrupted run."""
    strategy, env = reference.strategy, reference.env
    rng = random.Random(f"lightning-dist-{strategy}")
    # 1. rank 1 writes 2 tensor files per save (its pieces or its share of the replicated ones, its RNG): the 3rd
    # is in the 2nd save
    code, out = launch(tmp_path, job(tmp_path, strategy=strategy), env=dict(env, UNBROKEN_FAULTS="save.mid_file@1=3"))
    assert code not in (0, EXIT_PREEMPTED), out[-3000:]
    assert committed(tmp_path / "run") == ["step-000000003"]
    assert any(p.name.startswith(".staging") for p in (tmp_path / "run").iterdir())  # the torn save, hidden
    # 2. SIGTERM
    term = rng.randint(4, 7)
    on_line, fired = at_step(tmp_path, term, lambda proc: proc.send_signal(signal.SIGTERM))
    code, out = launch(tmp_path, job(tmp_path, strategy=strategy), env=env, on_line=on_line)
    assert fired and code == EXIT_PREEMPTED, out[-3000:]
    assert f"resumed from {tmp_path / 'run'}/step-000000003" in out, out[-3000:]
    stopped = preempted_at(out)
    assert stopped >= term and committed(tmp_path / "run")[-1] == f"step-{stopped:09d}"
    # 3. a rank SIGKILLed at a step (after the resume's first step; a SIGTERM served late under load,
    # at step 11, leaves none: a killed rank is also test_torchrun_restarts_a_killed_rank_and_resumes_bitwise's)
    if stopped + 1 <= STEPS - 1:
        kill = rng.randint(min(stopped + 2, STEPS - 1), STEPS - 1)
        on_line, fired = at_step(tmp_path, kill, sigkill_rank(tmp_path, 1 if strategy == "ddp" else 0))
        code, out = launch(tmp_path, job(tmp_path, strategy=strategy), env=env, on_line=on_line)
        assert fired and code != 0, out[-3000:]
        assert f"resumed from {tmp_path / 'run'}/step-{stopped:09d}" in out, out[-3000:]
    # 4. to the end
    code, out = launch(tmp_path, job(tmp_path, strategy=strategy), env=env)
    assert code == 0, out[-3000:]
    assert_bitwise(reference.out, tmp_path / "out")
    assert not (tmp_path / "run" / "quarantine").exists()


def test_resumed_on_one_rank_at_the_same_global_sample(reference: Reference, tmp_path: Path) -> None:
    """The reference's checkpoint of step 6 (2 ranks x 4 samples) resumed by 1 rank (8 samples: the same global
    batch): the restored parameters and moments are bitwise the 2-rank run's at step 6, and every later step
    trains on exactly the samples both ranks of the reference trained on together."""
    name = f"step-{REFERENCE_DUMP_AT:09d}"
    shutil.copytree(reference.base / "run" / name, tmp_path / "run" / name)
    code, out = launch(tmp_path, job(tmp_path, "--dump-restored", devices=1, strategy=reference.strategy),
                       env=reference.env)
    assert code == 0, out[-3000:]
    assert "world size changed from 2 to 1" in out and "RNGs reseeded" in out, out[-3000:]
    assert same(final(reference.out, f"step-{REFERENCE_DUMP_AT}.safetensors"),
                final(tmp_path / "out", "restored.safetensors"))
    both = [merged(reference.out, r)[0] for r in (0, 1)]
    got, _ = merged(tmp_path / "out", 0)
    later = sorted(k for k, v in both[0].items() if v[0] >= REFERENCE_DUMP_AT)
    assert sorted(got) == later  # the same micro-batches (epoch, batch index), none skipped or repeated
    for key in later:
        samples = both[0][key][2] + both[1][key][2]
        if key[1] == LAST_BATCH:  # 2 ranks pad the epoch's last global batch by wrapping; 1 rank gets it short
            samples = samples[:N_SAMPLES % (2 * BATCH)]
        assert got[key][0] == both[0][key][0] and got[key][2] == samples, key
    assert json.loads((tmp_path / "out" / "final.json").read_text()) == dict(
        json.loads((reference.out / "final.json").read_text()), world=1)


def test_with_distributed_samplers_order_unbroken_changes_nothing_and_resumes_bitwise(tmp_path: Path) -> None:
    """Lightning alone on 2 ranks (DDP), ``DataLoader(shuffle=True)`` dealt by the ``DistributedSampler`` Lightning
    injects, no checkpointing; against the same job with the callback and ``ResumableLoader(order="distributed")``:
    every rank's micro-batch losses and samples and the final state are the same bits (an epoch end and its
    padding inside). Rank 1 SIGKILLed in step 8 and the job relaunched: still that run."""
    alone, ours, killed = tmp_path / "alone", tmp_path / "ours", tmp_path / "killed"
    for base, extra in ((alone, ("--mode", "plain", "--data", "plain")), (ours, ("--data", "distributed-order"))):
        code, out = launch(base, job(base, *extra))
        assert code == 0, out[-3000:]
    assert_bitwise(alone / "out", ours / "out")
    on_line, fired = at_step(killed, 8, sigkill_rank(killed, 1))
    code, out = launch(killed, job(killed, "--data", "distributed-order"), on_line=on_line)
    assert fired and code != 0, out[-3000:]
    code, out = launch(killed, job(killed, "--data", "distributed-order"))
    assert code == 0 and "resumed from" in out, out[-3000:]
    assert_bitwise(alone / "out", killed / "out")


@pytest.mark.parametrize("reference", ["ddp"], indirect=True)
def test_torchrun_restarts_a_killed_rank_and_resumes_bitwise(reference: Reference, tmp_path: Path) -> None:
    """Under ``torchrun --max-restarts=1`` (the script calls ``unbroken.init_distributed()`` before the Trainer):
    rank 1 SIGKILLed at a random step, torchrun restarts both ranks, which resume from the newest checkpoint."""
    kill = random.Random(3).randint(SAVE_EVERY + 2, STEPS - 2)
    on_line, fired = at_step(tmp_path, kill, sigkill_rank(tmp_path, 1))
    code, out = launch(tmp_path, torchrun_job(tmp_path, restarts=1), on_line=on_line)
    assert fired and code == 0, out[-3000:]
    assert "resumed from" in out, out[-3000:]
    assert_bitwise(reference.out, tmp_path / "out")


# ---------------------------------------------------------------------- Lightning's own checkpointing
# ModelCheckpoint(every_n_train_steps=3, save_last=True) and fit(ckpt_path="last"), the same faults: what it loses.
ALONE = ("--mode", "lightning", *(f"--dump-at={s}" for s in range(SAVE_EVERY, STEPS + 1, SAVE_EVERY)))
MEASURED: dict[str, object] = {}
HANG_S = 60  # a job still running this long after a SIGTERM counts as hung, and is killed


def report(name: str, value: object) -> None:
    MEASURED[name] = value
    print(f"measured {name}: {value}")


def resumed_at(out: Path, before: int, rank: int = 0) -> int | None:
    """The global step at which the launch whose rows start at line ``before`` began (None: it ran nothing)."""
    new = rows(out, rank)[before:]
    return new[0]["step"] if new else None


def lightning_saved(run_dir: Path) -> list[str]:
    return sorted(p.name for p in run_dir.iterdir())


def compare(reference: Path, out: Path) -> dict[str, object]:
    equal = total = disagree = 0
    for rank in (0, 1):
        ref, _ = merged(reference, rank)
        got, d = merged(out, rank)
        equal += sum(1 for k, v in ref.items() if got.get(k) == v)
        total += len(ref)
        disagree += d
    return {"losses equal": f"{equal}/{total}", "re-run micro-batches that differ": disagree,
            "final parameters and moments equal": same(final(reference), final(out))}


def test_checkpoint_io_refuses_to_convert_runs_saved_under_fsdp1_or_deepspeed() -> None:
    """``fit(ckpt_path=run)`` through UnbrokenCheckpointIO converts a run to Lightning's dict; a run whose state is
    unbroken's per-parameter sharded layout (FSDP1, DeepSpeed) is refused with what to do instead."""
    from unbroken.errors import UnbrokenError
    from unbroken.integrations.lightning.checkpoint_io import to_lightning

    for tree in ({"engine": {"format": 1}, "loops": {}}, {"model": {"format": 1, "model": {}}, "loops": {}}):
        with pytest.raises(UnbrokenError, match="fit\\(\\) without ckpt_path"):
            to_lightning(tree, "2.6.6")
    assert to_lightning({"model": {"w": torch.zeros(1)}, "loops": {}}, "2.6.6")["state_dict"]["w"].shape == (1,)
