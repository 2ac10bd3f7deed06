"""The Hugging Face Trainer integration (``unbroken.integrations.hf``), end to end.

Every run is ``tests/hf_train.py``: a tiny random-init GPT-2 under ``transformers.Trainer`` with
dropout, shuffling, ``gradient_accumulation_steps=2`` (epochs of 17 micro-batches, so every
9th step has a single micro-batch), warmup + cosine, clipping, logging every 3 and evaluation
every 7 steps. Runs are
killed (SIGKILL at seeded random steps, SIGKILL inside a save, SIGTERM, an exception in the
training step), resumed until done, and compared with an uninterrupted run: the sha256 of the
final parameters + optimizer + scheduler, every per-step micro-batch loss (``repr``, including
the steps a resumed process recomputes), ``state.global_step``, ``state.epoch``,
``total_flos``, the final ``train_loss`` and the whole ``log_history`` (timings left out).

The same faults with the Trainer's own checkpointing (``save_strategy="steps"``,
``resume_from_checkpoint=True``) measure what HF alone loses; the numbers go into the table of
``docs/integrations.md``.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

STEPS, SAVE_EVERY, PER_EPOCH = 40, 5, 9  # 9 optimizer steps per epoch, the 9th with one micro-batch of 4
SCRIPT = Path(__file__).with_name("hf_train.py")
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
ENV.pop("UNBROKEN_FAULTS", None)


@dataclass
class Attempt:
    rc: int = 0
    started: str = ""
    steps: dict[int, str] = field(default_factory=dict)  # step -> "loss loss epoch=..."
    last_step: int = 0
    fetched: int | None = None
    preempted: int | None = None
    stderr: str = ""

    @property
    def resumed_at(self) -> int:
        return int(self.started.split()[-1]) if self.started.startswith("resumed") else 0


def attempt(out: Path, mode: str, *extra: str, kill: tuple[signal.Signals, int] | None = None,
            env: dict[str, str] | None = None) -> Attempt:
    """One process of a run; ``kill=(signal, n)`` sends the signal once step ``n`` is printed."""
    att = Attempt()
    with tempfile.TemporaryFile(mode="w+") as err:
        proc = subprocess.Popen([sys.executable, str(SCRIPT), "--mode", mode, "--out", str(out), *extra],
                                stdout=subprocess.PIPE, stderr=err, text=True, env=dict(ENV, **(env or {})))
        assert proc.stdout is not None
        sent = False
        for line in proc.stdout:
            words = line.split()
            if line.startswith(("resumed from", "fresh start")):
                att.started = line.strip()
            elif line.startswith("step "):
                att.last_step = int(words[1])
                att.steps[att.last_step] = " ".join(words[2:])
                if kill and not sent and att.last_step >= kill[1]:
                    proc.send_signal(kill[0])
                    sent = True
            elif line.startswith("fetched "):
                att.fetched = int(words[1])
            elif line.startswith("preempted at step"):
                att.preempted = int(words[-1])
        att.rc = proc.wait(timeout=300)
        err.seek(0)
        att.stderr = err.read()
    return att


def samples(first: int, last: int) -> int:
    """Samples the steps ``first..last`` load: 8 per step, 4 for the last step of an epoch."""
    return sum(4 if s % PER_EPOCH == 0 else 8 for s in range(first, last + 1))


def final(out: Path) -> dict:
    return json.loads((out / "final.json").read_text())


def same_steps(ref: Attempt, attempts: list[Attempt]) -> list[int]:
    """Steps whose losses or epoch differ from the uninterrupted run's (a re-run step counts each time)."""
    return [s for a in attempts for s, v in a.steps.items() if ref.steps.get(s) != v]


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Attempt, dict]]:
    """The uninterrupted runs, each made on first use: ``"unbroken"`` (with unbroken) and ``"hf"`` (with
    HF's own checkpointing: benchmarks/peers/test_hf_alone.py)."""

    class Runs(dict):
        def __missing__(self, mode: str) -> tuple[Attempt, dict]:
            out = tmp_path_factory.mktemp(f"reference-{mode}")
            att = attempt(out, mode)
            assert att.rc == 0 and att.started == "fresh start", att.stderr[-3000:]
            assert sorted(att.steps) == list(range(1, STEPS + 1))
            if mode == "unbroken":  # (accelerate's loader, used by HF alone, fetches one batch ahead)
                assert att.fetched == samples(1, STEPS)
            self[mode] = (att, final(out))
            return self[mode]

    return Runs()


def assert_exact(ref: tuple[Attempt, dict], out: Path, attempts: list[Attempt]) -> None:
    """The interrupted run ended exactly where the uninterrupted one did, bit for bit."""
    ref_att, ref_final = ref
    got = final(out)
    assert got["sha256"] == ref_final["sha256"], "final parameters / optimizer / scheduler differ"
    assert got["global_step"] == ref_final["global_step"] == STEPS
    assert got["epoch"] == ref_final["epoch"]
    assert got["total_flos"] == ref_final["total_flos"]
    assert got["train_loss"] == ref_final["train_loss"]
    assert got["log_history"] == ref_final["log_history"]
    assert not same_steps(ref_att, attempts), "per-step losses or epochs differ"
    done = set().union(*(a.steps for a in attempts))
    assert done == set(range(1, STEPS + 1)), sorted(set(range(1, STEPS + 1)) - done)


def checkpoints(run: Path) -> set[str]:
    return {p.name for p in run.iterdir() if p.is_dir() and p.name.startswith("step-")}


# ----------------------------------------------------------------------------- unbroken


@pytest.mark.parametrize("extra", [(), ("--random-sampler", "--workers", "2")], ids=["seedable-sampler",
                                                                                  "random-sampler-2-workers"])
def test_an_uninterrupted_run_with_unbroken_is_hf_alone_bitwise(references, tmp_path: Path,
                                                                  extra: tuple[str, ...]) -> None:
    """Enabling unbroken changes nothing but survival: the same data order (Accelerate's seedable sampler, or
    torch's RandomSampler whose seed each epoch draws from the global RNG), the same draws from the global RNG
    (the DataLoader's base seed each epoch: dropout follows it), so the same losses and parameters, across
    four epochs. Without unbroken's torch orders the two runs differ from step 1."""
    runs = {}
    for mode in ("plain", "unbroken"):
        if mode == "unbroken" and not extra:
            runs[mode] = references["unbroken"]
            continue
        out = tmp_path / mode
        att = attempt(out, mode, *extra)
        assert att.rc == 0 and att.started == "fresh start", att.stderr[-3000:]
        runs[mode] = (att, final(out))
    (alone, alone_final), (ours, ours_final) = runs["plain"], runs["unbroken"]
    assert sorted(alone.steps) == sorted(ours.steps) == list(range(1, STEPS + 1))
    assert [s for s in alone.steps if alone.steps[s] != ours.steps[s]] == [], "per-step losses differ"
    for key in ("sha256", "epoch", "total_flos", "train_loss", "log_history"):
        assert ours_final[key] == alone_final[key], key


@pytest.mark.parametrize("seed", [3])
def test_sigkill_at_random_steps(references, tmp_path: Path, seed: int) -> None:
    targets = sorted(random.Random(seed).sample(range(2, STEPS - 2), 3))
    attempts, resumed = [], []
    for target in targets:
        att = attempt(tmp_path, "unbroken", kill=(signal.SIGKILL, target))
        assert att.rc == -signal.SIGKILL, att.stderr[-3000:]
        attempts.append(att)
        resumed.append(att.resumed_at)
    # the last attempt names the run explicitly: train(resume_from_checkpoint="<run>")
    last = attempt(tmp_path, "unbroken", "--resume", str(tmp_path / "run"))
    assert last.rc == 0, last.stderr[-3000:]
    attempts.append(last)
    resumed.append(last.resumed_at)
    # each process resumed from the newest checkpoint the previous one committed (every 5 steps; the
    # save of a step comes after its "step" line, so a kill right after step 10 may beat step 10's save)
    assert resumed[0] == 0
    for before, now in zip(attempts, resumed[1:], strict=False):  # the last attempt has no successor
        newest = before.last_step // SAVE_EVERY * SAVE_EVERY
        assert now == newest or (now == newest - SAVE_EVERY and before.last_step == newest), (targets, resumed)
    assert resumed[-1] > 0
    print(f"measured, HF + unbroken: SIGKILL after steps {[a.last_step for a in attempts[:-1]]}, resumed at "
          f"{resumed[1:]}")
    # O(1) data position: the resumed process loaded exactly the samples of the steps it ran, nothing replayed
    assert last.fetched == samples(last.resumed_at + 1, STEPS)
    assert_exact(references["unbroken"], tmp_path, attempts)
    assert len(checkpoints(tmp_path / "run")) == 3  # keep_last=3


def test_sigkill_inside_a_save(references, tmp_path: Path) -> None:
    # the 7th time a save is half-way through a tensor file: inside the save of step 10 (a save writes
    # several files); the assertions below only need it to be a save after the first
    att = attempt(tmp_path, "unbroken", env={"UNBROKEN_FAULTS": "save.mid_file=7"})
    assert att.rc == -signal.SIGKILL, att.stderr[-3000:]
    run = tmp_path / "run"
    died_in = att.last_step // SAVE_EVERY * SAVE_EVERY  # the save of this step was being written
    assert died_in >= 2 * SAVE_EVERY and f"step-{died_in:09d}" not in checkpoints(run)
    assert any(p.name.startswith(".staging-") for p in run.iterdir())
    done = attempt(tmp_path, "unbroken", "--workers", "2")  # and the data position is independent of workers
    assert done.rc == 0, done.stderr[-3000:]
    assert done.resumed_at == died_in - SAVE_EVERY  # the previous checkpoint, intact
    assert not any(p.name.startswith(".staging-") for p in run.iterdir())
    assert not (run / "quarantine").exists()
    print(f"measured, HF + unbroken: SIGKILL inside the save of step {died_in}, resumed at {done.resumed_at}")
    assert_exact(references["unbroken"], tmp_path, [att, done])


def test_incremental_checkpoints_killed_at_a_step_and_inside_a_save(references, tmp_path: Path) -> None:
    """``enable(..., incremental=True)``: the same exactness with chunks (HF's counters, log and
    loss accumulators included)."""
    target = random.Random(4).randint(SAVE_EVERY + 2, STEPS - SAVE_EVERY)
    first = attempt(tmp_path, "unbroken", "--incremental", kill=(signal.SIGKILL, target))
    assert first.rc == -signal.SIGKILL, first.stderr[-3000:]
    second = attempt(tmp_path, "unbroken", "--incremental", env={"UNBROKEN_FAULTS": "save.mid_file=2"})
    assert second.rc == -signal.SIGKILL, second.stderr[-3000:]
    last = attempt(tmp_path, "unbroken", "--incremental")
    assert last.rc == 0 and last.resumed_at > 0, last.stderr[-3000:]
    import unbroken
    from unbroken.checkpoint.reader import read_manifest
    from unbroken.store import open_store

    store = open_store(tmp_path / "run")
    assert {read_manifest(store, n).format_version for n in store.list_committed()} == {3}
    for name in store.list_committed():
        unbroken.verify(tmp_path / "run" / name)
    assert_exact(references["unbroken"], tmp_path, [first, second, last])


@pytest.mark.parametrize("target", [PER_EPOCH * 3])
def test_sigterm_saves_at_the_step_boundary(references, tmp_path: Path, target: int) -> None:
    """SIGTERM after the last step of an epoch (whose boundary is the end of the Trainer's epoch loop)."""
    att = attempt(tmp_path, "unbroken", kill=(signal.SIGTERM, target))
    assert att.rc == 75, att.stderr[-3000:]  # unbroken.faults.EXIT_PREEMPTED
    # no completed step lost: the preemption checkpoint holds the last step the process finished
    assert att.preempted == att.last_step >= target
    assert f"step-{att.preempted:09d}" in checkpoints(tmp_path / "run")
    done = attempt(tmp_path, "unbroken")
    assert done.rc == 0, done.stderr[-3000:]
    assert done.resumed_at == att.preempted
    print(f"measured, HF + unbroken: SIGTERM after step {target}, saved step {att.preempted}, exit {att.rc}, "
          f"resumed at {done.resumed_at}")
    assert done.fetched == samples(att.preempted + 1, STEPS)
    assert_exact(references["unbroken"], tmp_path, [att, done])


def test_exception_in_a_step_leaves_an_exact_emergency_checkpoint(references, tmp_path: Path) -> None:
    step = random.Random(6).choice([s for s in range(3, STEPS - 3) if s % SAVE_EVERY != 1])
    att = attempt(tmp_path, "unbroken", "--crash-at", str(step))
    assert att.rc == 1 and f"injected failure in step {step}" in att.stderr, att.stderr[-3000:]
    assert "emergency checkpoint" in att.stderr
    assert att.last_step == step - 1
    done = attempt(tmp_path, "unbroken", "--crash-at", str(step))  # raises once per run folder
    assert done.rc == 0, done.stderr[-3000:]
    assert done.resumed_at == step - 1  # the failed step's start: it is re-run, nothing lost
    print(f"measured, HF + unbroken: exception in step {step}, resumed at {done.resumed_at}")
    assert_exact(references["unbroken"], tmp_path, [att, done])


# ----------------------------------------------------------------------------- HF alone, measured


# ----------------------------------------------------------------------------- in-process


@pytest.fixture()
def one_thread():
    """In-process training on one thread (two threads on two busy cores run ~15 times slower)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _trainer(out: Path, steps: int):
    sys.path.insert(0, str(SCRIPT.parent))
    import hf_train
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments, set_seed

    set_seed(7)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=hf_train.VOCAB, n_positions=hf_train.SEQ, n_embd=32,
                                       n_layer=2, n_head=2))
    args = TrainingArguments(output_dir=str(out / "hf"), per_device_train_batch_size=4, gradient_accumulation_steps=2,
                             max_steps=steps, learning_rate=3e-3, lr_scheduler_type="cosine", warmup_steps=2,
                             report_to=[], use_cpu=True, disable_tqdm=True, seed=7, save_strategy="no")
    return hf_train, hf_train.ScriptTrainer(model=model, args=args, train_dataset=hf_train.Tokens())


def test_resume_from_checkpoint_arguments(tmp_path: Path, one_thread: None) -> None:
    from unbroken.integrations.hf import enable

    hf_train, trainer = _trainer(tmp_path, 12)
    cb = enable(trainer, tmp_path / "run", save_every=5, keep_last=None)
    trainer.train()
    assert cb.restored is None and trainer.state.global_step == 12
    reference = hf_train.digest(trainer)
    assert checkpoints(tmp_path / "run") == {"step-000000005", "step-000000010", "step-000000012"}

    # a checkpoint folder of the run: resumes from exactly that one, ends where the first run ended
    hf_train, trainer = _trainer(tmp_path, 12)
    cb = enable(trainer, tmp_path / "run", save_every=5, keep_last=None)
    trainer.train(resume_from_checkpoint=str(tmp_path / "run" / "step-000000005"))
    assert cb.restored is not None and cb.restored.step == 5
    assert hf_train.digest(trainer) == reference

    # the run itself, and plain train(): the newest checkpoint, which is the final one: nothing left to do
    for how in ({"resume_from_checkpoint": tmp_path / "run"}, {}):
        hf_train, trainer = _trainer(tmp_path, 12)
        cb = enable(trainer, tmp_path / "run", save_every=5, keep_last=None)
        trainer.train(**how)
        assert cb.restored is not None and cb.restored.step == 12 and trainer.state.global_step == 12
        assert hf_train.digest(trainer) == reference

    # False: a fresh start on purpose, same result
    hf_train, trainer = _trainer(tmp_path, 12)
    cb = enable(trainer, tmp_path / "run", save_every=5, keep_last=None)
    trainer.train(resume_from_checkpoint=False)
    assert cb.restored is None and hf_train.digest(trainer) == reference

    # the Trainer's own checkpoint is refused, before any training
    hf_dir = tmp_path / "hf" / "checkpoint-5"
    hf_dir.mkdir(parents=True)
    (hf_dir / "trainer_state.json").write_text("{}")
    hf_train, trainer = _trainer(tmp_path, 12)
    enable(trainer, tmp_path / "run")
    with pytest.raises(ValueError, match="Trainer's own checkpointing"):
        trainer.train(resume_from_checkpoint=str(hf_dir))


def test_enable_refuses_what_it_cannot_make_exact(tmp_path: Path) -> None:
    from unbroken.integrations.hf import enable

    _, trainer = _trainer(tmp_path, 4)
    enable(trainer, tmp_path / "run")
    with pytest.raises(RuntimeError, match="already enabled"):
        enable(trainer, tmp_path / "run")
    _, trainer = _trainer(tmp_path, 4)
    trainer.args.auto_find_batch_size = True
    with pytest.raises(ValueError, match="auto_find_batch_size"):
        enable(trainer, tmp_path / "run")
    _, trainer = _trainer(tmp_path, 4)
    trainer.args.train_sampling_strategy = "group_by_length"
    with pytest.raises(ValueError, match="group_by_length"):
        enable(trainer, tmp_path / "run")


def test_import_without_transformers_names_the_extra() -> None:
    code = ("import sys; sys.modules['transformers'] = None\n"
            "try:\n    import unbroken.integrations.hf\nexcept ImportError as e:\n    print('ImportError:', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "ImportError:" in out.stdout and "pip install -e '.[hf]'" in out.stdout, out.stdout
