"""A fork server for the Python processes the tests launch: ``import torch`` paid once per worker.

Most of the suite's CPU is the start of the training processes it launches (``import torch`` alone
costs 2.5-3.5 s of CPU on this machine, a 60-step run of the demo 6-7 s in all). The zygote is a
Python process that has imported torch and numpy and nothing else (never unbroken: a test may put
another version of it on ``PYTHONPATH``), never ran an operator (no thread pool to break a fork),
and forks a child for each launch. The tests that use it (``ZYGOTE_MODULES`` in ``conftest.py``)
see ``sys.executable`` replaced by a launcher, ``<dir>/bin/python``; the other entries of the
virtual environment's ``bin`` are linked beside it.

The launcher is a small Python started with ``-S -I`` (no site, about 20 ms). It sends the zygote
what makes a process what it is: the command line, environment, working folder, umask, resource
limits, CPU affinity, ignored signals and signal mask, and every open descriptor (passed with
``SCM_RIGHTS``: standard streams and the pipes of ``pass_fds`` arrive as the same numbers). The
zygote forks; the child takes all of it, starts a session of its own, reseeds what a fresh process
seeds (torch's default generator, numpy's global one; Python's ``random`` does so itself), and runs
the script, ``-m`` module or ``-c`` code as the interpreter would. The launcher then stands for the
child: it forwards every signal it can catch, stops itself when the child stops, and exits as the
child exited (the same status, or killed by the same signal).

The launcher starts a plain interpreter instead (``exec``, the same pid) whenever the child could
differ from one: an option other than ``-u``, ``-B``, ``-X faulthandler``; another user, group,
capability set, namespace or cgroup; an environment that differs from the zygote's in a variable
read at import (``TORCH*``, ``OMP_*``, ``LD_*``, locale, ``PYTHON*``...); a folder on the path
that would shadow a module the zygote imported; one of the library's helper processes, which
depend on who their parent is (``PR_SET_PDEATHSIG``); or a zygote that is not running.

What differs, by design: the child's parent is the zygote, not the launcher (its descendants start
plain interpreters: ``sys.executable`` is the real one there); a signal sent to the launcher's
process group reaches the child through the launcher; SIGKILL cannot be forwarded, so the zygote
kills the child when the launcher's connection closes, and reaps it before it answers the next
launch (``conftest.py`` also sends ``Popen.send_signal`` to the child itself, so ``proc.kill()``
then ``proc.wait()`` returns only once the child is gone); all children of one zygote share its hash
seed (random per worker and session). A test that stops the launcher (SIGSTOP) or reads the child's
``/proc`` through ``proc.pid`` must not use it.
"""

from __future__ import annotations

import marshal
import os
import signal
import socket
import struct
import sys

# Environment variables read when torch, numpy or the interpreter start: a child whose value differs
# from the zygote's is started plainly. PYTHONPATH, PYTHONHASHSEED and the three emulated ones are checked
# on their own.
SENSITIVE = ("TORCH", "PYTORCH", "OMP_", "MKL", "KMP_", "GOMP_", "OPENBLAS", "NUMPY", "LD_", "PYTHON", "LANG",
             "LC_", "CUDA", "HIP_", "ROCM", "MALLOC", "GLIBC")
EMULATED = {"PYTHONPATH", "PYTHONHASHSEED", "PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE", "PYTHONFAULTHANDLER"}
# helper processes of the library that rely on their parent (PR_SET_PDEATHSIG, getppid)
PLAIN_MODULES = {"unbroken.filewriter", "unbroken.ramwriter"}
_HDR = struct.Struct("!I")
_HERE = os.path.abspath(__file__)


def _send(sock: socket.socket, obj: object, fds: list[int] | None = None) -> None:
    data = marshal.dumps(obj)
    msg = _HDR.pack(len(data)) + data
    if fds:
        socket.send_fds(sock, [msg], fds)
    else:
        sock.sendall(msg)


def _recv(sock: socket.socket, with_fds: bool = False) -> tuple[object, list[int]]:
    """One message (``None`` at end of stream) and the descriptors that came with it."""
    buf, fds = b"", []
    while len(buf) < _HDR.size or len(buf) < _HDR.size + _HDR.unpack_from(buf)[0]:
        if with_fds and not buf:
            chunk, got, _, _ = socket.recv_fds(sock, 1 << 20, 255)
            fds += got
        else:
            chunk = sock.recv(1 << 20)
        if not chunk:
            return None, fds
        buf += chunk
    return marshal.loads(buf[_HDR.size:]), fds


def identity() -> str:
    """What a forked child cannot change: credentials, capabilities, namespaces, cgroup."""
    keep = ("Uid", "Gid", "Groups", "CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb", "NoNewPrivs", "Seccomp")
    with open("/proc/self/status") as f:
        lines = [ln for ln in f if ln.split(":")[0] in keep]
    for ns in ("mnt", "net", "pid", "user", "uts", "ipc", "cgroup"):
        try:
            lines.append(f"{ns} {os.readlink(f'/proc/self/ns/{ns}')}\n")
        except OSError:
            pass
    with open("/proc/self/cgroup") as f:
        lines.append(f.read())
    return "".join(lines)


# ----------------------------------------------------------------------------------------- the launcher

def launch(sock_path: str, real: str, pids: str) -> None:
    """The launcher's whole life (``<dir>/bin/python``): have the zygote start ``sys.argv[1:]`` and
    stand for the child, or become a plain interpreter."""
    args = sys.argv[1:]
    try:
        child, conn = _request(sock_path, args)
    except OSError:
        child, conn = 0, None
    if not child or conn is None:
        os.execv(real, [real, *args])
    forward = lambda sig, _frame: _kill(child, sig)  # noqa: E731
    for sig in signal.valid_signals():
        if sig in (signal.SIGKILL, signal.SIGSTOP, signal.SIGCHLD) or signal.getsignal(sig) == signal.SIG_IGN:
            continue
        try:
            signal.signal(sig, forward)
        except (OSError, ValueError):
            pass
    while True:
        msg, _ = _recv(conn)
        if msg is None:
            sys.stderr.write("zygote launcher: the zygote went away; the child's end is unknown\n")
            os._exit(70)
        kind, value = msg  # type: ignore[misc]
        if kind == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)  # continued (SIGCONT) by whoever stopped the child's stand-in
        elif kind == "exit":
            try:
                os.unlink(os.path.join(pids, str(os.getpid())))
            except OSError:
                pass
            _mirror(value)


def _request(sock_path: str, args: list[str]) -> tuple[int, socket.socket | None]:
    fds = sorted(int(n) for n in os.listdir("/proc/self/fd"))
    fds = [fd for fd in fds if _valid(fd)]
    old_umask = os.umask(0o022)
    os.umask(old_umask)
    import resource
    limits = {r: resource.getrlimit(getattr(resource, r)) for r in dir(resource) if r.startswith("RLIMIT_")}
    req = {
        "args": args, "env": dict(os.environ), "cwd": os.getcwd(), "umask": old_umask, "limits": limits,
        "affinity": sorted(os.sched_getaffinity(0)), "nice": os.getpriority(os.PRIO_PROCESS, 0),
        "ignored": [int(s) for s in signal.valid_signals() if s not in (signal.SIGKILL, signal.SIGSTOP)
                    and signal.getsignal(s) == signal.SIG_IGN],
        "mask": [int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])],
        "identity": identity(), "fds": fds, "launcher": os.getpid(),
    }
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(sock_path)
    _send(conn, req, fds)
    reply, _ = _recv(conn)
    if not isinstance(reply, int) or reply <= 0:
        conn.close()
        return 0, None
    return reply, conn


def _valid(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _mirror(status: int) -> None:
    """Exit as the child did."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            import resource
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # the child dumped its core, if any
        except (OSError, ValueError):
            pass
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
        if sig != signal.SIGKILL:
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)
    os._exit(os.waitstatus_to_exitcode(status))


# ------------------------------------------------------------------------------------------- the server

class Zygote:
    """The server: accepts launch requests on a Unix socket and forks a child for each."""

    def __init__(self, sock_path: str, pids: str) -> None:
        import selectors
        self.sock_path, self.pids = sock_path, pids
        self.sel = selectors.DefaultSelector()
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(sock_path + ".new")
        self.listener.listen(64)
        self.children: dict[socket.socket, int] = {}  # a launcher's connection -> its child
        self.identity = identity()
        self.env = dict(os.environ)
        self.path0 = sys.path[0]
        self.base_path = sys.path[1:]
        self.top = {m.split(".")[0] for m in sys.modules}
        self.wake_r, wake_w = os.pipe()
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        self.sel.register(self.listener, 1, "accept")
        self.sel.register(self.wake_r, 1, "reap")
        os.rename(sock_path + ".new", sock_path)  # ready: launchers connect from now on

    def _stop(self, *_: object) -> None:
        for pid in self.children.values():
            _kill(pid, signal.SIGKILL)
        os._exit(0)

    def serve(self) -> dict:
        """Serve until this process is a child; return the child's request."""
        while True:
            events = self.sel.select()
            # a launcher that went away is handled before any new launch: its child is killed and reaped
            # first, so a test that killed the launcher and starts the next process finds the first gone
            events.sort(key=lambda e: {"gone": 0, "reap": 1}.get(e[0].data, 2))
            for key, _ in events:
                if key.data == "reap":
                    os.read(self.wake_r, 4096)
                    self._reap()
                elif key.data == "accept":
                    conn, _ = self.listener.accept()
                    req = self._start(conn)
                    if req is not None:
                        return req
                else:
                    self._gone(key.fileobj)  # type: ignore[arg-type]

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG | os.WUNTRACED | os.WCONTINUED)
            except ChildProcessError:
                return
            if not pid:
                return
            conn = next((c for c, p in self.children.items() if p == pid), None)
            if conn is None:
                continue
            if os.WIFSTOPPED(status):
                self._tell(conn, ("stop", os.WSTOPSIG(status)))
            elif not os.WIFCONTINUED(status):
                self._tell(conn, ("exit", status))
                self._forget(conn)

    def _tell(self, conn: socket.socket, msg: object) -> None:
        try:
            _send(conn, msg)
        except OSError:
            pass

    def _forget(self, conn: socket.socket) -> None:
        self.children.pop(conn, None)
        try:
            self.sel.unregister(conn)
        except (KeyError, ValueError):
            pass
        conn.close()

    def _gone(self, conn: socket.socket) -> None:
        """The launcher's connection is readable: it only ever closes (the launcher died)."""
        pid = self.children.get(conn)
        if pid is not None:
            _kill(pid, signal.SIGKILL)
            import time
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                try:
                    done, _ = os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    break
                if done:
                    break
                time.sleep(0.002)
        self._forget(conn)

    def _start(self, conn: socket.socket) -> dict | None:
        conn.settimeout(10)
        try:
            req, fds = _recv(conn, with_fds=True)
        except OSError:
            conn.close()
            return None
        why = self._refuse(req) if isinstance(req, dict) else "a bad request"
        if why or len(fds) != len(req["fds"]):  # type: ignore[index]
            for fd in fds:
                os.close(fd)
            self._tell(conn, 0)
            conn.close()
            return None
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child: nothing of the server stays open in it
            req["received"] = fds  # type: ignore[index]
            for c in (conn, self.listener, *self.children):
                c.close()
            self.sel.close()
            os.close(self.wake_r)
            os.close(signal.set_wakeup_fd(-1))
            return req  # type: ignore[return-value]
        for fd in fds:
            os.close(fd)
        conn.settimeout(None)
        self.children[conn] = pid
        self.sel.register(conn, 1, "gone")
        self._tell(conn, pid)
        return None

    def _refuse(self, req: dict) -> str | None:
        """Why this request must start a plain interpreter (``None``: it need not)."""
        if req.get("identity") != self.identity:
            return "another user, capability set, namespace or cgroup"
        env, mine = req["env"], self.env
        for k in set(env) | set(mine):
            if k.startswith(SENSITIVE) and k not in EMULATED and env.get(k) != mine.get(k):
                return f"{k} differs"
        if env.get("PYTHONHASHSEED", mine["PYTHONHASHSEED"]) != mine["PYTHONHASHSEED"]:
            return "PYTHONHASHSEED differs"
        target = parse(req["args"])
        if isinstance(target, str):
            return target
        kind, what, _, _ = target
        if kind == "-m" and what in PLAIN_MODULES:
            return f"{what} depends on its parent"
        path0 = _path0(kind, what, req["cwd"])
        for folder in [path0, *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]:
            try:
                names = os.listdir(os.path.join(req["cwd"], folder) if folder else req["cwd"])
            except OSError:
                continue
            shadow = _shadows(os.path.join(req["cwd"], folder), names, self.top)
            if shadow:
                return f"{folder} holds {shadow}, which the zygote imported"
        return None


def _shadows(folder: str, names: list[str], imported: set[str]) -> str | None:
    """The first module of ``imported`` that ``folder`` (listing ``names``) would provide before the
    folders after it: a source or compiled module, an extension module, or a regular package."""
    for entry in names:
        stem = entry.split(".")[0]
        if stem not in imported:
            continue
        if entry.endswith((".py", ".pyc", ".so")) or os.path.isfile(os.path.join(folder, entry, "__init__.py")):
            return stem
    return None


def parse(args: list[str]) -> tuple[str, str, list[str], list[str]] | str:
    """``(kind, what, options, rest)`` of an interpreter command line (kind ``"script"``, ``"-m"`` or
    ``"-c"``; ``options``: the emulated ones, ``-u``, ``-B``, ``faulthandler``; ``rest``: what follows
    the script, module or code), or why it is not served."""
    opts: list[str] = []
    i = 0
    while i < len(args):
        a = args[i]
        if a in ("-m", "-c"):
            if i + 1 >= len(args):
                return f"{a} without its argument"
            return a, args[i + 1], opts, args[i + 2:]
        if a[:2] in ("-m", "-c"):
            return a[:2], a[2:], opts, args[i + 1:]
        if a == "-X" and i + 1 < len(args) and args[i + 1] == "faulthandler":
            opts.append("faulthandler")
            i += 2
            continue
        if a in ("-u", "-B"):
            opts.append(a)
        elif a.startswith("-") or a == "":
            return f"option {a!r}"
        else:
            return "script", a, opts, args[i + 1:]
        i += 1
    return "an interactive interpreter"


def _path0(kind: str, what: str, cwd: str) -> str:
    if kind == "script":
        return os.path.dirname(os.path.realpath(os.path.join(cwd, what)))
    return cwd if kind == "-m" else ""


# -------------------------------------------------------------------------------------------- the child

def become(req: dict, base_path: list[str]) -> None:
    """In the forked child: take the launcher's process state, then run its command."""
    import resource
    for sig in signal.valid_signals():
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            continue
        default = {signal.SIGINT: signal.default_int_handler, signal.SIGPIPE: signal.SIG_IGN,
                   signal.SIGXFSZ: signal.SIG_IGN}.get(sig, signal.SIG_DFL)
        try:
            signal.signal(sig, signal.SIG_IGN if sig in req["ignored"] else default)
        except (OSError, ValueError):
            pass
    os.setsid()
    _take_fds(req["fds"], req["received"])
    env = req["env"]
    os.environ.clear()
    os.environ.update(env)
    os.chdir(req["cwd"])
    os.umask(req["umask"])
    for name, (soft, hard) in req["limits"].items():
        res = getattr(resource, name)
        if resource.getrlimit(res) != (soft, hard):
            resource.setrlimit(res, (soft, hard))
    os.sched_setaffinity(0, req["affinity"])
    if os.getpriority(os.PRIO_PROCESS, 0) != req["nice"]:
        os.setpriority(os.PRIO_PROCESS, 0, req["nice"])
    signal.pthread_sigmask(signal.SIG_SETMASK, req["mask"])
    kind, what, opts, rest = parse(req["args"])  # type: ignore[misc]
    unbuffered = "-u" in opts or bool(env.get("PYTHONUNBUFFERED"))
    sys.dont_write_bytecode = "-B" in opts or bool(env.get("PYTHONDONTWRITEBYTECODE"))
    _stdio(unbuffered)
    if "faulthandler" in opts or env.get("PYTHONFAULTHANDLER"):
        import faulthandler
        faulthandler.enable()
    sys.path[:] = [_path0(kind, what, req["cwd"]),
                   *(os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p), *base_path]
    import tempfile
    import time
    tempfile.tempdir = None
    time.tzset()
    import torch
    torch.seed()  # a fresh process seeds its default generator from the OS
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    real = sys.executable
    sys.orig_argv = [real, *req["args"]]
    with open(os.path.join(req["pids"], str(req["launcher"])), "w") as f:
        f.write(f"{os.getpid()} {_start_time(os.getpid())}\n")
    _run(kind, what, rest)


def _take_fds(numbers: list[int], received: list[int]) -> None:
    """Make the launcher's descriptors this process's, under the same numbers, and close the rest."""
    import fcntl
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 1024) for fd in received]
    keep = set(high)
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass
    for number, fd in zip(numbers, high):
        os.dup2(fd, number, inheritable=True)
    for fd in high:
        if fd not in numbers:
            os.close(fd)


def _stdio(unbuffered: bool) -> None:
    import io
    enc, errors = sys.__stdout__.encoding, sys.__stdout__.errors  # type: ignore[union-attr]
    for fd, name in ((0, "stdin"), (1, "stdout"), (2, "stderr")):
        try:
            os.fstat(fd)
        except OSError:
            setattr(sys, name, None)
            setattr(sys, f"__{name}__", None)
            continue
        raw = io.FileIO(fd, "r" if fd == 0 else "w", closefd=False)
        if fd == 0:
            stream = io.TextIOWrapper(io.BufferedReader(raw), encoding=enc, errors=errors)
        else:
            buffered = raw if unbuffered else io.BufferedWriter(raw)
            stream = io.TextIOWrapper(buffered, encoding=enc,  # type: ignore[arg-type]
                                      errors="backslashreplace" if fd == 2 else errors,
                                      line_buffering=fd == 2 or os.isatty(fd), write_through=unbuffered)
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def _start_time(pid: int) -> str:
    with open(f"/proc/{pid}/stat", "rb") as f:
        stat = f.read()
    return stat[stat.rfind(b")") + 2:].split()[19].decode()


def _run(kind: str, what: str, rest: list[str]) -> None:
    """Run the command as the interpreter's main would: ``__main__`` a fresh module, ``sys.argv[0]`` as
    given, ``__file__`` absolute; an uncaught exception printed from the script's frames on (exit 1), a
    KeyboardInterrupt left to the interpreter (it exits by SIGINT, as a plain one does)."""
    import runpy
    import types
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = __builtins__
    sys.modules["__main__"] = main
    try:
        if kind == "script" and os.path.isfile(what):
            import importlib.machinery
            path = os.path.abspath(what)
            sys.argv = [what, *rest]
            main.__file__ = path
            main.__loader__ = importlib.machinery.SourceFileLoader("__main__", path)
            with open(path, "rb") as f:
                code = compile(f.read(), path, "exec", dont_inherit=True)
            exec(code, main.__dict__)
        elif kind == "script":  # a folder or a zip file with __main__.py
            sys.argv = [what, *rest]
            runpy.run_path(what, run_name="__main__")
        elif kind == "-m":
            sys.argv = ["-m", *rest]
            runpy._run_module_as_main(what, alter_argv=True)  # type: ignore[attr-defined]
        else:
            sys.argv = ["-c", *rest]
            exec(compile(what, "<string>", "exec", dont_inherit=True), main.__dict__)
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as e:
        here = _HERE
        tb = e.__traceback__
        while tb is not None and (tb.tb_frame.f_code.co_filename == here or "runpy" in tb.tb_frame.f_code.co_filename):
            tb = tb.tb_next
        sys.excepthook(type(e), e.with_traceback(tb), tb)
        raise SystemExit(1) from None


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        _sock, _pids = sys.argv[2], sys.argv[3]
        import ctypes
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: ends with its pytest worker
        import numpy  # noqa: F401
        import torch  # noqa: F401
        _zygote = Zygote(_sock, _pids)
        _req = _zygote.serve()
        _req["pids"] = _pids
        _base = _zygote.base_path
        del _zygote
        become(_req, _base)
