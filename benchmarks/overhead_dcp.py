"""PyTorch DCP's ``async_save`` as a drop-in for the Checkpointer in ``bench_train_overhead.py``.

``DcpAsync(out, every, kind)`` saves ``{"model", "optimizer"}`` state dicts with
``torch.distributed.checkpoint.async_save`` every ``every`` steps, waiting for the save in flight
before the next one (the same backpressure as unbroken's), with ``kind`` ``"thread"`` (DCP's
default) or ``"process"`` (``AsyncCheckpointerType.PROCESS``: a background process of DCP's, fed
through shared memory). DCP needs a process group even for one process: a gloo group of one on a
free local port. Not the same work as unbroken's save: no checksums, no data-loader position, no
RNG states, no retention; a peer's stall and overhead for the same model and loop.
"""

from __future__ import annotations

import socket
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp


class DcpAsync:
    """The part of the Checkpointer's interface the benchmark's loop uses."""

    def __init__(self, out: Path, every: int, kind: str) -> None:
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        if not dist.is_initialized():
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
        self.out, self.every = out, every
        self.kind = AsyncCheckpointerType.PROCESS if kind == "process" else AsyncCheckpointerType.THREAD
        self.progress = SimpleNamespace(step=0)
        self._pending: Future[Any] | None = None
        self._last: int | None = None

    def environment(self) -> None:
        pass

    def step(self, state: dict[str, Any]) -> None:
        self.progress.step += 1
        if self.progress.step % self.every:
            return
        self.flush()
        sd = {"model": state["model"].state_dict(), "optimizer": state["optimizer"].state_dict()}
        self._pending = dcp.async_save(sd, checkpoint_id=str(self.out / f"step-{self.progress.step}"),
                                       async_checkpointer_type=self.kind)
        self._last = self.progress.step

    def flush(self) -> None:
        if self._pending is not None:
            self._pending.result()
            self._pending = None

    def latest(self) -> Any:
        return SimpleNamespace(step=self._last) if self._last is not None else None

    def close(self) -> None:
        self.flush()
        if dist.is_initialized():
            dist.destroy_process_group()
