"""``unbroken selftest``: the demo script resumes identically; scripts with one classic mistake each
are caught at the right step, with the right component and diagnosis; bad input is refused clearly,
in bounded time, leaving no process behind."""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

import unbroken
from unbroken.cli import app
from unbroken.selftest import protocol
from unbroken.selftest.compare import Divergence
from unbroken.selftest.diagnose import diagnose
from unbroken.selftest.plan import make_plan, parse_kinds

SCRIPTS = Path(__file__).parent / "selftest_scripts"


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    # the selftest's own temporary folders (kept when it diverges) go inside tmp_path too
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # and the scripts' (torchrun's torchelastic_* folders)
    for name in (protocol.DIR, protocol.RUN, protocol.KILL, protocol.STOP, "UNBROKEN_FAULTS"):
        monkeypatch.delenv(name, raising=False)


def selftest(*args: str) -> tuple[int, str, str]:
    res = CliRunner().invoke(app, ["selftest", *args])
    if res.exception is not None and not isinstance(res.exception, SystemExit):
        raise res.exception
    return res.exit_code, res.stdout, res.stderr


def script(name: str, *args: str) -> list[str]:
    return ["--", sys.executable, str(SCRIPTS / f"{name}.py"), *args]


@pytest.mark.slow  # runs long: the whole suite, not the fast tier (docs/testing.md)
def test_the_demo_training_script_is_identical(tmp_path: Path) -> None:
    code, out, err = selftest("--steps", "30", "--kills", "4", "--seed", "3", "--timeout", "120", "--json", "--",
                              sys.executable, "-m", "unbroken.demo.train", "--run-dir", str(tmp_path / "ignored"),
                              "--out", str(tmp_path / "out"), "--hidden", "64", "--save-every", "5")
    doc = json.loads(out)
    assert code == 0, (doc, err)
    assert doc["verdict"] == "identical" and doc["divergence"] is None
    ended = [a["ended"] for a in doc["attempts"]]
    # every kind of interruption really happened, each process after the first resumed
    assert any(e.startswith("killed after") for e in ended), ended
    assert any(e.startswith("killed in a save") for e in ended), ended
    assert any(e.startswith("preempted") and "exit 75" in e for e in ended), ended
    assert any(e.startswith("exception") for e in ended), ended
    assert ended[-1] == "finished at step 30"
    assert all(a["started"].startswith("resumed from step") for a in doc["attempts"][1:])
    assert doc["compared"]["rerun_steps"] >= 1 and doc["compared"]["records"] >= 30
    assert doc["workdir"] is None  # its temporary folder is removed when identical
    assert not (tmp_path / "ignored").exists()  # the selftest owns the run folders


# script, first diverging component, the cause (a phrase of it), whether the divergence follows a resume
BROKEN = [
    ("global_rng_sampler", "batch/indices", "sampler is not in the state", True),
    ("unsaved_generator", "optimizer/gradients", "random generator the script holds outside the state", True),
    ("iterator_before_restore", "batch/indices", "iterator was created before restore()", True),
    ("unsaved_accumulator", "optimizer/gradients", "carries from step to step is not in the state: `running`", True),
    ("nondeterministic", "optimizer/gradients", "non-deterministic operation", False),
    ("rng_after_restore", "batch/rng/torch", "draws from the global RNG between restore() and the first step", True),
]


@pytest.mark.parametrize("name,component,cause,after_resume", BROKEN, ids=[b[0] for b in BROKEN])
def test_a_classic_mistake_is_found_at_its_step(name: str, component: str, cause: str, after_resume: bool,
                                                tmp_path: Path) -> None:
    code, out, err = selftest("--steps", "20", "--kills", "1", "--kinds", "sigkill", "--seed", "1",
                              "--timeout", "120", "--workdir", str(tmp_path / "w"), "--json", *script(name))
    doc = json.loads(out)
    assert code == 1 and doc["verdict"] == "diverged", (doc, err)
    d, attempts = doc["divergence"], doc["attempts"]
    assert d["components"][0] == component, d
    assert cause in doc["diagnosis"]["cause"], doc["diagnosis"]
    if after_resume:  # the first step after the resume, in the process that resumed
        resumed = int(attempts[1]["started"].rsplit(" ", 1)[1])
        assert attempts[0]["ended"].startswith("killed after step") and resumed >= 5
        assert (d["segment"], d["resumed_from"], d["step"]) == (1, resumed, resumed + 1), d
        assert f"after the resume at step {resumed}" in doc["diagnosis"]["headline"]
    else:  # already the first step of the first process: no interruption needed to see it
        assert (d["segment"], d["resumed_from"], d["step"]) == (0, None, 1), d
        assert "before any interruption" in doc["diagnosis"]["headline"]
    assert (tmp_path / "w" / "interrupted" / "records.jsonl").is_file()  # kept for a look


def test_the_verdict_in_words(tmp_path: Path) -> None:
    code, out, err = selftest("--steps", "20", "--kills", "1", "--kinds", "sigkill", "--seed", "1",
                              "--timeout", "120", *script("global_rng_sampler"))
    assert code == 1
    assert "diverged step 6: the batch's sample indices differ after the resume at step 5" in out
    assert "fix:    use unbroken.data.ResumableLoader" in out
    assert "records, run folders and logs kept in" in err


@pytest.mark.slow  # runs long: the whole suite, not the fast tier (docs/testing.md)
def test_a_batch_fetched_ahead_is_named_and_the_fix_it_prints_is_identical(tmp_path: Path) -> None:
    """A loop that draws its batches itself and fetches the next one inside the step (nanoGPT), the fetched
    batch not in the state: the variables the resumed process makes only after restore() are compared at
    the same point as the uninterrupted run's (before: never compared, "cannot tell"), named, and the fix
    printed -- an ``unbroken.Vars`` in the state before restore() -- is what ``--fixed`` does: identical."""
    code, out, _ = selftest("--steps", "20", "--kills", "1", "--kinds", "sigkill", "--seed", "1", "--timeout", "120",
                            "--json", *script("prefetched_batch"))
    doc = json.loads(out)
    assert code == 1 and doc["verdict"] == "diverged", doc
    diagnosis = doc["diagnosis"]
    assert "`X`, `Y` exist when step" in diagnosis["cause"] and "makes them again after restore()" in \
        diagnosis["cause"], diagnosis  # not `iter_num`: made after restore() too, but equal at the step's end
    assert "loop = unbroken.Vars(X=None, Y=None); state['loop'] = loop before ckpt.restore(state)" in \
        diagnosis["fix"] and "loop.X, loop.Y = X, Y before each ckpt.step(state)" in diagnosis["fix"], diagnosis
    code, out, _ = selftest("--steps", "20", "--kills", "2", "--seed", "1", "--timeout", "120", "--json",
                            *script("prefetched_batch", "--fixed"))
    assert code == 0 and json.loads(out)["verdict"] == "identical", out


# script, a phrase of the fix the selftest prints for it; its ``--fixed`` variant follows that fix word for word
FIXED = [
    ("global_rng_sampler", "use unbroken.data.ResumableLoader and put it in the state before ckpt.restore(state)"),
    ("unsaved_generator", "put the generator in the state before ckpt.restore(state) (state['gen'] = g)"),
    ("iterator_before_restore", "create the iterator after ckpt.restore(state) (`for batch in loader:` inside the "
                                "loop); a torch DataLoader draws its iterator's seed from the global RNG, so give "
                                "it its own: DataLoader(..., generator=torch.Generator())"),
    ("unsaved_accumulator", "loop = unbroken.Vars(running=<its first value>); state['loop'] = loop before "
                            "ckpt.restore(state), and use loop.running where the loop used running"),
    ("rng_after_restore", "move that code before ckpt.restore(state)"),
    ("nondeterministic", "torch.use_deterministic_algorithms(True)"),  # a GPU's atomics, emulated (see the script)
]


@pytest.mark.parametrize("name,fix", FIXED, ids=[f[0] for f in FIXED])
@pytest.mark.slow  # runs long: the whole suite, not the fast tier (docs/testing.md)
def test_the_fix_the_selftest_prints_followed_literally_is_identical(name: str, fix: str, tmp_path: Path) -> None:
    """Every "fix:" line works as written (issue 35 §2): the same selftest as the mistake's (above) prints
    this fix, and the script with the fix applied word for word (``--fixed``) is identical."""
    args = ("--steps", "20", "--kills", "1", "--kinds", "sigkill", "--seed", "1", "--timeout", "120", "--json")
    code, out, err = selftest(*args, *script(name))
    doc = json.loads(out)
    assert code == 1 and fix in doc["diagnosis"]["fix"], (doc.get("diagnosis"), err)
    code, out, err = selftest(*args, *script(name, "--fixed"))
    assert code == 0 and json.loads(out)["verdict"] == "identical", (out, err)


def test_a_script_without_a_checkpointer(tmp_path: Path) -> None:
    code, out, err = selftest("--steps", "10", "--timeout", "120", *script("no_checkpointer"))
    assert code == 2
    assert "no Checkpointer was created: selftest needs one" in err and "README" in err


def test_a_script_that_crashes_on_its_own() -> None:
    code, out, err = selftest("--steps", "10", "--timeout", "120", "--json", *script("crashes"))
    doc = json.loads(out)
    assert code == 2 and doc["verdict"] == "error"
    assert "failed on its own in the uninterrupted run (exit 1)" in doc["error"]
    assert "ValueError: the script's own bug" in doc["stderr_tail"]
    assert doc["attempts"] == []  # nothing more was run


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


@pytest.mark.slow  # runs long: the whole suite, not the fast tier (docs/testing.md)
def test_a_script_that_hangs_is_killed_with_its_children(tmp_path: Path) -> None:
    pidfile = tmp_path / "child.pid"
    code, out, err = selftest("--steps", "10", "--timeout", "6", *script("hangs", "run", str(pidfile)))
    assert code == 2  # the 600 s sleep of the script was cut short: the message names the 6 s bound
    assert "did not finish within 6 s: killed it and every process it started" in err
    child = int(pidfile.read_text())
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child), "the script's child process outlived the selftest"


def test_bad_options() -> None:
    code, out, err = selftest("--nproc", "2", "--", str(SCRIPTS / "crashes.py"))
    assert code == 2 and "python train.py" in err  # under torchrun the leading python is replaced
    code, out, err = selftest("--kinds", "sigkill,meteor", *script("crashes"))
    assert code == 2 and "meteor" in err
    code, out, err = selftest("--steps", "10")
    assert code == 2 and "after --" in err


@pytest.mark.slow
def test_under_torchrun_every_kind_of_interruption_on_rank_0_and_both_ranks_identical(tmp_path: Path) -> None:
    code, out, err = selftest("--nproc", "2", "--steps", "16", "--kills", "4", "--seed", "17", "--timeout", "120",
                              "--workdir", str(tmp_path / "w"), "--json", *script("ddp_ok"))
    doc = json.loads(out)
    assert code == 0 and doc["verdict"] == "identical", (doc, err)
    assert doc["nproc"] == 2 and doc["divergence"] is None
    att = doc["attempts"]
    ended = [a["ended"] for a in att]
    assert ended[0] == "killed after step 5" and ended[1].startswith("preempted after step 7 (exit "), ended
    assert ended[2:] == ["exception after step 9 (exit 1)", "killed in a save after step 12", "finished at step 16"]
    assert att[0]["ranks"]["0"] == -9 and att[3]["ranks"]["0"] == -9  # rank 0 SIGKILLed (torchrun's report)
    # one SIGTERM to rank 0: both ranks saved step 7 and exited 75 (torchrun may SIGTERM the later one first)
    assert set(att[1]["ranks"]) == {"0", "1"} and 75 in att[1]["ranks"].values(), att[1]
    assert set(att[1]["ranks"].values()) <= {75, -15}, att[1]
    assert [a["started"] for a in att] == ["fresh start", "resumed from step 4", "resumed from step 7",
                                           "resumed from step 8", "resumed from step 8"]
    for rank, name in ((0, "records.jsonl"), (1, "records.rank1.jsonl")):  # each rank recorded every step
        recs = [json.loads(x) for x in (tmp_path / "w" / "interrupted" / name).read_text().splitlines()]
        assert {r["step"] for r in recs if r["kind"] == "step"} == set(range(1, 17)), rank
        assert not [r for r in recs if r["kind"] == "injected" and rank != 0]  # only rank 0 interrupts itself
        assert max(r["step"] for r in recs if r["kind"] == "step" and r["seg"] == 1) == 7, rank  # same stop step
    assert doc["compared"]["records"] >= 2 * 16 and doc["compared"]["rerun_steps"] >= 2


@pytest.mark.slow
def test_under_torchrun_a_mistake_on_one_rank_is_found_on_that_rank(tmp_path: Path) -> None:
    code, out, err = selftest("--nproc", "2", "--steps", "12", "--kills", "1", "--kinds", "sigkill", "--seed", "0",
                              "--timeout", "120", "--json", *script("ddp_ok", "--rank1-draws-after-restore"))
    doc = json.loads(out)
    assert code == 1 and doc["verdict"] == "diverged", (doc, err)
    d, attempts = doc["divergence"], doc["attempts"]
    assert attempts[0]["ended"] == "killed after step 7" and attempts[1]["started"] == "resumed from step 4"
    # rank 0's gradients differ at the same step (DDP averages them), but the cause is upstream on rank 1
    assert (d["rank"], d["segment"], d["step"], d["components"][0]) == (1, 1, 5, "batch/rng/torch"), d
    assert doc["diagnosis"]["headline"].startswith("rank 1, step 5: the torch CPU RNG before the first batch")
    assert "draws from the global RNG between restore() and the first step" in doc["diagnosis"]["cause"]


def test_the_plan_is_seeded_and_cycles_the_kinds() -> None:
    plan = make_plan(40, 4, parse_kinds("sigkill,sigterm,exception"), seed=5)
    assert plan == make_plan(40, 4, ["sigkill", "sigterm", "exception"], seed=5)
    assert [p.kind for p in plan] == ["sigkill", "sigterm", "exception", "save"]  # every second SIGKILL in a save
    assert [p.step for p in plan] == sorted(p.step for p in plan) and all(1 <= p.step < 40 for p in plan)
    assert plan[3].env() == {"UNBROKEN_FAULTS": "save.mid_file=1"}
    assert plan[1].env() == {"UNBROKEN_SELFTEST_KILL": f"sigterm@{plan[1].step}"}
    assert plan[3].env(nproc=2) == {"UNBROKEN_FAULTS": "save.mid_file@0=1"}  # under torchrun: rank 0 only
    assert make_plan(40, 4, ["sigkill"], seed=6) != plan


def test_diagnosis_of_an_optimizer_that_does_not_round_trip() -> None:
    d = Divergence(8, 1, "step", 5, ["optimizer/moments:exp_avg"], ["optimizer/gradients", "batch/indices"])
    g = diagnose(d)
    assert g.headline.startswith("step 8: state['optimizer']'s optimizer state 'exp_avg' differ after the resume "
                                 "at step 5")
    assert "optimizer does not continue exactly" in g.cause
    restored = Divergence(5, 1, "restore", 5, ["scheduler"], ["model/parameters"])
    assert "does not round-trip" in diagnose(restored).cause


def test_outside_selftest_mode_nothing_is_hooked(tmp_path: Path) -> None:
    ckpt = unbroken.Checkpointer(tmp_path / "run")
    try:
        assert ckpt._selftest is None
        assert ckpt.location.endswith("run")
        from torch.utils.data import dataloader
        assert not getattr(dataloader._BaseDataLoaderIter, "_unbroken_selftest", False)
        assert "unbroken.selftest.hooks" not in sys.modules
    finally:
        ckpt.close()
