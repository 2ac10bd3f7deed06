"""What :class:`~unbroken.data.StreamLoader` needs of a Hugging Face ``datasets.IterableDataset``.

Every use of ``datasets``' private structure is here, so a change in a ``datasets`` release
shows up in one module (tested with datasets 5.2). ``datasets`` is never imported by this
module: a stream is recognized by its type's module.

* **The shuffle buffer.** ``ds.shuffle(seed=..., buffer_size=...)`` ends the stream's pipeline
  with a ``BufferShuffledExamplesIterable``. Its ``state_dict()`` holds only the position of
  the stream *below* the buffer: the examples in the buffer, and its random generator, are not
  saved ("examples from shuffle buffers are lost when resuming", its docstring), so a resumed
  run refills the buffer and yields other examples (measured in ``tests/test_data_hf.py``).
  :func:`take_buffer` takes that last node off the pipeline and hands its size and generator
  to :class:`~unbroken.data.buffer.ShuffleBuffer`, which runs the same algorithm in the
  training process and saves its contents. The shard shuffling below it stays in ``datasets``.
* **Lanes.** A ``DataLoader`` worker running a ``datasets`` stream splits it by
  ``torch.utils.data.get_worker_info()`` and loads the saved state into the unsplit pipeline
  first, which fails for a shuffled stream (an ``IndexError`` in datasets 5.2: the split
  pipeline interleaves fewer shards than the unsplit one). So each worker reads its own *lane*,
  ``ds.shard(num_workers, worker, contiguous=False)`` (the shards ``datasets`` would give that
  worker), through ``ds.iter(batch_size=...)``, which never splits by worker: the state it
  loads and the state it reports belong to the same pipeline.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

_BUFFER = "BufferShuffledExamplesIterable"


def is_hf_stream(obj: Any) -> bool:
    """True for a ``datasets.IterableDataset`` (without importing ``datasets``)."""
    return any(c.__module__.startswith("datasets.") and c.__name__ == "IterableDataset" for c in type(obj).__mro__)


def _nodes(node: Any) -> Iterator[Any]:
    """The pipeline's nodes below ``node``, depth first."""
    yield node
    for child in ([node.ex_iterable] if hasattr(node, "ex_iterable") else []) + list(getattr(node, "ex_iterables", [])):
        yield from _nodes(child)


def _rebuild(ds: Any, pipeline: Any) -> Any:
    """A new stream like ``ds`` (format, split by node) over ``pipeline``, as ``datasets``' own
    methods build one (its epoch counter is its own: ``set_epoch`` on it changes nothing of ``ds``)."""
    return type(ds)(pipeline, info=ds._info.copy(), split=ds._split, formatting=ds._formatting,
                    distributed=copy.deepcopy(ds._distributed), token_per_repo_id=ds._token_per_repo_id)


def take_buffer(ds: Any) -> tuple[Any, int, Any]:
    """``(stream without its final shuffle buffer, buffer_size, generator)``, or ``(ds, 0, None)``
    when it has none. A buffer anywhere but at the end of the pipeline is refused: the
    operations after it would have to move before it."""
    top = ds._ex_iterable
    if type(top).__name__ == _BUFFER:
        return _rebuild(ds, top.ex_iterable), int(top.buffer_size), copy.deepcopy(top.generator)
    if any(type(n).__name__ == _BUFFER for n in _nodes(top)):
        raise ValueError(
            "this datasets stream shuffles through a buffer followed by other operations (.map, .filter, ...): "
            "datasets does not save a buffer's examples, so its position cannot be resumed exactly. Make "
            ".shuffle(seed=..., buffer_size=...) the last operation of the pipeline (after .map/.filter; the "
            "examples are the same), and StreamLoader saves the buffer with the checkpoint.")
    return ds, 0, None


def node(ds: Any) -> tuple[int, int] | None:
    """``(rank, world_size)`` given to ``datasets.distributed.split_dataset_by_node``, or None."""
    d = ds._distributed
    return None if d is None else (int(d.rank), int(d.world_size))


def lane(ds: Any, lanes: int, index: int) -> Any:
    """The part of ``ds`` a ``DataLoader`` worker ``index`` of ``lanes`` would read: every
    ``lanes``-th shard from ``index`` (a new object: reading it changes nothing of ``ds``)."""
    if lanes == 1:
        return _rebuild(ds, ds._ex_iterable)
    return ds.shard(num_shards=lanes, index=index, contiguous=False)


def chunks(ds: Any, size: int) -> Iterator[tuple[list[Any], Any]]:
    """``(examples, state after them)`` for each run of up to ``size`` examples of ``ds``
    (the state is ``ds.state_dict()``, which ``ds.load_state_dict`` resumes after them)."""
    for batch in ds.iter(batch_size=size):
        columns = list(batch)
        n = len(batch[columns[0]]) if columns else 0
        yield [{c: batch[c][i] for c in columns} for i in range(n)], ds.state_dict()


def _fits(live: Any, saved: Any) -> bool:
    """Whether ``saved`` has the shape of ``live`` (dict keys, list lengths, node ``type`` names);
    ``None`` fits anything (a reader not started yet)."""
    if live is None or saved is None:
        return True
    if isinstance(live, dict) and isinstance(saved, dict):
        return live.keys() == saved.keys() and live.get("type") == saved.get("type") and \
            all(_fits(live[k], saved[k]) for k in live)
    if isinstance(live, list) and isinstance(saved, list):
        return len(live) == len(saved) and all(map(_fits, live, saved))
    return not isinstance(live, (dict, list)) and not isinstance(saved, (dict, list))


def check_state(ds: Any, lanes: int, index: int, saved: Any) -> None:
    """Refuse a lane state saved by another pipeline (sources or operations added or removed):
    ``datasets`` would fail later in a worker, or read the state into the wrong places."""
    if saved is not None and not _fits(lane(ds, lanes, index).state_dict(), saved):
        raise ValueError(
            "the checkpoint's stream position was saved by another pipeline (its state has another shape: sources "
            "of interleave_datasets, shards or operations were added or removed), so it cannot be resumed here. "
            "Keep the pipeline across a resume; for sources that change, use unbroken.data.Mixture over map-style "
            "datasets, whose rule for added sources and changed weights is documented.")
