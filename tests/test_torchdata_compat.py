"""torchdata's ``StatefulDataLoader`` in an unbroken checkpoint (torchdata 0.11).

The loader is put in the state as is: unbroken saves its ``state_dict()`` pickle-free
(ints, bools, ``None``, and the sampler's generator state as a uint8 tensor) and
restores it through ``load_state_dict``. Also recorded here, as torchdata behaves,
not as unbroken would like:

* the saved state only works with the same ``num_workers``: 0 <-> N cannot even be
  read, and N -> M (M != N) fails an ``assert`` on the worker count. The error comes
  at ``iter()``, not at ``load_state_dict`` (so not inside ``Checkpointer.restore``);
* with ``num_workers=0`` the remainder of the epoch is exact, but the *next* epoch
  differs from the uninterrupted run's: the restore resets the generator to the
  epoch's start and redraws the permutation, losing the ``_base_seed`` draw the
  iterator had made from the same generator (with workers ``_base_seed`` is saved);
* ``num_workers=0`` and ``num_workers>0`` give different orders for the same
  generator (plain ``torch.utils.data.DataLoader`` gives the same order).
"""

from __future__ import annotations

import gc
import sys

import pytest
import torch

import unbroken

from torchdata.stateful_dataloader import StatefulDataLoader  # the test extra: missing fails, not skips

pytestmark = [
    pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning"),
    pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning"),
]

N, BATCH, SEED = 100, 4, 7


class Numbers(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i, i * i])


def make(num_workers: int) -> StatefulDataLoader:
    return StatefulDataLoader(Numbers(), batch_size=BATCH, shuffle=True,
                              generator=torch.Generator().manual_seed(SEED), num_workers=num_workers)


def epoch(loader) -> list[list[int]]:
    return [b[:, 0].tolist() for b in loader]


def interrupted(run, num_workers: int, consumed: int) -> None:
    """Take ``consumed`` batches, then save the loader through a Checkpointer."""
    loader = make(num_workers)
    it = iter(loader)
    for _ in range(consumed):
        next(it)
    with unbroken.Checkpointer(run, rng=False) as ckpt:
        ckpt.save({"data": loader})
    del it


def restore(run, loader) -> None:
    """What a new process does: a fresh Checkpointer restores into a fresh loader."""
    with unbroken.Checkpointer(run, rng=False) as ckpt:
        assert ckpt.restore({"data": loader}) is not None


def equal_trees(a, b) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(equal_trees(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return type(a) is type(b) and a == b


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("consumed", [1, 3, 17, 24])
def test_resumed_stream_is_the_uninterrupted_remainder(tmp_path, num_workers, consumed):
    full = epoch(make(num_workers))
    assert len(full) == N // BATCH
    interrupted(tmp_path / "run", num_workers, consumed)

    resumed = make(num_workers)
    restore(tmp_path / "run", resumed)
    assert epoch(resumed) == full[consumed:]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_state_dict_round_trips_exactly(tmp_path, num_workers):
    loader = make(num_workers)
    it = iter(loader)
    for _ in range(5):
        next(it)
    saved = loader.state_dict()
    unbroken.save(tmp_path / "c", {"data": loader})
    del it

    got = {}

    class Probe:  # receives exactly what unbroken hands to load_state_dict
        def state_dict(self):
            return {}

        def load_state_dict(self, sd):
            got.update(sd)

    unbroken.load(tmp_path / "c", {"data": Probe()})
    assert equal_trees(saved, got)


def test_next_epoch_after_resume(tmp_path):
    """With workers the epoch after the resumed one matches too; with 0 it does not."""
    for num_workers, same in ((2, True), (0, False)):
        ref = make(num_workers)
        _, second = epoch(ref), epoch(ref)
        interrupted(tmp_path / str(num_workers), num_workers, 3)
        resumed = make(num_workers)
        restore(tmp_path / str(num_workers), resumed)
        epoch(resumed)
        # num_workers=0, torchdata 0.11: the restored generator misses one int64 draw
        # (the iterator's _base_seed), so the next permutation is a different one.
        # If this starts failing for 0, torchdata fixed it: flip `same`.
        assert (epoch(resumed) == second) is same, num_workers


@pytest.mark.skipif(sys.flags.optimize > 0, reason="torchdata checks this with assert statements")
@pytest.mark.parametrize("saved_with, resumed_with, message", [
    (2, 0, "State doesn't contain key '_num_yielded' expected for single process dataloader"),
    (0, 2, "State doesn't contain key '_snapshot' expected for multiprocess dataloader"),
    (2, 4, ""),  # a bare `assert self._num_workers == state_dict["_num_workers"]`
])
def test_worker_count_must_not_change(tmp_path, saved_with, resumed_with, message):
    interrupted(tmp_path / "run", saved_with, 3)
    resumed = make(resumed_with)
    restore(tmp_path / "run", resumed)  # accepted: load_state_dict only stores the state
    with pytest.raises(AssertionError) as err:
        iter(resumed)
    assert str(err.value) == message
    # 2 -> 4 starts its workers before the assert. The half-built iterator lives on in
    # the traceback, and its __del__, whenever a later gc gets to it, joins the
    # workers with a 5 s timeout each: shut them down now instead.
    tb = err.tb
    while tb is not None:
        it = tb.tb_frame.f_locals.get("self")
        if hasattr(it, "_shutdown_workers"):
            it._shutdown_workers()
        tb = tb.tb_next
    del err, tb, it
    gc.collect()
