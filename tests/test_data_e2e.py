"""End to end: the data of real training scripts, killed with real SIGKILLs and resumed, bitwise.

The job is tests/data_train.py (a tiny model with dropout, AdamW, 2 DataLoader workers). Each
test runs it once uninterrupted (module-scoped, shared) and once killed at a seeded random step
(or inside a save) and resumed, and compares every step's samples and loss (steps run twice
after a kill included) and the final parameters and optimizer moments, bitwise:

* a map-style ``datasets.Dataset`` with a random ``set_transform`` (``unbroken.data.Seeded``);
* a sharded ``datasets.IterableDataset`` with ``.shuffle(seed, buffer_size)`` through
  ``StreamLoader`` (also killed inside a save), and the same stream through torchdata's
  ``StatefulDataLoader`` as ``datasets`` recommends: measured, not exact;
* a ``Mixture`` with a curriculum, resumed unchanged and resumed with other weights and a new
  source (equal to the run that planned that change from the resume's block boundary);
* packed token rows (``Packer`` through ``CarryOver``) killed with tokens carried over.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from unbroken.demo import run_attempt

pytestmark = pytest.mark.e2e
SCRIPT = str(Path(__file__).parent / "data_train.py")
STEPS, SAVE_EVERY = 24, 4
ENV = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")


def cmd(base: Path, mode: str, *extra: str) -> list[str]:
    return [sys.executable, SCRIPT, "--mode", mode, "--run-dir", str(base / "run"), "--out", str(base / "out"),
            "--steps", str(STEPS), "--save-every", str(SAVE_EVERY), *extra]


def records(base: Path) -> list[dict]:
    return [json.loads(x) for x in (base / "out" / "records.jsonl").read_text().splitlines()]


def restored(base: Path) -> list[dict]:
    """What each resumed attempt found in its checkpoint besides the position (buffer, carry)."""
    return [json.loads(x) for x in (base / "out" / "restored.jsonl").read_text().splitlines()]


def uninterrupted(base: Path, mode: str, *extra: str) -> Path:
    att = run_attempt(cmd(base, mode, *extra), "none", "", ENV)
    assert att.ended == "finished" and att.last_step == STEPS, att
    return base


def kill_then_finish(base: Path, mode: str, seed: int, *extra: str, finish: tuple[str, ...] = ()) -> str:
    """SIGKILL the job after a seeded random step past the first save, then run it to the end;
    returns the finishing attempt's stderr."""
    target = random.Random(seed).randint(SAVE_EVERY + 1, STEPS - 2)
    att = run_attempt(cmd(base, mode, *extra), "step", str(target), ENV)
    assert att.ended.startswith("killed"), att
    return finish_run(base, mode, *(finish or extra))


def finish_run(base: Path, mode: str, *extra: str) -> str:
    att = run_attempt(cmd(base, mode, *extra), "none", "", ENV)
    assert att.ended == "finished" and att.started.startswith("resumed from step"), att
    return att.stderr


def same_final(a: Path, b: Path) -> bool:
    x, y = load_file(str(a / "out" / "final.safetensors")), load_file(str(b / "out" / "final.safetensors"))
    return x.keys() == y.keys() and all(torch.equal(x[k].view(torch.uint8), y[k].view(torch.uint8)) for k in x)


def check_bitwise(ref: Path, got: Path, last_only: bool = False) -> None:
    """Every step's loss and samples (a step run twice after a kill: both times, or with
    ``last_only`` the run that counts) and the final state."""
    want = {r["step"]: (r["loss"], r["samples"]) for r in records(ref)}
    rows = records(got)
    assert {r["step"] for r in rows} == set(want)
    assert len(rows) > STEPS  # steps after the last checkpoint ran twice
    for r in ({r["step"]: r for r in rows}.values() if last_only else rows):
        assert (r["loss"], r["samples"]) == want[r["step"]], f"step {r['step']} differs"
    assert same_final(ref, got)


@pytest.fixture(scope="module")
def ref(tmp_path_factory: pytest.TempPathFactory):
    made: dict[str, Path] = {}

    def get(mode: str) -> Path:
        if mode not in made:
            made[mode] = uninterrupted(tmp_path_factory.mktemp(f"ref-{mode}"), mode)
        return made[mode]

    return get


def test_hf_map_dataset_with_random_transform_killed_resumes_bitwise(ref, tmp_path: Path) -> None:
    """2 workers until the kill, 1 after: the transform's draws are keyed by the sample (Seeded)."""
    kill_then_finish(tmp_path, "hfmap", 1, finish=("--workers", "1"))
    check_bitwise(ref("hfmap"), tmp_path)


@pytest.mark.slow  # runs long: the whole suite, not the fast tier (docs/testing.md)
def test_hf_stream_with_shuffle_buffer_killed_at_a_step_and_in_a_save_resumes_bitwise(ref, tmp_path: Path) -> None:
    target = random.Random(2).randint(SAVE_EVERY + 1, 2 * SAVE_EVERY)
    att = run_attempt(cmd(tmp_path, "stream"), "step", str(target), ENV)
    assert att.ended.startswith("killed"), att
    att = run_attempt(cmd(tmp_path, "stream"), "save", "save.mid_file=2", ENV)  # a tensor file half written
    assert att.ended.startswith("killed in a save"), att
    finish_run(tmp_path, "stream")
    check_bitwise(ref("stream"), tmp_path)
    assert all(r["buffer"] > 0 for r in restored(tmp_path))  # resumed with examples in the shuffle buffer


@pytest.mark.slow  # runs long: the whole suite, not the fast tier (docs/testing.md)
def test_hf_stream_through_statefuldataloader_alone_does_not_resume_exactly(tmp_path: Path) -> None:
    """The framework alone (datasets + torchdata, 0 workers: with 2 the resume crashes, see
    tests/test_data_hf.py): the shuffle buffer's examples are lost at the kill."""
    base = uninterrupted(tmp_path / "ref", "stream-sdl", "--workers", "0")
    kill_then_finish(tmp_path / "got", "stream-sdl", 3, "--workers", "0")
    want = {r["step"]: r["samples"] for r in records(base)}
    got = {r["step"]: r["samples"] for r in records(tmp_path / "got")}  # the last run of each step
    differ = sorted(s for s in want if got[s] != want[s])
    seen_ref = sorted(i for s in want for i in want[s])
    seen_got = sorted(i for s in got for i in got[s])
    print(f"\nstream-sdl: {len(differ)} of {STEPS} steps with other samples after the resume (first {differ[:1]}); "
          f"samples seen {len(set(seen_got))} vs {len(set(seen_ref))} uninterrupted")
    assert differ and not same_final(base, tmp_path / "got")


@pytest.fixture(scope="module")
def mixture_killed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A mixture run with a curriculum, killed at a seeded step: resumed twice (copies) below."""
    base = tmp_path_factory.mktemp("mixture-killed")
    att = run_attempt(cmd(base, "mixture"), "step", str(random.Random(4).randint(SAVE_EVERY + 1, STEPS - 6)), ENV)
    assert att.ended.startswith("killed"), att
    return base


@pytest.mark.slow  # runs long: the whole suite, not the fast tier (docs/testing.md)
def test_mixture_with_curriculum_killed_resumes_bitwise(ref, mixture_killed: Path, tmp_path: Path) -> None:
    shutil.copytree(mixture_killed, tmp_path, dirs_exist_ok=True)
    finish_run(tmp_path, "mixture", "--workers", "1")
    check_bitwise(ref("mixture"), tmp_path)


@pytest.mark.slow  # runs long: the whole suite, not the fast tier (docs/testing.md)
def test_mixture_weights_changed_and_source_added_at_resume_equals_the_planned_change(
        ref, mixture_killed: Path, tmp_path: Path) -> None:
    """The documented rule: samples before the resume stay; the new weights (and the new source)
    apply from the next block boundary, logged; bitwise the run that planned it from there."""
    got = tmp_path / "got"
    shutil.copytree(mixture_killed, got)
    err = finish_run(got, "mixture", "--change")
    cut = int(re.search(r"mixture weights changed at resume: from sample (\d+) on", err).group(1))  # type: ignore[union-attr]
    assert "sources added: ['c']" in err
    planned = uninterrupted(tmp_path / "planned", "mixture", "--plan", str(cut))
    check_bitwise(planned, got, last_only=True)  # the killed attempt ran some steps with the old weights
    before = {r["step"]: r["samples"] for r in records(ref("mixture"))}
    after = {r["step"]: r["samples"] for r in records(planned)}
    assert all(after[s] == before[s] for s in after if s * 8 <= cut)  # nothing drawn before the cut changed
    assert any(after[s] != before[s] for s in after if s * 8 > cut)
    assert any(i >= 900 for s in after for i in after[s] if s * 8 > cut)  # the added source is drawn


@pytest.mark.slow  # runs long: the whole suite, not the fast tier (docs/testing.md)
def test_packer_killed_with_tokens_carried_over_resumes_bitwise(ref, tmp_path: Path) -> None:
    kill_then_finish(tmp_path, "packer", 5, finish=("--workers", "0"))
    check_bitwise(ref("packer"), tmp_path)
    assert [r["tokens"] > 0 for r in restored(tmp_path)] == [True]  # resumed with tokens carried over
