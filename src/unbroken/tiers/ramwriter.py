"""The writer process of the RAM tier: copies committed RAM checkpoints to the run location.

``python -m unbroken.tiers.ramwriter`` is started by :class:`Persister` (the training side's handle)
the first time a RAM checkpoint is due for persisting. It is a separate process so that its
reading, hashing and writing never hold the training process's GIL, and so that it does not
die with the trainer: a SIGKILL or an OOM kill of the training process closes the pipe, the
writer finishes the checkpoint in hand (committed whole, manifest last, or not at all) and
exits. It imports no torch (about 0.1 s to start).

Protocol, one JSON document per line. The parent writes the configuration first
(``{"ram": dir, "run": url, "storage_options": {...}}``: the options travel through the pipe,
never on a command line other users can read), then one ``{"name": ...}`` per checkpoint to
persist, at most one outstanding at a time. The writer answers each with
``{"name", "final", "took_s"}`` or ``{"name", "error"}``. Every file is verified against the
manifest while it is copied (:func:`unbroken.tiers.remote.copy_checkpoint`): a RAM copy damaged in
memory is never persisted.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

log = logging.getLogger("unbroken")


class Persister:
    """The training side of the writer process: start it, hand it a checkpoint, collect answers.

    Every wait on the process is bounded, and an answer counts only if it comes from the process
    that has the checkpoint in hand, for that checkpoint: a writer that died while idle (SIGKILL, the
    OOM killer) leaves its end-of-output behind it, which must not be taken for its successor's reply.
    The writer runs in a session of its own, so that a signal to the trainer's process group (Ctrl-C,
    a scheduler's SIGTERM to the group) does not reach it: it finishes the copy in hand and exits when
    the trainer closes the pipe."""

    def __init__(self, ram_dir: str, run_url: str, storage_options: Mapping[str, Any] | None) -> None:
        self.ram_dir, self.run_url = ram_dir, run_url
        self.storage_options = dict(storage_options or {})
        self._proc: subprocess.Popen[bytes] | None = None
        self._answers: queue.Queue[dict[str, Any] | None] = queue.Queue()  # the current process's
        self.busy: str | None = None  # the RAM checkpoint being persisted
        self.busy_since = 0.0  # time.monotonic() when it was handed over

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def _start(self) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self._proc = subprocess.Popen([sys.executable, "-m", "unbroken.tiers.ramwriter"], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, env=env, close_fds=True, start_new_session=True)
        assert self._proc.stdin is not None
        self._answers = queue.Queue()  # a dead predecessor's answers (its end) stay in its own queue
        self._send({"ram": self.ram_dir, "run": self.run_url, "storage_options": self.storage_options})
        threading.Thread(target=self._read, args=(self._proc, self._answers), name="unbroken-persist-answers",
                         daemon=True).start()

    @staticmethod
    def _read(proc: subprocess.Popen[bytes], answers: queue.Queue[dict[str, Any] | None]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            try:
                answers.put(json.loads(line))
            except ValueError:
                continue
        answers.put(None)  # the process ended

    def _send(self, doc: dict[str, Any]) -> None:
        assert self._proc is not None and self._proc.stdin is not None
        self._proc.stdin.write(json.dumps(doc).encode() + b"\n")
        self._proc.stdin.flush()

    def submit(self, name: str) -> None:
        """Persist RAM checkpoint ``name`` (nothing may be in hand: see :attr:`busy`)."""
        assert self.busy is None, "one checkpoint at a time"
        if self._proc is None or self._proc.poll() is not None:
            self._start()
        self.busy, self.busy_since = name, time.monotonic()
        try:
            self._send({"name": name})
        except OSError as e:  # the writer died: answered as a failure by the next poll
            self._answers.put({"name": name, "error": f"the writer process is gone ({e})"})

    def poll(self, timeout: float | None = 0.0) -> dict[str, Any] | None:
        """The answer for the checkpoint in hand, if there is one by ``timeout`` (None: wait)."""
        if self.busy is None:
            return None
        while True:
            try:
                answer = self._answers.get(timeout=timeout) if timeout != 0.0 else self._answers.get_nowait()
            except queue.Empty:
                return None
            if answer is None or answer.get("name") == self.busy:
                break  # (an answer for another checkpoint cannot be this one's: skipped)
        if answer is None:  # the process ended without answering
            answer = {"name": self.busy, "error": f"the writer process exited (code {self._reap()}) during the copy"}
        self.busy = None
        return answer

    def _reap(self, timeout: float = 10.0) -> int | None:
        """End the current process (its output is closed: it is exiting), within ``timeout``; its code."""
        proc, self._proc = self._proc, None
        if proc is None:
            return None
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait()

    def abandon(self) -> int | None:
        """Kill the writer (stopped, or stuck on a hung filesystem) and forget the copy in hand, which
        commits nothing (a copy is committed whole or not at all); the next :meth:`submit` starts a new
        writer. The pid killed."""
        pid = self.pid
        if self._proc is not None:
            self._proc.kill()
            self._reap()
        self.busy = None
        return pid

    def stop(self, timeout: float = 60.0) -> None:
        """Close the pipe (the writer exits once idle) and wait for the process, at most ``timeout``."""
        proc = self._proc
        if proc is None:
            return
        try:
            assert proc.stdin is not None
            proc.stdin.close()
        except OSError:
            pass
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            log.error("the RAM tier's writer process %d did not exit within %.0f s: killed", proc.pid, timeout)
            proc.kill()
            proc.wait()
        self._proc = None


def _serve(config: dict[str, Any], lines: Any, out: Any) -> None:
    from ..store import open_store
    from .remote import copy_checkpoint

    src = open_store(config["ram"])
    dst = open_store(config["run"], config.get("storage_options") or None)
    owner = os.open(os.path.join(config["ram"], ".owner"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    fcntl.flock(owner, fcntl.LOCK_SH)  # the folder has a live owner while this process runs (unbroken.tiers.ram)
    for line in lines:
        job = json.loads(line)
        name = job["name"]
        t0 = time.monotonic()
        try:
            final, _ = copy_checkpoint(src, name, dst)
            answer: dict[str, Any] = {"name": name, "final": final, "took_s": time.monotonic() - t0}
        except Exception as e:  # noqa: BLE001 - answered; the training side raises or logs it
            answer = {"name": name, "error": f"{type(e).__name__}: {e}"}
        out.write(json.dumps(answer) + "\n")
        out.flush()


def main() -> None:
    # The writer runs in its own session (Persister), out of reach of the signals to the trainer's
    # group; ignored too when it is sent to this process alone by mistake: the writer goes on until the
    # trainer closes the pipe
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING, format="unbroken ram writer: %(message)s")
    config = json.loads(sys.stdin.readline() or "{}")
    if not config:
        return
    try:
        _serve(config, sys.stdin, sys.stdout)
    except BrokenPipeError:  # the trainer is gone and cannot read answers: nothing to tell
        pass


if __name__ == "__main__":
    main()
