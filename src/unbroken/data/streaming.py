"""``StreamLoader``: a DataLoader for iterable (streaming) data, resumed exactly at the sample,
with any ``num_workers``, shuffle buffers included.

A worker count of ``W`` reads ``W`` *lanes* (one per worker; one lane with ``num_workers=0``):
lane ``w`` is the part of the stream ``DataLoader`` worker ``w`` would read (for a
``datasets.IterableDataset``, every ``W``-th shard from ``w``). A worker sends its examples in
chunks, each with its lane's ``state_dict()`` *after* that chunk. The training process takes the
chunks in a fixed round-robin order of lanes, and from then on everything happens in it: the
shuffle buffer, cutting batches, ``collate_fn``. What it saves is what it took: each lane's
state as of the last chunk it took (chunks prefetched by workers but not taken are read again
after a resume), which lane comes next, the shuffle buffer (its examples and its generator) and
the examples released but not yet batched. So the batches after a resume are the ones the
uninterrupted run had, whatever the workers had prefetched when the process died.

Rules: the number of workers (the lanes), the buffer size and the rank's part of the stream
cannot change across a resume (the saved position belongs to them; a change is refused). A
stream's position differs from rank to rank: with several ranks put the loader in the state as
``unbroken.PerRank(loader)``.
"""

from __future__ import annotations

import copy
from collections import deque
from collections.abc import Callable, Iterator
from itertools import islice
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, default_collate, get_worker_info

from . import hf
from .buffer import ShuffleBuffer, epoch_generator
from .loader import _WorkerInit, _world
from .order import mix_ints

_OWNED = ("batch_size", "shuffle", "sampler", "batch_sampler", "generator", "persistent_workers")


def _identity(chunk: Any) -> Any:  # (batch_size=None: DataLoader hands each chunk as it is)
    return chunk


def _generic_chunks(source: Any, size: int) -> Iterator[tuple[list[Any], Any]]:
    it = iter(source)
    while True:
        rows = list(islice(it, size))
        if not rows:
            return
        yield rows, source.state_dict()


class _Lanes(IterableDataset):
    """What each worker runs: its lane of the stream, from its saved state, in tagged chunks."""

    def __init__(self, source: Any, is_hf: bool, lanes: int, first: int, states: list[Any], done: list[bool],
                 chunk: int, epoch: int) -> None:
        self.source, self.is_hf, self.lanes, self.first = source, is_hf, lanes, first
        self.states, self.done, self.chunk, self.epoch = states, done, chunk, epoch

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = get_worker_info()
        lane = (self.first + (info.id if info is not None else 0)) % self.lanes
        if self.done[lane]:
            return
        if self.is_hf:
            src = hf.lane(self.source, self.lanes, lane)
        else:
            src = copy.deepcopy(self.source)
            if self.lanes > 1:
                src = src.shard(num_shards=self.lanes, index=lane, contiguous=False)
        if hasattr(src, "set_epoch"):
            src.set_epoch(self.epoch)
        if self.states[lane] is not None:
            src.load_state_dict(copy.deepcopy(self.states[lane]))
        state = self.states[lane]
        for rows, state in (hf.chunks if self.is_hf else _generic_chunks)(src, self.chunk):
            yield {"lane": lane, "rows": rows, "state": state, "done": False}
        yield {"lane": lane, "rows": [], "state": state, "done": True}


class StreamLoader:
    """A ``DataLoader`` for iterable data whose position is saved and restored exactly.

    Put it in the checkpointed state (``state["data"] = loader``; with several ranks
    ``unbroken.PerRank(loader)``). Iterating yields the rest of the current pass over the
    stream; the next ``iter()`` starts the next pass (``set_epoch`` is called on the stream).

    Args:
        dataset: a ``datasets.IterableDataset`` (also after ``.shuffle(seed, buffer_size)``,
            ``.map``, ``interleave_datasets``, ``split_dataset_by_node``), or any iterable with
            ``state_dict()``/``load_state_dict()`` (with ``num_workers > 0`` also
            ``shard(num_shards, index, contiguous)``, as ``datasets`` has it).
        batch_size: examples per batch.
        num_workers: worker processes, each reading its own lane of shards. It cannot change
            across a resume.
        collate_fn: turns a list of examples into a batch (default ``default_collate``); runs
            in the training process.
        drop_last: drop the short last batch of each pass.
        shuffle_buffer, seed: shuffle through a buffer of this many examples (a ``datasets``
            stream that ends with ``.shuffle(buffer_size=...)`` brings its own: its buffer is
            taken over, same size and generator).
        **loader_kwargs: to the underlying ``torch.utils.data.DataLoader`` (``prefetch_factor``,
            ``multiprocessing_context``, ``worker_init_fn``, ``timeout``, ...).
    """

    def __init__(self, dataset: Any, batch_size: int, *, num_workers: int = 0,
                 collate_fn: Callable[[list[Any]], Any] | None = None, drop_last: bool = False,
                 shuffle_buffer: int = 0, seed: int = 0, **loader_kwargs: Any) -> None:
        bad = [k for k in _OWNED if k in loader_kwargs]
        if bad:
            raise TypeError(f"StreamLoader owns {bad} (batch_size= is its own argument; it makes a new DataLoader "
                            "each pass, so persistent_workers cannot apply)")
        if batch_size < 1 or num_workers < 0:
            raise ValueError("batch_size must be at least 1 and num_workers at least 0")
        for need in ("state_dict", "load_state_dict", "__iter__"):
            if not hasattr(dataset, need):
                raise TypeError(f"StreamLoader needs an iterable with state_dict()/load_state_dict() (a "
                                f"datasets.IterableDataset, unbroken.data.JsonlReader, ...); {type(dataset).__name__} "
                                f"has no {need}. Wrap a plain iterable in unbroken.data.Counted(...).")
        self.is_hf = hf.is_hf_stream(dataset)
        base: np.random.Generator | None = None
        if self.is_hf:
            dataset, size, base = hf.take_buffer(dataset)
            if size and shuffle_buffer:
                raise ValueError("the stream already ends with .shuffle(buffer_size=...); do not pass "
                                 "shuffle_buffer too")
            shuffle_buffer = shuffle_buffer or size
            if num_workers > dataset.num_shards:
                raise ValueError(f"num_workers={num_workers} but the stream has {dataset.num_shards} shard(s): each "
                                 f"worker reads whole shards; use num_workers <= {dataset.num_shards} (or a stream "
                                 "with more shards)")
        elif num_workers > 1 and not callable(getattr(dataset, "shard", None)):
            raise TypeError(f"num_workers={num_workers} splits the stream into lanes, one per worker, and "
                            f"{type(dataset).__name__} has no shard(num_shards, index, contiguous): use "
                            "num_workers=0 or 1, or give it one")
        self.dataset = dataset
        self.batch_size, self.num_workers, self.drop_last = batch_size, num_workers, drop_last
        self.collate_fn = collate_fn or default_collate
        self.seed = seed
        self.buffer_size = shuffle_buffer
        self._base_rng = base if base is not None else np.random.default_rng(seed)
        self.lanes = max(1, num_workers)
        self.chunk = batch_size
        self.rank, self.world_size = (hf.node(dataset) if self.is_hf else None) or _world()
        self._kwargs = dict(loader_kwargs)
        self._generator = torch.Generator()
        self.epoch = 0
        self.samples_seen = 0
        self._restores = 0
        self._start_epoch()

    def _start_epoch(self) -> None:
        self.next_lane = 0
        self.lane_states: list[Any] = [None] * self.lanes
        self.done = [False] * self.lanes
        self.pending: list[Any] = []
        self.buffer = ShuffleBuffer(self.buffer_size, epoch_generator(self._base_rng, self.epoch)) \
            if self.buffer_size else None

    def _exhausted(self) -> bool:
        """Nothing left of this pass: every lane ended, nothing buffered, no batch left to cut."""
        left = len(self.pending)
        return all(self.done) and not (self.buffer and self.buffer.items) and \
            (left == 0 or (self.drop_last and left < self.batch_size))

    def _expected(self) -> int:
        """The lane whose chunk is taken next (the round-robin order, skipping ended lanes)."""
        for k in range(self.lanes):
            lane = (self.next_lane + k) % self.lanes
            if not self.done[lane]:
                return lane
        raise AssertionError("every lane ended")

    def _take(self, chunk: dict[str, Any]) -> None:
        lane = chunk["lane"]
        self.lane_states[lane] = chunk["state"]
        self.done[lane] = chunk["done"]
        self.next_lane = (lane + 1) % self.lanes
        for row in chunk["rows"]:
            self.pending.extend(self.buffer.push(row) if self.buffer is not None else [row])
        if self.buffer is not None and all(self.done):
            self.pending.extend(self.buffer.drain())

    def __iter__(self) -> Iterator[Any]:
        if self._exhausted():
            self.epoch += 1
            self._start_epoch()
        # worker base seeds from our own generator: creating the iterator draws nothing from the global RNG
        self._generator.manual_seed(mix_ints(self.seed, self.epoch, 0x57EA) >> 1)
        kwargs = dict(self._kwargs)
        kwargs["worker_init_fn"] = _WorkerInit(kwargs.get("worker_init_fn"))
        lanes = _Lanes(self.dataset, self.is_hf, self.lanes, self.next_lane, list(self.lane_states),
                       list(self.done), self.chunk, self.epoch)
        loader = DataLoader(lanes, batch_size=None, num_workers=self.num_workers, collate_fn=_identity,
                            generator=self._generator, **kwargs)
        born = self._restores
        chunks = iter(loader) if not all(self.done) else iter(())
        held: dict[int, deque[dict[str, Any]]] = {lane: deque() for lane in range(self.lanes)}
        while True:
            while len(self.pending) >= self.batch_size or (self.pending and all(self.done) and not self.drop_last
                                                          and not (self.buffer and self.buffer.items)):
                rows, self.pending = self.pending[:self.batch_size], self.pending[self.batch_size:]
                self.samples_seen += len(rows)
                yield self.collate_fn(rows)
                if self._restores != born:
                    raise RuntimeError(
                        "this iterator of the StreamLoader was started before restore() loaded a new position: it "
                        "would serve the old stream. Create the iterator after restore() (`for batch in loader:` "
                        "inside the training loop).")
            if all(self.done):
                return
            want = self._expected()
            while not held[want]:
                try:
                    chunk: dict[str, Any] = next(chunks)
                except StopIteration:
                    raise RuntimeError(f"lane {want} of the stream ended without its end marker (a worker stopped "
                                       "early)") from None
                held[chunk["lane"]].append(chunk)
            self._take(held[want].popleft())

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "samples_seen": self.samples_seen, "lanes": self.lanes, "chunk": self.chunk,
                "rank": self.rank, "world_size": self.world_size, "next_lane": self.next_lane,
                "lane_states": list(self.lane_states), "done": list(self.done), "pending": list(self.pending),
                "buffer": self.buffer.state_dict() if self.buffer is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state["lanes"]) != self.lanes:
            raise ValueError(
                f"the checkpoint's stream was read by {state['lanes']} worker lane(s), this loader has {self.lanes} "
                f"(num_workers={self.num_workers}): each lane's position belongs to its shards, so the worker count "
                "of a stream cannot change across a resume. "
                f"Use num_workers={state['lanes'] if state['lanes'] > 1 else 0}.")
        if (int(state["rank"]), int(state["world_size"])) != (self.rank, self.world_size):
            per_rank = " Put it in the state as unbroken.PerRank(loader): a stream's position differs from rank to " \
                       "rank." if int(state["world_size"]) == self.world_size else ""
            raise ValueError(
                f"the checkpoint's stream position is rank {state['rank']} of {state['world_size']}'s, this loader "
                f"reads rank {self.rank} of {self.world_size}'s part of the stream.{per_rank} A stream's ranks read "
                "different shards, so the world size cannot change across a resume.")
        saved = state["buffer"]
        if (saved is None) != (self.buffer_size == 0) or (saved is not None and saved["size"] != self.buffer_size):
            raise ValueError(f"the checkpoint's shuffle buffer size is {0 if saved is None else saved['size']}, this "
                             f"loader's {self.buffer_size}: keep the buffer size across a resume")
        if self.is_hf:
            for index, lane_state in enumerate(state["lane_states"]):
                hf.check_state(self.dataset, self.lanes, index, lane_state)
        self.epoch, self.samples_seen = int(state["epoch"]), int(state["samples_seen"])
        self._start_epoch()
        self.chunk, self.next_lane = int(state["chunk"]), int(state["next_lane"])
        self.lane_states, self.done = list(state["lane_states"]), [bool(d) for d in state["done"]]
        self.pending = list(state["pending"])
        if self.buffer is not None:
            self.buffer.load_state_dict(saved)
        self._restores += 1
