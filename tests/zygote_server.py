"""The zygote's server and the child it forks (the launcher and the protocol: :mod:`zygote`, which
describes the whole)."""

from __future__ import annotations

import gc
import logging
import os
import signal
import socket
import sys
import time
from typing import Any

from zygote import (
    EMULATED,
    PLAIN_MODULES,
    RUNTIME,
    SENSITIVE,
    THREADS,
    _kill,
    _path0,
    _recv,
    _send,
    framework_env,
    identity,
    parse,
    place,
)
from zygote_flavour import flavour

PRELOAD = ("numpy", "torch", "torch._dynamo", "torch._inductor", "torch.distributed.run", "torch.distributed.tensor",
           "torch.distributed.checkpoint", "torch.distributed.fsdp", "torch.utils.data", "safetensors.torch", "xxhash",
           "sqlite3", "unbroken", "unbroken.checkpointer.manager", "unbroken.cli")
"""What the zygote imports: torch, and the parts of it that the tests' jobs import later as a matter of course
(``torch.use_deterministic_algorithms`` imports inductor and dynamo: 2-3 s of CPU; unbroken imports the
distributed packages; torchrun's agent is ``torch.distributed.run``), and unbroken's training side and CLI
(0.13 s of CPU in each of the suite's ~1,500 children). unbroken reads nothing of the environment when it is
imported (each process reads its own when it acts: ``tests/test_zygote.py`` checks), and what it keeps of its
process (its signal handlers' owner, its launcher) is taken when it acts or after a fork. A job that puts
another unbroken on its path is started plainly, as any shadowed module (:func:`_shadows`)."""
EMULATED_AT_START = {"TMPDIR", "TEMP", "TMP"}  # read by tempfile when an import asked for a temporary folder: its
# cache (tempfile.tempdir) is cleared in the child, which reads them again
EMULATED_AT_FORK = {"LOGLEVEL"}  # torch's elastic loggers take their level from it when made (at import): the
# child sets the level of each one the zygote's imports made (ELASTIC_LOGGERS) as they would have
ELASTIC_LOGGERS: list[str | None] = []
"""The loggers ``torch.distributed.elastic.utils.logging._setup_logger`` made in this zygote (its imports', and
a framework zygote's): their level is ``LOGLEVEL``'s, read then (``zygote_child._logger_levels``)."""
MAX_FRAMEWORK_ZYGOTES = 6  # per worker (each rank of a job has its own: RANK is in the key); the least
# recently used without a running child leaves to make room


def record_elastic_loggers() -> None:
    """From now on, note each logger torch's elastic package sets up (torchrun's agent, its rendezvous...)."""
    from torch.distributed.elastic.utils import logging as elastic_logging
    made = elastic_logging._setup_logger

    def setup(name: str | None = None) -> Any:
        ELASTIC_LOGGERS.append(name)
        return made(name)

    setup.__wrapped__ = made  # type: ignore[attr-defined]
    elastic_logging._setup_logger = setup


class reads_of_environ:
    """The environment variables read while it is entered (``with reads_of_environ() as read:``): every
    ``os.environ[name]``, ``name in os.environ``, ``os.environ.get`` and ``os.getenv``, whoever reads them, but
    not a scan of all of them (``os.environ.items()``, ``dict(os.environ)``: what code that iterated over the
    environment reads next; tqdm and fsspec look for their prefixes that way, ``zygote.SENSITIVE`` holds
    those). What an import reads there is fixed in the zygote for every child (torch's elastic logger takes
    its level from ``LOGLEVEL`` when imported, inductor's config ``CXX``...):
    a launch whose value differs starts plainly. Variables read by native code (``getenv`` in C: OpenMP,
    the allocator) do not pass here: ``zygote.SENSITIVE`` names those."""

    def __enter__(self) -> set[str]:
        cls = type(os.environ)
        self.saved = cls.__getitem__, cls.__contains__, cls.__iter__
        getitem, contains, iterate = self.saved
        read: set[str] = set()
        # the frames that iterated over the whole environment (dict(os.environ), items()): what they read
        # next is a scan (fsspec copies it all, then looks for FSSPEC_), kept alive so their ids stay theirs
        self.scanning: dict[int, object] = {}
        scanning = self.scanning

        def outer(frame: Any) -> Any:
            while frame is not None and "_collections_abc" in frame.f_code.co_filename:
                frame = frame.f_back
            return frame

        def note(key: object) -> None:
            frame = outer(sys._getframe(2))
            if frame is not None and id(frame) in scanning:
                return
            if isinstance(key, str):
                read.add(key)

        def __getitem__(self: os._Environ, key: str) -> str:
            note(key)
            return getitem(self, key)

        def __contains__(self: os._Environ, key: object) -> bool:
            note(key)
            return contains(self, key)

        def __iter__(self: os._Environ) -> Any:
            frame = outer(sys._getframe(1))
            if frame is not None:
                scanning[id(frame)] = frame
            return iterate(self)

        cls.__getitem__, cls.__contains__, cls.__iter__ = __getitem__, __contains__, __iter__  # type: ignore[method-assign]
        return read

    def __exit__(self, *_: object) -> None:
        cls = type(os.environ)
        cls.__getitem__, cls.__contains__, cls.__iter__ = self.saved  # type: ignore[method-assign]
        self.scanning.clear()


class Framework:
    """A zygote forked from this one that has also imported a framework (see :func:`flavour`)."""

    def __init__(self, pid: int, sock_path: str, control: socket.socket) -> None:
        self.pid, self.sock_path, self.control = pid, sock_path, control
        self.used = time.monotonic()


class Zygote:
    """The server: accepts launch requests on a Unix socket and forks a child for each."""

    def __init__(self, sock_path: str, pids: str, control: socket.socket | None = None, strict: bool = False,
                 read: set[str] | frozenset[str] = frozenset()) -> None:
        """``control``: for a zygote another one started, its end of the pair that one syncs it with;
        ``strict``: a framework's zygote (the frameworks' variables must match too); ``read``: the variables
        its imports read (:class:`reads_of_environ`), which must match as well."""
        import selectors
        self.sock_path, self.pids, self.control = sock_path, pids, control
        self.frameworks: dict[tuple, Framework] = {}
        self.started = 0  # framework zygotes started (their sockets' numbers)
        self.strict = strict
        self.read = set(read) - EMULATED_AT_START - EMULATED_AT_FORK
        self.delta: tuple[dict[str, str], list[str]] = ({}, [])  # what the imports did to the environment
        self.sel = selectors.DefaultSelector()
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(sock_path + ".new")
        self.listener.listen(64)
        self.children: dict[socket.socket, int] = {}  # a launcher's connection -> its child
        self.leaders: dict[int, bool] = {}  # a child -> whether its launcher leads its process group
        self.launchers: dict[int, int] = {}  # a child -> its launcher's pid
        self.identity = identity()
        self.place = place()
        self.env = dict(os.environ)
        self.path0 = sys.path[0]
        self.base_path = sys.path[1:]
        # the fork server's own modules (zygote*.py) sit beside the test scripts: a script that imports one gets
        # the same file, so tests/ first on its path shadows nothing
        self.top = {m.split(".")[0] for m in sys.modules if not m.startswith("zygote")} - {"__main__"}
        self.origins = {name: _origin(sys.modules.get(name)) for name in self.top}
        self.wake_r, wake_w = os.pipe()
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        self.sel.register(self.listener, 1, "accept")
        self.sel.register(self.wake_r, 1, "reap")
        if control is not None:
            self.sel.register(control, 1, "sync")
        os.rename(sock_path + ".new", sock_path)  # ready: launchers connect from now on

    def _stop(self, *_: object) -> None:
        for pid in self.children.values():
            _kill(pid, signal.SIGKILL)
        for fw in self.frameworks.values():
            _kill(fw.pid, signal.SIGTERM)  # it kills its own children
        os._exit(0)

    def serve(self) -> dict:
        """Serve until this process is a child; return the child's request."""
        while True:
            events = self.sel.select()
            # a launcher that went away is handled before any new launch: its child is killed and reaped
            # first, so a test that killed the launcher and starts the next process finds the first gone
            events.sort(key=lambda e: {"gone": 0, "reap": 1, "sync": 2}.get(e[0].data, 3))
            for key, _ in events:
                if key.data == "reap":
                    os.read(self.wake_r, 4096)
                    self._reap()
                elif key.data == "sync":  # the parent zygote asks: every launcher gone before now is handled
                    assert self.control is not None
                    asked = self.control.recv(64)
                    if not asked:
                        self._stop()
                    for byte in asked:
                        if byte == ord("q"):  # asked to make room: leave if no child of ours is running
                            self.control.sendall(b"n" if self.children else b"y")
                            if not self.children:
                                self._stop()
                        else:
                            self.control.sendall(b"k")
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
                for key, fw in list(self.frameworks.items()):
                    if fw.pid == pid and not os.WIFSTOPPED(status) and not os.WIFCONTINUED(status):
                        fw.control.close()
                        del self.frameworks[key]
                continue
            if os.WIFSTOPPED(status):
                self._tell(conn, ("stop", os.WSTOPSIG(status)))
                continue
            launcher = self.launchers.get(pid)  # stopped with its child: continued with it, and to hear its end
            if launcher:
                _kill(launcher, signal.SIGCONT)
            if not os.WIFCONTINUED(status):
                self._tell(conn, ("exit", status))
                self._forget(conn)

    def _tell(self, conn: socket.socket, msg: object) -> None:
        try:
            _send(conn, msg)
        except OSError:
            pass

    def _forget(self, conn: socket.socket) -> None:
        pid = self.children.pop(conn, -1)
        self.leaders.pop(pid, None)
        self.launchers.pop(pid, None)
        try:
            self.sel.unregister(conn)
        except (KeyError, ValueError):
            pass
        conn.close()

    def _gone(self, conn: socket.socket) -> None:
        """The launcher's connection is readable: it only ever closes (the launcher died)."""
        pid = self.children.get(conn)
        if pid is not None:
            if self.leaders.get(pid):  # killed with its process group (killpg): so is the child's
                try:
                    os.killpg(pid, signal.SIGKILL)
                except OSError:
                    pass
            _kill(pid, signal.SIGKILL)
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
        self._sync()
        conn.settimeout(10)
        try:
            req, fds = _recv(conn, with_fds=True)
        except OSError:
            conn.close()
            return None
        why = self._refuse(req) if isinstance(req, dict) else "a bad request"
        if why == "PYTHONHASHSEED differs" and self.control is None and len(fds) == len(req["fds"]):  # type: ignore[index]
            other = self._hash_seed(req["env"]["PYTHONHASHSEED"])  # type: ignore[index]
            if other is not None and os.path.exists(other.sock_path):  # a zygote started with that seed serves it
                return self._answer(conn, fds, other)
        if why or len(fds) != len(req["fds"]):  # type: ignore[index]
            sys.stderr.write(f"plain start of {req.get('args', [])[:3]}: {why or 'descriptors lost'}\n")  # type: ignore[union-attr]
            return self._answer(conn, fds, None)
        key = flavour(req, self.top) if self.control is None else None  # type: ignore[arg-type]
        if key is not None:
            fw = self.frameworks.get(key)
            if fw is not None and os.path.exists(fw.sock_path):  # that framework's zygote serves it
                return self._answer(conn, fds, fw)
            if fw is None and self._room():
                served = self._fork_framework(key, conn, fds)
                if served is not None:  # this process is the framework's zygote's child
                    return served
        sys.stdout.flush()
        sys.stderr.flush()
        gc.freeze()  # what the zygote holds is never collected in the child, nor at its exit: untouched, its
        # pages stay shared (a child's exit cost ~1.1 s of CPU, the collections of the 300,000 objects of torch)
        pid = os.fork()
        if pid == 0:  # the child: nothing of the server stays open in it
            req["received"] = fds  # type: ignore[index]
            req["delta"] = self.delta  # type: ignore[index]
            req["loggers"] = list(ELASTIC_LOGGERS)  # type: ignore[index]
            self._close_all(conn)
            return req  # type: ignore[return-value]
        for fd in fds:
            os.close(fd)
        conn.settimeout(None)
        self.children[conn] = pid
        self.leaders[pid] = bool(req.get("leader"))  # type: ignore[union-attr]
        self.launchers[pid] = int(req.get("launcher", 0))  # type: ignore[union-attr]
        self.sel.register(conn, 1, "gone")
        self._tell(conn, pid)
        return None

    def _answer(self, conn: socket.socket, fds: list[int], other: Framework | None) -> None:
        """Answer a launch this zygote does not fork: another zygote's socket (the launcher asks there), or
        a plain start (``other`` None)."""
        for fd in fds:
            os.close(fd)
        if other is not None:
            other.used = time.monotonic()
        self._tell(conn, other.sock_path if other is not None else 0)
        conn.close()

    def _close_all(self, conn: socket.socket) -> None:
        """In a forked process: close what is this server's."""
        for c in (conn, self.listener, *self.children, *(fw.control for fw in self.frameworks.values())):
            c.close()
        if self.control is not None:
            self.control.close()
        self.sel.close()
        os.close(self.wake_r)
        os.close(signal.set_wakeup_fd(-1))

    def _sync(self) -> None:
        """Before a launch: every framework's zygote has handled the launchers gone before it (their
        children killed and reaped), as this one has."""
        for key, fw in list(self.frameworks.items()):
            if not os.path.exists(fw.sock_path):  # still importing: no children yet
                continue
            try:
                fw.control.settimeout(10)
                fw.control.sendall(b"s")
                if fw.control.recv(1) != b"k":
                    raise OSError("no answer")
            except OSError:
                fw.control.close()
                _kill(fw.pid, signal.SIGTERM)
                del self.frameworks[key]

    def _room(self) -> bool:
        """Whether another zygote may start: under the cap, or once the least recently used one without
        a running child has left (asked on its control pair)."""
        if len(self.frameworks) < MAX_FRAMEWORK_ZYGOTES:
            return True
        for key, fw in sorted(self.frameworks.items(), key=lambda kv: kv[1].used):
            if not os.path.exists(fw.sock_path):
                continue  # still importing
            try:
                fw.control.settimeout(10)
                fw.control.sendall(b"q")
                answer = fw.control.recv(1)
            except OSError:
                answer = b"y"
            if answer == b"y":
                fw.control.close()
                del self.frameworks[key]
                return True
        return False

    def _hash_seed(self, seed: str) -> Framework | None:
        """The zygote whose interpreter started with ``PYTHONHASHSEED=seed`` (a seed is fixed at an
        interpreter's start: a new one, not a fork), started now if there is none (``None`` then: this
        launch starts plainly, the next ones go there)."""
        key = ("PYTHONHASHSEED", seed)
        if key in self.frameworks:
            return self.frameworks[key]
        if not seed.isdigit() or not self._room():
            return None
        import subprocess
        ours, theirs = socket.socketpair()
        path = f"{self.sock_path}-hash{seed}"
        proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve", path, self.pids, "--control",
                                 str(theirs.fileno())], env=dict(self.env, PYTHONHASHSEED=seed),
                                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
        theirs.close()
        self.frameworks[key] = Framework(proc.pid, path, ours)
        return None

    def _fork_framework(self, key: tuple, conn: socket.socket, fds: list[int]) -> dict | None:
        """Start the zygote of ``key`` (it imports the framework for later launches; this one is served
        here). In that zygote's children, return their request; here, ``None``."""
        ours, theirs = socket.socketpair()
        self.started += 1
        path = f"{self.sock_path}-f{self.started}"  # short: a Unix socket's path has at most 107 bytes
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid:
            theirs.close()
            self.frameworks[key] = Framework(pid, path, ours)
            return None
        ours.close()
        for fd in fds:
            os.close(fd)
        self._close_all(conn)
        import ctypes
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: ends with the zygote it came from
        statements, env = key
        for k in [k for k in os.environ if framework_env(k)]:
            del os.environ[k]
        os.environ.update(dict(env))
        before = dict(os.environ)
        try:
            scratch: dict = {}
            with reads_of_environ() as read:
                for statement in statements:
                    exec(statement, scratch)
        except BaseException as e:  # the launches that would have come here are served by the first zygote
            sys.stderr.write(f"the zygote of {statements} could not import them: {e!r}\n")
            os._exit(1)
        after = dict(os.environ)  # an import may set variables (transformers: TORCHINDUCTOR_CACHE_DIR), as it would
        os.environ.clear()        # in the script: compared as they were before it, set in the children after
        os.environ.update(before)
        zygote = Zygote(path, self.pids, control=theirs, strict=True, read=self.read | read)
        os.environ.update(after)
        zygote.delta = ({k: v for k, v in after.items() if before.get(k) != v}, [k for k in before if k not in after])
        return zygote.serve()

    def _refuse(self, req: dict) -> str | None:
        """Why this request must start a plain interpreter (``None``: it need not)."""
        if req.get("identity") != self.identity:
            return "another user, capability set, namespace or cgroup"
        there = req.get("place") or {}
        if there != self.place:  # a node of tests/netns.py: the child joins the launcher's namespaces (setns)
            if os.geteuid() != 0:
                return "another network or mount namespace (joining one needs root)"
            if there.get("mounts") != self.place["mounts"]:
                return "other mounts"
        env, mine = req["env"], self.env
        for k in set(env) | set(mine):
            if (((k.startswith(SENSITIVE) or k in self.read) and not k.startswith(RUNTIME) and k not in EMULATED)
                    or (self.strict and framework_env(k))) and env.get(k) != mine.get(k):
                return f"{k} differs" + (" (read when the zygote imported torch or a framework)" * (k in self.read))
        level = env.get("LOGLEVEL")
        if level is not None and level != mine.get("LOGLEVEL") and level not in logging.getLevelNamesMapping():
            # (another value fails torch's import in a plain process as well)
            return f"LOGLEVEL={level!r} is no level"
        wanted = {env[k] for k in THREADS if k in env}
        if any(k in mine for k in THREADS) or len(wanted) > 1 or not all(v.isdigit() and int(v) > 0 for v in wanted):
            return "a number of threads the zygote cannot set"
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
            shadow = _shadows(os.path.join(req["cwd"], folder), names, self.origins)
            if shadow:
                return f"{folder} holds {shadow}, which the zygote imported"
        return None


def _origin(module: object) -> str | None:
    """Where a top-level module was imported from: its package's folder or its file (resolved)."""
    path = getattr(module, "__file__", None)
    if not path:
        return None
    if os.path.basename(path).startswith("__init__."):
        path = os.path.dirname(path)
    return os.path.realpath(path)


def _shadows(folder: str, names: list[str], imported: dict[str, str | None]) -> str | None:
    """The first module of ``imported`` (name -> where the zygote imported it from) that ``folder`` (listing
    ``names``) would provide before the folders after it, from another place: a source or compiled module,
    an extension module, or a regular package. The very module the zygote imported is no shadow."""
    for entry in names:
        stem = entry.split(".")[0]
        if stem not in imported:
            continue
        candidate = os.path.join(folder, entry)
        if entry.endswith((".py", ".pyc", ".so")) or os.path.isfile(os.path.join(candidate, "__init__.py")):
            if imported[stem] is None or os.path.realpath(candidate) != imported[stem]:
                return stem
    return None


if __name__ == "__main__":
    from zygote_child import become

    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        _sock, _pids = sys.argv[2], sys.argv[3]
        import ctypes
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: ends with its pytest worker
        import importlib
        import warnings
        _defaults = len(warnings.filters)  # the interpreter's own filters (PYTHONWARNINGS unset here)
        _env = dict(os.environ)
        with reads_of_environ() as _read:
            try:
                record_elastic_loggers()
            except ImportError:
                pass
            for _name in PRELOAD:
                try:
                    importlib.import_module(_name)
                except ImportError:  # not installed here: imported by whoever needs it, as it would be
                    pass
        os.environ.clear()  # what the imports set (inductor: TORCHINDUCTOR_CACHE_DIR, a default it sets again
        os.environ.update(_env)  # when it needs it) is not the children's
        _control = socket.socket(fileno=int(sys.argv[5])) if sys.argv[4:5] == ["--control"] else None
        _zygote = Zygote(_sock, _pids, control=_control, read=_read)
        _req = _zygote.serve()
        _req["pids"] = _pids
        _req["default_filters"] = _defaults
        _base = _zygote.base_path
        del _zygote
        become(_req, _base)
