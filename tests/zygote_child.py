"""The zygote's child: it takes the launcher's process state, then runs its command as the
interpreter's main would (the whole: :mod:`zygote`)."""

from __future__ import annotations

import os
import signal
import sys

from zygote import JOINED, THREADS, _path0, parse

_HERE = os.path.abspath(__file__)


def _join(req: dict) -> None:
    """Enter the launcher's network and mount namespaces where they are not the zygote's (a node of
    tests/netns.py; the server checked that the mounts are the same, ``/sys`` aside, and that it runs as root).
    The launcher waits for its child's pid meanwhile: its namespaces are there to be joined."""
    there = req.get("place") or {}
    if all(there.get(ns) == os.readlink(f"/proc/self/ns/{ns}") for ns in JOINED):
        return
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    for ns in JOINED:
        fd = os.open(f"/proc/{req['launcher']}/ns/{ns}", os.O_RDONLY)
        try:
            if libc.setns(fd, 0) != 0:
                err = ctypes.get_errno()
                sys.stderr.write(f"zygote: cannot join the launcher's {ns} namespace: {os.strerror(err)}\n")
                os._exit(70)
        finally:
            os.close(fd)


def _logger_levels(names: list[str | None], env: dict[str, str]) -> None:
    """The level torch's elastic loggers made by the zygote's imports would have had here: ``LOGLEVEL``'s, else
    torch's default (``_setup_logger``, read when each is made)."""
    elastic = sys.modules.get("torch.distributed.elastic.utils.logging")
    if elastic is not None:  # the zygote's note-taker (zygote_server.record_elastic_loggers) gone
        elastic._setup_logger = getattr(elastic._setup_logger, "__wrapped__", elastic._setup_logger)
    if not names:
        return
    import logging

    from torch.distributed.elastic.utils.log_level import get_log_level
    level = env.get("LOGLEVEL", get_log_level())
    for name in names:
        logging.getLogger(name).setLevel(level)


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
    _join(req)
    _take_fds(req["fds"], req["received"])
    env = req["env"]
    os.environ.clear()
    os.environ.update(env)
    changed, removed = req.get("delta", ({}, []))
    os.environ.update({k: v for k, v in changed.items() if k not in env})  # what the zygote's imports set (as a
    # default: inductor's cache folder) they would have set here
    for k in removed:
        os.environ.pop(k, None)
    _logger_levels(req.get("loggers", []), env)
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
    _warnings([*filter(None, env.get("PYTHONWARNINGS", "").split(",")), *(o[2:] for o in opts if o.startswith("W:"))],
              req.get("default_filters", 0))
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
    threads = next((int(env[k]) for k in THREADS if k in env), None)
    if threads is not None:  # what the variable does at the start of a plain process
        torch.set_num_threads(threads)
        _openblas_threads(threads)
    sys.executable = req.get("executable") or sys.executable  # its own children start from the zygote too
    sys.orig_argv = [sys.executable, *req["args"]]
    with open(os.path.join(req["pids"], str(req["launcher"])), "w") as f:
        f.write(f"{os.getpid()} {_start_time(os.getpid())}\n")
    _run(kind, what, rest)


def _openblas_threads(n: int) -> None:
    """Set the threads of numpy's OpenBLAS (it read ``OMP_NUM_THREADS`` when the zygote loaded it)."""
    import ctypes
    with open("/proc/self/maps") as f:
        libs = {line.split()[-1] for line in f if "openblas" in line.lower() and line.rstrip().endswith(".so")}
    for path in libs:
        lib = ctypes.CDLL(path)
        for name in ("scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads", "openblas_set_num_threads"):
            if hasattr(lib, name):
                getattr(lib, name)(n)
                break


def _warnings(options: list[str], defaults: int) -> None:
    """The warning filters of ``PYTHONWARNINGS`` and ``-W``, as a plain interpreter orders them: after
    what the imports added (those come first: they were added later), before the interpreter's own
    ``defaults`` (the last ones of the list, there when the zygote started)."""
    import warnings
    sys.warnoptions[:] = options
    if not options:
        return
    cut = len(warnings.filters) - defaults
    head, tail = warnings.filters[:cut], warnings.filters[cut:]
    warnings.filters[:] = tail
    warnings._processoptions(options)  # type: ignore[attr-defined]
    warnings.filters[:0] = head
    warnings._filters_mutated()  # type: ignore[attr-defined]


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
    for number, fd in zip(numbers, high, strict=True):
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
            sys.modules.pop(what, None)  # the zygote imported it (torchrun's agent): run anew, as python -m does
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
        sys.last_type, sys.last_value, sys.last_traceback = type(e), e.with_traceback(tb), tb  # as PyErr_Print sets
        sys.excepthook(type(e), e, tb)  # them (an atexit hook may read them: unbroken's signal handling does)
        raise SystemExit(1) from None
