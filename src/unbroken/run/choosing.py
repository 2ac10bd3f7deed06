"""The newest valid checkpoint across a run's tiers: what :meth:`unbroken.run.run.Run.newest_valid` does.

Candidates are taken newest first by ``(seq, step)`` from every tier: the RAM tier
(:mod:`unbroken.tiers.ram`, read in place: memory first), the run location, and the remote tier (a
checkpoint only the remote has is downloaded, verified, into the run location first). Every rank
verifies its share of a candidate; one that fails anywhere is reported, quarantined in its tier,
and the next tried (:func:`unbroken.run.collective.choose`). A candidate is a name in the run
location, or ``ram:`` + a name in the RAM tier (checkpoint names never hold a colon).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from ..checkpoint.chunks import LiveChunks
from ..checkpoint.discovery import manifests
from ..checkpoint.reader import LoadedCheckpoint, read_checkpoint, verify_share
from ..errors import CorruptCheckpointError
from ..format.manifest import Manifest
from ..store.retry import is_transient
from ..tiers import rampeers
from . import collective

if TYPE_CHECKING:
    from .run import Run

log = logging.getLogger("unbroken")
RELISTS = 10
"""How often :func:`newest_valid` looks again after checkpoints vanished while it read them."""
RAM = "ram:"
REMOTE = "remote:"  # a checkpoint downloaded from the remote tier into the primary store, read there
"""Prefix of a candidate in the RAM tier."""


def newest_valid(run: Run, repair: LiveChunks | None = None) -> tuple[LoadedCheckpoint | None, str, str]:
    """The newest checkpoint that verifies in any tier (downloaded if only the remote has it),
    where it was read, and the tier it came from (``ram``, ``local``, ``remote``; ``""``: none). Invalid ones are
    reported, quarantined and skipped; a damaged chunk the live state still holds is
    rewritten by ``repair`` first. A collective: every rank gets its part."""
    rank, world = run.comm.rank, run.comm.world
    nodes = run.ram.nodes if run.ram is not None else None
    held = rampeers.holdings(nodes, run.comm, run.ram.manifests) if nodes is not None and run.ram else None

    def attempt(token: str) -> LoadedCheckpoint:
        store, name = _where(run, token)
        if held is not None and token.startswith(RAM):  # a node without it receives it first
            rampeers.fill(nodes, run.comm, store, name, held)  # type: ignore[arg-type]
        files = verify_share(store, name, rank, world, repair=repair)
        return read_checkpoint(store, name, rank, files, all_shards=world == 1)

    def invalid(token: str, reason: str) -> None:
        store, name = _where(run, token)
        run.invalid(store, name, reason, tier="ram" if store is not run.store else "primary")

    for _ in range(RELISTS):  # a checkpoint pruned while read (a read-only run's writer): look again
        run.damage.vanished = False
        chosen = collective.choose(run.comm, _candidates(run, held) if run.comm.coordinator else None,
                                   attempt, invalid)
        if not run.comm.broadcast(run.damage.vanished and run.comm.coordinator and _newer_than(run, chosen)):
            break
    if chosen is None:
        return None, "", ""
    token, loaded = chosen
    run.use_base(loaded)
    store, name = _where(run, token)
    tier = "ram" if token.startswith(RAM) else "remote" if token.startswith(REMOTE) else "local"
    return loaded, store.describe(name), tier  # (the token is the coordinator's, on every rank)

def _where(run: Run, token: str) -> tuple[Any, str]:
    if run.ram is not None and token.startswith(RAM):
        return run.ram.store, token[len(RAM):]
    return run.store, token.removeprefix(REMOTE)

def _newer_than(run: Run, chosen: tuple[str, LoadedCheckpoint] | None) -> bool:
    """Whether a checkpoint newer than ``chosen`` is committed now (one vanished meanwhile)."""
    seq = chosen[1].manifest.seq if chosen is not None else -1
    return any(m.seq > seq for m in manifests(run.store).values())

def _candidates(run: Run, held: list[dict[str, list[int]]] | None) -> Iterator[str]:
    """Names to try, newest first, in the primary store: a checkpoint only the remote tier
    has (or whose local copy failed) is downloaded first. ``held``: the RAM checkpoints of
    every node (several nodes: any node's is a candidate)."""
    local = _manifests(run, run.store)
    remote = _manifests(run, run.remote_store) if run.remote_store is not None and run.remote_ok else {}
    ram = _manifests(run, run.ram.store) if run.ram is not None else {}
    by_key = lambda found: {(m.seq, m.step): n for n, m in found.items()}  # noqa: E731
    local_by, remote_by, ram_by = by_key(local), by_key(remote), by_key(ram)
    for node in held or []:  # this node's first: read in place
        for name, (seq, step) in node.items():
            ram_by.setdefault((seq, step), name)
    keys = sorted({*local_by, *remote_by, *ram_by}, reverse=True)
    for key in keys:
        if key in ram_by and run.ram is not None:
            yield RAM + ram_by[key]  # memory first; if it fails, the same checkpoint from disk or remote
        if key in local_by:
            yield local_by[key]
            if local_by[key] in run.store.list_committed():
                continue  # invalid but could not be quarantined: not shadowed by a download
        if key in remote_by and run.remote_store is not None:
            try:
                yield REMOTE + run.download(remote_by[key])
            except CorruptCheckpointError as e:
                run.invalid(run.remote_store, remote_by[key], str(e), tier="remote")

def _manifests(run: Run, store: Any) -> dict[str, Manifest]:
    """Readable manifests; unreadable committed ones are reported as invalid."""
    from ..checkpoint.reader import read_manifest

    out = {}
    try:
        names = store.list_committed()
    except Exception as e:
        if store is run.store or (run.ram is not None and store is run.ram.store) or not is_transient(e):
            raise
        log.warning("remote tier %s unreachable (%s); resuming from the local tier only", store.url, e)
        run.remote_unlisted = True
        return {}
    for name in names:
        try:
            out[name] = read_manifest(store, name)
        except CorruptCheckpointError as e:
            tier = "primary" if store is run.store else "ram" if run.ram and store is run.ram.store else "remote"
            run.invalid(store, name, str(e), tier=tier)
    return out
