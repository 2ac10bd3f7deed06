"""``ResumableLoader(order="dataloader" | "epoch_seeded")``: the order and the global-RNG draws of torch's
and Accelerate's own loaders, so that replacing them changes nothing of an uninterrupted run, and a resume
at any position (mid-epoch, at an epoch's end, with workers) is still that run.

Each comparison runs the framework's loader and unbroken's from the same global RNG state, draws from the
global RNG after every batch (as dropout would) and compares the batches, those draws and the final RNG
state bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from unbroken.data import ResumableLoader

DATA = list(range(23))


class Noisy(Dataset):
    """Samples that draw from the global RNG in the main process (a random transform), not in workers."""

    def __len__(self) -> int:
        return 19

    def __getitem__(self, i: int) -> torch.Tensor:
        inside_worker = torch.utils.data.get_worker_info() is not None
        return torch.tensor([int(i), 0 if inside_worker else int(torch.randint(0, 10**6, ()))])


def consume(loader: Iterable[Any], epochs: int, before_epoch: Callable[[int], None] = lambda e: None) -> list:
    """Every batch and one global draw after it (dropout's), over ``epochs`` epochs."""
    out = []
    for epoch in range(epochs):
        before_epoch(epoch)
        for batch in loader:
            out.append((batch.tolist(), torch.rand(1).item()))
    return out


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("shuffle,batch,drop_last", [(True, 4, False), (True, 4, True), (True, 5, False),
                                                     (False, 4, False)])
def test_order_dataloader_is_torchs_dataloader_bitwise(shuffle: bool, batch: int, drop_last: bool,
                                                       workers: int) -> None:
    torch.manual_seed(7)
    theirs = consume(DataLoader(DATA, batch_size=batch, shuffle=shuffle, drop_last=drop_last,
                                num_workers=workers), 3)
    rng = torch.get_rng_state()
    torch.manual_seed(7)
    ours = consume(ResumableLoader(DATA, batch_size=batch, shuffle=shuffle, drop_last=drop_last,
                                   num_workers=workers, order="dataloader"), 3)
    assert ours == theirs
    assert torch.equal(torch.get_rng_state(), rng)
    # the default order draws nothing from the global RNG: there the draws after the batches differ
    torch.manual_seed(7)
    default = consume(ResumableLoader(DATA, batch_size=batch, shuffle=shuffle, drop_last=drop_last), 3)
    assert [d for _, d in default] != [d for _, d in theirs]


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("shuffle,drop_last", [(True, False), (True, True), (False, False)])
def test_order_epoch_seeded_is_accelerates_seedable_sampler_on_every_rank(world: int, shuffle: bool,
                                                                          drop_last: bool) -> None:
    """Accelerate's ``prepare_data_loader`` with ``use_seedable_sampler`` (the HF Trainer's loader), each
    process of ``world``: the same batches (the last global batch padded from the epoch's start or dropped,
    as ``BatchSamplerShard`` does) and the same global draws."""
    from accelerate.data_loader import prepare_data_loader
    from accelerate.state import PartialState

    PartialState()
    for rank in range(world):
        torch.manual_seed(11)
        base = DataLoader(DATA, batch_size=4, shuffle=shuffle, drop_last=drop_last)
        theirs_loader = prepare_data_loader(base, num_processes=world, process_index=rank, use_seedable_sampler=True,
                                            data_seed=42, put_on_device=False)
        theirs = consume(theirs_loader, 3, theirs_loader.set_epoch)
        rng = torch.get_rng_state()
        torch.manual_seed(11)
        ours = consume(ResumableLoader(DATA, batch_size=4, shuffle=shuffle, drop_last=drop_last, rank=rank,
                                       world_size=world, order="epoch_seeded", seed=42), 3)
        assert ours == theirs, (rank, world)
        assert torch.equal(torch.get_rng_state(), rng)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("order", ["dataloader", "epoch_seeded"])
def test_a_resume_at_any_batch_draws_nothing_again_and_goes_on_bitwise(order: str, workers: int) -> None:
    """Saved after every batch of three epochs (so also at each epoch's last batch, before the next epoch's
    draws), restored into a new loader with the RNG of that moment: the rest is the uninterrupted run's."""
    def make() -> ResumableLoader:
        return ResumableLoader(Noisy(), batch_size=3, shuffle=True, num_workers=workers, order=order, seed=5)

    torch.manual_seed(3)
    loader, full, saved = make(), [], []
    for _ in range(3):
        for batch in loader:
            full.append((batch.tolist(), torch.rand(1).item()))
            saved.append((loader.state_dict(), torch.get_rng_state()))
    for cut in range(1, len(full)):
        state, rng = saved[cut - 1]
        resumed = make()
        resumed.load_state_dict(state)
        torch.set_rng_state(rng)
        rest: list = []
        while len(rest) < len(full) - cut:
            rest += [(b.tolist(), torch.rand(1).item()) for b in resumed]
        assert rest == full[cut:], cut


def test_persistent_workers_draw_the_base_seed_once_as_torch_does() -> None:
    torch.manual_seed(5)
    theirs = consume(DataLoader(DATA, batch_size=4, shuffle=True, num_workers=1, persistent_workers=True), 3)
    rng = torch.get_rng_state()
    torch.manual_seed(5)
    ours = consume(ResumableLoader(DATA, batch_size=4, shuffle=True, num_workers=1, persistent_workers=True,
                                   order="dataloader"), 3)
    assert ours == theirs and torch.equal(torch.get_rng_state(), rng)


def test_what_the_torch_orders_cannot_do_is_refused_clearly() -> None:
    with pytest.raises(ValueError, match="order must be one of"):
        ResumableLoader(DATA, order="random")
    with pytest.raises(ValueError, match="continuous=True needs the next epoch's order"):
        ResumableLoader(DATA, batch_size=4, shuffle=True, continuous=True, order="dataloader")
    saved = ResumableLoader(DATA, batch_size=4, shuffle=True, order="epoch_seeded").state_dict()
    with pytest.raises(ValueError, match="order='epoch_seeded', this one with order='unbroken'"):
        ResumableLoader(DATA, batch_size=4, shuffle=True).load_state_dict(saved)
    old = ResumableLoader(DATA, batch_size=4, shuffle=True).state_dict()  # a checkpoint from before the option
    with pytest.raises(ValueError, match="order='unbroken', this one with order='dataloader'"):
        ResumableLoader(DATA, batch_size=4, shuffle=True, order="dataloader").load_state_dict(old)


def test_an_integration_that_chose_the_order_resumes_a_run_saved_in_another_in_that_one() -> None:
    """The HF integration picks the Trainer's order (``adopts_saved_order``): a run saved by an earlier
    version, in unbroken's default order, goes on in that order (with a warning), batch for batch."""
    old = ResumableLoader(DATA, batch_size=4, shuffle=True, seed=7)
    first = next(iter(old))
    saved = old.state_dict()
    want = [b.tolist() for b in old]
    new = ResumableLoader(DATA, batch_size=4, shuffle=True, seed=3, order="epoch_seeded")
    new.adopts_saved_order = True
    with pytest.warns(UserWarning, match="saved with the data order 'unbroken' \\(seed 7\\): it goes on in that"):
        new.load_state_dict(saved)
    assert [b.tolist() for b in new] == want and first.tolist() not in want
    # a refused state changes nothing: the loader keeps the order it had
    other = ResumableLoader(DATA, batch_size=4, shuffle=True, seed=3, order="epoch_seeded")
    other.adopts_saved_order = True
    with pytest.raises(ValueError, match="differs from this loader's"):
        other.load_state_dict({**saved, "n": 99})
    assert other.order.mode == "epoch_seeded" and other.seed == 3


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("shuffle,batch,drop_last", [(True, 4, False), (True, 3, True), (False, 4, False)])
def test_order_distributed_is_a_dataloader_over_distributed_sampler_on_every_rank(
        world: int, shuffle: bool, batch: int, drop_last: bool) -> None:
    """What Lightning builds with several devices: ``DataLoader(ds, batch_size, drop_last, sampler=
    DistributedSampler(ds, world, rank, shuffle=..., seed=S))`` with ``set_epoch`` each epoch. The same
    batches on each rank (the permutation padded from its start, dealt in turn, a short or dropped last
    batch), the same global draws; and a resume at every batch goes on with the same batches."""
    from torch.utils.data.distributed import DistributedSampler

    for rank in range(world):
        torch.manual_seed(11)
        sampler = DistributedSampler(DATA, num_replicas=world, rank=rank, shuffle=shuffle, seed=42)
        theirs_loader = DataLoader(DATA, batch_size=batch, drop_last=drop_last, sampler=sampler)
        theirs = consume(theirs_loader, 3, sampler.set_epoch)
        rng = torch.get_rng_state()

        def make(rank: int = rank) -> ResumableLoader:
            return ResumableLoader(DATA, batch_size=batch, shuffle=shuffle, drop_last=drop_last, rank=rank,
                                   world_size=world, order="distributed", seed=42)

        torch.manual_seed(11)
        loader = make()
        assert len(loader) == len(theirs_loader)
        ours, saved = [], []
        for _ in range(3):
            for b in loader:
                ours.append((b.tolist(), torch.rand(1).item()))
                saved.append((loader.state_dict(), torch.get_rng_state()))
        assert ours == theirs, (rank, world)
        assert torch.equal(torch.get_rng_state(), rng)
        for cut in (1, len(ours) // 2, len(ours) - 1):
            state, at = saved[cut - 1]
            resumed = make()
            resumed.load_state_dict(state)
            torch.set_rng_state(at)
            rest: list = []
            while len(rest) < len(ours) - cut:
                rest += [(b.tolist(), torch.rand(1).item()) for b in resumed]
            assert rest == ours[cut:], (rank, cut)
