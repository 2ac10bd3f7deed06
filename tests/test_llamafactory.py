"""unbroken with Trainers it does not construct: a real LLaMA-Factory SFT run and TRL's SFTTrainer.

Every run is ``tests/lf_builtelsewhere.py`` in the LLaMA-Factory test environment (built once by
``scripts/llamafactory_env.sh`` into a cache folder, see :func:`lf_python`): a tiny random-init Llama
with attention dropout, a word-level tokenizer and 26 alpaca examples made by the test (nothing is
downloaded), SFT with ``gradient_accumulation_steps=2`` over epochs of 13 micro-batches (every 7th
step has one), warmup + cosine, clipping, a loss logged every step, 20 steps.

With unbroken the job passes ``UnbrokenTrainerCallback`` to ``run_exp(args, callbacks=[...])`` (or to
TRL's ``SFTTrainer(callbacks=[...])`` built inside a function) and nothing else; it is SIGKILLed at a
step, SIGKILLed inside a save, SIGTERMed, restarted with the same command each time, and compared
with an uninterrupted run: the sha256 of the final parameters + optimizer + scheduler, the sha256 of
the parameters after every optimizer step (the steps a resumed process recomputes included),
``global_step``, ``epoch``, ``total_flos``, ``train_loss`` and the whole ``log_history`` (every
per-step loss). The same faults against LLaMA-Factory's own resume (``save_steps`` +
``overwrite_output_dir=False``: it passes ``output_dir``'s last ``checkpoint-N`` to ``train()``)
measure what it loses; the numbers go into ``docs/integrations.md``.
"""

from __future__ import annotations

import functools
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import buildcache

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REPO = Path(__file__).resolve().parent.parent
JOB = Path(__file__).with_name("lf_builtelsewhere.py")
ENV_SCRIPT = REPO / "scripts" / "llamafactory_env.sh"
STEPS, SAVE_EVERY = 20, 4


@pytest.fixture(scope="session")
def lf_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Python of the LLaMA-Factory test environment, built on first use (1.5 GB; 2.5 to 6 minutes
    on two busy cores) into a folder keyed by the build script, ``constraints.txt`` and the interpreter
    (:mod:`buildcache`: ``make test`` keeps it in ``~/.cache/unbroken-test`` between runs; a plain pytest
    in the session's temporary root), and rebuilt whenever that key changes. A failed build fails the
    test (CI installs it like every test extra): the script's output says why."""
    digest = buildcache.key(ENV_SCRIPT)
    root = buildcache.root(tmp_path_factory)
    env = buildcache.folder(root, "llamafactory", digest)
    python = env / "bin" / "python"
    if (env / ".key").is_file() and (env / ".key").read_text() == digest and python.is_file():
        return python
    if env.is_dir() and not env.is_symlink():
        shutil.rmtree(env)  # an unfinished or damaged build of ours: never trusted
    staging = root / f".llamafactory-{digest}.{os.getpid()}"
    proc = subprocess.run(["sh", str(ENV_SCRIPT), str(staging)], capture_output=True, text=True,
                          env=dict(os.environ, PYTHON=sys.executable))
    if proc.returncode != 0:
        shutil.rmtree(staging, ignore_errors=True)
        pytest.fail(f"building the LLaMA-Factory test environment failed (sh {ENV_SCRIPT} DIR):\n"
                    f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}", pytrace=False)
    (staging / ".key").write_text(digest)  # written last: a build without it is unfinished
    try:
        staging.rename(env)  # atomic: a concurrent session that finished first keeps its own
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
    return python


@dataclass
class Attempt:
    rc: int = 0
    started: str = ""
    steps: dict[int, str] = field(default_factory=dict)  # step -> sha256 of the parameters after it
    last_step: int = 0
    stderr: str = ""

    @property
    def resumed_at(self) -> int:
        return int(self.started.split()[-1]) if self.started.startswith("resumed") else 0


def attempt(python: Path, command: str, assets: Path, out: Path, *extra: str,
            kill: tuple[signal.Signals, int] | None = None, env: dict[str, str] | None = None) -> Attempt:
    """One process of a run; ``kill=(signal, n)`` sends the signal once step ``n`` is printed."""
    att = Attempt()
    environ = dict(os.environ, PYTHONPATH=str(REPO / "src"), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                   HF_HOME=str(assets / "hf-home"), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", **(env or {}))
    if not env or "UNBROKEN_FAULTS" not in env:
        environ.pop("UNBROKEN_FAULTS", None)
    with tempfile.TemporaryFile(mode="w+") as err:
        proc = subprocess.Popen([str(python), str(JOB), command, "--assets", str(assets), "--out", str(out),
                                 "--steps", str(STEPS), "--save-every", str(SAVE_EVERY), *extra],
                                stdout=subprocess.PIPE, stderr=err, text=True, env=environ)
        assert proc.stdout is not None
        sent = False
        for line in proc.stdout:
            words = line.split()
            if line.startswith(("resumed from", "fresh start")):
                att.started = line.strip()
            elif line.startswith("step "):
                att.last_step = int(words[1])
                att.steps[att.last_step] = words[2]
                if kill and not sent and att.last_step >= kill[1]:
                    proc.send_signal(kill[0])
                    sent = True
        att.rc = proc.wait(timeout=600)
        err.seek(0)
        att.stderr = err.read()
    return att


def final(out: Path) -> dict:
    return json.loads((out / "final.json").read_text())


def differing_steps(ref: Attempt, attempts: list[Attempt]) -> list[int]:
    """Steps whose parameters differ from the uninterrupted run's (a recomputed step counts each time)."""
    return [s for a in attempts for s, v in a.steps.items() if ref.steps.get(s) != v]


def without(logs: list[dict], key: str) -> list[dict]:
    return [{k: v for k, v in e.items() if k != key} for e in logs]


def assert_exact(ref: tuple[Attempt, dict], out: Path, attempts: list[Attempt], log_except: str = "") -> None:
    """The interrupted run ended exactly where the uninterrupted one did, bit for bit (the logged
    metric ``log_except`` left out of the log history)."""
    ref_att, ref_final = ref
    got = final(out)
    assert got["sha256"] == ref_final["sha256"], "final parameters / optimizer / scheduler differ"
    for k in ("global_step", "epoch", "total_flos", "train_loss"):
        assert got[k] == ref_final[k], k
    assert without(got["log_history"], log_except) == without(ref_final["log_history"], log_except)
    assert got["global_step"] == STEPS
    assert not differing_steps(ref_att, attempts), "parameters after some steps differ"
    done = set().union(*(a.steps for a in attempts))
    assert done == set(range(1, STEPS + 1)), sorted(set(range(1, STEPS + 1)) - done)


@pytest.fixture(scope="module")
def assets(lf_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model, tokenizer and dataset, written by the job itself (no download)."""
    path = tmp_path_factory.mktemp("lf-assets")
    subprocess.run([str(lf_python), str(JOB), "prepare", "--assets", str(path)], check=True, capture_output=True,
                   env=dict(os.environ, OMP_NUM_THREADS="1", HF_HOME=str(path / "hf-home"), HF_HUB_OFFLINE="1"))
    return path


@pytest.fixture(scope="module")
def references(lf_python: Path, assets: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The uninterrupted runs, each made on first use: ``"unbroken"`` (LLaMA-Factory + unbroken,
    ``save_strategy="no"``) and ``"alone"`` (LLaMA-Factory alone: benchmarks/peers)."""

    class Runs(dict):
        def __missing__(self, mode: str) -> tuple[Attempt, dict]:
            out = tmp_path_factory.mktemp(f"lf-reference-{mode}")
            att = attempt(lf_python, "llamafactory", assets, out, "--mode", mode)
            assert att.rc == 0 and att.started == "fresh start", att.stderr[-3000:]
            assert sorted(att.steps) == list(range(1, STEPS + 1))
            self[mode] = (att, final(out))
            return self[mode]

    return Runs()


def newest_save(last_step: int) -> int:
    return last_step // SAVE_EVERY * SAVE_EVERY


def newest_step(folder: Path, prefix: str = "step-") -> int:
    """The newest ``<prefix><step>`` folder in ``folder`` (committed checkpoints; 0 if none)."""
    names = [p.name[len(prefix):] for p in folder.glob(f"{prefix}*") if p.is_dir()]
    return max((int(n) for n in names if n.isdigit()), default=0)


# ----------------------------------------------------------------------------- LLaMA-Factory + unbroken


def test_llamafactory_sigkilled_twice_and_sigtermed_resumes_bitwise(lf_python, assets, references, tmp_path):
    """``run_exp(args, callbacks=[UnbrokenTrainerCallback(...)])``, restarted with the same command after
    each fault. The interrupted processes also keep LLaMA-Factory's own saves (``save_steps=4``, its
    default strategy), so each restart finds ``output_dir/checkpoint-N`` and passes it to ``train()``:
    unbroken's run governs, and the Trainer's saves change nothing of the training (the reference has
    none)."""
    run = functools.partial(attempt, lf_python, "llamafactory", assets, tmp_path, "--hf-saves")
    kill_at = random.Random(5).randint(SAVE_EVERY + 1, 2 * SAVE_EVERY - 1)
    first = run(kill=(signal.SIGKILL, kill_at))
    assert first.rc == -signal.SIGKILL and first.started == "fresh start", first.stderr[-3000:]
    # the SIGKILL is sent once the step is printed and lands a moment later, under load possibly inside the
    # save of a later step: the newest checkpoint committed when it died is what the next process resumes
    committed = newest_step(tmp_path / "run")
    assert committed in (newest_save(first.last_step), newest_save(first.last_step) - SAVE_EVERY), committed
    hf_saves = newest_step(tmp_path / "lf", "checkpoint-")  # LLaMA-Factory's own, passed to train() at restart
    # the 7th time a save is half-way through a tensor file (4 files a save): the 2nd save of this process
    second = run(env={"UNBROKEN_FAULTS": "save.mid_file=7"})
    assert second.rc == -signal.SIGKILL, second.stderr[-3000:]
    assert second.resumed_at == committed > 0
    hf_ckpt = tmp_path / "lf" / f"checkpoint-{hf_saves}"
    assert f"resume_from_checkpoint={str(hf_ckpt)!r} is not a checkpoint of the unbroken run" in second.stderr
    died_in = second.resumed_at + 2 * SAVE_EVERY  # the save of this step was being written
    assert second.last_step == died_in and not (tmp_path / "run" / f"step-{died_in:09d}").exists()
    third = run(kill=(signal.SIGTERM, died_in + 2))
    assert third.rc == 75, third.stderr[-3000:]  # saved at the step boundary: unbroken.Preemption
    assert third.resumed_at == died_in - SAVE_EVERY  # the torn save never became a checkpoint
    last = run()
    assert last.rc == 0, last.stderr[-3000:]
    assert last.resumed_at == third.last_step  # no step lost to the SIGTERM
    print(f"measured, LLaMA-Factory + unbroken: SIGKILL after step {first.last_step}, resumed at "
          f"{second.resumed_at}; SIGKILL inside the save of step {died_in}, resumed at {third.resumed_at}; "
          f"SIGTERM after step {third.last_step}, resumed at {last.resumed_at}")
    assert_exact(references["unbroken"], tmp_path, [first, second, third, last])


# ----------------------------------------------------------------------------- LLaMA-Factory alone


# ----------------------------------------------------------------------------- TRL


def test_trl_sfttrainer_sigkilled_resumes_bitwise(lf_python, assets, tmp_path):
    """TRL's ``SFTTrainer`` (a Trainer subclass) built inside a function that takes only callbacks."""
    ref_out, out = tmp_path / "reference", tmp_path / "run"
    with ThreadPoolExecutor(2) as pool:
        ref_job = pool.submit(attempt, lf_python, "trl", assets, ref_out)
        first = attempt(lf_python, "trl", assets, out, kill=(signal.SIGKILL, 2 * SAVE_EVERY + 1))
    ref = ref_job.result()
    assert ref.rc == 0 and sorted(ref.steps) == list(range(1, STEPS + 1)), ref.stderr[-3000:]
    assert first.rc == -signal.SIGKILL, first.stderr[-3000:]
    committed = newest_step(out / "run")  # the kill lands a moment after the step printed: maybe in a later save
    assert committed in (newest_save(first.last_step), newest_save(first.last_step) - SAVE_EVERY), committed
    last = attempt(lf_python, "trl", assets, out)
    assert last.rc == 0 and last.resumed_at == committed > 0, last.stderr[-3000:]
    ref_final = final(ref_out)
    assert_exact((ref, ref_final), out, [first, last])  # TRL's num_tokens too: kept outside TrainerState
