"""The RAM tier on several nodes: every RAM checkpoint is held in the memory of every node.

With one node (every rank sees the same RAM folder) nothing here runs. With several, the
ranks find their nodes themselves (:class:`Nodes`: the ranks that see the same RAM folder
share a node's memory; the lowest rank of a node is its *leader*), and:

**Save.** Every rank writes its files into its own node's staging folder (node 0's is the
coordinator's; on another node the leader opens one and the node's ranks join it). Then the
leaders exchange, over a gloo group of their own, every file written on another node; each is
checked against the checksum its writer reported before it is kept. The coordinator commits
once every node has every file, and each other leader then commits its node's copy under the
same name with the same manifest. So every checkpoint in the RAM tier is whole in the memory of
every node: the loss of any node (its processes and its memory) leaves it on the others, and the
coordinator's writer process persists it from node 0's memory as on one node. A node that could
not commit its copy is named in the log; it receives the checkpoint if a restore needs it there.

**Restore.** The leaders report which RAM checkpoints they hold; the candidates are their union,
newest first (with the disk's and the remote tier's, as always). A node that lacks the one tried
(a node that replaced a lost one, a relaunch on other machines) receives it from the first node
that holds it, every file checked against the manifest before it is written, and commits it;
then every rank verifies and reads its share from its own node's memory as usual.

**Memory and network.** Each node holds whole checkpoints: ``keep_last + 1`` of them, as on one
node (for a sharded model that is the whole model's state on every node, not one shard). Each
save sends every node the part written elsewhere: ``(nodes - 1) / nodes`` of a checkpoint, over
the leaders' gloo group (on the network gloo uses, ``GLOO_SOCKET_IFNAME``), in pieces of at most
:data:`PIECE` bytes.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from .._support import faultpoints as _faults
from ..checkpoint.persist import check_space
from ..dist.comm import Comm, fresh_group
from ..errors import ConfigurationError, CorruptCheckpointError, StorageError, UnbrokenError
from ..format.manifest import MANIFEST, Manifest, new_hasher

log = logging.getLogger("unbroken")
PIECE = 64 << 20
"""The largest piece of a file sent in one broadcast (bytes): bounds the memory of a transfer."""


class Nodes:
    """The nodes of a run's ranks, found by which ranks see each other's files in the RAM folder
    (a collective of every rank, at the start of the run)."""

    def __init__(self, comm: Comm, folder: Path) -> None:
        self.comm = comm
        token = f".node-{comm.rank}-{os.getpid()}-{time.time_ns()}"
        (folder / token).write_text(token)
        try:
            tokens = comm.gather(token)
            views = comm.gather([r for r, t in enumerate(tokens) if _sees(folder, t)])
        finally:
            (folder / token).unlink(missing_ok=True)
        for r, seen in enumerate(views):
            if r not in seen or any(views[o] != seen for o in seen):
                raise ConfigurationError(f"the ranks' RAM folders do not split them into nodes (rank {r} sees the "
                                         f"folders of ranks {seen}): give every node its own RamTier root, shared "
                                         "by all of that node's ranks")
        self.nodes: list[list[int]] = sorted({tuple(v): list(v) for v in views}.values())
        self.index = next(i for i, ranks in enumerate(self.nodes) if comm.rank in ranks)
        self.leaders = [ranks[0] for ranks in self.nodes]
        self.leader = comm.rank == self.leaders[self.index]
        self.group = fresh_group(comm.rank, comm.world, comm.timeout_s, ranks=self.leaders) \
            if len(self.nodes) > 1 else None

    @property
    def several(self) -> bool:
        return len(self.nodes) > 1

    def node_of(self, rank: int) -> int:
        return next(i for i, ranks in enumerate(self.nodes) if rank in ranks)

    def describe(self) -> str:
        return ", ".join(f"node {i}: rank(s) {', '.join(map(str, ranks))}" for i, ranks in enumerate(self.nodes))

    # ------------------------------------------------------------------ transfer
    def _bcast(self, t: torch.Tensor, node: int) -> None:
        torch.distributed.broadcast(t, src=self.leaders[node], group=self.group)

    def send_bytes(self, node: int, data: bytes | None) -> bytes | None:
        """``data`` of node ``node``'s leader on every leader (None: it had none)."""
        size = torch.tensor([-1 if data is None else len(data)], dtype=torch.int64)
        self._bcast(size, node)
        n = int(size.item())
        if n < 0:
            return None
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.index == node and n and data \
            else torch.empty(n, dtype=torch.uint8)
        if n:
            self._bcast(buf, node)
        return bytes(buf.numpy()) if self.index != node else data

    def send_file(self, node: int, read: Any, size: int, write: Any) -> str:
        """One file from node ``node``'s leader (``read(offset, n)`` gives its bytes there) to
        every other leader (``write(piece)`` there), in pieces; an error of this leader, or "".
        Every leader takes part in every piece, whatever failed (the others would wait)."""
        error = ""
        ok = torch.tensor([1], dtype=torch.int64)
        if self.index == node:
            try:
                read(0, 0)  # opens it: a file that cannot be read is announced, never half sent
            except Exception as e:  # noqa: BLE001 - told to the receivers
                ok[0], error = 0, f"{type(e).__name__}: {e}"
        self._bcast(ok, node)
        if not int(ok.item()):
            return error or "the sending node could not read it"
        for offset in range(0, size, PIECE):
            n = min(PIECE, size - offset)
            if self.index == node:
                try:
                    piece = torch.frombuffer(bytearray(read(offset, n)), dtype=torch.uint8)
                except Exception as e:  # noqa: BLE001 - zeros go out: the receivers' checksums fail
                    error = error or f"{type(e).__name__}: {e}"
                    piece = torch.zeros(n, dtype=torch.uint8)
            else:
                piece = torch.empty(n, dtype=torch.uint8)
            self._bcast(piece, node)
            if self.index != node and not error:
                try:
                    write(memoryview(piece.numpy()))  # type: ignore[arg-type]  # an ndarray is a buffer
                except Exception as e:  # noqa: BLE001 - reported after the last piece
                    error = f"{type(e).__name__}: {e}"
        return error


def start_nodes(comm: Comm, ram: Any) -> Nodes | None:
    """At the start of a run with several ranks (a collective): find the nodes of the RAM tier
    ``ram`` (a :class:`~unbroken.tiers.ram.RamRun`); on several, each node's leader opens its node's
    folder as the coordinator opened node 0's. None on one node."""
    failure = ""
    try:
        ram.ensure_folder()
    except StorageError as e:
        failure = str(e)
    failed = [f"rank {r}: {f}" for r, f in enumerate(comm.gather(failure)) if f]
    if failed:
        raise StorageError("the RAM tier's folder could not be created: " + "; ".join(failed))
    nodes = Nodes(comm, ram.dir)
    if not nodes.several:
        return None
    failure = ""
    if nodes.leader and not comm.coordinator:
        try:
            ram.begin()
        except Exception as e:  # noqa: BLE001 - told to every rank
            failure = f"{type(e).__name__}: {e}"
    failed = [f"rank {r}: {f}" for r, f in enumerate(comm.gather(failure)) if f]
    if failed:
        raise StorageError("the RAM tier could not start on every node: " + "; ".join(failed))
    if comm.coordinator:
        log.info("the RAM tier spans %d nodes (%s): every node holds a copy of every RAM checkpoint",
                 len(nodes.nodes), nodes.describe())
    return nodes


def _sees(folder: Path, token: str) -> bool:
    try:
        return (folder / token).read_text() == token
    except OSError:
        return False


class _Checked:
    """A file being received: written piece by piece, its checksum compared at the end."""

    def __init__(self, staging: Any, fname: str) -> None:
        self.f = staging.open(fname)
        self.h = new_hasher()

    def write(self, piece: memoryview) -> None:
        self.h.update(piece)
        self.f.write(piece)

    def drop(self) -> None:
        self.f.__exit__(OSError, None, None)  # closed without being kept: the staging folder is removed

    def close(self, digest: str, what: str) -> None:
        self.f.close()
        if self.h.hexdigest() != digest:
            raise CorruptCheckpointError(f"{what}: checksum mismatch after the transfer between nodes")


class _Reader:
    """``read(offset, n)`` over a file opened by ``open_fd()`` at the first call; ``close()``."""

    def __init__(self, open_fd: Callable[[], int]) -> None:
        self.open_fd, self.fd = open_fd, -1

    def __call__(self, offset: int, n: int) -> bytes:
        if self.fd < 0:
            self.fd = self.open_fd()
        data = os.pread(self.fd, n, offset) if n else b""
        if len(data) != n:
            raise OSError(f"short read ({len(data)} of {n} bytes at {offset})")
        return data

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _commit_as(store: Any, staging: Any, raw: bytes, name: str) -> None:
    """Write the manifest ``raw`` and commit ``staging`` under ``name`` exactly (the name the
    checkpoint has on the other nodes); raises, with nothing left, otherwise."""
    try:
        with staging.open(MANIFEST) as f:
            f.write(raw)
        final = staging.commit()
    except BaseException:
        staging.abort()
        raise
    if final != name:
        store.delete(final)
        raise StorageError(f"{name} exists on this node under another state")


# ---------------------------------------------------------------------- saving
def node_staging(nodes: Nodes, comm: Comm, store: Any, name: str, token: str, need: int,
                 staging: Any = None) -> tuple[Any, BaseException | None]:
    """Every rank's staging folder for a RAM save: the coordinator's (``token``; ``staging`` on
    the coordinator) on node 0, the node leader's own elsewhere, once its memory was found to
    hold ``need`` more bytes, as node 0's was (a collective). Returns ``(staging or None, error)``."""
    error: BaseException | None = None
    opened = None
    if staging is None and nodes.leader and nodes.index > 0:
        try:
            check_space(store, need)
            staging = opened = store.stage(name)
        except UnbrokenError as e:  # the same error, saying which node
            error = type(e)(f"node {nodes.index}: {e}")
        except Exception as e:  # noqa: BLE001 - reported with the save's errors
            error = StorageError(f"node {nodes.index}: {type(e).__name__}: {e}")
    tokens = comm.gather(opened.token if opened is not None else None)
    if staging is None and error is None:
        mine = token if nodes.index == 0 else tokens[nodes.leaders[nodes.index]]
        if mine is None:
            error = StorageError(f"the leader of node {nodes.index} (rank {nodes.leaders[nodes.index]}) could not "
                                 "open its staging folder")
        else:
            try:
                staging = store.join(mine)
            except Exception as e:  # noqa: BLE001
                error = e
    return staging, error


def replicate(nodes: Nodes, staging: Any, results: list[Mapping[str, Any]]) -> str:
    """Send every file to the nodes that did not write it (leaders only; the others return at
    once): after this every node's staging folder has every file. An error of this node, or ""."""
    if not nodes.leader:
        return ""
    errors = []
    for rank, res in enumerate(results):
        node = nodes.node_of(rank)
        for fname, (size, digest) in sorted(res["files"].items()):
            def opener(f: str = fname) -> int:
                return os.open(f, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=staging.folder_fd)

            read = _Reader(opener)
            sink: _Checked | None = None

            def write(piece: memoryview, f: str = fname) -> None:
                nonlocal sink
                if sink is None:
                    sink = _Checked(staging, f)
                sink.write(piece)

            error = nodes.send_file(node, read, size, write)
            try:
                if nodes.index != node and not error:
                    if sink is None:  # an empty file
                        sink = _Checked(staging, fname)
                    sink.close(digest, fname)
                    _faults.point("peers.after_file")
            except Exception as e:  # noqa: BLE001 - reported to the coordinator
                error = str(e) if isinstance(e, CorruptCheckpointError) else f"{type(e).__name__}: {e}"
            finally:
                read.close()
            if error and sink is not None and not sink.f.closed:
                sink.drop()
            if error:
                errors.append(f"{fname} from node {node}: {error}")
    return "; ".join(errors)


def commit_copy(nodes: Nodes, store: Any, staging: Any, decision: Mapping[str, Any]) -> None:
    """After the coordinator's decision: another node's leader commits its copy under the same
    name with the same manifest, or removes its staging folder (never raises: a node without a
    copy is filled from another node by a restore that needs it)."""
    if not (nodes.leader and nodes.index > 0) or staging is None:
        return
    if not decision.get("ok"):
        staging.abort()
        return
    try:
        _commit_as(store, staging, decision["manifest"].encode(), decision["name"])
    except Exception as e:  # noqa: BLE001
        log.warning("node %d (rank %d) could not commit its copy of RAM checkpoint %s: %s", nodes.index,
                    nodes.comm.rank, decision["name"], e)


# ---------------------------------------------------------------------- restore
def holdings(nodes: Nodes, comm: Comm, manifests: Callable[[], Mapping[str, Manifest]]) -> list[dict[str, list[int]]]:
    """Which RAM checkpoints each node holds (its leader lists ``manifests()``), ``{name: [seq,
    step]}`` per node (a collective)."""
    mine = {n: [m.seq, m.step] for n, m in manifests().items()} if nodes.leader else None
    every = comm.gather(mine)
    return [every[leader] for leader in nodes.leaders]


def fill(nodes: Nodes, comm: Comm, store: Any, name: str, held: list[dict[str, list[int]]]) -> None:
    """Give every node RAM checkpoint ``name`` from the first node that holds it (a collective):
    the manifest, then every file, each checked against the manifest before it is kept, then the
    commit. Raises :class:`CorruptCheckpointError` on every rank if any node could not get it."""
    have = [name in h for h in held]
    if all(have) or not any(have):
        return
    src = have.index(True)
    error = ""
    if nodes.leader:
        error = _transfer(nodes, store, name, src, receive=not have[nodes.index])
    errors = [e for e in comm.gather(error) if e]
    if errors:
        for h, had in zip(held, have, strict=True):
            if not had:
                h.pop(name, None)
        raise CorruptCheckpointError(f"{name} could not be copied from node {src}'s memory to every node: "
                                     + "; ".join(errors))
    lacking = [i for i, had in enumerate(have) if not had]
    for i in lacking:
        held[i][name] = held[src][name]
    if comm.coordinator:
        log.info("copied RAM checkpoint %s from node %d's memory to node(s) %s", name, src,
                 ", ".join(map(str, lacking)))


def _transfer(nodes: Nodes, store: Any, name: str, src: int, receive: bool) -> str:
    raw: bytes | None = None
    if nodes.index == src:
        try:
            raw = bytes(store.read(name, MANIFEST))
        except Exception as e:  # noqa: BLE001 - the others are told (None)
            log.warning("cannot read the manifest of RAM checkpoint %s to send it: %s", name, e)
    raw = nodes.send_bytes(src, raw)
    if raw is None:
        return f"node {src} could not read {name}'s manifest"
    manifest = Manifest.from_json(raw)
    staging, errors = None, []
    if receive:
        try:
            staging = store.stage(name)
        except Exception as e:  # noqa: BLE001
            errors.append(f"{type(e).__name__}: {e}")
    for fname, entry in sorted(manifest.files.items()):
        buf: list[Any] = []

        def read(offset: int, n: int, f: str = fname, buf: list[Any] = buf, size: int = entry.size) -> bytes:
            if not buf:
                buf.append(memoryview(store.read(name, f, size)))
            return bytes(buf[0][offset:offset + n])

        sink = _Checked(staging, fname) if staging is not None and not errors else None
        error = nodes.send_file(src, read, entry.size, sink.write if sink else (lambda piece: None))
        if sink is not None and not error:
            try:
                sink.close(entry.xxh3_128, fname)
            except CorruptCheckpointError as e:
                error = str(e)
        elif sink is not None:
            sink.drop()
        if error and receive:
            errors.append(f"{fname}: {error}")
    if staging is None:
        return "; ".join(errors)
    if errors:
        staging.abort()
        return "; ".join(errors)
    try:
        _commit_as(store, staging, raw, name)
    except Exception as e:  # noqa: BLE001
        return f"node {nodes.index}: {type(e).__name__}: {e}"
    return ""
