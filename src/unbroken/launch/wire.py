"""What the warm torchrun worker (:mod:`.worker`), the spare server (:mod:`.server`) and a spare
(:mod:`.spare`) share: where the server listens, who may own it, and how messages travel.

**Where.** One server per torchrun agent and run: a unix socket ``sock`` in a folder ``<base>/<key>``.
``base`` is ``$UNBROKEN_SPARES_DIR``, else ``$XDG_RUNTIME_DIR/unbroken-spares``, else
``/tmp/unbroken-spares-<uid>``; ``key`` hashes the user, the host's name, ``TORCHELASTIC_RUN_ID``, the
agent's pid and the interpreter (the host's name: on a base folder the nodes share, two nodes' agents of
the same pid would otherwise get one folder, and a socket reaches only its own host). Both folders are
created ``0700``; an existing one is used only when it is a real folder (not a symbolic link), owned by
this user, and closed to group and others, and the socket only when it is a socket owned by this user.
Once connected, the peer's uid (``SO_PEERCRED``) must be this user's: another local user can neither
plant a server nor read what a worker sends (its environment).

**How.** A message is 4 bytes of length (big-endian) and that much JSON; file descriptors travel with
its first bytes (``SCM_RIGHTS``).
"""

from __future__ import annotations

import array
import hashlib
import json
import os
import socket
import stat
import struct
from collections.abc import Mapping
from typing import Any

PER_LAUNCH = ("RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
              "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES")
"""Variables that differ between the launches one spare may take (with ``TORCHELASTIC_*``, ``TORCH_ELASTIC_*``
and :data:`CLIENT`): torchrun sets them per worker and round; nothing reads them before the script runs (a spare
imports no CUDA and nothing of unbroken)."""
CLIENT = "UNBROKEN_WARM_CLIENT"
"""Set in a warm training process: ``CLIENT_PID:AGENT_PID`` (the worker torchrun watches, and its parent, the
agent): whose death is the launcher's death (:mod:`unbroken.faults.launcher`)."""
MAX_MESSAGE = 1 << 24


class Refused(Exception):
    """A folder or socket that is not safely this user's, or a peer of another uid."""


def per_launch(name: str) -> bool:
    return name in PER_LAUNCH or name == CLIENT or name.startswith(("TORCHELASTIC_", "TORCH_ELASTIC_"))


def stable_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` without the per-launch variables: what must be equal for a spare to take a launch."""
    return {k: v for k, v in env.items() if not per_launch(k)}


def base_dir(env: Mapping[str, str] | None = None) -> str:
    """Where the servers' folders are (see the module docstring)."""
    found: Mapping[str, str] = os.environ if env is None else env
    if found.get("UNBROKEN_SPARES_DIR"):
        return found["UNBROKEN_SPARES_DIR"]
    if found.get("XDG_RUNTIME_DIR"):
        return os.path.join(found["XDG_RUNTIME_DIR"], "unbroken-spares")
    return f"/tmp/unbroken-spares-{os.getuid()}"


def key(run_id: str, agent: int, executable: str) -> str:
    """The name of the server folder of ``agent`` (its pid) in run ``run_id`` on this host."""
    who = f"{os.getuid()}\0{socket.gethostname()}\0{run_id}\0{agent}\0{executable}"
    return hashlib.sha256(who.encode()).hexdigest()[:16]


def private_dir(path: str) -> str:
    """``path`` as a folder of this user's that nobody else can enter, created so if missing; else :class:`Refused`."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as e:
        raise Refused(f"cannot create {path}: {e}") from e
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise Refused(f"{path} is not a folder (a symbolic link?)")
    if st.st_uid != os.getuid():
        raise Refused(f"{path} is owned by uid {st.st_uid}, not {os.getuid()}")
    if st.st_mode & 0o077:
        raise Refused(f"{path} is open to other users (mode {stat.S_IMODE(st.st_mode):o})")
    return path


def server_dir(run_id: str, agent: int, executable: str, env: Mapping[str, str] | None = None) -> str:
    return private_dir(os.path.join(private_dir(base_dir(env)), key(run_id, agent, executable)))


def check_socket(path: str) -> bool:
    """Whether ``path`` exists (as a socket of this user's: else :class:`Refused`)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.getuid():
        raise Refused(f"{path} is not a socket of uid {os.getuid()}")
    return True


def check_peer(sock: socket.socket) -> None:
    """:class:`Refused` unless the process at the other end runs as this user."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    if uid != os.getuid():
        raise Refused(f"the peer runs as uid {uid}, not {os.getuid()}")


def send(sock: socket.socket, obj: Any, fds: list[int] | tuple[int, ...] = ()) -> None:
    data = json.dumps(obj).encode()
    data = struct.pack(">I", len(data)) + data
    if fds:
        sent = sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
        data = data[sent:]
    if data:
        sock.sendall(data)


def recv(sock: socket.socket, max_fds: int = 8) -> tuple[Any, list[int]]:
    """One message and the descriptors that came with it; ``(None, [])`` at end of file."""
    fds: list[int] = []
    buf = b""
    need = 4
    while len(buf) < need:
        data, anc, _flags, _addr = sock.recvmsg(need - len(buf), socket.CMSG_SPACE(max_fds * 4))
        for level, kind, raw in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                arr = array.array("i")
                arr.frombytes(raw[:len(raw) - len(raw) % arr.itemsize])
                fds += list(arr)
        if not data:
            for fd in fds:
                os.close(fd)
            return None, []
        buf += data
        if need == 4 and len(buf) >= 4:
            need = 4 + struct.unpack(">I", buf[:4])[0]
            if need > MAX_MESSAGE:
                raise ValueError("message too long")
    return json.loads(buf[4:]), fds
