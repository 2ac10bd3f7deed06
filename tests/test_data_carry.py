"""Collators that carry examples over between batches: ``Packer`` and any ``Carrier`` (a bucketing
collator here) through ``CarryOver``, resumed at every output batch (the kill is in test_data_e2e.py)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch.utils.data import Dataset

import unbroken
import unbroken.data as ud

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


class Docs(Dataset):
    """Token sequences of 1 to 9 tokens; token values say (document, position)."""

    def __len__(self) -> int:
        return 40

    def __getitem__(self, i):
        n = 1 + (int(i) * 7) % 9
        return {"input_ids": [100 * int(i) + t for t in range(n)], "id": int(i)}


class Buckets:
    """A user's bucketing collator: examples wait in a bucket by length until ``size`` share one."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.buckets: dict[str, list[int]] = {"short": [], "long": []}

    def __call__(self, examples):
        out = []
        for ex in examples:
            bucket = self.buckets["short" if len(ex["input_ids"]) < 5 else "long"]
            bucket.append(ex["id"])
            if len(bucket) == self.size:
                out.append(torch.tensor(bucket))
                bucket.clear()
        return out

    def state_dict(self):
        return {k: list(v) for k, v in self.buckets.items()}

    def load_state_dict(self, state):
        self.buckets = {k: list(v) for k, v in state.items()}


def packed(workers: int = 0, collator=None) -> ud.CarryOver:
    loader = ud.ResumableLoader(Docs(), batch_size=3, shuffle=True, seed=1, num_workers=workers, collate_fn=list)
    return ud.CarryOver(loader, collator or ud.Packer(seq_len=6, batch_size=2, eos=-1))


def flat(batches) -> list:
    return [b["input_ids"].tolist() if isinstance(b, dict) else b.tolist() for b in batches]


def test_packer_rows_and_positions() -> None:
    p = ud.Packer(seq_len=4, batch_size=2, eos=0)
    assert p([[5, 6, 7]]) == [] and p.tokens == [5, 6, 7, 0]
    (b,) = p([{"input_ids": torch.tensor([8, 9, 10, 11, 12])}, [13]])
    assert b["input_ids"].tolist() == [[5, 6, 7, 0], [8, 9, 10, 11]]
    assert b["position_ids"].tolist() == [[0, 1, 2, 3], [0, 1, 2, 3]]
    assert p.tokens == [12, 0, 13, 0] and p.positions == [4, 5, 0, 1]  # carried: a document continues
    with pytest.raises(ValueError, match="shape"):
        ud.Packer(seq_len=5, batch_size=2).load_state_dict(p.state_dict())


@pytest.mark.parametrize("change,message", [
    ({"tokens": torch.arange(8.0)}, "not two integer vectors"),  # floats
    ({"tokens": torch.arange(9)}, "not two integer vectors"),  # a batch's worth or more: never carried
    ({"positions": torch.tensor([4, 5, -1, 1])}, "positions from 0"),
    ({"tokens": [12, 0, 13, 0]}, "not two integer vectors"),  # a list, not a tensor
    ({"seq_len": "4"}, r"seq_len is '4' \(str\), not an integer"),
])
def test_packer_refuses_a_crafted_carry(change: dict, message: str) -> None:
    """What a packer carries is checked at restore (issue 33 §5): a clear error naming what is wrong,
    the packer unchanged (before: a float token went through int(), a list raised AttributeError)."""
    p = ud.Packer(seq_len=4, batch_size=2, eos=0)
    p([[5, 6, 7], [8, 9, 10, 11, 12], [13]])
    state = p.state_dict() | change
    q = ud.Packer(seq_len=4, batch_size=2, eos=0)
    with pytest.raises(ValueError, match=message):
        q.load_state_dict(state)
    assert q.tokens == [] and q.positions == []


def test_shuffle_buffer_refuses_a_crafted_state() -> None:
    import numpy as np

    from unbroken.data.buffer import ShuffleBuffer

    b = ShuffleBuffer(4, np.random.default_rng(0))
    for i in range(3):
        b.push(i)
    state = b.state_dict()
    with pytest.raises(ValueError, match="not a list of at most 4 examples"):
        ShuffleBuffer(4, np.random.default_rng(0)).load_state_dict(state | {"items": list(range(10**6))})
    with pytest.raises(ValueError, match=r"size is 4.5 \(float\), not an integer"):
        ShuffleBuffer(4, np.random.default_rng(0)).load_state_dict(state | {"size": 4.5})


@pytest.mark.parametrize("collator", ["packer", "buckets"])
def test_carry_over_resumes_at_every_output_batch(collator: str) -> None:
    make = lambda w=0: packed(w, Buckets(3) if collator == "buckets" else None)  # noqa: E731
    ref = flat(make())
    assert ref and flat(make(2)) == ref
    carried = 0
    for k in range(len(ref)):
        first = make()
        it = iter(first)
        head = [next(it) for _ in range(k)]
        state = copy.deepcopy(first.state_dict())
        carried += bool(state["collator"]["tokens"].numel() if collator == "packer"
                        else any(state["collator"].values()))
        second = make(2 if k % 2 else 0)
        second.load_state_dict(state)
        assert flat(head) + flat(second) == ref, k
    assert carried > len(ref) // 2  # most resume points had examples carried over


def test_restoring_the_loader_alone_loses_the_carry() -> None:
    """The negative control: without the collator's carry the resumed batches differ."""
    ref = flat(packed())
    first = packed()
    it = iter(first)
    head = [next(it) for _ in range(4)]
    second = packed()
    second.loader.load_state_dict(first.loader.state_dict())  # the position, not the carry
    assert flat(head) + flat(second) != ref


def test_carry_over_goes_through_a_real_checkpoint_and_continues_across_epochs(tmp_path: Path) -> None:
    two = packed()
    ref = flat(two) + flat(two)  # two passes: the carry continues into the next epoch
    first = packed()
    head = flat(first)
    it = iter(first)
    head += [b["input_ids"].tolist() for b in (next(it) for _ in range(3))]
    assert first.collator.tokens
    unbroken.save(tmp_path / "ckpt", {"data": first})
    second = packed()
    unbroken.load(tmp_path / "ckpt", {"data": second})
    assert head + flat(second) == ref
    it = iter(second)
    next(it)  # an iterator started before a restore serves the old position: refused
    second.load_state_dict(first.state_dict())
    with pytest.raises(RuntimeError, match="after restore"):
        next(it)
    with pytest.raises(TypeError, match="state_dict"):
        ud.CarryOver(torch.utils.data.DataLoader(Docs()), ud.Packer(4, 1))
