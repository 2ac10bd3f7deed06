"""The RAM tier (unbroken.tiers.ram): real training subprocesses killed with real signals, resumed from
shared memory (or, after a simulated node loss, from the disk), compared bitwise with a run that
was never interrupted; the writer process outliving the trainer; a copy killed half-way; the
memory bound on a real, small tmpfs; clean-up.

Every test puts the RAM tier's root in its own temporary folder (``UNBROKEN_RAM_ROOT``): nothing
is written to the machine's /dev/shm. The capacity test mounts a small tmpfs inside its folder.
"""

from __future__ import annotations

import fcntl
import logging
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import unbroken
from unbroken.demo import compare, run_attempt
from unbroken.errors import InsufficientSpaceError
from unbroken.run.index.index import RunIndex

from conftest import real_pid
from procs import with_environment

pytestmark = pytest.mark.e2e

STEPS, HIDDEN, PERSIST = 40, 128, 5


def env_for(tmp: Path, **extra: str) -> dict[str, str]:
    return dict(os.environ, PYTHONUNBUFFERED="1", UNBROKEN_RAM_ROOT=str(tmp / "shm"), **extra)


def cmd(base: Path, *extra: str, save_every: int = 1, ram: int = PERSIST) -> list[str]:
    return [sys.executable, "-m", "unbroken.demo.train", "--run-dir", str(base / "run"), "--out", str(base / "out"),
            "--steps", str(STEPS), "--save-every", str(save_every), "--hidden", str(HIDDEN), "--seed", "3",
            *(["--ram", str(ram)] if ram else []), *extra]


def ram_folders(tmp: Path) -> list[Path]:
    root = tmp / "shm" / f"unbroken-{os.getuid()}"
    return sorted(root.iterdir()) if root.is_dir() else []


def on_disk(run: Path) -> list[str]:
    return sorted(p.name for p in run.iterdir() if p.is_dir() and p.name.startswith("step-"))


def identical(ref: Path, got: Path) -> None:
    verdict = compare(ref, got)
    assert all(verdict.values()), verdict


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run that is never interrupted (no RAM tier: saving where cannot change the numbers)."""
    base = tmp_path_factory.mktemp("reference")
    att = run_attempt(cmd(base, save_every=10, ram=0), "none", "", dict(os.environ, PYTHONUNBUFFERED="1"))
    assert att.ended == "finished" and att.last_step == STEPS
    return base / "out"


def finish(tmp: Path, **extra: str) -> unbroken.demo.Attempt:
    att = run_attempt(cmd(tmp), "none", "", env_for(tmp, **extra))
    assert att.ended == "finished", att
    return att


@pytest.mark.parametrize("seed,flags", [(21, ()), (22, ("--async-save", "lazy"))])
@pytest.mark.slow  # runs long: the whole suite, not the fast tier (docs/testing.md)
def test_sigkill_at_random_steps_resumes_from_ram_bitwise(reference: Path, tmp_path: Path, seed: int,
                                                          flags: tuple[str, ...]) -> None:
    """Saved to RAM every step (also in the background, lazily): each relaunch restores from memory,
    at most the steps in flight lost; the finished run leaves no shared memory behind and its last
    state on disk."""
    targets = sorted(random.Random(seed).sample(range(3, STEPS - 3), 3))
    lost = 1 if not flags else 2  # the step printed before its save, and a save still in the background
    last = None
    for target in targets:
        att = run_attempt(cmd(tmp_path, *flags), "step", str(target), env_for(tmp_path))
        assert att.ended.startswith("killed"), att
        if last is not None:
            assert att.started.startswith("resumed from step") and att.started.endswith("(ram)"), att.started
            # the kill came once step `last` was printed, just before its save: at most that step lost
            assert int(att.started.split()[3]) >= last - lost
        last = target
        assert len(ram_folders(tmp_path)) == 1  # the RAM folder outlives the killed trainer
    att = run_attempt(cmd(tmp_path, *flags), "none", "", env_for(tmp_path))
    assert att.ended == "finished", att
    assert att.started.endswith("(ram)") and int(att.started.split()[3]) >= targets[-1] - lost, att.started
    identical(reference, tmp_path / "out")
    assert ram_folders(tmp_path) == []  # removed at close()
    assert f"step-{STEPS:09d}" in on_disk(tmp_path / "run")  # the final state persisted by close()
    assert RunIndex(tmp_path / "run").events("persisted")


def test_node_lost_resumes_from_the_last_persisted_checkpoint_bitwise(reference: Path, tmp_path: Path) -> None:
    """The node's memory is gone (the RAM folder deleted after the kill, as a reboot would):
    the relaunch restores the newest checkpoint the writer persisted to disk."""
    att = run_attempt(cmd(tmp_path), "step", "23", env_for(tmp_path))
    assert att.ended.startswith("killed"), att
    persisted = on_disk(tmp_path / "run")
    assert persisted, "nothing persisted in 23 saves with persist_every=5"
    newest = int(persisted[-1].split("-")[1])
    assert newest % PERSIST == 0 and newest <= 23
    for folder in ram_folders(tmp_path):
        subprocess.run(["rm", "-rf", str(folder)], check=True)
    att = finish(tmp_path)
    assert att.started == f"resumed from step {newest} (disk)", att.started
    identical(reference, tmp_path / "out")


@pytest.mark.parametrize("fault", ["save.before_manifest=9", "save.before_commit=12"])
def test_killed_inside_a_ram_save_resumes_from_the_previous_ram_checkpoint(reference: Path, tmp_path: Path,
                                                                          fault: str) -> None:
    att = run_attempt(cmd(tmp_path), "save", fault, env_for(tmp_path))
    assert att.ended.startswith("killed"), att
    killed_in = int(fault.split("=")[1])  # the n-th save is step n (a save every step, from step 1)
    att = finish(tmp_path)
    assert att.started == f"resumed from step {killed_in - 1} (ram)", att.started
    identical(reference, tmp_path / "out")
    assert not [p for p in (tmp_path / "run").iterdir() if p.name.startswith(".staging")]


def _stopped(pid: int, timeout: float = 60.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return False
        if state == "T":
            return True
        time.sleep(0.05)
    return False


def _writer_pid(trainer: int) -> int | None:
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if Path(p / "stat").read_text().rsplit(")", 1)[1].split()[1] == str(trainer) and \
                        b"unbroken.tiers.ramwriter" in (p / "cmdline").read_bytes():
                    return int(p.name)
            except OSError:
                continue
    return None


@pytest.mark.slow  # runs long: the whole suite, not the fast tier (docs/testing.md)
def test_the_writer_outlives_the_trainer_and_commits_its_copy(reference: Path, tmp_path: Path) -> None:
    """The writer is stopped (SIGSTOP, by a fault point) before the manifest of its first copy;
    the trainer is SIGKILLed; the writer, continued, commits that copy whole and exits."""
    env = env_for(tmp_path, UNBROKEN_FAULTS="copy.before_manifest=1", UNBROKEN_FAULT_ACTION="stop")
    proc = subprocess.Popen(cmd(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True)
    writer = None
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.strip() == f"step {PERSIST + 2}":
                break
        writer = _writer_pid(real_pid(proc))  # the trainer itself, when it was forked by the zygote
        assert writer is not None and _stopped(writer), "the writer did not stop before its manifest"
        assert on_disk(tmp_path / "run") == []  # not committed yet: only a staging folder
        proc.kill()
        proc.wait()
        os.kill(writer, signal.SIGCONT)
        end = time.monotonic() + 60
        while Path(f"/proc/{writer}").exists() and time.monotonic() < end:
            time.sleep(0.05)
        assert not Path(f"/proc/{writer}").exists(), "the writer did not exit after the trainer's death"
    finally:
        if proc.poll() is None:
            proc.kill()
        if writer is not None and Path(f"/proc/{writer}").exists():
            os.kill(writer, signal.SIGKILL)
    assert on_disk(tmp_path / "run") == [f"step-{PERSIST:09d}"]
    unbroken.verify(str(tmp_path / "run" / f"step-{PERSIST:09d}"))
    finish(tmp_path)
    identical(reference, tmp_path / "out")


def test_a_writer_killed_mid_copy_commits_nothing_and_training_goes_on(reference: Path, tmp_path: Path) -> None:
    """SIGKILL of the writer after a data file of its first copy: no half checkpoint on disk; the
    trainer logs the failure, the next due copy starts a new writer; the run ends exact."""
    att = run_attempt(cmd(tmp_path), "none", "", env_for(tmp_path, UNBROKEN_FAULTS="copy.after_file=1",
                                                           UNBROKEN_FAULT_ONCE=str(tmp_path / "fired")))
    assert att.ended == "finished", att
    assert "the writer process exited" in att.stderr
    run = tmp_path / "run"
    persisted = [e["checkpoint"] for e in RunIndex(run).events("persisted")]
    # the next due one after the failure (a later one if several came due while the writer started)
    assert persisted and f"step-{PERSIST:09d}" not in persisted, persisted
    assert all(int(n.split("-")[1]) % PERSIST == 0 for n in persisted[:-1])  # the last one: close()
    assert not [p for p in run.iterdir() if p.name.startswith(".staging")]  # removed (its writer is dead)
    identical(reference, tmp_path / "out")


def test_a_flipped_byte_in_ram_is_quarantined_and_the_previous_one_restored(reference: Path, tmp_path: Path) -> None:
    att = run_attempt(cmd(tmp_path), "step", "17", env_for(tmp_path))
    assert att.ended.startswith("killed"), att
    (folder,) = ram_folders(tmp_path)
    newest = sorted(p for p in folder.iterdir() if p.name.startswith("step-"))[-1]
    victim = max((f for f in newest.iterdir() if f.suffix == ".safetensors"), key=lambda f: f.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x10
    victim.write_bytes(bytes(data))
    att = finish(tmp_path)
    assert att.started == f"resumed from step {int(newest.name.split('-')[1]) - 1} (ram)", att.started
    assert "quarantined" in att.stderr and "checksum" in att.stderr
    identical(reference, tmp_path / "out")


def test_preemption_saves_to_disk_and_keeps_ram_for_the_relaunch(reference: Path, tmp_path: Path) -> None:
    """SIGTERM: the state of the last step is on the disk before the exit (the node may go away);
    the RAM folder is kept for a relaunch on this node, which reads memory and removes it when it ends."""
    att = run_attempt(cmd(tmp_path), "signal", "SIGTERM@12", env_for(tmp_path))
    assert att.ended.startswith("preempted at step"), att
    step = int(att.ended.split()[3])
    assert f"step-{step:09d}" in on_disk(tmp_path / "run")
    assert len(ram_folders(tmp_path)) == 1
    att = finish(tmp_path)
    assert att.started == f"resumed from step {step} (ram)", att.started  # on disk too; memory is read first
    identical(reference, tmp_path / "out")
    assert ram_folders(tmp_path) == []


def test_the_next_start_collects_ram_folders_no_process_owns(tmp_path: Path) -> None:
    """Run A is killed (its RAM holds steps newer than its disk): run B's start keeps A's folder and
    names it. A is relaunched and preempted (its disk is now newest, its RAM kept): B's next start
    removes A's folder. A folder whose owner lives is never touched."""
    a = tmp_path / "a"
    att = run_attempt(cmd(a), "step", "7", env_for(tmp_path))
    assert att.ended.startswith("killed"), att
    (folder,) = ram_folders(tmp_path)
    _no_owner(folder)  # the killed trainer's writer process finishes its copy in hand and exits
    tier = unbroken.RamTier(keep_last=2, persist_every=5, root=str(tmp_path / "shm"))
    state = _state(4)

    def start_b() -> list[str]:
        with pytest.MonkeyPatch.context() as mp:
            messages: list[str] = []
            mp.setattr("unbroken.tiers.ram.log.warning", lambda msg, *args: messages.append(msg % args))
            mp.setattr("unbroken.tiers.ram.log.info", lambda msg, *args: messages.append(msg % args))
            with unbroken.Checkpointer(tmp_path / "b", save_every=1, ram=tier) as ckpt:
                ckpt.restore(state)
                ckpt.step(state)
                assert folder.is_dir() or "removing" in " ".join(messages)
            return messages

    said = start_b()
    assert folder.is_dir() and any(str(folder) in m and "newer than its disk" in m for m in said), said
    att = run_attempt(cmd(a), "signal", "SIGTERM@9", env_for(tmp_path))
    assert att.ended.startswith("preempted at step") and folder.is_dir(), att
    _no_owner(folder)
    said = start_b()
    assert not folder.exists() and any(m.startswith(f"removing {folder}") for m in said), said


def _no_owner(folder: Path, timeout: float = 60.0) -> None:
    """Wait until no process holds the folder's owner lock (as the next start will find it) and no RAM
    writer of this test is left: a writer the trainer started just before it was killed may still be
    importing, and takes the lock (to finish the copy it was handed) after the trainer is gone."""
    end = time.monotonic() + timeout
    root = str(folder.parent.parent)  # the test's UNBROKEN_RAM_ROOT, in its writers' environment
    while with_environment("UNBROKEN_RAM_ROOT", root, command=b"unbroken.tiers.ramwriter"):
        assert time.monotonic() < end, f"a RAM writer of {root} still runs after {timeout} s"
        time.sleep(0.05)
    fd = os.open(folder / ".owner", os.O_RDWR)
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                assert time.monotonic() < end, f"{folder} is still owned after {timeout} s"
                time.sleep(0.05)
    finally:
        os.close(fd)


# ------------------------------------------------------------------ in process
def _state(n: int) -> dict:
    torch.manual_seed(0)
    return {"w": torch.nn.Linear(n, n, bias=False)}


def test_checkpoints_lists_the_tiers_and_close_removes_the_folder(tmp_path: Path) -> None:
    tier = unbroken.RamTier(keep_last=2, persist_every=2, root=str(tmp_path / "shm"))
    state = _state(8)
    with unbroken.Checkpointer(tmp_path / "run", save_every=1, ram=tier) as ckpt:
        ckpt.restore(state)
        for _ in range(5):
            ckpt.step(state)
        assert ckpt.wait(60)  # the writer's copy in hand committed
        tiers = {c.step: c.tiers for c in ckpt.checkpoints()}
        assert tiers[5] == ("ram",) and tiers[4] == ("local", "ram")  # RAM keeps 2: steps 4, 5
        assert tiers[2] == ("local",) and 3 not in tiers
    assert ram_folders(tmp_path) == []
    assert list((tmp_path / "shm").iterdir()) == []  # nor the per-user folder it was in
    assert on_disk(tmp_path / "run") == ["step-000000002", "step-000000004", "step-000000005"]


def test_a_crash_keeps_the_ram_folder_and_is_not_called_a_signal(tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    """An exception out of the ``with`` block: the RAM folder is kept for the relaunch (as on a signal),
    and the log says why it really stopped, never "on a signal" (issue 33 §5)."""
    tier = unbroken.RamTier(keep_last=2, persist_every=10, root=str(tmp_path / "shm"))
    state = _state(8)
    caplog.set_level(logging.INFO, logger="unbroken")
    with pytest.raises(RuntimeError, match="a bad batch"):
        with unbroken.Checkpointer(tmp_path / "run", save_every=1, ram=tier) as ckpt:
            ckpt.restore(state)
            for _ in range(3):
                ckpt.step(state)
            raise RuntimeError("a bad batch")
    assert len(ram_folders(tmp_path)) == 1
    assert "on a signal" not in caplog.text
    assert "stopping without close() (an exception" in caplog.text and "is kept for a relaunch" in caplog.text
    with unbroken.Checkpointer(tmp_path / "run", save_every=1, ram=tier) as ckpt:  # the relaunch reads memory
        info = ckpt.restore(_state(8))
        assert info is not None and info.step == 3 and info.tiers == ("ram",)
    with RunIndex(str(tmp_path / "run"), readonly=True) as index:  # and the run index says so
        assert [e["data"] for e in index.events("resumed")] == [{"tier": "ram"}]


def test_persisted_checkpoints_go_on_to_the_remote_tier(tmp_path: Path) -> None:
    """RAM -> the run location (the writer process) -> a remote tier (the uploader thread)."""
    remote = tmp_path / "remote"
    tier = unbroken.RamTier(keep_last=2, persist_every=3, root=str(tmp_path / "shm"))
    state = _state(8)
    with unbroken.Checkpointer(tmp_path / "run", save_every=1, ram=tier, keep_last=5,
                               remote=unbroken.Remote(str(remote), keep_last=None)) as ckpt:
        ckpt.restore(state)
        for _ in range(9):
            ckpt.step(state)
        assert ckpt.wait(120)
        tiers = {c.step: set(c.tiers) for c in ckpt.checkpoints()}
    # 3 and 9 persisted (6 came due while the new writer process still copied 3: skipped, not queued)
    assert tiers[9] == {"ram", "local", "remote"} and tiers[3] == {"local", "remote"}, tiers
    assert sorted(p.name for p in remote.iterdir() if p.name.startswith("step-"))[-1] == "step-000000009"
    for name in ("step-000000003", "step-000000009"):  # verified, on the remote, as written
        unbroken.verify(str(remote / name))


def test_ram_tier_with_incremental_is_refused(tmp_path: Path) -> None:
    with pytest.raises(unbroken.errors.ConfigurationError, match="RAM tier"):
        unbroken.Checkpointer(tmp_path / "run", ram=unbroken.RamTier(root=str(tmp_path / "shm")), incremental=True)
    with pytest.raises(unbroken.errors.ConfigurationError, match="keep at least 1"):
        unbroken.RamTier(keep_last=0)


@pytest.fixture
def small_tmpfs(tmpfs) -> Path:
    return tmpfs("2m")


def test_a_tmpfs_too_small_for_keep_last_plus_one_is_refused_with_the_numbers(tmp_path: Path, small_tmpfs: Path):
    state = _state(512)  # 1 MiB of weights: 3 of them do not fit in 2 MiB
    tier = unbroken.RamTier(keep_last=2, persist_every=1, root=str(small_tmpfs))
    with unbroken.Checkpointer(tmp_path / "run", save_every=1, ram=tier) as ckpt:
        ckpt.restore(state)
        with pytest.raises(InsufficientSpaceError) as err:
            ckpt.step(state)
        msg = str(err.value)
        assert re.search(r"keeps 2 of about 1\.\d MB plus one being written, [\d.]+ MB in all; the shared memory "
                         r"filesystem has [\d.]+ MB free of 2\.1 MB", msg), msg
        assert "--shm-size" in msg
        (folder,) = (small_tmpfs / f"unbroken-{os.getuid()}").iterdir()
        assert not [p for p in folder.iterdir() if p.name.startswith(("step-", ".staging"))]
    fits = unbroken.RamTier(keep_last=1, persist_every=1, root=str(small_tmpfs))  # 2 x 1 MiB: still too much
    small = _state(256)  # 256 KiB: 2 of them fit
    with unbroken.Checkpointer(tmp_path / "run2", save_every=1, ram=fits) as ckpt:
        ckpt.restore(small)
        for _ in range(3):
            ckpt.step(small)
    assert on_disk(tmp_path / "run2")[-1] == "step-000000003"
    assert list(small_tmpfs.iterdir()) == []  # both folders removed at close, and the per-user one
