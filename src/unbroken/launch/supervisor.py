"""``unbroken run -- python train.py ...``: restart the training after a failure, from a warm spare.

The supervisor runs the command and, while it trains, keeps one **spare** ready (:mod:`.spare`): an
interpreter of the same Python with the same flags, environment and working folder that has imported
torch (and ``--preload`` modules) and waits. Spares are forked from one interpreter that imported these once
(:mod:`.forker`, started with the first spare): a replacement costs a fork, not 2-3 s of CPU importing torch
beside the restarted training (``UNBROKEN_SPARES_FORK=0``, or a forker that died or stopped answering: each
spare a new interpreter). When the training process dies — SIGKILL, the OOM killer,
a segfault, an exception — the spare becomes the next training process at once (no interpreter start,
no ``import torch``: most of a cold restart), resumes from the run's newest checkpoint as any restart
does, and a new spare starts warming behind it. A restart is exact as every resume is: the spare is a
new process image started before the failure, nothing of the dead process is reused.

Exit statuses: 0 when the training finishes; 75 when it stopped for a preemption (the scheduler
requeues the job: restarting here would fight it); otherwise the training's last status (a signal
``N``: 128 + N) once ``--max-restarts`` restarts are used up, or at once when the supervisor itself was
asked to stop. SIGTERM, SIGINT, SIGUSR1 and SIGHUP sent to the supervisor go to the training process
too (a copy that also reached it directly is the same request for unbroken: :mod:`unbroken.faults.signals`),
and no restart follows them.

The supervisor SIGKILLed (it cannot forward anything then): a training process that uses a
:class:`~unbroken.Checkpointer` is signalled as if preempted (:mod:`unbroken.faults.launcher`: by the kernel, or
for a forked training by a thread waiting on the supervisor's pidfd): it saves at its next step boundary and exits
75, its lock released; a waiting spare exits (its pipe closed), and so does the forker (its socket closed).

Costs: the forker's and the spare's memory (each an interpreter with torch imported, sharing its pages: about 300 MB
of RAM in all, no GPU memory; neither ever touches CUDA) and the forker's CPU while it imports, once. A command the
spare cannot run (:mod:`.command`) restarts cold, with the reason said once.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from .command import Command, parse
from .forks import Forked, Forker, reap
from .spare import read_answer

PRELOAD = ("numpy", "torch", "torch._dynamo", "torch.utils.data", "torch.distributed", "unbroken",
           "unbroken.checkpointer.manager", "unbroken.checkpointer.restoring", "unbroken.data")
"""What every spare imports: torch, the parts of it a training script loads as a matter of course (the first
``torch.optim`` optimizer imports ``torch._dynamo``: over a second of CPU), and unbroken's training side."""
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP)
READY_TIMEOUT_S = 300.0
"""How long the supervisor waits for a spare to import before it runs the command cold instead."""
PREEMPTED = 75


def child_env() -> dict[str, str]:
    """The training's environment: this one, and this supervisor's pid (``UNBROKEN_SUPERVISOR``): a training
    process whose supervisor is SIGKILLed then saves at its next step and exits 75, as a torchrun worker
    whose agent died does (:mod:`unbroken.faults.launcher`), instead of training on unsupervised."""
    return dict(os.environ, UNBROKEN_SUPERVISOR=str(os.getpid()))


def say(message: str) -> None:
    print(f"unbroken run: {message}", file=sys.stderr, flush=True)


class Spare:
    """One waiting interpreter (see :mod:`.spare`), forked by ``forker`` while it is usable, else a new one;
    :meth:`go` makes it the training process."""

    def __init__(self, cmd: Command, preload: tuple[str, ...], forker: Forker | None) -> None:
        go_r, self._go = os.pipe()
        self._ready, ready_w = os.pipe()
        assert cmd.executable is not None
        forked = forker.fork(go_r, ready_w) if forker is not None and forker.usable else None
        self.forker = forker if forked is not None else None
        self.proc: subprocess.Popen[bytes] | Forked = forked or subprocess.Popen(
            [cmd.executable, *cmd.flags, "-m", "unbroken.launch.spare", str(go_r), str(ready_w), ",".join(preload)],
            pass_fds=(go_r, ready_w), stdin=None, env=child_env())
        os.close(go_r)
        os.close(ready_w)
        self.started = time.monotonic()
        self.answer: str | None = None

    def wait_ready(self, timeout: float) -> bool:
        """Whether the spare has imported what it preloads (within ``timeout`` seconds from now; a forked one
        within :data:`.forks.FORK_TIMEOUT_S` of its forker's import, else the forker is not asked again)."""
        if self.answer is None:
            if self.forker is not None:
                timeout = self.forker.ready_timeout(timeout)
            self.answer = read_answer(self._ready, timeout)
            if self.answer is None and self.forker is not None:
                self.forker.unanswered()
        return self.answer == "ready" and self.proc.poll() is None

    def go(self, cmd: Command) -> subprocess.Popen[bytes] | Forked:
        order = {"argv": cmd.main_argv(), "script": cmd.script, "module": cmd.module}
        os.write(self._go, (json.dumps(order) + "\n").encode())
        os.close(self._go)
        return self.proc

    def discard(self) -> None:
        """Not needed: its ``GO`` closes (it exits 0); killed if it has not within 5 s."""
        try:
            os.close(self._go)
        except OSError:
            pass
        if self.answer is None:
            os.close(self._ready)
            self.answer = "discarded"
        reap(self.proc)


@dataclass
class Outcome:
    status: int
    restarts: int
    warm: int


class Supervisor:
    """The loop of ``unbroken run`` (see the module docstring)."""

    def __init__(self, argv: list[str], max_restarts: int = 10, preload: tuple[str, ...] = (),
                 warm: bool = True) -> None:
        self.cmd = parse(argv)
        if not warm:
            self.cmd.cold = "--cold"
        self.max_restarts, self.preload = max_restarts, PRELOAD + tuple(preload)
        self.child: subprocess.Popen[bytes] | Forked | None = None
        self.spare: Spare | None = None
        self.forker: Forker | None = None
        self._retired = False  # the forker found unusable (said once)
        self.stopping: signal.Signals | None = None

    def _forward(self, signum: int, frame: object) -> None:
        self.stopping = signal.Signals(signum)
        if self.child is not None and self.child.poll() is None:
            self.child.send_signal(signum)

    def _spare(self) -> Spare:
        """A new spare; the first one starts the forker (unless ``UNBROKEN_SPARES_FORK=0``)."""
        if self.forker is None and os.environ.get("UNBROKEN_SPARES_FORK", "1") != "0":
            assert self.cmd.executable is not None
            self.forker = Forker(self.cmd.flags, self.preload, executable=self.cmd.executable, env=child_env(),
                                 detached=False)
        elif self.forker is not None and not self.forker.usable and not self._retired:
            how = "has ended" if not self.forker.up else "does not answer"
            say(f"the spare forker {how}: spares start as new interpreters")
            self._retired = True
        return Spare(self.cmd, self.preload, self.forker)

    def _start(self) -> tuple[subprocess.Popen[bytes] | Forked, bool]:
        """The next training process: the spare when it is ready, else the command started cold."""
        spare, self.spare = self.spare, None
        if spare is not None:
            if spare.wait_ready(READY_TIMEOUT_S - (time.monotonic() - spare.started)):
                return spare.go(self.cmd), True
            say(f"the spare was not ready ({spare.answer or 'still importing'}): starting cold")
            spare.discard()
        return subprocess.Popen(self.cmd.argv, env=child_env()), False

    def run(self) -> Outcome:
        if self.cmd.cold:
            say(f"cold restarts: {self.cmd.cold}")
        previous = {s: signal.signal(s, self._forward) for s in FORWARDED}
        restarts = warm = 0
        try:
            if self.cmd.warm:
                self.spare = self._spare()
            while True:
                self.child, was_warm = self._start()
                warm += was_warm
                if self.cmd.warm and self.stopping is None:
                    self.spare = self._spare()  # warms while the training runs
                status = _status(self.child.wait())
                if status == 0 or status == PREEMPTED or self.stopping is not None:
                    return Outcome(status, restarts, warm)
                if restarts >= self.max_restarts:
                    say(f"the training process ended with status {status}; {restarts} restarts used up: stopping")
                    return Outcome(status, restarts, warm)
                restarts += 1
                how = "from the warm spare" if self.spare is not None else "cold"
                say(f"the training process ended with status {status}: restart {restarts} of "
                    f"{self.max_restarts}, {how}")
        finally:
            if self.spare is not None:
                self.spare.discard()
            if self.forker is not None:
                self.forker.close()
            for s, h in previous.items():
                signal.signal(s, h)


def _status(returncode: int) -> int:
    """A shell's exit status for a child's return code (killed by signal N: 128 + N)."""
    return 128 - returncode if returncode < 0 else returncode
