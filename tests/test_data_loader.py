"""``unbroken.data.ResumableLoader``: the data position is exact, O(1) to restore and
independent of ``num_workers`` and of the world size.

The dataset below draws a random augmentation from ``i.generator()``, so comparing the
augmented tensors bitwise checks the per-sample randomness as well as the order. Ranks
are simulated in one process: ``world_size`` loaders with ``rank=0..W-1`` iterated in
lockstep, one batch from each rank per global step; the expected global stream is
taken from :class:`GlobalOrder` directly. Multi-worker loaders are few (worker start-up
costs ~0.3 s each).
"""

from __future__ import annotations

import gc
import json
from collections import Counter
import random
import warnings
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset

import unbroken
from unbroken.data import GlobalOrder, ResumableLoader, SampleIndex

N, B, SEED = 37, 4, 1234


class AugDataset(Dataset):
    """Returns (index, augmented sample); the augmentation comes from i.generator()."""

    def __init__(self, n: int = N) -> None:
        self.n = n
        self.base = torch.arange(n * 3, dtype=torch.float32).view(n, 3)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: SampleIndex) -> tuple[int, torch.Tensor]:
        assert isinstance(i, SampleIndex), type(i)
        g = i.generator()
        x = self.base[i] + torch.randn(3, generator=g)  # noise
        if torch.rand((), generator=g) < 0.5:  # random flip
            x = x.flip(0)
        return int(i), x


def expected_sample(ds: AugDataset, index: int, epoch: int) -> torch.Tensor:
    return ds[SampleIndex(index, SEED, epoch)][1]


def make(n: int = N, batch_size: int = B, **kw: Any) -> ResumableLoader:
    kw.setdefault("seed", SEED)
    kw.setdefault("shuffle", True)
    return ResumableLoader(AugDataset(n), batch_size, **kw)


def roundtrip(state: dict) -> dict:
    """The state as a checkpoint stores it: plain JSON values."""
    return json.loads(json.dumps(state))


def take(loader: ResumableLoader, k: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """k batches, re-calling iter() at each epoch end (so k may span several epochs). A loader
    restored at the end of an epoch (a checkpoint of its last step) first ends that epoch: an
    empty pass."""
    out: list[Any] = []
    first = True
    while len(out) < k:
        before, at_end = len(out), loader.position >= loader.epoch_length
        for batch in loader:
            out.append(batch)
            if len(out) == k:
                break
        assert len(out) > before or (first and at_end), "an epoch yielded nothing"
        first = False
    return out


def assert_same(a: list, b: list) -> None:
    assert len(a) == len(b)
    for (ia, xa), (ib, xb) in zip(a, b, strict=True):
        assert torch.equal(ia, ib), (ia, ib)
        assert xa.dtype == xb.dtype and torch.equal(xa.view(torch.int32), xb.view(torch.int32))  # bitwise


# ------------------------------------------------------------------ the reference
def test_stream_is_global_order_with_keyed_augmentation() -> None:
    loader, ds = make(), AugDataset()
    order = GlobalOrder(N, SEED)
    assert len(loader) == 10
    for epoch in range(3):
        batches = list(loader)
        assert [len(i) for i, _ in batches] == [4] * 9 + [1]  # one process: a short last batch
        got = torch.cat([i for i, _ in batches]).tolist()
        assert got == order.indices(epoch, 0, N).tolist()
        for idx, x in zip(got, torch.cat([x for _, x in batches]), strict=True):
            assert torch.equal(x, expected_sample(ds, idx, epoch))
        assert loader.state_dict()["epoch"] == epoch + 1 and loader.state_dict()["position"] == 0
    assert loader.samples_seen == 3 * N


def test_no_shuffle_is_dataset_order_every_epoch() -> None:
    loader = make(shuffle=False)
    for _ in range(2):
        assert torch.cat([i for i, _ in loader]).tolist() == list(range(N))


# -------------------------------------------------------- every resume position
@pytest.mark.parametrize("drop_last", [False, True])
def test_resume_at_every_position_across_epochs(drop_last: bool) -> None:
    per_epoch = 9 if drop_last else 10
    total = 3 * per_epoch  # three epochs
    reference = take(make(drop_last=drop_last), total)
    for k in range(total + 1):
        first = make(drop_last=drop_last)
        head = take(first, k)
        assert_same(head, reference[:k])
        state = roundtrip(first.state_dict())
        second = make(drop_last=drop_last)
        second.load_state_dict(state)
        assert second.state_dict() == state
        assert_same(take(second, total - k), reference[k:])


def test_state_after_break_at_epoch_end_starts_next_epoch() -> None:
    # Breaking right after the last batch (the generator never finishes) leaves
    # position == epoch length; in that process the next iter() starts the next epoch.
    # Restored there (a checkpoint of the epoch's last step), the epoch's loop ends first:
    # one empty pass, so an epoch loop goes on with that epoch's end (evaluation, ...).
    loader = make()
    for k, _ in enumerate(loader, 1):
        if k == 10:
            break
    state = loader.state_dict()
    assert (state["epoch"], state["position"]) == (0, N)
    first = GlobalOrder(N, SEED).indices(1, 0, B).tolist()
    fresh = make()
    fresh.load_state_dict(state)
    assert next(iter(loader))[0].tolist() == first
    assert list(fresh) == [] and (fresh.epoch, fresh.position) == (1, 0)
    assert next(iter(fresh))[0].tolist() == first
    # A framework that restores its own epoch loop (Lightning) ended that epoch itself: with
    # "epoch_ended" in the state the next iterator starts the next epoch at once.
    framework = make()
    framework.load_state_dict(dict(state, epoch_ended=True))
    assert next(iter(framework))[0].tolist() == first and framework.epoch == 1
    mid = make()
    mid.load_state_dict(dict(state, position=B, epoch_ended=True))  # inside an epoch: no effect
    assert next(iter(mid))[0].tolist() == GlobalOrder(N, SEED).indices(0, B, 2 * B).tolist() and mid.epoch == 0


# ------------------------------------------------------------------------ workers
@pytest.mark.filterwarnings("ignore:This DataLoader will create 4 worker")
def test_changing_num_workers_across_resumes_gives_identical_samples() -> None:
    total = 25  # 2.5 epochs
    reference = take(make(num_workers=0), total)
    got = []
    loader = make(num_workers=0)
    for workers, k in [(0, 3), (2, 9), (4, 8), (0, 5)]:  # 0 -> 2 -> 4 -> 0; spans epoch ends
        fresh = make(num_workers=workers)
        fresh.load_state_dict(roundtrip(loader.state_dict()))
        loader = fresh
        got += take(loader, k)
        # the position counts what the loop received, not what workers prefetched
        done = len(got)
        assert loader.samples_seen == sum(len(i) for i, _ in reference[:done])
    assert_same(got, reference)


def test_persistent_workers_over_two_epochs_equal_no_workers() -> None:
    reference = take(make(num_workers=0), 20)
    loader = make(num_workers=2, persistent_workers=True)
    got = list(loader) + list(loader)
    assert loader.state_dict()["epoch"] == 2
    assert_same(got, reference)


def test_persistent_workers_break_mid_epoch_then_resume_and_stop_on_del() -> None:
    reference = take(make(), 20)
    loader = make(num_workers=2, persistent_workers=True)
    got = take(loader, 4)  # prefetched batches 5.. are in flight and must be discarded
    got += take(loader, 16)
    assert_same(got, reference)
    # Dropping the loader stops its persistent workers at once (no reference cycle that
    # leaves them to a later garbage-collector pass, which stalled 5 s per worker).
    workers = loader._loader._iterator._workers  # torch internals, only to observe
    assert workers and all(w.is_alive() for w in workers)
    gc.disable()
    try:
        del loader
        assert not any(w.is_alive() for w in workers)
    finally:
        gc.enable()


@pytest.mark.parametrize("workers", [0, 2])
def test_iterating_does_not_touch_global_rng(workers: int) -> None:
    # DESIGN trap: a plain DataLoader draws its workers' base seed from the global torch
    # RNG when an iterator is created, so restoring RNG before iter(loader) leaves the
    # training loop one draw off. This loader draws from its own generator.
    loader = make(num_workers=workers)
    torch.manual_seed(99)
    np.random.seed(99)
    random.seed(99)
    states = lambda: (torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate())  # noqa: E731
    before = states()

    def unchanged() -> bool:
        now = states()
        return torch.equal(before[0], now[0]) and (before[1] == now[1]).all() and before[2] == now[2]

    it = iter(loader)
    assert unchanged()
    next(it)
    assert unchanged()
    for _ in it:
        pass
    assert unchanged()
    assert loader.state_dict()["epoch"] == 1


# -------------------------------------------------------------------- world size
def ranks(world: int, batch: int, n: int = N, **kw: Any) -> list[ResumableLoader]:
    return [make(n, batch, rank=r, world_size=world, **kw) for r in range(world)]


def lockstep(loaders: list[ResumableLoader], steps: int | None = None) -> list[list[tuple]]:
    """Global steps (one batch per rank) until the epoch ends or ``steps`` are done."""
    its = [iter(x) for x in loaders]
    out = []
    while steps is None or len(out) < steps:
        got = [next(it, None) for it in its]
        if all(g is None for g in got):
            break
        assert all(g is not None for g in got), "ranks disagree on the number of batches"
        out.append(got)
        states = [x.state_dict() for x in loaders]
        assert all(s == states[0] for s in states), "ranks' states differ at the same step"
    return out


def flatten(steps: list[list[tuple]], batch: int) -> tuple[list[int], list[torch.Tensor]]:
    idx, xs = [], []
    for step in steps:
        for i, x in step:
            assert len(i) == batch, "every rank gets a full batch"
            idx += i.tolist()
            xs += list(x)
    return idx, xs


def expected_end(start: int, g: int, n: int, drop_last: bool) -> int:
    end = start
    if drop_last:
        while end + g <= n:
            end += g
    else:
        while end < n:
            end += g
    return end


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("before,after", [((4, 2), (2, 2)), ((2, 2), (3, 2)), ((3, 2), (2, 5)), ((2, 3), (4, 1))])
def test_world_size_change_mid_epoch(before: tuple[int, int], after: tuple[int, int], drop_last: bool) -> None:
    (w0, b0), (w1, b1) = before, after
    g0, g1 = w0 * b0, w1 * b1
    order = GlobalOrder(N, SEED)
    ds = AugDataset()
    for s in range(len(ranks(w0, b0, drop_last=drop_last)[0])):  # every switch step inside the epoch
        old = ranks(w0, b0, drop_last=drop_last)
        head = lockstep(old, s)
        p = len(head) * g0
        state = roundtrip(old[s % w0].state_dict())  # any rank's state: they agree
        assert (state["epoch"], state["position"]) == (0, p)
        new = ranks(w1, b1, drop_last=drop_last)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the "global batch changed" warning
            for x in new:
                x.load_state_dict(state)
        end = expected_end(p, g1, N, drop_last)
        # if no whole new global batch fits (drop_last), the epoch is over: iter() starts the next
        tail = lockstep(new) if end > p else []
        i0, x0 = flatten(head, b0)
        i1, x1 = flatten(tail, b1)
        stream, xs = i0 + i1, x0 + x1
        # exactly the uninterrupted global order, padded by wrap-around or cut short
        assert stream == order.indices(0, 0, end).tolist()
        if drop_last:
            assert N - g1 < end <= N  # fewer than one global batch dropped
        else:
            assert N <= end < N + g1  # fewer than one global batch padded
            assert sorted(stream[:N]) == list(range(N))  # nothing skipped, nothing repeated
            assert stream[N:] == stream[: end - N]  # padding wraps to the epoch's start
        for idx, x in zip(stream, xs, strict=True):
            assert torch.equal(x, expected_sample(ds, idx, 0))
        if end <= p:  # restored at the epoch's end: the loaders end that epoch first (an empty pass)
            assert lockstep(new) == []
        # the next epoch starts at position 0 of epoch 1 in the new world
        nxt = lockstep(new, 1)
        assert flatten(nxt, b1)[0] == order.indices(1, 0, g1).tolist()


@pytest.mark.parametrize("world", [2, 3, 4])
def test_drop_last_drops_trailing_n_mod_global_batch(world: int) -> None:
    b = 3
    g = world * b
    loaders = ranks(world, b, drop_last=True)
    assert all(len(x) == N // g for x in loaders)
    stream, _ = flatten(lockstep(loaders), b)
    whole = GlobalOrder(N, SEED).indices(0, 0, N).tolist()
    assert stream == whole[: N - N % g]  # the trailing N mod G samples are never seen
    assert loaders[0].state_dict()["epoch"] == 1


@pytest.mark.parametrize("world", [2, 3, 4])
def test_padding_gives_every_rank_a_full_last_batch(world: int) -> None:
    b = 3
    g = world * b
    loaders = ranks(world, b, drop_last=False)
    assert all(len(x) == -(-N // g) for x in loaders)
    stream, _ = flatten(lockstep(loaders), b)  # flatten checks every batch is full
    whole = GlobalOrder(N, SEED).indices(0, 0, N).tolist()
    pad = -N % g
    assert stream == whole + whole[:pad]


def test_world_size_one_short_last_batch_or_dropped() -> None:
    sizes = [len(i) for i, _ in make(batch_size=5)]
    assert sizes == [5] * 7 + [2]
    sizes = [len(i) for i, _ in make(batch_size=5, drop_last=True)]
    assert sizes == [5] * 7


def test_rank_and_world_size_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    loader = make(batch_size=2)
    assert (loader.rank, loader.world_size) == (1, 3)
    assert next(iter(loader))[0].tolist() == GlobalOrder(N, SEED).indices(0, 2, 4).tolist()
    with pytest.raises(ValueError):
        make(rank=3, world_size=3)


# ------------------------------------------------------- gradient accumulation
@pytest.mark.parametrize("world", [1, 2])
def test_position_advances_per_micro_batch(world: int) -> None:
    loaders = ranks(world, B, drop_last=False)
    g = world * B
    its = [iter(x) for x in loaders]
    k = 0
    while True:
        got = [next(it, None) for it in its]
        if got[0] is None:
            break
        k += 1
        state = loaders[0].state_dict()
        if state["epoch"] == 0:
            # per micro-batch, not per optimizer step; one process ends on a short batch
            assert state["position"] == min(k * g, N if world == 1 else len(loaders[0]) * g)
            assert loaders[0].batches_left() == len(loaders[0]) - k
    assert k == len(loaders[0])
    assert (loaders[0].state_dict()["epoch"], loaders[0].state_dict()["position"]) == (1, 0)


# --------------------------------------------------------------- load validation
def test_load_refuses_another_dataset_or_seed() -> None:
    state = make().state_dict()
    with pytest.raises(ValueError, match="n=37"):
        make(n=38).load_state_dict(state)
    with pytest.raises(ValueError, match="seed"):
        make(seed=SEED + 1).load_state_dict(state)
    with pytest.raises(ValueError):
        make(shuffle=False).load_state_dict(state)


@pytest.mark.parametrize("key,value,message", [
    ("position", 10**12, r"position is 1000000000000, outside from 0 to 4\d"),  # 37 and a global batch
    ("position", -1, r"position is -1, outside from 0 to 4\d"),
    ("epoch", 2.5, r"epoch is 2.5 \(float\), not an integer"),
    ("samples_seen", "12", r"samples_seen is '12' \(str\), not an integer"),
    ("epoch", True, r"epoch is True \(bool\), not an integer"),
    ("batch_size", 0, r"batch_size is 0, outside at least 1"),
    ("position", None, r"position is None"),
])
def test_load_refuses_a_crafted_position_before_anything_changes(key: str, value: object, message: str) -> None:
    """A crafted or damaged data state (issue 33 §5) is refused at ``load_state_dict`` with the key and
    the value, and the loader is left as it was (before: a position past the data served nothing or
    raised at the first batch; a float epoch went through ``int()``)."""
    loader = make()
    take(loader, 2)
    before = loader.state_dict()
    state = make().state_dict() | {key: value}
    with pytest.raises(ValueError, match=message):
        loader.load_state_dict(state)
    assert loader.state_dict() == before


def test_load_warns_when_global_batch_changes_off_boundary() -> None:
    loader = make(batch_size=4)
    take(loader, 3)  # position 12
    state = loader.state_dict()
    with pytest.warns(UserWarning, match="global batch changed from 4 to 8"):
        make(batch_size=8).load_state_dict(state)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        make(batch_size=6).load_state_dict(state)  # 12 is a multiple of 6: no warning
        make(batch_size=4).load_state_dict(state)  # unchanged: no warning
    with pytest.warns(UserWarning, match="world size changed from 1 to 2") as seen:  # 12 % 6 == 0: only that
        make(batch_size=3, rank=0, world_size=2).load_state_dict(state)
    assert len(seen) == 1


@pytest.mark.parametrize("kwarg", [{"sampler": [0, 1]}, {"batch_sampler": [[0]]}, {"generator": torch.Generator()}])
def test_owned_dataloader_arguments_are_refused(kwarg: dict) -> None:
    with pytest.raises(TypeError, match="owns"):
        ResumableLoader(AugDataset(), 4, **kwarg)
    # ``shuffle`` is the loader's own keyword (it shuffles by seed and epoch), never DataLoader's
    assert ResumableLoader(AugDataset(), 4, shuffle=True).order.shuffle is True


# ----------------------------------------------------------------- Checkpointer
def test_checkpointer_saves_and_restores_the_data_position(tmp_path) -> None:
    def build() -> dict:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Dropout(0.2), torch.nn.Linear(4, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        return {"model": model, "optimizer": opt, "data": make(num_workers=0)}

    def train(state: dict, steps: int, ckpt=None, save_at=None) -> list:
        seen = []
        model, opt = state["model"], state["optimizer"]
        for batch in take_iter(state["data"], steps):
            idx, x = batch
            loss = model(x / 100).square().mean()  # dropout draws from the global RNG
            opt.zero_grad()
            loss.backward()
            opt.step()
            seen.append((idx, x))
            if ckpt is not None:
                ckpt.step(state)
                if ckpt.progress.step == save_at:
                    ckpt.save(state)
        return seen

    total, cut = 24, 13  # the cut is mid-epoch (epoch 1, position 12)
    ref_state = build()
    reference = train(ref_state, total)

    run = tmp_path / "run"
    first = build()
    ckpt = unbroken.Checkpointer(run)
    assert_same(train(first, cut, ckpt, save_at=cut), reference[:cut])
    train(first, 5)  # the killed run went on past the save; its work is lost

    second = build()  # fresh model, optimizer and loader
    ckpt2 = unbroken.Checkpointer(run)
    assert ckpt2.restore(second) is not None
    assert second["data"].state_dict() == {**first["data"].state_dict(), "epoch": 1, "position": 12,
                                           "samples_seen": N + 12}
    assert_same(train(second, total - cut), reference[cut:])
    for a, b in zip(ref_state["model"].parameters(), second["model"].parameters(), strict=True):
        assert torch.isfinite(a).all() and torch.equal(a, b)


def take_iter(loader: ResumableLoader, k: int):
    """Yield k batches, re-calling iter() at each epoch end."""
    done = 0
    while done < k:
        for batch in loader:
            yield batch
            done += 1
            if done == k:
                return


# ----------------------------------------------------------------- DataLoader's defaults
def test_the_arguments_and_defaults_are_dataloaders() -> None:
    """Replacing ``DataLoader(ds, ...)`` by ``ResumableLoader(ds, ...)`` with the same arguments changes
    nothing of the uninterrupted run: the same defaults (no shuffling), the same batches in the same order."""
    import inspect

    from torch.utils.data import DataLoader, TensorDataset

    ours, theirs = inspect.signature(ResumableLoader).parameters, inspect.signature(DataLoader).parameters
    for name in ("batch_size", "shuffle", "drop_last"):  # (DataLoader's shuffle=None means False)
        assert (ours[name].default or False) == (theirs[name].default or False), name
    assert list(ours)[:3] == list(theirs)[:3] == ["dataset", "batch_size", "shuffle"]  # positional like DataLoader's
    ds = TensorDataset(torch.randn(10, 3))
    for args, kw in (((), {}), ((4,), {}), ((3,), {"drop_last": True})):
        want = [b[0] for b in DataLoader(ds, *args, **kw)]
        got = [b[0] for b in ResumableLoader(ds, *args, **kw)]
        assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), (args, kw)


def test_a_checkpoint_of_the_old_shuffling_default_names_the_argument() -> None:
    state = make(shuffle=True).state_dict()
    with pytest.raises(ValueError, match="shuffle=True was the default"):
        make(shuffle=False).load_state_dict(state)


# ----------------------------------------------------------------- continuous epochs
def _stream(loader: ResumableLoader):
    """Batches of every epoch, one epoch after another (a loop that draws with ``next()``)."""
    while True:
        yield from loader


def _samples(world: int, accumulate: int, steps: int, **kw: Any) -> tuple[list[list[tuple[int, float]]], dict]:
    """Each step's samples (index and the augmented tensor's sum: it depends on the epoch's randomness),
    and the loaders' state after the last step."""
    n, micro = kw.pop("n", 104), kw.pop("micro", 4)
    state = kw.pop("state", None)
    loaders = [ResumableLoader(AugDataset(n), micro, True, seed=SEED, rank=r, world_size=world, **kw)
               for r in range(world)]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for ld in loaders:
            if state is not None:
                ld.load_state_dict(state)
    streams = [_stream(ld) for ld in loaders]
    out = []
    for _ in range(steps):
        step = []
        for _ in range(accumulate):
            for s in streams:
                idx, x = next(s)
                step += [(int(i), float(v.sum())) for i, v in zip(idx, x, strict=True)]
        out.append(sorted(step))
    return out, {"state": loaders[0].state_dict(), "warnings": [str(w.message) for w in seen]}


def test_continuous_epochs_give_every_step_the_same_samples_on_any_number_of_ranks() -> None:
    """104 samples, 16 per optimizer step (6.5 steps per epoch): on 1, 2 and 4 ranks (micro-batch 4, accumulating
    4, 2 and 1 micro-batches) every step of 3 epochs trains on the same samples with the same augmentation;
    without ``continuous`` the padding of each epoch's end depends on the world size, and the steps after
    the first epoch end differ (the condition the docs state)."""
    steps = 20
    runs = {w: _samples(w, 4 // w, steps, continuous=True)[0] for w in (1, 2, 4)}
    assert runs[1] == runs[2] == runs[4]
    two_epochs = Counter(i for step in runs[1][:13] for i, _ in step)  # 13 steps of 16: 2 epochs of 104
    assert two_epochs == dict.fromkeys(range(104), 2)  # each sample once per epoch, nothing padded or repeated
    padded = {w: _samples(w, 4 // w, steps, continuous=False)[0] for w in (2, 4)}
    assert padded[2][:6] == padded[4][:6] and padded[2][7:] != padded[4][7:]


def test_a_continuous_run_resumed_on_another_number_of_ranks_goes_on_with_the_same_samples_across_epoch_ends() -> None:
    """Saved by 2 ranks after step 5 (mid-epoch), resumed by 4 and by 1: every later step, through two epoch
    ends, trains on the samples of the run that never stopped; no warning. Without ``continuous`` the
    resume warns that the epochs' ends will differ."""
    whole, _ = _samples(2, 2, 20, continuous=True)
    first, info = _samples(2, 2, 5, continuous=True)
    assert first == whole[:5]
    for world in (4, 1):
        rest, after = _samples(world, 4 // world, 15, continuous=True, state=info["state"])
        assert rest == whole[5:], world
        assert after["warnings"] == [], after["warnings"]
    _, padded = _samples(2, 2, 5, continuous=False)
    _, resumed = _samples(4, 1, 1, continuous=False, state=padded["state"])
    assert any("continuous=True) keeps them" in w for w in resumed["warnings"]), resumed["warnings"]


def test_continuous_refuses_what_it_cannot_keep() -> None:
    with pytest.raises(ValueError, match="drop_last"):
        ResumableLoader(AugDataset(), 4, continuous=True, drop_last=True)
    with pytest.raises(ValueError, match="at least one global batch"):
        ResumableLoader(AugDataset(6), 4, continuous=True, rank=0, world_size=2)
    with pytest.raises(ValueError, match="continuous=True"):
        make(continuous=False).load_state_dict(make(continuous=True).state_dict())


def test_batches_done_is_where_a_resumed_epoch_s_batch_index_goes_on() -> None:
    """Stopped after ``cut`` batches of an epoch and resumed: ``enumerate(loader, loader.batches_done())``
    goes on with the uninterrupted epoch's indices (37 samples in batches of 4: 10 batches in epoch 0;
    continuous, epoch 1 begins after the 3 samples epoch 0's last batch took)."""
    for kw in ({}, {"continuous": True}):
        for epoch, cut in ((0, 1), (0, 4), (0, 9), (1, 3)):
            ref = make(**kw)
            for _ in range(epoch):
                list(ref)
            total = len(list(ref))
            first = make(**kw)
            for _ in range(epoch):
                list(first)
            stream = iter(first)
            for _ in range(cut):
                next(stream)
            resumed = make(**kw)
            resumed.load_state_dict(first.state_dict())
            stream.close()
            indices = [i for i, _ in enumerate(resumed, resumed.batches_done())]
            assert indices == list(range(cut, total)), (kw, epoch, cut, indices, total)
