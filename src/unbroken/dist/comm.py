"""The rank, the world size, and the collectives a run needs to agree.

One code path for one process and for N (DESIGN decision 8): a single process is a
world of size 1, where every collective returns at once. With ``torch.distributed``
initialized, the Checkpointer creates a private **gloo** group (CPU, works beside NCCL)
with a timeout, so an absent rank turns into a :class:`CoordinationError` after
``timeout_s``, never a hang. Messages are JSON sent as byte tensors: no pickle, even
between our own ranks.

The private group's keys live under a prefix the ranks agree on afresh
(:func:`~unbroken.dist.rendezvous.fresh_prefix`), so the group comes up after a torchrun
restart however the default group was initialized: under a plain
``init_process_group()`` the store still holds the previous round's keys, and a group
created under the same names read a dead peer's address and waited ten minutes.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch

from ..errors import UnbrokenError
from .rendezvous import fresh_prefix

_groups_made = itertools.count()  # every rank creates its groups in the same order


class CoordinationError(UnbrokenError):
    """The ranks of a run could not agree: a rank did not answer within the timeout, or one
    failed. The message names the ranks and what they reported."""


def world() -> tuple[int, int]:
    """``(rank, world_size)`` of this process: from ``torch.distributed`` when initialized,
    else ``(0, 1)``. Raises if the launcher says there are several ranks but the process
    group is not initialized (the ranks could not agree on anything)."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise CoordinationError(
            f"WORLD_SIZE={os.environ['WORLD_SIZE']} but torch.distributed is not initialized: call "
            "torch.distributed.init_process_group() before creating the Checkpointer, so the ranks "
            "can agree on what to save and resume")
    return 0, 1


class Comm:
    """Collectives among the ranks of one run (trivial at world size 1)."""

    def __init__(self, timeout_s: float = 600.0) -> None:
        self.rank, self.world = world()
        self.timeout_s = timeout_s
        self._group: Any = None
        self._pending: PendingMax | None = None  # the last start_max: finished before the group closes
        _ = self.group  # created now, while every rank constructs its Checkpointer

    @property
    def group(self) -> Any:
        """The private gloo group (None at world size 1), created again after :meth:`close`."""
        if self.world > 1 and self._group is None:
            self._group = fresh_group(self.rank, self.world, self.timeout_s)
        return self._group

    @property
    def coordinator(self) -> bool:
        return self.rank == 0

    def _call(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, group=self.group, **kwargs)
        except RuntimeError as e:  # gloo: timeouts, a peer that died
            raise CoordinationError(f"rank {self.rank}/{self.world}: {what} failed (a rank did not answer "
                                    f"within {self.timeout_s:.0f} s, or died): {e}") from None

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """``obj`` of rank ``src`` on every rank (JSON-able values only)."""
        if self.world == 1:
            return obj
        data = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8) \
            if self.rank == src else torch.empty(0, dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.int64)
        self._call("broadcast", torch.distributed.broadcast, size, src=src)
        if self.rank != src:
            data = torch.empty(int(size.item()), dtype=torch.uint8)
        if data.numel():
            self._call("broadcast", torch.distributed.broadcast, data, src=src)
        return json.loads(bytes(data.numpy()).decode()) if self.rank != src else obj

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order, on every rank."""
        if self.world == 1:
            return [obj]
        raw = json.dumps(obj).encode()
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world)]
        self._call("all_gather", torch.distributed.all_gather, sizes, torch.tensor([len(raw)], dtype=torch.int64))
        longest = max(int(s.item()) for s in sizes)
        mine = torch.zeros(longest, dtype=torch.uint8)
        mine[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else mine[:0]
        bufs = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.world)]
        self._call("all_gather", torch.distributed.all_gather, bufs, mine)
        return [json.loads(bytes(b[: int(s.item())].numpy()).decode()) for b, s in zip(bufs, sizes)]

    def any(self, flag: bool) -> bool:
        """True on every rank if ``flag`` is true on any rank."""
        if self.world == 1:
            return flag
        t = torch.tensor([1 if flag else 0], dtype=torch.int64)
        self._call("all_reduce", torch.distributed.all_reduce, t, op=torch.distributed.ReduceOp.MAX)
        return bool(t.item())

    def max(self, value: int) -> int:
        """The largest ``value`` over all ranks."""
        if self.world == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        self._call("all_reduce", torch.distributed.all_reduce, t, op=torch.distributed.ReduceOp.MAX)
        return int(t.item())

    def start_max(self, values: Sequence[int]) -> "PendingMax":
        """Start the element-wise largest of ``values`` over all ranks without waiting (a
        non-blocking gloo all-reduce); :meth:`PendingMax.result` waits for it. Every rank must
        start it at the same point of its sequence of collectives, as for any collective."""
        t = torch.tensor(list(values), dtype=torch.int64)
        if self.world == 1:
            return PendingMax(self, None, t)
        self._pending = PendingMax(self, self._call("all_reduce", torch.distributed.all_reduce, t,
                                                    op=torch.distributed.ReduceOp.MAX, async_op=True), t)
        return self._pending

    def barrier(self) -> None:
        if self.world > 1:
            self._call("barrier", torch.distributed.barrier)

    def close(self) -> None:
        """Destroy the private group (idempotent), once a reduction still in flight has finished
        (every rank started it: it completes, or fails at once if a peer died)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            try:
                pending.result()
            except CoordinationError:  # closing anyway
                pass
        group, self._group = self._group, None
        if group is not None and torch.distributed.is_initialized():
            try:
                torch.distributed.destroy_process_group(group)
            except (RuntimeError, ValueError):  # the default group is gone already
                pass


class PendingMax:
    """A reduction started by :meth:`Comm.start_max`; :meth:`result` waits for it (once)."""

    def __init__(self, comm: Comm, work: Any, tensor: torch.Tensor) -> None:
        self._comm, self._work, self._tensor = comm, work, tensor

    def result(self) -> list[int]:
        """The element-wise largest values over all ranks; a :class:`CoordinationError` if a rank
        did not answer."""
        work, self._work = self._work, None
        if work is not None:
            try:
                work.wait()
            except RuntimeError as e:  # gloo: timeouts, a peer that died
                c = self._comm
                raise CoordinationError(f"rank {c.rank}/{c.world}: all_reduce failed (a rank did not answer "
                                        f"within {c.timeout_s:.0f} s, or died): {e}") from None
        return [int(v) for v in self._tensor.tolist()]


def fresh_group(rank: int, world: int, timeout_s: float, ranks: list[int] | None = None) -> Any:
    """``new_group(ranks, backend="gloo")`` whose keys lie under a prefix no earlier round used
    (every rank calls it, also those not in ``ranks``; None: every rank).

    ``new_group`` takes no store: it names groups by a counter that starts again at 1 in
    every process and keys them in the default group's store, which torchrun keeps across
    restarts. For the time of the call the default group's entry in torch's registry points
    at the same store under the agreed prefix (the group is registered with that store).
    """
    dist = torch.distributed
    c10d = dist.distributed_c10d
    timeout = timedelta(seconds=timeout_s)
    key = f"group{next(_groups_made)}"
    try:
        default = c10d._get_default_group()
        backend, store = c10d._world.pg_map[default]
    except (AttributeError, KeyError, TypeError):  # another torch's internals: its own naming
        return dist.new_group(ranks=ranks, backend="gloo", timeout=timeout)

    def failed(why: str) -> CoordinationError:
        return CoordinationError(f"rank {rank}/{world}: the ranks could not set up unbroken's gloo group: {why}. "
                                 "Every rank must create its Checkpointer at the same point")

    prefix = fresh_prefix(store, rank, world, key, timeout_s, failed)
    c10d._world.pg_map[default] = (backend, dist.PrefixStore(prefix, store))
    try:
        return dist.new_group(ranks=ranks, backend="gloo", timeout=timeout)
    finally:
        c10d._world.pg_map[default] = (backend, store)


def init_distributed(backend: str | None = None, timeout_s: float = 1800.0) -> tuple[int, int]:
    """``torch.distributed.init_process_group`` that survives ``torchrun --max-restarts``.

    Under torchrun (``TORCHELASTIC_USE_AGENT_STORE=True``) every restart round reuses the
    agent's store, and torch 2.x keeps the previous round's keys in it: a fast rank of the
    new round can read a dead peer's address and fail to connect ("Gloo connectFullMesh
    failed ... Connection refused"), so the group never comes back. Here the store is
    prefixed with a token the ranks of this round agree on through the store
    (:func:`~unbroken.dist.rendezvous.fresh_prefix`; not the restart count, which nodes
    count differently), so each round meets only its own keys. Outside torchrun this is
    the plain ``init_process_group`` (env://). Returns ``(rank, world_size)``; a no-op if
    the group is already initialized.
    """
    dist = torch.distributed
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    timeout = timedelta(seconds=timeout_s)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                              timeout=timeout)
        prefix = fresh_prefix(store, rank, world, "init", timeout_s, lambda why: CoordinationError(
            f"rank {rank}/{world}: init_distributed: {why}; is every rank started?"))
        dist.init_process_group(backend, store=dist.PrefixStore(prefix, store), rank=rank, world_size=world,
                                timeout=timeout)
    else:
        dist.init_process_group(backend, timeout=timeout)
    return dist.get_rank(), dist.get_world_size()
