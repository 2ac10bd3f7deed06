"""Accelerate + unbroken (``unbroken.integrations.accelerate``), end to end on 2 CPU processes.

Every run is ``tests/accel_train.py`` started the way users start it,
``accelerate launch --multi_gpu --num_processes 2`` (DDP; ``ACCELERATE_USE_CPU=1``) or
``accelerate launch --use_fsdp --fsdp_version 2 --num_processes 2`` (FSDP2), which is torchrun
underneath: dropout, AdamW + LambdaLR, gradient accumulation through ``accelerator.accumulate``
with a single-micro-batch step at every epoch's end, clipping, an evaluation after every epoch.
Runs are faulted (a save killed half-way through a rank's file, a rank SIGKILLed with torchrun
restarting the group, SIGTERM to the launcher and every process, another number of processes),
resumed until done, and compared bitwise with an uninterrupted run: every process's micro-batch
losses and samples of every step, every evaluation, the final parameters, AdamW moments, LR and
``accelerator.step``. Accelerate alone under the same faults: tests/test_accelerate_alone.py.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from test_distributed import run
from unbroken.checkpoint.reader import read_manifest
from unbroken.store import open_store

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
SCRIPT = str(Path(__file__).parent / "accel_train.py")
STEPS, SAVE_EVERY, CUT = 12, 4, 8  # epochs end after steps 5 and 10
ENV = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", ACCELERATE_USE_CPU="1")
ENV.pop("UNBROKEN_FAULTS", None)


def launch_cmd(n: int, base: Path, *extra: str, fsdp: bool = False, restarts: int = 0,
               mode: str = "unbroken") -> list[str]:
    """``accelerate launch`` of the job on ``n`` processes (torchrun underneath)."""
    kind = ["--use_fsdp", "--fsdp_version", "2"] if fsdp else ["--multi_gpu"]
    where = ["--run-dir", str(base / "run")] if mode == "unbroken" else ["--ckpt-dir", str(base / "ckpt")]
    return [sys.executable, "-m", "accelerate.commands.launch", *kind, "--num_processes", str(n),
            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "0",
            "--max_restarts", str(restarts), SCRIPT, "--mode", mode, *where, "--out", str(base / "out"),
            "--steps", str(STEPS), "--save-every", str(SAVE_EVERY), *extra]


def launch(cmd: list[str], base: Path, on_line=None, env: dict | None = None) -> tuple[int, str]:
    return run(cmd, env=env or ENV, timeout=400, on_line=on_line, workers=base / "out")  # (tests/jobs.py)


def rows(out: Path, rank: int, name: str = "losses") -> dict[int, tuple]:
    """step (or epoch) -> what one process logged for it last: (losses, samples) or the eval loss."""
    got = {}
    for line in (out / f"{name}-r{rank}.jsonl").read_text().splitlines():
        r = json.loads(line)
        if name == "losses":
            got[r["step"]] = (r["losses"], r["samples"])
        else:
            got[r["epoch"]] = r["eval"]
    return got


def logged_steps(out: Path, rank: int) -> list[int]:
    return [json.loads(x)["step"] for x in (out / f"losses-r{rank}.jsonl").read_text().splitlines()]


def differing(a: Path, b: Path) -> list[str]:
    """The keys whose tensors differ (or exist on one side only)."""
    x, y = load_file(str(a)), load_file(str(b))
    return sorted(set(x) ^ set(y)) + [k for k in x if k in y and not torch.equal(x[k], y[k])]


def global_samples(out: Path) -> dict[int, list[int]]:
    """step -> the samples of that optimizer step over every process (the last run that logged it)."""
    got: dict[int, dict[int, list[int]]] = {}
    for f in out.glob("losses-r*.jsonl"):
        for line in f.read_text().splitlines():
            r = json.loads(line)
            got.setdefault(r["step"], {})[int(f.stem.split("-r")[1])] = r["samples"]
    return {s: sorted(i for v in by_rank.values() for i in v) for s, by_rank in got.items()}


def check_bitwise(ref: Path, out: Path) -> None:
    assert differing(ref / "final.safetensors", out / "final.safetensors") == []
    for rank in (0, 1):
        assert rows(out, rank) == rows(ref, rank)  # every micro-batch loss and sample, bitwise
        assert rows(out, rank, "eval") == rows(ref, rank, "eval")  # every epoch's evaluation, once each


_references: dict[tuple[str, bool], Path] = {}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory):
    """The uninterrupted 2-process run (made once per mode), its state dumped after step CUT."""
    def get(fsdp: bool, mode: str = "unbroken") -> Path:
        key = (mode, fsdp)
        if key not in _references:
            base = tmp_path_factory.mktemp(f"accel-reference-{mode}-{'fsdp' if fsdp else 'ddp'}")
            code, out = launch(launch_cmd(2, base, "--dump-at", str(CUT), fsdp=fsdp, mode=mode), base)
            assert code == 0, out
            assert out.count(f"{'FSDP' if fsdp else 'MULTI_CPU'}, fsdp2={fsdp}") == 2, out
            if mode == "unbroken":  # FSDP2: DTensor shards written by each process through DCP's planners
                files = read_manifest(open_store(base / "run"), f"step-{CUT:09d}").files
                assert ({"s00000.safetensors", "s00001.safetensors", "sharded.json"} <= set(files)) == fsdp, files
            _references[key] = base
        return _references[key]

    return get


def test_an_uninterrupted_run_with_unbroken_is_accelerate_alone_bitwise(reference) -> None:
    """Enabling unbroken changes nothing but survival: the same 2-process script with Accelerate alone
    (``DataLoader(shuffle=True)`` through its seedable sampler, its own ``save_state``) and with unbroken's
    loader in the same order (``order="epoch_seeded"``) and the Checkpointer: every micro-batch loss and
    sample on each process, every evaluation and the final state are the same bits, across three epochs
    (the epoch ends are in the run, as are the DataLoader's draws from the global RNG that dropout follows)."""
    alone, ours = reference(False, "alone") / "out", reference(False) / "out"
    assert len(rows(ours, 0)) == STEPS
    check_bitwise(alone, ours)


@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp2"])
def test_killed_inside_a_save_then_a_rank_sigkilled_then_sigterm_resumes_bitwise(reference, tmp_path, fsdp) -> None:
    """One run, three faults, three launches (as a job's life could go):

    1. process 1 SIGKILLed half-way through one of its files in the save of step 8: the save
       never commits, step 4 stays the newest checkpoint;
    2. relaunched with ``--max_restarts 1`` (saving every 5 steps): process 1 SIGKILLed after
       step 7, torchrun restarts both, which resume from step 5, the last step of epoch 0 (its
       evaluation still to come); then SIGTERM to the launcher and both processes during step 9:
       the processes agree on it during the next step (no blocking collective per step), so every
       process finishes step 10, step 10 is saved once, every process exits with 75;
    3. relaunched: resumes from step 10 and finishes.

    Every step's losses and samples, every evaluation and the final state are bitwise the
    uninterrupted run's."""
    ref = reference(fsdp) / "out"
    out = tmp_path / "out"
    faulted = dict(ENV, UNBROKEN_FAULTS="save.mid_file@1=3")
    code, log = launch(launch_cmd(2, tmp_path, fsdp=fsdp), tmp_path, env=faulted)
    assert code != 0 and "rank 0 step 8" in log, log
    assert open_store(tmp_path / "run").list_committed() == [f"step-{SAVE_EVERY:09d}"], log

    events: list[str] = []

    def on_line(line: str, proc) -> None:  # the processes wait after steps 7 and 9 until the go file
        if not events and "rank 1 step 7" in line:
            os.kill(int((out / "pid-r1").read_text()), signal.SIGKILL)
            events.append("killed")
            (out / "go-7").touch()
        elif events == ["killed"] and "rank 1 step 9" in line:  # only the restarted round gets here
            for pid in [proc.pid] + [int(f.read_text()) for f in sorted(out.glob("pid-r*"))]:
                os.kill(pid, signal.SIGTERM)
            events.append("sigterm")
            (out / "go-9").touch()

    cmd = launch_cmd(2, tmp_path, "--save-every", "5", "--wait-at", "7", "--wait-at", "9", fsdp=fsdp, restarts=1)
    code, log = launch(cmd, tmp_path, on_line)
    assert events == ["killed", "sigterm"] and code != 0, log
    assert log.count(f"resumed from step {SAVE_EVERY}") == 2 and log.count("resumed from step 5") == 2, log
    assert [(out / f"exit-r{r}").read_text() for r in (0, 1)] == ["75", "75"], log
    assert log.count("preempted at step 10") == 2, log  # the step after the one both were in, saved once
    assert "step-000000010" in open_store(tmp_path / "run").list_committed()

    code, log = launch(launch_cmd(2, tmp_path, fsdp=fsdp), tmp_path)
    assert code == 0 and log.count("resumed from step 10") == 2, log
    check_bitwise(ref, out)
    assert len(logged_steps(out, 1)) > STEPS  # steps really ran twice, identically


@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp2"])
def test_a_checkpoint_of_2_processes_resumes_on_1(reference, tmp_path, fsdp) -> None:
    """The checkpoint of step 8 (mid-epoch) of the 2-process reference, resumed by one process
    with the same global batch: model, AdamW moments, LR and ``accelerator.step`` are bitwise the
    saved ones, and every later optimizer step trains on the samples of the uninterrupted run."""
    ref = reference(fsdp)
    shutil.copytree(ref / "run", tmp_path / "run")
    args = ["--batch", "8", "--resume-from", str(tmp_path / "run" / f"step-{CUT:09d}"), "--dump-restored"]
    if fsdp:  # FSDP2 needs a process group: one process under the launcher
        cmd = launch_cmd(1, tmp_path, *args, fsdp=True)
    else:  # plain `python train.py`: no distribution at all
        cmd = [sys.executable, SCRIPT, "--run-dir", str(tmp_path / "run"), "--out", str(tmp_path / "out"),
               "--steps", str(STEPS), "--save-every", str(SAVE_EVERY), *args]
    code, log = launch(cmd, tmp_path)
    assert code == 0 and f"resumed from step {CUT}" in log and "world size changed from 2 to 1" in log, log
    assert f"{'FSDP' if fsdp else 'NO'}, fsdp2={fsdp}" in log, log
    assert differing(ref / "out" / f"state-{CUT}.safetensors", tmp_path / "out" / "restored.safetensors") == []
    want, got = global_samples(ref / "out"), global_samples(tmp_path / "out")
    assert sorted(got) == list(range(CUT + 1, STEPS + 1))
    assert all(got[s] == want[s] for s in got)


# --------------------------------------------------------------------- in one process
@pytest.fixture()
def accelerator(monkeypatch):
    """A fresh single-process Accelerator on CPU; Accelerate's singletons reset afterwards."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield lambda **kw: Accelerator(cpu=True, **kw)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _parts():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.utils.data.TensorDataset(torch.arange(10.0).reshape(10, 1).repeat(1, 3))
    return model, opt, data


def test_what_would_break_exactness_is_refused_with_the_fix(accelerator, tmp_path) -> None:
    from unbroken import UnsupportedStateError
    from unbroken.integrations.accelerate import Checkpointer, ResumableLoader

    acc = accelerator()
    with pytest.raises(UnsupportedStateError, match="create the Checkpointer after"):
        Checkpointer(acc, tmp_path / "run")
    model, opt, data = _parts()
    plain = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)
    model, opt, plain = acc.prepare(model, opt, plain)
    with pytest.raises(UnsupportedStateError, match=r"DataLoader #0 .*batch_size=4, shuffled.*ResumableLoader\("
                                                   r"dataset, batch_size=4.*eval_loaders=\[that_loader\]"):
        Checkpointer(acc, tmp_path / "run")
    assert not (tmp_path / "run").exists()  # refused before anything was opened
    loader = acc.prepare(ResumableLoader(data, batch_size=2, shuffle=True, seed=0))
    ckpt = Checkpointer(acc, tmp_path / "run", eval_loaders=[plain])  # an evaluation loader: left out
    assert sorted(ckpt.state) == ["accelerator", "data", "model", "optimizer"] and ckpt.state["data"] is loader
    ckpt.close()


@pytest.mark.parametrize("kind", ["FSDP1", "DEEPSPEED"])
def test_fsdp1_and_deepspeed_through_accelerate_are_refused(accelerator, tmp_path, kind) -> None:
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    from unbroken import UnsupportedStateError
    from unbroken.integrations.accelerate import Checkpointer

    acc = accelerator()
    acc.prepare(*_parts()[:2])
    acc.state.distributed_type = DistributedType.FSDP if kind == "FSDP1" else DistributedType.DEEPSPEED
    acc.state.fsdp_plugin = FullyShardedDataParallelPlugin(fsdp_version=1)
    with pytest.raises(UnsupportedStateError, match="use FSDP2" if kind == "FSDP1" else "put the engine in"):
        Checkpointer(acc, tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_split_batches_is_refused(accelerator, tmp_path) -> None:
    from accelerate.utils import DataLoaderConfiguration

    from unbroken import UnsupportedStateError
    from unbroken.integrations.accelerate import Checkpointer, ResumableLoader

    acc = accelerator(dataloader_config=DataLoaderConfiguration(split_batches=True))
    model, opt, data = _parts()
    acc.prepare(model, opt, ResumableLoader(data, batch_size=2))
    with pytest.raises(UnsupportedStateError, match="split_batches=True is not supported"):
        Checkpointer(acc, tmp_path / "run")


def test_the_loader_is_registered_as_it_is_and_marks_the_epoch_end_before_its_last_batch(accelerator) -> None:
    from accelerate.state import GradientState

    from unbroken.integrations.accelerate import ResumableLoader

    acc = accelerator(gradient_accumulation_steps=2)
    model, opt, data = _parts()
    loader = ResumableLoader(data, batch_size=4, shuffle=True, seed=3)  # 3 batches: 4, 4, 2
    model, opt, prepared = acc.prepare(model, opt, loader)
    assert prepared is loader and acc._dataloaders == [loader]
    seen = []
    for (x,) in loader:
        with acc.accumulate(model):
            seen.append((len(x), GradientState().end_of_dataloader, acc.sync_gradients, x.device.type))
    # Accelerate steps on the epoch's last batch (a window of one) because the loader says it is the last
    assert seen == [(4, False, False, "cpu"), (4, False, True, "cpu"), (2, True, True, "cpu")]
    assert not GradientState().in_dataloader and (loader.epoch, loader.position) == (1, 0)


def test_after_a_checkpoint_of_an_epochs_last_step_the_next_loop_is_empty(accelerator) -> None:
    """Restored at the end of an epoch (its last step checkpointed before the loop ended), the
    first iteration yields nothing (the epoch-end code runs once) and the next starts a new epoch."""
    from unbroken.integrations.accelerate import ResumableLoader

    _, _, data = _parts()
    a, b = (ResumableLoader(data, batch_size=4, shuffle=True, seed=3) for _ in range(2))
    it = iter(a)
    saved = [next(it) for _ in range(3)] and a.state_dict()  # the last batch handed out, loop not ended
    assert (saved["epoch"], saved["position"]) == (0, 10)
    b.load_state_dict(saved)
    assert list(b) == [] and (b.epoch, b.position) == (1, 0)
    rest = list(it)  # the uninterrupted loop ends the epoch, then starts the next one
    assert rest == [] and [x.tolist() for (x,) in b] == [x.tolist() for (x,) in a]


def test_step_counts_optimizer_steps_and_a_restore_loads_every_part(accelerator, tmp_path) -> None:
    """``step()`` is a no-op between the micro-batches of a window, ``save()`` there is refused; a
    checkpoint restores model, optimizer, data position and ``accelerator.step`` in place."""
    from unbroken.integrations.accelerate import Checkpointer, ResumableLoader

    acc = accelerator(gradient_accumulation_steps=2)
    model, opt, data = _parts()
    model, opt, loader = acc.prepare(model, opt, ResumableLoader(data, batch_size=2, shuffle=True, seed=1))
    ckpt = Checkpointer(acc, tmp_path / "run")
    assert ckpt.restored is None
    batches = iter(loader)
    for i in range(3):  # one whole window (2 micro-batches), then the first micro-batch of the next
        with acc.accumulate(model):
            acc.backward(model(next(batches)[0]).sum())
            opt.step()
            opt.zero_grad()
        assert ckpt.step() is None and ckpt.progress.step == (0, 1, 1)[i]
    with pytest.raises(RuntimeError, match="between the micro-batches"):
        ckpt.save()
    with acc.accumulate(model):
        acc.backward(model(next(batches)[0]).sum())
        opt.step()
        opt.zero_grad()
    ckpt.step()
    info = ckpt.save()
    assert info is not None and info.step == 2 and (loader.position, acc.step) == (8, 4)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    ckpt.close()
    with torch.no_grad():
        model.weight.add_(1.0)
    loader.load_state_dict({**loader.state_dict(), "position": 0})
    acc.step = 0
    with Checkpointer(acc, tmp_path / "run") as again:
        assert again.restored is not None and again.restored.step == 2 and again.progress.step == 2
        assert all(torch.equal(saved[k], v) for k, v in model.state_dict().items())
        assert (loader.position, acc.step) == (8, 4) and opt.state_dict()["state"] == {}  # SGD: no state


def test_import_without_accelerate_names_the_extra() -> None:
    code = ("import sys; sys.modules['accelerate'] = None\n"
            "try:\n    import unbroken.integrations.accelerate\n"
            "except ImportError as e:\n    print('ImportError:', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "ImportError:" in out.stdout and "pip install -e '.[accelerate]'" in out.stdout, out.stdout
