"""DeepSpeed ZeRO stages 1, 2 and 3 under torchrun (CPU, gloo): real engines, real kills.

The job is tests/ds_train.py: the engine as DeepSpeed returns it in the state, dropout, a
frozen parameter, AdamW + LambdaLR handed to DeepSpeed, gradient clipping, a ResumableLoader
with a fixed global batch. Every check is bitwise: each rank's micro-batch losses and samples,
and the fp32 master weights and Adam moments consolidated by DeepSpeed's own
``safe_get_full_*`` API. DeepSpeed's CPU accelerator compiles its shared-memory collective
once per session (about a minute), into a folder of the session's own.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import jobs
from test_distributed import run
from unbroken.store import open_store

assert importlib.util.find_spec("deepspeed"), "DeepSpeed is missing: `make test` installs it (the test extra)"
pytestmark = [pytest.mark.e2e, pytest.mark.slow]
SCRIPT = str(Path(__file__).parent / "ds_train.py")
STEPS, SAVE_EVERY, CUT = 12, 3, 6


@pytest.fixture(scope="module")
def env(deepspeed_env: dict[str, str]) -> dict[str, str]:
    return deepspeed_env


def torchrun(n: int, base: Path, stage: int, *extra: str, restarts: int = 0) -> list[str]:
    return jobs.torchrun(n, SCRIPT, "--run-dir", str(base / "run"), "--out", str(base / "out"), "--stage",
                           str(stage), "--steps", str(STEPS), "--save-every", str(SAVE_EVERY), *extra,
                           restarts=restarts)


def launch(cmd: list[str], env: dict[str, str], base: Path, on_line=None) -> tuple[int, str]:
    return run(cmd, env=env, timeout=400, on_line=on_line, workers=base / "out")  # (tests/jobs.py)


def rows(out: Path, rank: int) -> dict[int, tuple[list[float], list[int]]]:
    """step -> (micro-batch losses, samples) of one rank, the last logged for each step."""
    got = {}
    for line in (out / f"losses-r{rank}.jsonl").read_text().splitlines():
        r = json.loads(line)
        got[r["step"]] = (r["losses"], r["samples"])
    return got


def global_samples(out: Path) -> dict[int, list[int]]:
    """step -> the samples of that optimizer step over every rank (of the last run that logged it)."""
    got: dict[int, dict[int, list[int]]] = {}
    for f in out.glob("losses-r*.jsonl"):
        for line in f.read_text().splitlines():
            r = json.loads(line)
            got.setdefault(r["step"], {})[int(f.stem.split("-r")[1])] = r["samples"]
    return {s: sorted(i for v in by_rank.values() for i in v) for s, by_rank in got.items()}


def same_tensors(a: Path, b: Path) -> list[str]:
    """The keys whose tensors differ (or exist on one side only)."""
    x, y = load_file(str(a)), load_file(str(b))
    return sorted(set(x) ^ set(y)) + [k for k in x if k in y and not torch.equal(x[k], y[k])]


_references: dict[int, Path] = {}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, env: dict[str, str]):
    """The uninterrupted 2-rank run of a stage (made once per stage), its state dumped after step CUT."""
    def get(stage: int) -> Path:
        if stage not in _references:
            base = tmp_path_factory.mktemp(f"ds-reference-{stage}")
            code, out = launch(torchrun(2, base, stage, "--dump-at", str(CUT)), env, base)
            assert code == 0, out
            _references[stage] = base / "out"
        return _references[stage]

    return get


def check_bitwise(ref: Path, out: Path) -> None:
    assert not same_tensors(ref / "final.safetensors", out / "final.safetensors")
    for rank in (0, 1):
        assert rows(out, rank) == rows(ref, rank)  # every micro-batch loss and sample, bitwise


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_rank_sigkilled_at_a_random_step_resumes_bitwise(stage, reference, env, tmp_path) -> None:
    target = random.Random(stage).randint(SAVE_EVERY + 1, STEPS - 2)
    killed: list[int] = []

    def on_line(line: str, proc) -> None:
        if not killed and f"rank 1 step {target}" in line:
            killed.append(int((tmp_path / "out" / "pid-r1").read_text()))
            os.kill(killed[0], signal.SIGKILL)

    code, out = launch(torchrun(2, tmp_path, stage, restarts=1), env, tmp_path, on_line)
    assert code == 0 and killed, out
    assert "resumed from step" in out, out
    check_bitwise(reference(stage), tmp_path / "out")
    again = [json.loads(x)["step"] for x in (tmp_path / "out" / "losses-r0.jsonl").read_text().splitlines()]
    assert len(again) > STEPS  # steps really ran twice, identically


def test_sigterm_to_every_rank_saves_one_step_exits_75_and_resumes_bitwise(reference, env, tmp_path) -> None:
    stage, target, sent = 3, 5, []

    def on_line(line: str, proc) -> None:
        if not sent and f"rank 1 step {target}" in line:
            for f in sorted((tmp_path / "out").glob("pid-r*")):
                sent.append(int(f.read_text()))
                os.kill(sent[-1], signal.SIGTERM)

    code, out = launch(torchrun(2, tmp_path, stage), env, tmp_path, on_line)
    assert code != 0 and len(sent) == 2, out
    assert out.count("exiting with 75") >= 2, out  # both ranks, after saving
    committed = open_store(tmp_path / "run").list_committed()
    step = max(int(n.split("-")[1]) for n in committed)
    assert step >= target, committed
    code, out = launch(torchrun(2, tmp_path, stage), env, tmp_path)
    assert code == 0 and f"resumed from step {step}" in out, out
    check_bitwise(reference(stage), tmp_path / "out")


def test_a_rank_killed_inside_a_save_never_commits_half_and_resumes_bitwise(reference, env, tmp_path) -> None:
    stage = 3
    # rank 1 writes its pieces and its RNG at each save: the 3rd file it starts is in the 2nd save
    killing = dict(env, UNBROKEN_FAULTS="save.mid_file@1=3")
    code, out = launch(torchrun(2, tmp_path, stage), killing, tmp_path)
    assert code != 0
    assert open_store(tmp_path / "run").list_committed() == [f"step-{SAVE_EVERY:09d}"], out
    code, out = launch(torchrun(2, tmp_path, stage), env, tmp_path)
    assert code == 0 and f"resumed from step {SAVE_EVERY}" in out, out
    check_bitwise(reference(stage), tmp_path / "out")


_cuts: dict[int, Path] = {}


@pytest.fixture(scope="module")
def cut(tmp_path_factory: pytest.TempPathFactory, env: dict[str, str]):
    """A 2-rank run of a stage stopped after step CUT (its last checkpoint)."""
    def get(stage: int) -> Path:
        if stage not in _cuts:
            base = tmp_path_factory.mktemp(f"ds-cut-{stage}")
            code, out = launch(torchrun(2, base, stage, "--stop-at", str(CUT)), env, base)
            assert code == 0 and f"step-{CUT:09d}" in open_store(base / "run").list_committed(), out
            _cuts[stage] = base / "run"
        return _cuts[stage]

    return get


@pytest.mark.parametrize("stage,world,to_stage", [(2, 1, 2), (2, 4, 2), (3, 1, 3), (3, 4, 3), (2, 2, 3), (3, 2, 1)])
def test_a_checkpoint_of_2_ranks_resumes_on_another_world_size_or_stage(stage, world, to_stage, reference, cut, env,
                                                                       tmp_path) -> None:
    """What DeepSpeed needs its offline universal-checkpoint conversion for: the fp32 masters and
    Adam moments restored on 1 or 4 ranks (or under another ZeRO stage) are bitwise the saved ones,
    and every later optimizer step trains on exactly the samples of the uninterrupted run, through the
    epoch end inside step 7 (the job's loader is ``continuous``: without it, 2 -> 4 ranks pads that
    epoch differently and every later step is shifted)."""
    shutil.copytree(cut(stage), tmp_path / "run")
    code, out = launch(torchrun(world, tmp_path, to_stage, "--dump-restored"), env, tmp_path)
    assert code == 0 and f"resumed from step {CUT}" in out, out
    ref = reference(stage)
    assert not same_tensors(ref / f"state-{CUT}.safetensors", tmp_path / "out" / "restored.safetensors")
    want, got = global_samples(ref), global_samples(tmp_path / "out")
    assert sorted(got) == list(range(CUT + 1, STEPS + 1))
    assert all(got[s] == want[s] for s in got)


# ------------------------------------------------------------------------------ the documented loop
DOC_PRELUDE = '''
import os, signal, sys
import torch, deepspeed, unbroken, unbroken.data
from safetensors.torch import save_file

unbroken.init_distributed()
total_steps, term_at = int(sys.argv[1]), int(sys.argv[2])
torch.manual_seed(0)
g = torch.Generator().manual_seed(0)
xs = torch.randn(40, 8, generator=g)
dataset = torch.utils.data.TensorDataset(xs, (xs[:, 0] > 0).long())  # 40 samples: 3.3 steps of 12
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.1), torch.nn.Linear(16, 2))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
cfg = {"train_batch_size": 12, "train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2}}
micro_batch = 4


class Checkpointer(unbroken.Checkpointer):  # the test's only hook: a SIGTERM to itself before step term_at
    def step(self, state, **metrics):
        if self.progress.step + 1 == term_at:
            os.kill(os.getpid(), signal.SIGTERM)
        return super().step(state, **metrics)


unbroken.Checkpointer = Checkpointer
'''
DOC_EPILOGUE = '''
ckpt.close()
save_file({k: v.contiguous() for k, v in engine.module.state_dict().items()}, "final.safetensors")
print(f"done at step {ckpt.progress.step}, epoch {loader.epoch}", flush=True)
'''


def test_the_documented_loop_runs_across_epoch_ends_and_resumes(env, tmp_path) -> None:
    """The DeepSpeed loop of docs/integrations.md, as written (a prelude defines what it leaves to the reader: a
    tiny model, 40 samples, ZeRO-2, 12 samples per step in 3 micro-batches): it trains through 2 epoch ends (it
    raised StopIteration at the first), and stopped by a SIGTERM before step 5 (after the first epoch end)
    and run again, it ends bitwise where the uninterrupted run ends."""
    import docblocks
    code = docblocks.block_under(docblocks.REPO / "docs" / "integrations.md", "DeepSpeed ZeRO (stages 1, 2 and 3)")
    script = tmp_path / "loop.py"
    script.write_text(DOC_PRELUDE + code + DOC_EPILOGUE)
    def run(folder: str, term_at: int) -> tuple[int, str]:
        (tmp_path / folder).mkdir(exist_ok=True)
        res = subprocess.run(jobs.torchrun(1, script, "8", str(term_at)), cwd=tmp_path / folder, env=env,
                             capture_output=True, text=True, timeout=400)
        return res.returncode, res.stdout + res.stderr

    code, out = run("whole", 0)
    assert code == 0 and "done at step 8, epoch 2" in out, out[-4000:]
    code, out = run("stopped", 5)
    assert code != 0 and "exiting with 75" in out and "done at" not in out, out[-4000:]
    code, out = run("stopped", 0)
    assert code == 0 and "done at step 8, epoch 2" in out, out[-4000:]
    assert "resumed from" in out and "step-000000005" in out, out[-4000:]
    assert not same_tensors(tmp_path / "whole" / "final.safetensors", tmp_path / "stopped" / "final.safetensors")
