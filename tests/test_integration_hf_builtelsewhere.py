"""``UnbrokenTrainerCallback``: unbroken for a ``transformers.Trainer`` built by someone else.

The end-to-end test runs ``tests/lf_builtelsewhere.py plain``: a Trainer built inside a function that
takes only callbacks and calls ``train(resume_from_checkpoint=<its own last checkpoint-N>)`` as
LLaMA-Factory does; SIGKILLed at a step and inside a save, restarted with the same command, compared
bit for bit with an uninterrupted run (final parameters + optimizer + scheduler, the parameters after
every step, ``global_step``, ``epoch``, ``total_flos``, ``train_loss``, the log history with evaluations).
The in-process tests check how the callback finds its Trainer and what it refuses. LLaMA-Factory itself
and TRL: tests/test_llamafactory.py.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from transformers import (LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments,
                          set_seed)

from unbroken.integrations.hf import UnbrokenCallback, UnbrokenTrainerCallback

JOB = Path(__file__).with_name("lf_builtelsewhere.py")
STEPS, SAVE_EVERY = 20, 4


@pytest.fixture(autouse=True)
def one_thread():
    """In-process training on one thread (two threads on two busy cores run many times slower)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 12) -> None:
        self.x = torch.randint(0, 32, (n, 8), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.x[i], "labels": self.x[i]}


class ToolTrainer(Trainer):
    """A Trainer subclass that does more after ``Trainer.__init__``, as TRL's and LLaMA-Factory's do."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.after_init = True


class CountInit(TrainerCallback):
    def __init__(self) -> None:
        self.init_ends = 0

    def on_init_end(self, args, state, control, **kwargs):
        self.init_ends += 1


def build(tmp_path: Path, callbacks: list[TrainerCallback], **overrides) -> Trainer:
    """What a tool does: it builds the Trainer; the user only passes callbacks."""
    set_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=8))
    args = TrainingArguments(**{**dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, max_steps=6,
                                       save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True),
                                **overrides})
    return ToolTrainer(model=model, args=args, train_dataset=Tokens(), callbacks=callbacks)


def test_attaches_to_the_trainer_whose_init_runs(tmp_path: Path) -> None:
    before, after = CountInit(), CountInit()
    cb = UnbrokenTrainerCallback(tmp_path / "run", save_every=3)
    trainer = build(tmp_path, [before, cb, after])
    assert cb.trainer is trainer and trainer.after_init
    handler = trainer.callback_handler.callbacks
    assert isinstance(handler[0], UnbrokenCallback)  # enable()'s callback, first: it restores before the others
    assert [c for c in handler if c is cb] == [cb]
    # enable() inserted a callback while the handler was calling on_init_end: nobody missed it or got it twice
    assert before.init_ends == after.init_ends == 1
    assert cb.checkpointer is not None and cb.restored is None
    trainer.train()
    assert cb.restored is None and trainer.state.global_step == 6
    assert sorted(p.name for p in (tmp_path / "run").iterdir() if p.name.startswith("step-")) == [
        "step-000000003", "step-000000006"]
    # a second Trainer, as a restarted tool builds it: resumes from the run; a checkpoint of the run
    # passed to train() is honoured, anything outside the run is the tool's guess and is ignored
    again = UnbrokenTrainerCallback(tmp_path / "run", save_every=3)
    build(tmp_path, [again], max_steps=8).train(resume_from_checkpoint=str(tmp_path / "run" / "step-000000003"))
    assert again.restored is not None and again.restored.step == 3
    third = UnbrokenTrainerCallback(tmp_path / "run", save_every=3)
    foreign = tmp_path / "out" / "checkpoint-6"
    with pytest.warns(UserWarning, match="is not a checkpoint of the unbroken run .*: ignored"):
        build(tmp_path, [third], max_steps=9).train(resume_from_checkpoint=str(foreign))
    assert third.restored is not None and third.restored.step == 8


def test_added_after_construction_is_refused(tmp_path: Path) -> None:
    trainer = build(tmp_path, [])
    trainer.add_callback(UnbrokenTrainerCallback(tmp_path / "run"))
    with pytest.raises(RuntimeError, match=r"must be among the callbacks the Trainer is constructed with.*enable"):
        trainer.train()
    assert not (tmp_path / "run").exists()  # nothing was enabled, nothing written


def test_one_callback_per_trainer(tmp_path: Path) -> None:
    cb = UnbrokenTrainerCallback(tmp_path / "run")
    build(tmp_path, [cb])
    with pytest.raises(RuntimeError, match="already attached to another Trainer"):
        build(tmp_path, [cb])


def test_outside_a_trainer_it_says_what_to_do(tmp_path: Path) -> None:
    trainer = build(tmp_path, [])
    cb = UnbrokenTrainerCallback(tmp_path / "run")
    with pytest.raises(RuntimeError, match=r"could not find the transformers.Trainer that owns it.*enable\(trainer"):
        cb.on_init_end(trainer.args, trainer.state, trainer.control)


def test_enable_refusals_surface_when_the_trainer_is_built(tmp_path: Path) -> None:
    cb = UnbrokenTrainerCallback(tmp_path / "run")
    with pytest.raises(ValueError, match="auto_find_batch_size"):
        build(tmp_path, [cb], auto_find_batch_size=True)
    assert cb.trainer is None  # the refused Trainer did not keep it: the corrected one can
    assert build(tmp_path, [cb]) is cb.trainer


# ----------------------------------------------------------------------------- end to end


def attempt(out: Path, *, kill: tuple[signal.Signals, int] | None = None,
            env: dict[str, str] | None = None) -> dict:
    """One process of the job; ``kill=(signal, n)`` sends the signal once step ``n`` is printed."""
    got = {"started": "", "steps": {}, "last": 0}
    environ = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
    if not env or "UNBROKEN_FAULTS" not in env:
        environ.pop("UNBROKEN_FAULTS", None)
    with tempfile.TemporaryFile(mode="w+") as err:
        proc = subprocess.Popen([sys.executable, str(JOB), "plain", "--out", str(out), "--steps", str(STEPS),
                                 "--save-every", str(SAVE_EVERY)], stdout=subprocess.PIPE, stderr=err, text=True,
                                env=environ)
        assert proc.stdout is not None
        sent = False
        for line in proc.stdout:
            if line.startswith(("resumed from", "fresh start")):
                got["started"] = line.strip()
            elif line.startswith("step "):
                got["last"] = int(line.split()[1])
                got["steps"][got["last"]] = line.split()[2]
                if kill and not sent and got["last"] >= kill[1]:
                    proc.send_signal(kill[0])
                    sent = True
        got["rc"] = proc.wait(timeout=300)
        err.seek(0)
        got["stderr"] = err.read()
    got["resumed_at"] = int(got["started"].split()[-1]) if got["started"].startswith("resumed") else 0
    return got


@pytest.mark.e2e
@pytest.mark.slow  # the HF Trainer's job in every process
def test_trainer_built_in_a_function_sigkilled_twice_resumes_bitwise(tmp_path: Path) -> None:
    ref_out, out = tmp_path / "reference", tmp_path / "run"
    kill_at = random.Random(2).randint(SAVE_EVERY + 1, 2 * SAVE_EVERY - 1)
    with ThreadPoolExecutor(2) as pool:
        ref_job = pool.submit(attempt, ref_out)
        first = attempt(out, kill=(signal.SIGKILL, kill_at))
    ref = ref_job.result()
    assert ref["rc"] == 0 and sorted(ref["steps"]) == list(range(1, STEPS + 1)), ref["stderr"][-3000:]
    assert first["rc"] == -signal.SIGKILL and first["started"] == "fresh start", first["stderr"][-3000:]
    # the 7th time a save is half-way through a tensor file (4 files a save): the 2nd save of this process
    second = attempt(out, env={"UNBROKEN_FAULTS": "save.mid_file=7"})
    assert second["rc"] == -signal.SIGKILL, second["stderr"][-3000:]
    resumed = first["last"] // SAVE_EVERY * SAVE_EVERY
    assert second["resumed_at"] == resumed > 0
    # the function passed its own last checkpoint to train(): ignored, the unbroken run governs
    assert f"checkpoint-{resumed}' is not a checkpoint of the unbroken run" in second["stderr"]
    died_in = resumed + 2 * SAVE_EVERY
    assert second["last"] == died_in and not (out / "run" / f"step-{died_in:09d}").exists()
    last = attempt(out)
    assert last["rc"] == 0 and last["resumed_at"] == died_in - SAVE_EVERY, last["stderr"][-3000:]
    got, want = (json.loads((d / "final.json").read_text()) for d in (out, ref_out))
    assert got == want  # parameters + optimizer + scheduler, counters, train_loss, log history with evaluations
    assert [s for a in (first, second, last) for s, h in a["steps"].items() if ref["steps"][s] != h] == []
    assert set().union(*(a["steps"] for a in (first, second, last))) == set(range(1, STEPS + 1))
