"""The writer process of background saves: tensor files written from shared memory by another process.

With ``async_save``, the training process copies the state into staging buffers in shared memory
(:mod:`unbroken.checkpoint.background.shm`) and goes on; writing the tensor files (header, every byte, the xxh3-128
checksum, ``fsync``) is done by ``python -m unbroken.checkpoint.background.filewriter``, a process of its own, so none
of it competes with the training thread for the GIL. The background thread of the save only
sends the job and waits for the answer (no GIL held), then writes the small files (the state's
JSON tree, the manifest) and commits as for any save: the protocol of :mod:`unbroken.checkpoint.persist`,
the collective of several ranks and the guarantees (nothing half-committed, a failure raised at
the next step) are unchanged.

Which saves use it: background saves (``async_save=True`` or ``"lazy"``) to a run folder on a
filesystem or to the RAM tier, full checkpoints. Incremental checkpoints and object stores are
written by the background thread as before. ``UNBROKEN_WRITER_PROCESS=0`` turns it off.

Protocol, over a Unix socket pair (the descriptors of segments and of the staging folder travel
with the messages, ``SCM_RIGHTS``): each message is an 8-byte length and a JSON document.
``{"op": "map", "id", "size"}`` + a segment's descriptor; ``{"op": "drop", "ids"}``; ``{"op": "exit"}``;
``{"op": "write", "files": [{"name", "head", "ranges": [[id, offset, size], ...]}], "pause_half"}``
+ the staging folder's descriptor, answered by ``{"files": {name: [size, digest]}}`` or
``{"error", "errno"}``. With ``pause_half`` (fault-injection tests) the writer says
``{"half": name}`` half-way through each file and waits for ``{"go": true}``: the training
process runs its ``save.mid_file`` fault point there, exactly where a thread's write would.

The files are created inside the staging folder's descriptor with ``O_EXCL|O_NOFOLLOW``, as the
thread does. The writer dies with the training process (``PR_SET_PDEATHSIG``); the hidden staging
folder it leaves is removed by the next start, as after any interrupted save.
"""

from __future__ import annotations

import ctypes
import json
import logging
import mmap
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ...format.manifest import FileEntry
    from ...format.tensorfile import TensorEntry
    from ..snapshot import Snapshotter
    from .shm import SharedArena

log = logging.getLogger("unbroken")
_LEN = struct.Struct("<Q")
_CHUNK = 64 << 20
_MAX_FDS = 8


def enabled() -> bool:
    """Whether background saves may use a writer process (``UNBROKEN_WRITER_PROCESS=0``: no)."""
    return os.environ.get("UNBROKEN_WRITER_PROCESS", "1") != "0" and hasattr(os, "memfd_create")


def _send(sock: socket.socket, doc: dict[str, Any], fds: list[int] = ()) -> None:  # type: ignore[assignment]
    raw = json.dumps(doc, separators=(",", ":")).encode()
    msg = _LEN.pack(len(raw)) + raw
    sent = socket.send_fds(sock, [msg], list(fds)) if fds else sock.send(msg)
    if sent < len(msg):
        sock.sendall(msg[sent:])


def _recv(sock: socket.socket) -> tuple[dict[str, Any] | None, list[int]]:
    """One message and the descriptors that came with it; ``(None, [])`` when the peer is gone."""
    head, fds, _, _ = socket.recv_fds(sock, _LEN.size, _MAX_FDS)
    if not head:
        return None, []
    while len(head) < _LEN.size:
        more = sock.recv(_LEN.size - len(head))
        if not more:
            return None, []
        head += more
    (n,) = _LEN.unpack(head)
    body = bytearray()
    while len(body) < n:
        more = sock.recv(min(n - len(body), 1 << 20))
        if not more:
            return None, []
        body += more
    return json.loads(body), list(fds)


class WriterDied(OSError):
    """The writer process ended during a job (killed, out of memory): the files it was writing
    are incomplete, and the job may be written another way."""


class FileWriter:
    """The training side: starts the writer process on first use and hands it files to write."""

    def __init__(self, *arenas: SharedArena) -> None:
        self.arenas = arenas
        self._proc: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        self._mapped: set[int] = set()
        self._lock = threading.Lock()

    def _locate(self, t: Any) -> tuple[int, int] | None:
        for arena in self.arenas:
            where = arena.locate(t)
            if where is not None:
                return where
        return None

    def write(self, staging: Any, files: dict[str, list[TensorEntry]], metadata: dict[str, str],
              on_half: Any = None) -> dict[str, FileEntry] | None:
        """Write ``files`` into ``staging`` from the writer process; each file's size and digest,
        or ``None`` (nothing done) when it cannot: ``staging`` is not a local folder, or a tensor
        of ``files`` is not in the arenas.

        ``on_half()`` runs in this process half-way through each file (fault injection). An error
        of the writer (a full disk, a link in the way) is raised here as an ``OSError`` with its
        errno; a writer that died is raised as one too, and the next save starts a new one."""
        from ...format.manifest import FileEntry
        from ...format.tensorfile import layout

        if getattr(staging, "folder_fd", None) is None:
            return None
        jobs = []
        for name, entries in files.items():
            head, ordered = layout(entries, metadata)
            ranges = []
            for e in ordered:
                n = e.tensor.numel() * e.tensor.element_size()
                if n:
                    where = self._locate(e.tensor)
                    if where is None:
                        return None
                    ranges.append([*where, n])
            jobs.append({"name": name, "head": head.decode("latin-1"), "ranges": ranges})
        with self._lock:
            sock = self._mapped_all()
            try:
                _send(sock, {"op": "write", "files": jobs, "pause_half": on_half is not None},
                      [staging.folder_fd])
                while True:
                    answer, _ = _recv(sock)
                    if answer is None:
                        raise self._died()
                    if "half" not in answer:
                        break
                    on_half()
                    _send(sock, {"go": True})
            except OSError as e:
                if isinstance(e, (BrokenPipeError, ConnectionResetError)):
                    raise self._died() from e
                raise
        if "error" in answer:
            raise OSError(answer.get("errno") or 5, f"{answer['error']} (in the writer process)")
        return {name: FileEntry(size, digest) for name, (size, digest) in answer["files"].items()}

    def close(self) -> None:
        """End the writer process (it finishes nothing: call after the last save is collected)."""
        with self._lock:
            sock, proc, self._sock, self._proc = self._sock, self._proc, None, None
            self._mapped.clear()
        if sock is not None:
            try:  # said, not only closed: a process forked meanwhile (a DataLoader worker) holds our end too
                _send(sock, {"op": "exit"})
            except OSError:
                pass
            sock.close()
        if proc is not None:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                log.warning("the writer process of background saves did not end at close(): killed")
                proc.kill()
                proc.wait()

    def start(self) -> None:
        """Start the writer process if none is running. Call it from the training thread: the
        writer is killed when the thread that started it ends (``PR_SET_PDEATHSIG``), and a save's
        background thread ends with the save."""
        with self._lock:
            if self._sock is not None and self._proc is not None and self._proc.poll() is None:
                return
            if self._sock is not None:  # it ended between saves (killed, out of memory): start another
                log.warning("the writer process of background saves ended (exit code %s); starting another",
                            self._proc.returncode if self._proc is not None else None)
                self._sock.close()
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                self._proc = subprocess.Popen([sys.executable, "-m", "unbroken.checkpoint.background.filewriter",
                                               str(theirs.fileno())],
                                              pass_fds=[theirs.fileno()], close_fds=True, stdin=subprocess.DEVNULL)
            except BaseException:
                ours.close()
                raise
            finally:
                theirs.close()
            self._sock, self._mapped = ours, set()

    def _mapped_all(self) -> socket.socket:
        """The socket to the live writer, once it has every current segment mapped."""
        sock = self._sock
        if sock is None:
            raise WriterDied(5, "the writer process of background saves is not running")
        for arena in self.arenas:
            if arena.dropped:
                _send(sock, {"op": "drop", "ids": [i for i in arena.dropped if i in self._mapped]})
                self._mapped.difference_update(arena.dropped)
                arena.dropped.clear()
            for s in arena.segments:
                if s.id not in self._mapped:
                    _send(sock, {"op": "map", "id": s.id, "size": s.size}, [s.fd])
                    self._mapped.add(s.id)
        return sock

    def _died(self) -> WriterDied:
        proc, sock = self._proc, self._sock
        self._proc = self._sock = None
        if sock is not None:
            sock.close()
        code = None
        if proc is not None:
            try:
                code = proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait()
        return WriterDied(5, f"the writer process of background saves ended during the save (exit code {code})")


def snapshotters(async_save: bool | str) -> tuple[Snapshotter, Snapshotter, FileWriter | None]:
    """The Checkpointer's two :class:`~unbroken.checkpoint.snapshot.Snapshotter` (the shared state, this rank's
    part) and the writer process that writes their background saves (``None``: none is used)."""
    from ..snapshot import Snapshotter
    from .shm import SharedArena

    if not async_save or not enabled():
        return Snapshotter(copy=bool(async_save)), Snapshotter(copy=bool(async_save)), None
    import torch

    pin = torch.cuda.is_available()
    arenas = SharedArena(pin), SharedArena(pin)
    return Snapshotter(True, arenas[0]), Snapshotter(True, arenas[1]), FileWriter(*arenas)


# --------------------------------------------------------------------------- the writer process
def _write_file(dir_fd: int, job: dict[str, Any], segments: dict[int, mmap.mmap],
                half: Any) -> tuple[int, str]:
    from ...format.manifest import new_hasher

    nofollow = getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(job["name"], os.O_WRONLY | os.O_CREAT | os.O_EXCL | nofollow | os.O_CLOEXEC, 0o644, dir_fd=dir_fd)
    try:
        h = new_hasher()
        head = job["head"].encode("latin-1")
        _write_all(fd, head)
        h.update(head)
        total = sum(n for _, _, n in job["ranges"])
        done = 0
        for seg, off, n in job["ranges"]:
            mv = memoryview(segments[seg])[off:off + n]
            for i in range(0, n, _CHUNK):
                chunk = mv[i:i + _CHUNK]
                if half is not None and done + len(chunk) >= total // 2:
                    cut = max(0, total // 2 - done)
                    _write_all(fd, chunk[:cut])
                    half(job["name"])
                    half = None
                    _write_all(fd, chunk[cut:])
                else:
                    _write_all(fd, chunk)
                h.update(chunk)
                done += len(chunk)
        if half is not None:
            half(job["name"])
        os.fsync(fd)
    finally:
        os.close(fd)
    return len(head) + total, h.hexdigest()


def _write_all(fd: int, data: memoryview | bytes) -> None:
    mv = memoryview(data)
    while mv:
        mv = mv[os.write(fd, mv):]


def _serve(sock: socket.socket) -> None:
    segments: dict[int, mmap.mmap] = {}
    send_lock = threading.Lock()
    while True:
        msg, fds = _recv(sock)
        if msg is None or msg.get("op") == "exit":
            return
        op = msg.get("op")
        if op == "map":
            segments[msg["id"]] = mmap.mmap(fds[0], msg["size"])
            os.close(fds[0])
        elif op == "drop":
            for i in msg["ids"]:
                segments.pop(i, None)
        elif op == "write":
            dir_fd = fds[0]
            def pause(name: str) -> None:  # the trainer runs its fault point, then says go
                with send_lock:
                    _send(sock, {"half": name})
                if _recv(sock)[0] is None:
                    raise SystemExit(0)

            half = pause if msg.get("pause_half") else None
            try:
                jobs = msg["files"]
                big = [j for j in jobs if sum(n for _, _, n in j["ranges"]) >= 64 << 20] if half is None else []
                out: dict[str, tuple[int, str]] = {}
                if len(big) > 1:  # one file's fsync overlaps another's hashing (as the thread does)
                    with ThreadPoolExecutor(2) as pool:
                        futs = {j["name"]: pool.submit(_write_file, dir_fd, j, segments, None) for j in big}
                        out.update({k: f.result() for k, f in futs.items()})
                for j in jobs:
                    if j["name"] not in out:
                        out[j["name"]] = _write_file(dir_fd, j, segments, half)
                answer: dict[str, Any] = {"files": out}
            except OSError as e:
                answer = {"error": f"{type(e).__name__}: {e}", "errno": e.errno}
            except Exception as e:  # noqa: BLE001 - reported to the trainer, which fails the save
                answer = {"error": f"{type(e).__name__}: {e}", "errno": 5}
            finally:
                os.close(dir_fd)
            with send_lock:
                _send(sock, answer)


def main(argv: list[str]) -> int:
    try:  # die with the training process: what is half-written is never committed
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_IGN)  # the trainer's to handle (it ends us by closing the socket)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a file size limit: an error (EFBIG) for the save, not a death
    sock = socket.socket(fileno=int(argv[0]))
    if os.getppid() == 1:
        return 0
    try:
        _serve(sock)
    except (BrokenPipeError, ConnectionResetError):
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
