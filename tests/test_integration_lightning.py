"""The Lightning integration, end to end: real Trainer subprocesses (tests/lightning_train.py)
killed with SIGKILL at seeded random steps and inside saves, stopped with SIGTERM, failing
with an exception, each resumed until done, compared bitwise with an uninterrupted run:
final weights, optimizer state, every micro-batch's loss (repr), global_step, epoch.

The same faults with Lightning's own checkpointing (ModelCheckpoint every N steps,
``fit(ckpt_path="last")``) measure what it loses; the numbers are in docs/integrations.md.

The test environment has both ``pytorch-lightning`` and ``lightning`` installed (as real ones often
do): the jobs import the Trainer from ``pytorch_lightning`` unless told ``--flavour lightning``;
in-process tests run either Trainer, with ``enable_checkpointing`` on and off; a subprocess with one
package hidden covers the environments that have only that one.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

import lightning  # noqa: F401  (the test extra installs both packages: a missing one fails, not skips)
import pytorch_lightning  # noqa: F401
from lightning_train import lightning as lightning_package
from lightning_train import model_class

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SCRIPT = Path(__file__).with_name("lightning_train.py")
STEPS, SAVE_EVERY = 30, 4
ENV = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
ENV.pop("UNBROKEN_FAULTS", None)


@dataclass
class Attempt:
    rc: int
    losses: dict[tuple[int, int], tuple[int, str]]  # (epoch, batch_idx) -> (global_step, repr(loss))
    stdout: str
    stderr: str
    first_step: int | None = None  # global_step of the first micro-batch this attempt ran
    steps_done: list[int] = field(default_factory=list)


def attempt(base: Path, *extra: str, stop_at: int | None = None, sig: int = signal.SIGKILL,
            env: dict[str, str] | None = None) -> Attempt:
    """One training process; with ``stop_at``, send ``sig`` once it prints a loss of that global step."""
    cmd = [sys.executable, str(SCRIPT), "--run-dir", str(base / "run"), "--out", str(base / "out"),
           "--steps", str(STEPS), "--save-every", str(SAVE_EVERY), *extra]
    err = base / "stderr.txt"
    with open(err, "w") as ferr:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=ferr, text=True, env=env or ENV)
        lines, sent = [], False
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if stop_at is not None and not sent and line.startswith("LOSS") and int(line.split()[3]) >= stop_at:
                proc.send_signal(sig)
                sent = True
        rc = proc.wait(timeout=300)
    losses: dict[tuple[int, int], tuple[int, str]] = {}
    first, steps = None, []
    for line in lines:
        if line.startswith("LOSS"):
            _, epoch, batch, step, value = line.split()
            losses[(int(epoch), int(batch))] = (int(step), value)
            first = int(step) if first is None else first
            steps.append(int(step))
    return Attempt(rc, losses, "".join(lines), err.read_text(), first, steps)


def finish(base: Path, *extra: str) -> Attempt:
    att = attempt(base, *extra)
    assert att.rc == 0 and "FINISHED" in att.stdout, att.stderr[-3000:]
    return att


@dataclass
class Comparison:
    """How a resumed run differs from the uninterrupted one."""

    weights: bool
    optimizer: bool
    losses_equal: int
    losses_total: int
    rerun_disagree: int  # micro-batches run twice (before and after a resume) with different losses
    global_step: tuple[int, int]
    epoch: tuple[int, int]

    @property
    def exact(self) -> bool:
        return (self.weights and self.optimizer and self.losses_equal == self.losses_total
                and self.rerun_disagree == 0 and self.global_step[0] == self.global_step[1]
                and self.epoch[0] == self.epoch[1])


def tensors_equal(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(tensors_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(
            tensors_equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def compare(ref: tuple[Path, Attempt], base: Path, attempts: list[Attempt]) -> Comparison:
    ref_dir, ref_att = ref
    merged: dict[tuple[int, int], tuple[int, str]] = {}
    disagree = 0
    for att in attempts:
        for key, value in att.losses.items():
            if key in merged and merged[key] != value:
                disagree += 1
            merged[key] = value
    want = torch.load(ref_dir / "final.pt", weights_only=True)
    got = torch.load(base / "out" / "final.pt", weights_only=True)
    wj = json.loads((ref_dir / "final.json").read_text())
    gj = json.loads((base / "out" / "final.json").read_text())
    equal = sum(1 for k, v in ref_att.losses.items() if merged.get(k) == v)
    return Comparison(tensors_equal(want["model"], got["model"]), tensors_equal(want["optimizer"], got["optimizer"]),
                      equal, len(ref_att.losses), disagree, (wj["global_step"], gj["global_step"]),
                      (wj["current_epoch"], gj["current_epoch"]))


def checkpoints(run: Path) -> list[str]:
    return sorted(p.name for p in run.iterdir() if p.is_dir() and p.name.startswith("step-"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Attempt]:
    base = tmp_path_factory.mktemp("reference")
    att = finish(base)
    assert json.loads((base / "out" / "final.json").read_text())["global_step"] == STEPS
    # saves every SAVE_EVERY steps plus the final one, keep_last=3
    assert checkpoints(base / "run") == ["step-000000024", "step-000000028", "step-000000030"]
    assert not any((base / "run").rglob("*.ckpt"))
    # enable_checkpointing at its default: Lightning's default ModelCheckpoint runs beside unbroken (epoch ends)
    assert sorted(p.name for p in (base / "out" / "checkpoints").iterdir()) == ["epoch=4-step=30.ckpt"]
    return base / "out", att


# --------------------------------------------------------------------------- with unbroken
def test_sigkill_at_random_steps_resumes_bitwise(reference, tmp_path: Path) -> None:
    rng = random.Random(11)
    targets = sorted(rng.sample(range(2, STEPS - 2), 3))
    atts = []
    for target in targets:
        att = attempt(tmp_path, stop_at=target)
        assert att.rc == -signal.SIGKILL, att.stderr[-2000:]
        atts.append(att)
    atts.append(finish(tmp_path))
    assert any("resumed from" in a.stderr for a in atts[1:])
    cmp = compare(reference, tmp_path, atts)
    assert cmp.exact, (targets, cmp)


@pytest.mark.parametrize("flags,files", [((), 4), (("--flavour", "lightning", "--no-lightning-checkpointing"), 3)],
                         ids=["pytorch_lightning", "lightning.pytorch-enable_checkpointing=False"])
def test_sigkill_inside_a_save_resumes_bitwise(reference, tmp_path: Path, flags: tuple[str, ...],
                                               files: int) -> None:
    """The Trainer from either package (both installed), Lightning's checkpointing on and off: the
    resumed run equals the reference (pytorch_lightning, checkpointing on) bitwise."""
    # tensor files per save: model, optimizer, RNG, and the state of Lightning's ModelCheckpoint when it
    # runs: the kill is half-way through the third save's first file
    env = dict(ENV, UNBROKEN_FAULTS=f"save.mid_file={2 * files + 1}")
    att = attempt(tmp_path, *flags, env=env)
    assert att.rc == -signal.SIGKILL, att.stderr[-2000:]
    run = tmp_path / "run"
    # the third save (step 12) was killed half-way: no visible checkpoint, only a hidden staging folder
    assert checkpoints(run) == ["step-000000004", "step-000000008"]
    assert any(p.name.startswith(".staging-") for p in run.iterdir())
    final = finish(tmp_path, *flags)
    assert "resumed from" in final.stderr and final.first_step == 8
    assert not (run / "quarantine").exists()
    cmp = compare(reference, tmp_path, [att, final])
    assert cmp.exact, cmp


def test_sigterm_saves_that_step_and_exits_nonzero(reference, tmp_path: Path) -> None:
    """A SIGTERM at a random moment, then one between the two micro-batches of step 21: each time the
    step under way is finished, saved, and the process exits with 75; the resume starts there."""
    target = random.Random(5).randint(2, 14)
    att = attempt(tmp_path, stop_at=target, sig=signal.SIGTERM)
    assert att.rc == 75, (att.rc, att.stderr[-2000:])
    stopped = int(att.stdout.split("preempted at step ")[1].split()[0])
    # no finished step is lost: the last step it ran (its loss lines carry global_step - 1) is saved
    assert stopped == max(att.steps_done) + 1 and stopped >= target, (stopped, att.steps_done)
    assert checkpoints(tmp_path / "run")[-1] == f"step-{stopped:09d}"
    mid = attempt(tmp_path, "--sigterm-at", "20")
    assert mid.rc == 75 and mid.first_step == stopped, (mid.rc, mid.first_step, mid.stderr[-2000:])
    assert "preempted at step 21" in mid.stdout and checkpoints(tmp_path / "run")[-1] == "step-000000021"
    final = finish(tmp_path, "--sigterm-at", "20")
    assert final.first_step == 21
    cmp = compare(reference, tmp_path, [att, mid, final])
    assert cmp.exact, cmp


@pytest.mark.parametrize("micro,seed", [(0, 3), (1, 4)])
def test_exception_gives_exact_emergency_checkpoint(reference, tmp_path: Path, micro: int, seed: int) -> None:
    """An exception in the first micro-batch of a step, or in the second (which Lightning runs inside
    ``optimizer.step(closure)``): the emergency checkpoint holds the state at the start of that step."""
    crash = random.Random(seed).choice([s for s in range(2, STEPS - 2) if s % SAVE_EVERY])
    flags = ("--crash-at", str(crash), "--crash-micro", str(micro))
    att = attempt(tmp_path, *flags)
    assert att.rc == 1 and "injected failure" in att.stderr, att.stderr[-2000:]
    assert "emergency checkpoint" in att.stderr
    assert checkpoints(tmp_path / "run")[-1] == f"step-{crash:09d}"
    final = finish(tmp_path, *flags)
    assert final.first_step == crash
    cmp = compare(reference, tmp_path, [att, final])
    assert cmp.exact, cmp


# ------------------------------------------------------------- Lightning's own checkpointing
# ModelCheckpoint(every_n_train_steps=SAVE_EVERY, save_last=True) and fit(ckpt_path="last"): what it loses.
LIGHTNING = ("--mode", "lightning")
MEASURED: dict[str, object] = {}


def report(name: str, value: object) -> None:
    MEASURED[name] = value
    print(f"measured {name}: {value}")


def test_lightning_alone_uninterrupted_equals_the_unbroken_run(reference, tmp_path: Path) -> None:
    """The callback changes nothing in the training: Lightning alone computes the same run, bitwise
    (and two separate processes agree, so every difference below comes from a resume)."""
    att = finish(tmp_path, *LIGHTNING)
    assert compare(reference, tmp_path, [att]).exact
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["epoch=3-step=28.ckpt", "last.ckpt"]


def test_with_the_dataloaders_order_unbroken_changes_nothing_and_resumes_bitwise(tmp_path: Path) -> None:
    """Lightning alone with ``DataLoader(shuffle=True)`` and no checkpointing, against the same script with
    the callback and ``ResumableLoader(order="dataloader")``: the same run, bitwise (the same batches and the
    DataLoader's draws from the global RNG at each epoch's start, which dropout follows). Killed after steps
    10, 17 and 29 (resumed mid-epoch from 8 and 16, and from 28: the last step of an epoch, before the next
    epoch's draws), it is still that run."""
    for name in ("alone", "ours", "killed"):
        (tmp_path / name).mkdir()
    alone = finish(tmp_path / "alone", "--mode", "plain", "--data", "plain")
    ours = finish(tmp_path / "ours", "--data", "torch-order")
    reference = (tmp_path / "alone" / "out", alone)
    assert compare(reference, tmp_path / "ours", [ours]).exact
    atts = [attempt(tmp_path / "killed", "--data", "torch-order", stop_at=target) for target in (10, 17, 29)]
    assert [a.rc for a in atts] == [-signal.SIGKILL] * 3, atts[-1].stderr[-2000:]
    atts.append(finish(tmp_path / "killed", "--data", "torch-order"))
    assert [a.first_step for a in atts] == [0, 8, 16, 28]
    cmp = compare(reference, tmp_path / "killed", atts)
    assert cmp.exact, cmp


# ------------------------------------------- either Trainer, checkpointing on or off, CheckpointIO plugin
FLAVOURS = ["pytorch_lightning", "lightning"]


def _trainer(root: Path, steps: int, callbacks: list, plugins: list | None = None, flavour: str = "pytorch_lightning",
             **kw: object):
    return lightning_package(flavour).Trainer(
        default_root_dir=root, accelerator="cpu", devices=1, max_steps=steps, accumulate_grad_batches=2, logger=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, callbacks=callbacks,
        plugins=plugins or [], **kw)


def _model(steps: int, flavour: str = "pytorch_lightning"):
    import argparse

    args = argparse.Namespace(data="resumable", crash_at=None, crash_micro=1, sigterm_at=None, steps=steps,
                              out=None)
    return model_class(lightning_package(flavour))(args)


def _final(model, trainer) -> dict:
    return {"model": {k: v.clone() for k, v in model.state_dict().items()},
            "optimizer": trainer.optimizers[0].state_dict(), "global_step": trainer.global_step,
            "epoch": trainer.current_epoch, "batches": trainer.fit_loop.epoch_loop.batch_progress.state_dict(),
            "scheduler": trainer.lr_scheduler_configs[0].scheduler.state_dict()["last_epoch"]}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """8 steps in this process, Lightning alone, nothing saved: what a resumed fit must end with."""
    torch.manual_seed(0)
    model = _model(8)
    trainer = _trainer(tmp_path_factory.mktemp("uninterrupted"), 8, [], enable_checkpointing=False)
    trainer.fit(model)
    return _final(model, trainer)


@pytest.mark.parametrize("checkpointing", [True, False], ids=["enable_checkpointing", "enable_checkpointing=False"])
@pytest.mark.parametrize("flavour", FLAVOURS)
def test_either_trainer_with_lightning_checkpointing_on_or_off_resumes_exactly(
        uninterrupted: dict, tmp_path: Path, flavour: str, checkpointing: bool) -> None:
    """Both packages installed; the Trainer (and the module) from ``flavour``: the callback and the plugin
    are taken, with ``enable_checkpointing`` either way; a fit stopped at step 5 and resumed in a new
    Trainer ends bitwise where the uninterrupted one did."""
    from unbroken.integrations.lightning import UnbrokenCallback, UnbrokenCheckpointIO

    pl = lightning_package(flavour)
    for steps, seed in ((5, 0), (8, 1)):  # the resumed fit's initial weights (seed 1) are overwritten
        torch.manual_seed(seed)
        model = _model(8, flavour)
        callback = UnbrokenCallback(tmp_path / "run", save_every=2)
        other = pl.callbacks.LambdaCallback()  # listed after it: unbroken moves itself last
        trainer = _trainer(tmp_path, steps, [callback, other], [UnbrokenCheckpointIO()], flavour,
                           enable_checkpointing=checkpointing)
        trainer.fit(model)
        assert trainer.callbacks[-1] is callback
    assert callback.restored is not None and callback.restored.step == 5
    assert tensors_equal(_final(model, trainer), uninterrupted)
    lightnings = [cb for cb in trainer.callbacks if isinstance(cb, pl.callbacks.ModelCheckpoint)]
    if checkpointing:  # Lightning's default ModelCheckpoint, beside unbroken; it wrote through the plugin
        assert len(lightnings) == 1 and lightnings[0].dirpath == str(tmp_path / "checkpoints")
        assert (tmp_path / "checkpoints" / "epoch_1-step_8.ckpt" / "manifest.json").is_file()
    else:
        assert lightnings == [] and not (tmp_path / "checkpoints").exists()


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_checkpoint_io_writes_pickle_free_folders_and_resumes_an_unbroken_run(tmp_path: Path, capfd,
                                                                              flavour: str) -> None:
    from unbroken.integrations.lightning import UnbrokenCallback, UnbrokenCheckpointIO

    torch.manual_seed(0)
    model = _model(8, flavour)
    trainer = _trainer(tmp_path, 6, [UnbrokenCallback(tmp_path / "run", save_every=2)], [UnbrokenCheckpointIO()],
                       flavour, enable_checkpointing=False)
    trainer.fit(model)
    manual = tmp_path / "manual.ckpt"
    trainer.save_checkpoint(manual)
    trainer.save_checkpoint(manual)  # overwriting (ModelCheckpoint's last.ckpt) swaps in the new one
    files = sorted(p.name for p in manual.iterdir())
    assert "manifest.json" in files and all(f.endswith((".json", ".safetensors")) for f in files), files
    import unbroken

    unbroken.verify(manual)  # every file checksummed; the tree is JSON, the tensors safetensors
    assert all(json.loads(p.read_text()) is not None for p in manual.glob("*.json"))
    assert not any(".unbroken-" in p.name for p in tmp_path.iterdir())
    io = UnbrokenCheckpointIO()
    loaded = io.load_checkpoint(manual)
    assert loaded["global_step"] == 6 and torch.equal(loaded["state_dict"]["net.0.weight"], model.net[0].weight)

    # a run written by the callback, read by ckpt_path= through the plugin: weights, optimizer, loops
    converted = io.load_checkpoint(tmp_path / "run")
    assert converted["global_step"] == 6 and len(converted["optimizer_states"]) == 1
    again = _model(8, flavour)
    t2 = _trainer(tmp_path, 8, [], [UnbrokenCheckpointIO()], flavour)
    capfd.readouterr()
    t2.fit(again, ckpt_path=str(tmp_path / "run"))
    assert t2.global_step == 8
    # Lightning restored the loop counters and the data position: it continued with epoch 0's last batch
    out = capfd.readouterr().out
    resumed = [tuple(map(int, line.split()[1:4])) for line in out.splitlines() if line.startswith("LOSS")]
    assert resumed == [(0, 12, 6), (1, 0, 7), (1, 1, 7)], resumed
    # Lightning's own ModelCheckpoint wrote through the plugin ("epoch=1-step=8.ckpt" stored as epoch_1-step_8.ckpt)
    assert (tmp_path / "checkpoints" / "epoch_1-step_8.ckpt" / "manifest.json").is_file()
    io.remove_checkpoint(manual)
    assert not manual.exists()


ONE_PACKAGE = """
import sys
for name in sys.argv[2:]:
    sys.modules[name] = None  # not installed, as far as this process can tell
import argparse, torch
from lightning_train import lightning, model_class
from unbroken.integrations.lightning import UnbrokenCallback, UnbrokenCheckpointIO

pl = lightning(sys.argv[1])
print("BASES", *sorted({b.__module__.split(".")[0] for cls in (UnbrokenCallback, UnbrokenCheckpointIO)
                        for b in cls.__bases__}))
args = argparse.Namespace(data="resumable", crash_at=None, crash_micro=1, sigterm_at=None, steps=4, out=None)
for steps in (2, 4):
    trainer = pl.Trainer(default_root_dir="root", accelerator="cpu", max_steps=steps, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                         callbacks=[UnbrokenCallback("run", save_every=1)], plugins=[UnbrokenCheckpointIO()])
    trainer.fit(model_class(pl)(args))
trainer.save_checkpoint("root/saved.ckpt")
print("DONE", trainer.global_step, UnbrokenCheckpointIO().load_checkpoint("root/saved.ckpt")["global_step"])
"""


@pytest.mark.parametrize("only,hidden,bases", [
    ("pytorch_lightning", ["lightning"], "lightning_fabric pytorch_lightning"),
    ("lightning", ["pytorch_lightning", "lightning_fabric"], "lightning")])
def test_with_one_lightning_package_installed(tmp_path: Path, only: str, hidden: list[str], bases: str) -> None:
    """The suite's environment has both packages; here the other one is hidden from a fresh process, as in
    an environment with ``only`` installed: the classes derive from its base classes alone, and a fit
    resumes (``enable_checkpointing=False``) and saves through the plugin."""
    env = dict(ENV, PYTHONPATH=os.pathsep.join(p for p in (str(SCRIPT.parent), ENV.get("PYTHONPATH")) if p))
    out = subprocess.run([sys.executable, "-c", ONE_PACKAGE, only, *hidden], capture_output=True, text=True,
                         env=env, cwd=tmp_path, timeout=300)
    assert "DONE 4 4" in out.stdout, out.stdout[-2000:] + out.stderr[-3000:]
    assert f"BASES {bases}\n" in out.stdout and "resumed from" in out.stderr


def test_import_without_lightning_names_the_extra() -> None:
    code = ("import sys\n"
            "for m in ('lightning', 'lightning.pytorch', 'pytorch_lightning', 'lightning_fabric'):\n"
            "    sys.modules[m] = None\n"
            "try:\n"
            "    import unbroken.integrations.lightning\n"
            "except ImportError as e:\n"
            "    print('IMPORTERROR', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=120)
    assert "IMPORTERROR" in out.stdout, out.stdout + out.stderr
    assert "pip install -e '.[lightning]'" in out.stdout
