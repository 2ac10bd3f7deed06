"""``unbroken.data.GlobalOrder`` and ``SampleIndex``: the shuffled order and the per-sample
randomness are pure functions of (seed, epoch, position / index).

Everything here is deterministic: hypothesis runs derandomized, without a database, and
the statistical check uses fixed seeds, so nothing can flake.
"""

from __future__ import annotations

import copy
import pickle
from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from unbroken.data import GlobalOrder, SampleIndex, sample_seed

SETTINGS = settings(derandomize=True, database=None, deadline=None, max_examples=60)


def full(order: GlobalOrder, epoch: int = 0) -> list[int]:
    return order.indices(epoch, 0, order.n).tolist()


# --------------------------------------------------------------------- permutation
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 8, 15, 16, 17, 64, 65, 255, 256, 257, 1000, 4096, 4097])
@pytest.mark.parametrize("seed", [0, 1, 12345])
def test_is_a_permutation(n: int, seed: int) -> None:
    order = GlobalOrder(n, seed)
    for epoch in (0, 1, 7):
        got = order.indices(epoch, 0, n)
        assert got.dtype == np.int64 and got.shape == (n,)
        assert sorted(got.tolist()) == list(range(n))


@SETTINGS
@given(n=st.integers(1, 100_000), seed=st.integers(0, 2**63 - 1), epoch=st.integers(0, 10_000))
def test_is_a_permutation_for_random_n(n: int, seed: int, epoch: int) -> None:
    got = GlobalOrder(n, seed).indices(epoch, 0, n)
    assert got.min() >= 0 and got.max() < n
    assert np.unique(got).size == n


def test_empty_dataset_and_empty_ranges() -> None:
    assert GlobalOrder(0, 1).indices(0, 0, 10).size == 0
    assert GlobalOrder(10, 1).indices(0, 5, 5).size == 0
    assert GlobalOrder(10, 1).indices(0, 6, 5).size == 0
    with pytest.raises(ValueError):
        GlobalOrder(-1)


# ----------------------------------------------------------------- seed and epoch
@pytest.mark.parametrize("n", [10, 11, 37, 1000])
def test_depends_on_seed_and_epoch(n: int) -> None:
    # 10! = 3.6e6 orders: with these fixed seeds no two coincide (and a broken key
    # schedule, one that ignored the epoch or the seed, would make them all equal).
    orders = {tuple(full(GlobalOrder(n, seed), epoch)) for seed in range(5) for epoch in range(5)}
    assert len(orders) == 25


def test_same_arguments_same_order_in_a_fresh_object() -> None:
    assert full(GlobalOrder(1000, 42), 3) == full(GlobalOrder(1000, 42), 3)
    assert GlobalOrder(1000, 42)(3, 17) == GlobalOrder(1000, 42).indices(3, 17, 18)[0]


def test_golden_order_is_stable_across_versions() -> None:
    # A checkpoint saved by one version of unbroken is resumed by another: the order
    # must never change for the same (n, seed, epoch). Update these numbers only with a
    # deliberate, documented break of old checkpoints' data position.
    assert GlobalOrder(1000, 0).indices(0, 0, 10).tolist() == GOLDEN_1000_0_0
    assert GlobalOrder(37, 5).indices(2, 0, 37).tolist() == GOLDEN_37_5_2
    assert sample_seed(0, 0, 0) == GOLDEN_SAMPLE_SEED


GOLDEN_1000_0_0 = [926, 459, 268, 610, 585, 655, 909, 120, 831, 966]
GOLDEN_37_5_2 = [4, 36, 26, 11, 21, 24, 35, 2, 25, 31, 1, 3, 28, 20, 7, 34, 6, 19, 22, 27, 8, 30, 18, 29,
                 15, 16, 14, 10, 13, 9, 17, 23, 32, 12, 0, 33, 5]
GOLDEN_SAMPLE_SEED = 626839982013840967


def test_no_shuffle_is_dataset_order() -> None:
    for n in (1, 7, 100):
        order = GlobalOrder(n, seed=3, shuffle=False)
        for epoch in (0, 1, 5):
            assert full(order, epoch) == list(range(n))
    assert GlobalOrder(10, shuffle=False).indices(4, 8, 13).tolist() == [8, 9, 0, 1, 2]


# ------------------------------------------------------------------- random access
@SETTINGS
@given(n=st.integers(1, 3000), seed=st.integers(0, 2**32), epoch=st.integers(0, 50), data=st.data())
def test_window_equals_slice_of_full_epoch(n: int, seed: int, epoch: int, data: st.DataObject) -> None:
    a = data.draw(st.integers(0, n - 1), label="a")
    b = data.draw(st.integers(a + 1, n), label="b")
    order = GlobalOrder(n, seed)
    assert order.indices(epoch, a, b).tolist() == full(order, epoch)[a:b]
    assert order(epoch, a) == full(order, epoch)[a]


@pytest.mark.parametrize("n", [1, 3, 37, 1000])
def test_positions_past_n_wrap_to_the_same_epoch(n: int) -> None:
    order = GlobalOrder(n, seed=9)
    whole = full(order, 4)
    for start in (n, n + 1, 3 * n + 2):
        got = order.indices(4, start, start + 2 * n + 3).tolist()
        assert got == [whole[p % n] for p in range(start, start + 2 * n + 3)]


@pytest.mark.parametrize("n", [10**12, 2**40, 2**40 + 1, 2**61 + 3])
def test_huge_n_small_window(n: int) -> None:
    order = GlobalOrder(n, seed=1)
    start = n - 500  # near the end, as a resume deep into a huge epoch would be
    got = order.indices(3, start, start + 1000)  # the last 500 wrap around
    assert got.size == 1000 and (got >= 0).all() and (got < n).all()
    assert np.unique(got[:500]).size == 500
    assert got[500:].tolist() == order.indices(3, 0, 500).tolist()
    assert order(3, start + 7) == got[7]
    assert got.tolist() != GlobalOrder(n, seed=2).indices(3, start, start + 1000).tolist()


def test_rough_uniformity_over_seeds() -> None:
    # Where position 0 lands, over 2000 fixed seeds: each of 10 values ~200 times.
    # (Binomial sd is ~13, so +-60 is > 4 sd: deterministic seeds, but a robust margin.)
    counts = Counter(GlobalOrder(10, seed)(0, 0) for seed in range(2000))
    assert set(counts) == set(range(10))
    assert all(140 <= c <= 260 for c in counts.values()), counts
    # and over epochs of one seed, for a position in the middle of a larger domain
    counts = Counter(GlobalOrder(10, 7)(epoch, 5) for epoch in range(2000))
    assert all(140 <= c <= 260 for c in counts.values()), counts


def test_neighbouring_positions_are_not_correlated() -> None:
    # A weak shuffle (e.g. a rotation) keeps neighbours together; a permutation of 1000
    # items keeps on average ~2 of its 999 successor pairs.
    whole = full(GlobalOrder(1000, 0), 0)
    kept = sum(1 for a, b in zip(whole, whole[1:], strict=False) if b == a + 1)
    assert kept <= 10


# ---------------------------------------------------------------------- SampleIndex
def test_sample_index_is_an_int() -> None:
    i = SampleIndex(3, seed=5, epoch=2)
    assert i == 3 and isinstance(i, int) and hash(i) == hash(3)
    assert ["a", "b", "c", "d"][i] == "d"
    assert torch.arange(10)[i].item() == 3
    assert torch.arange(20).view(10, 2)[i].tolist() == [6, 7]
    assert np.arange(10)[i] == 3
    assert {3: "x"}[i] == "x"
    assert range(10)[i] == 3
    assert (i.seed, i.epoch) == (5, 2)
    assert "3" in repr(i) and "seed=5" in repr(i) and "epoch=2" in repr(i)


@pytest.mark.parametrize("copier", [lambda x: pickle.loads(pickle.dumps(x)),
                                    lambda x: pickle.loads(pickle.dumps(x, protocol=0)),
                                    copy.copy, copy.deepcopy])
def test_sample_index_survives_pickle_and_copy(copier) -> None:
    # DataLoader workers receive the indices pickled: seed and epoch must cross.
    i = SampleIndex(11, seed=2**62 + 1, epoch=4)
    j = copier(i)
    assert type(j) is SampleIndex and j == 11 and (j.seed, j.epoch) == (2**62 + 1, 4)
    assert j.generator().initial_seed() == i.generator().initial_seed()
    assert torch.equal(torch.rand(4, generator=j.generator()), torch.rand(4, generator=i.generator()))


def test_generator_is_reproducible_and_keyed_by_seed_epoch_index() -> None:
    def draw(index: int, seed: int, epoch: int) -> torch.Tensor:
        return torch.randn(8, generator=SampleIndex(index, seed, epoch).generator())

    base = draw(5, 1, 0)
    assert torch.equal(base, draw(5, 1, 0))
    assert torch.equal(base, torch.randn(8, generator=SampleIndex(5, 1, 0).generator()))
    others = [draw(6, 1, 0), draw(5, 1, 1), draw(5, 2, 0), draw(4, 1, 0), draw(0, 0, 0)]
    for other in others:
        assert not torch.equal(base, other)
    # all (index, epoch) pairs of a small grid get distinct seeds
    seeds = {sample_seed(1, e, k) for e in range(20) for k in range(500)}
    assert len(seeds) == 20 * 500
    assert all(0 <= s < 2**63 for s in seeds)  # a valid manual_seed / default_rng seed


def test_numpy_generator_is_reproducible_and_keyed() -> None:
    a = SampleIndex(5, 1, 0).numpy().random(4)
    assert np.array_equal(a, SampleIndex(5, 1, 0).numpy().random(4))
    assert not np.array_equal(a, SampleIndex(5, 1, 1).numpy().random(4))
    assert not np.array_equal(a, SampleIndex(6, 1, 0).numpy().random(4))
    assert not np.array_equal(a, SampleIndex(5, 2, 0).numpy().random(4))


def test_generators_do_not_touch_global_rng() -> None:
    torch.manual_seed(0)
    np.random.seed(0)
    t, n = torch.get_rng_state(), np.random.get_state()[1].copy()
    torch.randn(3, generator=SampleIndex(1, 2, 3).generator())
    SampleIndex(1, 2, 3).numpy().random(3)
    assert torch.equal(t, torch.get_rng_state())
    assert np.array_equal(n, np.random.get_state()[1])
