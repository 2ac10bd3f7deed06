"""Resumable iterable data: sharded JSONL/text files by byte offset, and a skip protocol.

Iterable datasets cannot be indexed, so resuming by replaying consumed records costs
time proportional to the position (and real per-record work). :class:`JsonlReader`
stores (shard, byte offset) instead and resumes with one ``seek`` (the Lingua
approach). :class:`Counted` makes any other iterable resumable: it counts consumed
items and, on restore, fast-forwards with the source's ``skip(n)`` if it has one,
else by replaying (with a warning). A custom iterable that implements
``state_dict``/``load_state_dict`` itself needs neither: put it in the state as is.

Use these in the training process (or a ``DataLoader`` with ``num_workers=0``): the
position must be what the loop consumed, which a worker process cannot know.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from .checked import count


@runtime_checkable
class Skippable(Protocol):
    """An iterable source that can fast-forward: the next iteration skips ``n`` items."""

    def skip(self, n: int) -> None: ...


class JsonlReader:
    """Records of sharded JSONL (or plain-text) files, resumable by byte offset.

    Args:
        paths: the shard files, in order.
        parse: ``"json"`` (one JSON value per line) or ``"text"`` (the line, without
            its newline). Blank lines are skipped.
        rank, world_size: this process reads shards ``rank, rank + world_size, ...``.
            The world size must stay the same across a resume (shards are per rank).
        loop: start again from the first shard after the last, counting epochs.
    """

    def __init__(self, paths: Sequence[str | os.PathLike[str]], *, parse: str = "json",
                 rank: int = 0, world_size: int = 1, loop: bool = False) -> None:
        if parse not in ("json", "text"):
            raise ValueError("parse must be 'json' or 'text'")
        self.all_paths = [str(p) for p in paths]
        self.paths = self.all_paths[rank::world_size]
        if not self.paths:
            raise ValueError(f"rank {rank} of {world_size} has no shard ({len(self.all_paths)} shards)")
        self.parse, self.rank, self.world_size, self.loop = parse, rank, world_size, loop
        self.shard, self.offset, self.epoch, self.records = 0, 0, 0, 0

    def __iter__(self) -> Iterator[Any]:
        while True:
            while self.shard < len(self.paths):
                with open(self.paths[self.shard], "rb") as f:
                    f.seek(self.offset)
                    for line in f:
                        self.offset += len(line)
                        text = line.decode("utf-8").rstrip("\r\n")
                        if not text.strip():
                            continue
                        self.records += 1
                        yield json.loads(text) if self.parse == "json" else text
                self.shard, self.offset = self.shard + 1, 0
            if not self.loop:
                return
            self.shard, self.epoch = 0, self.epoch + 1

    def state_dict(self) -> dict[str, Any]:
        return {"shard": self.shard, "offset": self.offset, "epoch": self.epoch, "records": self.records,
                "shard_name": Path(self.paths[min(self.shard, len(self.paths) - 1)]).name,
                "rank": self.rank, "world_size": self.world_size, "num_shards": len(self.all_paths)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["world_size"] != self.world_size or state["num_shards"] != len(self.all_paths):
            raise ValueError(
                f"saved with {state['num_shards']} shards over {state['world_size']} ranks, now "
                f"{len(self.all_paths)} over {self.world_size}: shard positions are per rank and cannot move")
        shard = count(state, "shard", "stream", hi=len(self.paths))
        offset = count(state, "offset", "stream")
        epoch, records = count(state, "epoch", "stream"), count(state, "records", "stream")
        if shard < len(self.paths) and Path(self.paths[shard]).name != state["shard_name"]:
            raise ValueError(f"shard {shard} was {state['shard_name']!r}, now {Path(self.paths[shard]).name!r}")
        if shard < len(self.paths) and os.path.getsize(self.paths[shard]) < offset:
            raise ValueError(f"{self.paths[shard]} is shorter than the saved offset {offset}")
        self.shard, self.offset, self.epoch, self.records = shard, offset, epoch, records


class Counted:
    """Makes an iterable resumable by counting the items the loop consumed in this pass
    (the count starts again at 0 when a pass over the source ends).

    ``source`` is re-iterated from the start after a restore: if it is
    :class:`Skippable`, ``source.skip(consumed)`` is called first (O(1) for a
    well-made source); otherwise the consumed items are read and discarded, which is
    exact but costs time proportional to the position, and a warning says so.
    """

    def __init__(self, source: Iterable[Any] | Callable[[], Iterable[Any]]) -> None:
        self._source = source
        self.consumed = 0
        self._resume_at = 0

    def __iter__(self) -> Iterator[Any]:
        src = self._source() if callable(self._source) and not isinstance(self._source, Iterable) \
            else self._source
        skip, self._resume_at = self._resume_at, 0
        if skip and isinstance(src, Skippable):
            src.skip(skip)
            it = iter(src)
        else:
            it = iter(src)
            if skip:
                warnings.warn(f"replaying {skip} items to resume: give the source a skip(n) method "
                              "or state_dict()/load_state_dict() to make this O(1)", stacklevel=2)
                for _ in range(skip):
                    next(it)
        for item in it:
            self.consumed += 1
            yield item
        self.consumed = 0  # a whole pass is done: the next one (and a resume) starts from the beginning

    def state_dict(self) -> dict[str, int]:
        return {"consumed": self.consumed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.consumed = self._resume_at = count(state, "consumed", "counter")
