"""The RAM tier's folders in shared memory as files: who owns one, who trains from it, which are
orphans, how one is removed (for :mod:`unbroken.tiers.ram`, whose docstring tells the rules)."""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import shutil
import socket
from pathlib import Path
from typing import Any

from ..checkpoint.runid import read_run_id
from ..errors import StorageError
from ..store import open_store

log = logging.getLogger("unbroken")
MARKER = ".unbroken-ram.json"
"""Written into every RAM folder: the run it belongs to (what removing it may touch)."""
TRAINER = ".trainer"
"""Locked exclusively by the one trainer process (the coordinator, or a node's leader) that uses the
folder, holding its pid and host: a second one is refused (:func:`exclusive`)."""
OWNER = ".owner"
"""Locked (shared) by the trainer and its writer process while they live: a folder whose lock can be
taken exclusively has no live owner (:func:`collect_orphans`)."""


def own(folder: Path, exclusive: bool = False) -> int | None:
    """Lock ``folder``'s owner file (shared; ``exclusive`` and non-blocking: None if a live
    process holds it); the open descriptor holds the lock until closed."""
    fd = os.open(folder / OWNER, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB if exclusive else fcntl.LOCK_SH)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def exclusive(folder: Path) -> int:
    """Lock ``folder``'s trainer file exclusively (one live trainer per RAM folder, as one writer per
    run folder: a second job on the same run, a container with the same volume on the same node);
    raise :class:`StorageError` naming the holder if another process has it."""
    fd = os.open(folder / TRAINER, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 200, 0).decode("utf-8", "replace").strip() or "unknown"
        os.close(fd)
        raise StorageError(f"another live process ({holder}) trains from the RAM folder {folder}: two jobs on one "
                           "run (or one run's folder mounted in two containers of this node) would prune and persist "
                           "each other's checkpoints; stop the other one, or give this one another run "
                           "location") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
    return fd


def collect_orphans(root: Path, mine: Path) -> None:
    """Remove the RAM folders under ``root`` that no live process owns and whose every checkpoint
    is older than the newest one on its run's disk (a killed run relaunched elsewhere, or one that
    ended with ``keep``); a folder holding a newer state is kept for its run's relaunch, and named.
    So is one whose run id is not the id of the run now at its path (that run was deleted and another
    made there, or it is another container's at the same path): its own run may still need it."""
    from ..checkpoint.discovery import manifests

    for folder in sorted(root.iterdir()):
        if folder == mine or not (folder / MARKER).is_file():
            continue
        fd = own(folder, exclusive=True)
        if fd is None:
            continue  # a live trainer or writer
        try:
            marked = json.loads((folder / MARKER).read_text())
            run = marked["run"]
            if "run_id" in marked and "://" not in run and read_run_id(open_store(run)) != marked["run_id"]:
                log.info("keeping %s: RAM checkpoints of run id %s, which is not the run now at %s (deleted and "
                         "made again there, or another container's); delete the folder to give the memory back",
                         folder, marked["run_id"] or "none", run)
                continue
            store = open_store(str(folder))
            ram = max((m.seq for m in manifests(store).values()), default=-1)
            disk = max((m.seq for m in manifests(open_store(run)).values()), default=-1) if "://" not in run else None
            if disk is not None and ram <= disk:
                log.info("removing %s: the RAM checkpoints of %s left by a process that ended (all older than "
                         "its newest on disk)", folder, run)
                remove_folder(folder, store)
            else:
                log.warning("%s holds RAM checkpoints of %s newer than its disk's, left by a process that ended: "
                            "relaunching that run on this node resumes from them (and removes them); delete the "
                            "folder to give the memory back", folder, run)
        except Exception as e:  # noqa: BLE001 - someone else's folder: never a reason to stop training
            log.debug("not collecting %s: %s", folder, e)
        finally:
            os.close(fd)


def remove_folder(folder: Path, store: Any) -> None:
    """Delete a RAM folder this library made: its checkpoints, leftovers and quarantine, then itself."""
    try:
        for name in store.list_committed():
            store.delete(name)
        store.clean_stale()
        q = folder / "quarantine"
        if q.is_dir():
            names = sorted(p.name for p in q.iterdir())
            if names:
                log.warning("removing the RAM tier's quarantined copies: %s", ", ".join(names))
            shutil.rmtree(q)
        for p in folder.iterdir():
            if p.name.startswith((".node-", ".lock", OWNER, TRAINER, MARKER)):
                p.unlink()
        folder.rmdir()
    except OSError as e:
        if e.errno != errno.ENOENT:
            log.warning("could not remove the RAM tier's folder %s: %s", folder, e)
        return
    try:  # the per-user folder (unbroken-<uid>) too, once no run of this user has one in it
        folder.parent.rmdir()
    except OSError:
        pass
