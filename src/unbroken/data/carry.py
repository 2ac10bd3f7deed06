"""Collators that carry examples over from batch to batch (packing, bucketing), saved with the
data position.

A packing collator joins the token sequences of several examples into fixed-length rows; what
does not fill a row waits for the next batch. A bucketing collator holds examples by length
until a bucket fills. Either holds examples the loader has already counted as consumed, so a
resume that restores only the loader's position loses them (and one that replays would repeat
others). :class:`CarryOver` runs such a collator in the training process, after the loader, and
saves three things together: the loader's position, the collator's own ``state_dict()`` (what it
carries) and the output batches it produced that the loop has not taken yet.

A collator for :class:`CarryOver` is any object with ``__call__(batch) -> list of output
batches`` (zero or more: what this input completes), ``state_dict()`` and
``load_state_dict()`` (:class:`Carrier`). :class:`Packer` is one.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Protocol, runtime_checkable

import torch

from .checked import count


@runtime_checkable
class Carrier(Protocol):
    """A collator with a carry: takes one loader batch, returns the output batches it completes."""

    def __call__(self, batch: Any) -> list[Any]: ...

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> Any: ...


class CarryOver:
    """Batches of ``collator`` over ``loader``'s batches, resumable at the sample.

    Put it in the state instead of the loader (``state["data"] = CarryOver(loader, Packer(...))``).
    Iterating takes the loader's next pass (the rest of its epoch) and yields what the collator
    completes; output batches already made are yielded first.

    Args:
        loader: a resumable loader (:class:`~unbroken.data.ResumableLoader`,
            :class:`~unbroken.data.StreamLoader`, ...) whose batches the collator takes; give it
            ``collate_fn=list`` for a collator that takes lists of examples.
        collator: a :class:`Carrier`, e.g. :class:`Packer`.
    """

    def __init__(self, loader: Any, collator: Carrier) -> None:
        for obj, what in ((loader, "loader"), (collator, "collator")):
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                hint = " (use unbroken.data.ResumableLoader or StreamLoader)" if what == "loader" else ""
                raise TypeError(f"CarryOver's {what} needs state_dict()/load_state_dict(); {type(obj).__name__} has "
                                f"not{hint}")
        self.loader, self.collator = loader, collator
        self.ready: list[Any] = []
        self._restores = 0

    def __iter__(self) -> Iterator[Any]:
        born = self._restores
        for batch in self._batches():
            yield batch
            if self._restores != born:
                raise RuntimeError("this iterator of the CarryOver was started before restore() loaded a new "
                                   "position: create it after restore() (`for batch in data:` in the training loop)")

    def _batches(self) -> Iterator[Any]:
        while self.ready:
            yield self.ready.pop(0)
        for batch in self.loader:
            self.ready = list(self.collator(batch))
            while self.ready:
                yield self.ready.pop(0)

    def state_dict(self) -> dict[str, Any]:
        return {"loader": self.loader.state_dict(), "collator": self.collator.state_dict(), "ready": list(self.ready)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.loader.load_state_dict(state["loader"])
        self.collator.load_state_dict(state["collator"])
        self.ready = list(state["ready"])
        self._restores += 1


class Packer:
    """Packs token sequences into batches of ``batch_size`` rows of ``seq_len`` tokens.

    The examples' tokens are joined in order (``eos`` appended to each, if given) and cut into
    rows; a sequence longer than what is left of a row continues on the next row. Each output
    batch is ``{"input_ids": (batch_size, seq_len) int64, "position_ids": same shape}``, the
    positions counting from 0 at each example's start (for attention that must not cross
    examples, as HF's ``DataCollatorWithFlattening`` does). The tokens that do not fill a batch
    are carried to the next call, and saved with the checkpoint.

    Args:
        seq_len, batch_size: the shape of each output batch.
        key: where an example (a mapping) keeps its tokens; an example may also be the token
            sequence itself (a list, tuple or 1-d tensor of ints).
        eos: a token appended after each example, or None.
    """

    def __init__(self, seq_len: int, batch_size: int, *, key: str = "input_ids", eos: int | None = None) -> None:
        if seq_len < 1 or batch_size < 1:
            raise ValueError("seq_len and batch_size must be at least 1")
        self.seq_len, self.batch_size, self.key, self.eos = seq_len, batch_size, key, eos
        self.tokens: list[int] = []
        self.positions: list[int] = []

    def __call__(self, examples: Any) -> list[dict[str, torch.Tensor]]:
        for ex in examples:
            seq = ex[self.key] if isinstance(ex, Mapping) else ex
            toks = seq.tolist() if isinstance(seq, torch.Tensor) else [int(t) for t in seq]
            if self.eos is not None:
                toks.append(self.eos)
            self.tokens.extend(toks)
            self.positions.extend(range(len(toks)))
        out, size = [], self.seq_len * self.batch_size
        while len(self.tokens) >= size:
            shape = (self.batch_size, self.seq_len)
            out.append({"input_ids": torch.tensor(self.tokens[:size], dtype=torch.int64).view(shape),
                        "position_ids": torch.tensor(self.positions[:size], dtype=torch.int64).view(shape)})
            del self.tokens[:size], self.positions[:size]
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"seq_len": self.seq_len, "batch_size": self.batch_size,
                "tokens": torch.tensor(self.tokens, dtype=torch.int64),
                "positions": torch.tensor(self.positions, dtype=torch.int64)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        shape = (count(state, "seq_len", "packer", lo=1), count(state, "batch_size", "packer", lo=1))
        if shape != (self.seq_len, self.batch_size):
            raise ValueError(f"the checkpoint's packer made ({state['batch_size']}, {state['seq_len']}) batches, "
                             f"this one ({self.batch_size}, {self.seq_len}): keep the shape across a resume")
        tokens, positions = state.get("tokens"), state.get("positions")
        if not isinstance(tokens, torch.Tensor) or not isinstance(positions, torch.Tensor) \
                or not all(t.dim() == 1 and not t.is_floating_point() for t in (tokens, positions)) \
                or tokens.numel() != positions.numel() or tokens.numel() >= self.seq_len * self.batch_size \
                or (positions.numel() and int(positions.min()) < 0):
            raise ValueError("the checkpoint's packer carries tokens and positions that are not two integer vectors "
                             f"of one length under a batch ({self.batch_size} x {self.seq_len}), positions from 0: the "
                             "checkpoint is damaged or was not written by this packer")
        self.tokens = [int(t) for t in tokens.tolist()]
        self.positions = [int(t) for t in positions.tolist()]
