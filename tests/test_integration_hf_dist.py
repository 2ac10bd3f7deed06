"""The HF Trainer integration on 2 ranks under torchrun (gloo, CPU): DDP, FSDP2, DeepSpeed ZeRO-2 and ZeRO-3.

Every run is ``tests/hf_dist_train.py``: a tiny random-init GPT-2 with dropout under
``transformers.Trainer``, a fixed global batch of 16 samples per optimizer step (2 ranks x 4 samples
x 2 micro-batches, or 1 rank x 4 x 4), epochs of 5 steps, AdamW (the Trainer's decay / no-decay
groups), warmup + cosine, clipping, logging every 2 and evaluation every 5 steps, 12 steps.

Per stack, one uninterrupted 2-rank run (module-scoped, shared by the tests), then:

- one launch under ``torchrun --max-restarts=3`` that goes through three faults in a row: rank 1
  SIGKILLed half-way through a file of the 2nd save (round 0), rank 1 SIGKILLed at a step (round 1),
  SIGTERM to both ranks (round 2: both save the same step and exit 75); round 3 finishes. Compared
  bitwise with the uninterrupted run: the final parameters (fp32 masters under ZeRO), AdamW moments,
  learning rates and scheduler position (gathered by FSDP's ``full_tensor()`` / DeepSpeed's
  ``safe_get_full_*``), every rank's micro-batch losses and samples of every step (the re-run ones
  included), ``state.epoch``, and on rank 0 ``global_step``, ``total_flos`` (under ZeRO-3 to the exact
  offset HF's flop count has there, see :func:`assert_bitwise`), ``train_loss``, the whole ``log_history``;
- a resume on 1 rank from the 2-rank checkpoint of step 6: the restored state is bitwise the
  uninterrupted run's state after step 6, and every later step trains on the same 16 global samples.
  The losses after it are not compared: another world size reduces gradients in another order and
  reseeds dropout (``docs/distributed.md``).

The same faults against the Trainer's own checkpointing (``save_strategy="steps"``,
``resume_from_checkpoint=True``) measure what HF alone does (DDP, FSDP2, ZeRO-3); the numbers go into
the table of ``docs/integrations.md``. FSDP runs on CPU only because the job forces accelerate's FSDP plugin
(``--force-fsdp-on-cpu``: accelerate 1.15 applies it for accelerator devices only).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import jobs
from test_distributed import run

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
SCRIPT = str(Path(__file__).with_name("hf_dist_train.py"))
STEPS, SAVE_EVERY, CUT, GLOBAL = 12, 3, 6, 16
STACKS = ["ddp", "fsdp2", "zero2", "zero3"]
# rank 1 writes 3 files per save on every stack (under DDP two of the replicated files, the smaller ones,
# and its RNG; under FSDP2 and DeepSpeed its shards, one replicated file, its RNG): the 4th time it is
# half-way through a file is in the first file of the 2nd save, the save of step 6
KILL_IN_SAVE = "save.mid_file@1=4"
WRAPPER = {"ddp": "DistributedDataParallel (Parameter parameters)", "fsdp2": "FSDPGPT2LMHeadModel (DTensor parameters)",
           "zero2": "DeepSpeedEngine (Parameter parameters)", "zero3": "DeepSpeedEngine (Parameter parameters)"}


@pytest.fixture(scope="module")
def env(deepspeed_env: dict[str, str]) -> dict[str, str]:
    return dict(deepspeed_env, TRANSFORMERS_VERBOSITY="error")


def torchrun(n: int, base: Path, stack: str, mode: str, *extra: str, restarts: int = 0) -> list[str]:
    force = ("--force-fsdp-on-cpu",) if stack.startswith("fsdp") else ()
    return jobs.torchrun(n, SCRIPT, "--stack", stack, "--mode", mode, "--out", str(base / "out"), "--steps",
                           str(STEPS), "--save-every", str(SAVE_EVERY), *force, *extra, restarts=restarts)


def launch(cmd: list[str], env: dict[str, str], base: Path, on_line=None) -> tuple[int, str]:
    return run(cmd, env=env, timeout=480, on_line=on_line, workers=base / "out")  # (tests/jobs.py)


def pid(base: Path, rank: int) -> int:
    return int((base / "out" / f"pid-r{rank}").read_text())


def all_rows(out: Path, rank: int) -> list[dict]:
    return [json.loads(x) for x in (out / f"steps-r{rank}.jsonl").read_text().splitlines()]


def rows(out: Path, rank: int) -> dict[int, dict]:
    """step -> that step's row of one rank (the last one logged)."""
    return {r["step"]: r for r in all_rows(out, rank)}


def global_samples(out: Path) -> dict[int, list[int]]:
    """step -> the samples of that optimizer step over every rank (the last run that logged it)."""
    got: dict[int, list[int]] = {}
    for rank in range(2):
        if (out / f"steps-r{rank}.jsonl").exists():
            for step, r in rows(out, rank).items():
                got.setdefault(step, []).extend(r["samples"])
    return {s: sorted(v) for s, v in got.items()}


def differing(a: Path, b: Path) -> list[str]:
    """The keys whose tensors differ bitwise (or exist on one side only)."""
    x, y = load_file(str(a)), load_file(str(b))
    return sorted(set(x) ^ set(y)) + [k for k in x if k in y and not torch.equal(x[k], y[k])]


def starts(out: str) -> list[int]:
    """The step each round of a launch started from (rank 0's line), in order."""
    return [int(m.group(2) or 0) for m in re.finditer(r"rank 0: (resumed from step (\d+)|fresh start)", out)]


_references: dict[tuple[str, str], Path] = {}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, env: dict[str, str]):
    """The uninterrupted 2-rank run of a stack and mode (made once), its full state dumped after step CUT."""
    def get(stack: str, mode: str = "unbroken") -> Path:
        if (stack, mode) not in _references:
            base = tmp_path_factory.mktemp(f"hf-{stack}-{mode}-reference")
            code, out = launch(torchrun(2, base, stack, mode, "--dump-at", str(CUT)), env, base)
            assert code == 0 and starts(out) == [0], out[-5000:]
            assert f"rank 1: training under {WRAPPER[stack]}" in out, out[-5000:]  # the stack really ran
            assert sorted(rows(base / "out", 0)) == list(range(1, STEPS + 1))
            _references[stack, mode] = base / "out"
        return _references[stack, mode]

    return get


def assert_bitwise(ref: Path, out: Path, stack: str, processes: int) -> None:
    """The interrupted run (``processes`` per rank) ended exactly where the uninterrupted one did, every
    step on the way included."""
    assert not differing(ref / "final.safetensors", out / "final.safetensors")
    for rank in (0, 1):
        want = rows(ref, rank)
        got = all_rows(out, rank)
        assert {r["step"] for r in got} == set(range(1, STEPS + 1))
        bad = [r["step"] for r in got if r != want[r["step"]]]  # a re-run step must equal it each time
        assert not bad, f"rank {rank}: steps {bad} differ (losses, samples or epoch)"
    final, ref_final = (json.loads((p / "final.json").read_text()) for p in (out, ref))
    if stack == "zero3":
        # HF's flop count is not training state: Trainer.floating_point_ops reads numel() of the model's
        # parameters, 0 under ZeRO-3 until DeepSpeed has gathered them, so the first micro-batch of every
        # process counts 0 on each rank (HF alone too). The uninterrupted run counted 2 x 2 x 12 - 2
        # micro-batches, this one 2 x 2 x 12 - 2 x processes: that much less, to the flop.
        micro = 2 * 2 * STEPS
        flos, ref_flos = float(final.pop("total_flos")), float(ref_final.pop("total_flos"))
        assert flos * (micro - 2) == ref_flos * (micro - 2 * processes), (flos, ref_flos)
        for log in (final["log_history"][-1], ref_final["log_history"][-1]):
            log.pop("total_flos")
    assert final == ref_final


# ----------------------------------------------------------------------------- HF + unbroken


@pytest.mark.parametrize("stack", STACKS)
def test_killed_inside_a_save_then_sigkill_then_sigterm_resume_bitwise(stack, reference, env, tmp_path) -> None:
    ref = reference(stack)
    sent: dict[str, list[int]] = {"kill": [], "term": []}
    rounds: list[int] = []

    def on_line(line: str, proc) -> None:
        if m := re.search(r"rank 0: (resumed from step (\d+)|fresh start)", line):
            rounds.append(int(m.group(2) or 0))
        m = re.search(r"rank 1 step (\d+)", line)
        if m is None:
            return
        step = int(m.group(1))
        if len(rounds) == 2 and step >= 7 and not sent["kill"]:  # round 1, right after the save of step 6
            sent["kill"].append(pid(tmp_path, 1))
            os.kill(sent["kill"][0], signal.SIGKILL)
        elif len(rounds) == 3 and step >= 10 and not sent["term"]:  # round 2: a preemption of every rank
            for rank in (0, 1):
                sent["term"].append(pid(tmp_path, rank))
                os.kill(sent["term"][-1], signal.SIGTERM)

    faults = dict(env, UNBROKEN_FAULTS=KILL_IN_SAVE)
    code, out = launch(torchrun(2, tmp_path, stack, "unbroken", "--faults-in-round", "0", restarts=3), faults,
                       tmp_path, on_line)
    assert code == 0 and sent["kill"] and len(sent["term"]) == 2, out[-5000:]
    first, second, third, fourth = starts(out)
    # round 0 died inside the save of step 6: that save never committed, round 1 resumed from step 3
    assert (first, second) == (0, SAVE_EVERY), out[-5000:]
    # round 1 was killed after step 7: round 2 resumed from the newest committed checkpoint
    assert third in (2 * SAVE_EVERY, 3 * SAVE_EVERY), out[-5000:]
    # round 2: both ranks finished the same step, saved it, exited with 75; round 3 resumed from exactly it
    # (only round 2's lines: when round 1's rank 1 was SIGKILLed, torchrun's agent tore rank 0 down with a
    # SIGTERM, which that rank may have reported as a preemption too)
    bounds = [m.start() for m in re.finditer(r"rank 0: (resumed from step (\d+)|fresh start)", out)]
    round2 = out[bounds[2]:bounds[3]]
    preempted = [int(x) for x in re.findall(r"preempted at step (\d+)", round2)]
    assert len(preempted) == 2 and preempted[0] == preempted[1] == fourth >= 10, out[-5000:]
    assert round2.count("exiting with 75") == 2, out[-5000:]
    run_dir = tmp_path / "out" / "run"
    assert not [p.name for p in run_dir.iterdir() if p.name.startswith(".staging-")]
    assert not (run_dir / "quarantine").exists()
    print(f"measured, {stack} + unbroken: killed inside the save of step 6 -> resumed at {second}; SIGKILL after "
          f"step 7 -> resumed at {third}; SIGTERM after step 10 -> saved step {fourth}, resumed at {fourth}")
    assert_bitwise(ref, tmp_path / "out", stack, processes=4)


@pytest.mark.parametrize("stack", STACKS)
def test_saved_by_two_ranks_resumed_on_one_at_the_same_global_sample(stack, reference, env, tmp_path) -> None:
    ref = reference(stack)
    shutil.copytree(ref / "run", tmp_path / "out" / "run")
    checkpoint = tmp_path / "out" / "run" / f"step-{CUT:09d}"
    code, out = launch(torchrun(1, tmp_path, stack, "unbroken", "--resume", str(checkpoint), "--dump-restored"),
                       env, tmp_path)
    assert code == 0 and starts(out) == [CUT], out[-5000:]
    assert "world size changed from 2 to 1" in out, out[-5000:]
    got = tmp_path / "out"
    # the state after the restore is bitwise the 2-rank run's after step 6: parameters (masters), moments,
    # learning rates, the scheduler's position
    assert not differing(ref / f"state-{CUT}.safetensors", got / "restored.safetensors")
    # every later step trains on the same 16 global samples (4 micro-batches of 4 instead of 2 x 2 x 4) ...
    want = global_samples(ref)
    assert global_samples(got) == {s: want[s] for s in range(CUT + 1, STEPS + 1)}
    assert {len(r["losses"]) for r in all_rows(got, 0)} == {GLOBAL // 4}
    # ... and loads nothing else: the data position restored in O(1), nothing replayed
    assert f"rank 0 fetched {(STEPS - CUT) * GLOBAL}" in out, out[-3000:]
    final, ref_final = (json.loads((p / "final.json").read_text()) for p in (got, ref))
    assert (final["global_step"], final["epoch"]) == (ref_final["global_step"], ref_final["epoch"]) == \
        (STEPS, ref_final["epoch"])


# ----------------------------------------------------------------------------- HF alone, measured
# ZeRO-2 gave what ZeRO-3 gives under each of these faults (the same errors) when measured; left out of CI.
ALONE = ["ddp", "fsdp2", "zero3"]


def errors(out: str) -> list[str]:
    return re.findall(r"^\[rank0\]: ([\w.]+(?:Error|Exception)\w*: .*)$", out, re.M)


# ----------------------------------------------------------------------------- FSDP on CPU, FSDP1

FSDP_CHECKS = """
import sys
sys.path.insert(0, {tests!r})
import hf_dist_train as job
import unbroken
from accelerate.state import PartialState
from accelerate.utils import DistributedType
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
from unbroken.integrations.hf import enable

unbroken.init_distributed("gloo")


def trainer(version, force):
    args = TrainingArguments(output_dir={out!r}, use_cpu=True, ddp_backend="gloo", report_to=[], max_steps=1,
                             save_strategy="no", **job.stack_args("fsdp%d" % version))
    if force:  # what the job's --force-fsdp-on-cpu does
        PartialState._shared_state["distributed_type"] = DistributedType.MULTI_GPU
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2))
    return Trainer(model=model, args=args, train_dataset=job.Tokens())


t = trainer(2, force=False)
print("fsdp on cpu:", t.args.fsdp, t.is_fsdp_enabled, t.accelerator.distributed_type, flush=True)
enable(t, {out!r} + "/run-ddp").checkpointer.close()
t = trainer(1, force=True)
print("fsdp1 forced:", t.is_fsdp_enabled, t.accelerator.state.fsdp_plugin.fsdp_version, flush=True)
try:
    enable(t, {out!r} + "/run-fsdp1")
except ValueError as e:
    print("refused:", e, flush=True)
"""


def test_fsdp_on_cpu_is_ddp_and_fsdp1_is_refused(env, tmp_path: Path) -> None:
    """One rank under torchrun (a Trainer with FSDP wants a process group). accelerate 1.15 applies its
    FSDP plugin only for accelerator devices (``AcceleratorState.__init__``: the branch of MULTI_GPU,
    MULTI_XPU, ...): on CPU the Trainer trains without FSDP, which unbroken saves like DDP. FSDP1,
    when it runs, is refused by ``enable`` before any training, naming FSDP2."""
    script = tmp_path / "checks.py"
    script.write_text(FSDP_CHECKS.format(tests=str(Path(SCRIPT).parent), out=str(tmp_path)))
    code, out = launch([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
                        str(script)], env, tmp_path)
    assert code == 0, out[-3000:]
    assert "fsdp on cpu: True False DistributedType.MULTI_CPU" in out, out[-3000:]
    assert "fsdp1 forced: True 1" in out
    assert re.search(r"refused: .*does not support FSDP1.*'fsdp_version': 2", out), out[-3000:]
    assert not (tmp_path / "run-fsdp1").exists()
