"""``unbroken.data.Mixture``: weighted sources and curricula, exact at any position, and the rule
when weights or sources change at a resume (the kills are in test_data_e2e.py)."""

from __future__ import annotations

import copy
import logging
from collections import Counter, defaultdict
from pathlib import Path

import pytest
import torch
from torch.utils.data import Dataset

import unbroken
import unbroken.data as ud

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


class Source(Dataset):
    def __init__(self, name: str, n: int) -> None:
        self.name, self.n = name, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        # the sample's augmentation draw is keyed by the source's seed, pass and index
        return {"src": self.name, "i": int(i), "pass": i.epoch, "aug": torch.rand(1, generator=i.generator())}


def sources(**sizes: int) -> dict[str, Source]:
    return {k: Source(k, n) for k, n in sizes.items()}


def names(mix: ud.Mixture, start: int, stop: int) -> list[str]:
    return [mix.locate(g)[0] for g in range(start, stop)]


def test_every_block_has_each_sources_exact_share_and_sources_are_drawn_without_repetition() -> None:
    mix = ud.Mixture(sources(a=50, b=30, c=7), {"a": 5, "b": 3, "c": 2}, seed=1, block=64)
    draws = [mix.locate(g) for g in range(64 * 40)]
    total = Counter(n for n, _, _ in draws)
    assert total == {"a": 1280, "b": 768, "c": 512}  # exact over whole blocks
    for j in range(40):
        share = Counter(n for n, _, _ in draws[64 * j:64 * (j + 1)])
        assert all(abs(share[k] - 64 * w) < 1 for k, w in (("a", .5), ("b", .3), ("c", .2))), share
    for name, n in (("a", 50), ("b", 30), ("c", 7)):
        passes = defaultdict(list)
        for src, i, p in draws:
            if src == name:
                passes[p].append(i)
        for p in sorted(passes)[:-1]:  # every complete pass: each sample once
            assert sorted(passes[p]) == list(range(n)), (name, p)
        assert len(set(passes[max(passes)])) == len(passes[max(passes)])
    assert names(mix, 0, 64) != sorted(names(mix, 0, 64))  # the block is shuffled


def test_a_sample_is_a_pure_function_of_seed_position_and_schedule() -> None:
    make = lambda seed=1: ud.Mixture(sources(a=50, b=30), {"a": .6, "b": .4}, seed=seed, block=32)  # noqa: E731
    a, b = make(), make()
    order = [5000, 3, 777, 64, 31, 32, 10 ** 9]
    assert [a.locate(g) for g in order] == [b.locate(g) for g in reversed(order)][::-1]
    assert [a[g]["aug"] for g in order] == [b[g]["aug"] for g in order]
    assert names(make(2), 0, 200) != names(a, 0, 200)


def test_a_curriculum_changes_the_shares_at_its_block_boundaries() -> None:
    mix = ud.Mixture(sources(easy=40, hard=40), [(0, {"easy": 1}), (100, {"easy": 1, "hard": 1}), (200, {"hard": 1})],
                     block=32)
    got = names(mix, 0, 288)
    assert set(got[:128]) == {"easy"}  # 100 rounds up to the block boundary 128
    assert Counter(got[128:224]) == {"easy": 48, "hard": 48}  # 200 rounds up to 224
    assert set(got[224:]) == {"hard"}
    assert mix.weights_at(130) == {"easy": .5, "hard": .5}
    # the hard source's draws continue where they stood (48 drawn by 224: pass 1 from its 9th sample)
    hard = Counter(p for g in range(224, 288) for s, _, p in [mix.locate(g)] if s == "hard")
    assert hard == {1: 32, 2: 32}


def loader_batches(make, k: int | None = None, state=None):
    loader = make()
    if state is not None:
        loader.load_state_dict(state)
    it = iter(loader)
    out = [[(s, int(i)) for s, i in zip(b["src"], b["i"], strict=True)]
           for b in (it if k is None else (next(it) for _ in range(k)))]
    return out, loader


def test_a_mixture_loader_resumes_exactly_with_other_workers_and_world_sizes() -> None:
    mix = ud.Mixture(sources(a=50, b=30, c=7), [(0, {"a": .7, "b": .3}), (96, {"a": .2, "b": .3, "c": .5})],
                     seed=3, block=16)
    make = lambda w=0, **kw: mix.loader(batch_size=8, num_workers=w, **kw)  # noqa: E731
    ref, _ = loader_batches(make, 30)
    assert loader_batches(lambda: make(2), 30)[0] == ref
    for k in (1, 11, 13):
        head, first = loader_batches(make, k)
        tail, _ = loader_batches(lambda: make(2), 30 - k, copy.deepcopy(first.state_dict()))
        assert head + tail == ref
    # 2 ranks of 4 samples each: the same global samples, then 1 rank of 8 resumes
    ranks = [mix.loader(batch_size=4, rank=r, world_size=2) for r in (0, 1)]
    its = [iter(r) for r in ranks]
    two = []
    for _ in range(10):
        two.append(sum(([(s, int(i)) for s, i in zip(b["src"], b["i"], strict=True)]
                        for b in (next(it) for it in its)), []))
    assert two == ref[:10]
    tail, _ = loader_batches(make, 20, copy.deepcopy(ranks[0].state_dict()))
    assert two + tail == ref
    with pytest.raises(TypeError, match="sample order"):
        make(shuffle=True)


def test_the_schedule_goes_through_a_real_checkpoint(tmp_path: Path) -> None:
    mix = ud.Mixture(sources(a=20, b=9), [(0, {"a": 1, "b": 1}), (40, {"b": 1})], seed=4, block=8)
    ref, _ = loader_batches(lambda: mix.loader(batch_size=4), 20)
    head, first = loader_batches(lambda: mix.loader(batch_size=4), 7)
    unbroken.save(tmp_path / "ckpt", {"data": first})
    again = ud.Mixture(sources(a=20, b=9), [(0, {"a": 1, "b": 1}), (40, {"b": 1})], seed=4, block=8)
    loader = again.loader(batch_size=4)
    unbroken.load(tmp_path / "ckpt", {"data": loader})
    tail, _ = loader_batches(lambda: loader, 13)
    assert head + tail == ref


def planned_vs_changed(caplog, at_batch: int, new: dict, new_sources: dict, old_sources: dict | None = None):
    """Resume after ``at_batch`` batches with ``new`` weights and sources: the result, and the run
    that planned the same change from the logged cut."""
    old = {"a": .7, "b": .3}
    old_sources = old_sources or sources(a=50, b=30)
    make = lambda: ud.Mixture(old_sources, old, seed=5, block=16).loader(batch_size=8)  # noqa: E731
    head, first = loader_batches(make, at_batch)
    changed = ud.Mixture(new_sources, new, seed=5, block=16)
    with caplog.at_level(logging.WARNING, logger="unbroken"):
        tail, _ = loader_batches(lambda: changed.loader(batch_size=8), 12, copy.deepcopy(first.state_dict()))
    cut = int(caplog.records[-1].getMessage().split("from sample ")[1].split()[0])
    union = {**old_sources, **new_sources}
    planned = ud.Mixture(union, [(0, old), (cut, new)], seed=5, block=16)
    want, _ = loader_batches(lambda: planned.loader(batch_size=8), at_batch + 12)
    return head + tail, want, cut, caplog.records[-1].getMessage()


def test_weights_changed_at_resume_apply_from_the_next_block_boundary_and_are_logged(caplog) -> None:
    got, want, cut, message = planned_vs_changed(caplog, 5, {"a": .1, "b": .9}, sources(a=50, b=30))
    assert cut == 48  # 5 batches of 8 = sample 40, the next block boundary is 48
    assert got == want
    unchanged, _ = loader_batches(lambda: ud.Mixture(sources(a=50, b=30), {"a": .7, "b": .3}, seed=5,
                                                     block=16).loader(batch_size=8), 17)
    flat = lambda batches: [x for b in batches for x in b]  # noqa: E731
    assert flat(got)[:cut] == flat(unchanged)[:cut] and flat(got)[cut:] != flat(unchanged)[cut:]
    assert "a: 0.1, b: 0.9" in message and "a: 0.7, b: 0.3" in message


def test_a_source_added_at_resume_starts_at_its_first_sample(caplog) -> None:
    got, want, cut, message = planned_vs_changed(caplog, 6, {"a": .3, "b": .3, "c": .4}, sources(a=50, b=30, c=9))
    assert got == want and "sources added: ['c']" in message
    flat = [x for b in got for x in b]
    assert {s for s, _ in flat[:cut]} == {"a", "b"} and "c" in {s for s, _ in flat[cut:]}


def test_a_source_removed_at_resume_is_accepted_only_once_no_longer_drawn(caplog) -> None:
    both = sources(a=50, b=30)
    got, want, cut, message = planned_vs_changed(caplog, 6, {"a": 1}, sources(a=50), old_sources=both)
    assert got == want and "sources removed: ['b']" in message  # 48 = a block boundary: b is not needed
    head, first = loader_batches(lambda: ud.Mixture(both, {"a": .7, "b": .3}, seed=5, block=16).loader(batch_size=8), 5)
    with pytest.raises(ValueError, match=r"keep them in the sources, with weight 0"):
        ud.Mixture(sources(a=50), {"a": 1}, seed=5, block=16).loader(batch_size=8).load_state_dict(first.state_dict())


def test_what_a_resume_refuses() -> None:
    make = lambda **kw: ud.Mixture(kw.pop("src", sources(a=50, b=30)), kw.pop("w", {"a": 1, "b": 1}),  # noqa: E731
                                   **{"seed": 5, "block": 16, **kw})
    _, first = loader_batches(lambda: make().loader(batch_size=8), 3)
    state = copy.deepcopy(first.state_dict())
    with pytest.raises(ValueError, match="new name"):
        make(src=sources(a=51, b=30)).loader(batch_size=8).load_state_dict(state)
    with pytest.raises(ValueError, match="seed"):
        make(seed=6).loader(batch_size=8).load_state_dict(state)
    with pytest.raises(ValueError, match="block"):
        make(block=32).loader(batch_size=8).load_state_dict(state)
    plain = make(w={"a": 2, "b": 1})  # a mixture restored on its own does not know the position
    with pytest.raises(ValueError, match=r"mixture.loader"):
        plain.load_state_dict(state["mixture"])
    make().load_state_dict(state["mixture"])  # unchanged: fine
    for key, value, message in (("position", -5, "position is -5, outside from 0 to"),  # (endless: 2**62)
                                ("epoch", -1, "epoch is -1, outside at least 0")):  # crafted (issue 33 §5)
        with pytest.raises(ValueError, match=message):
            make().loader(batch_size=8).load_state_dict(state | {key: value})
    with pytest.raises(ValueError, match="not in the mixture"):
        make(w={"a": 1, "z": 1})
    with pytest.raises(ValueError, match="sum to 0"):
        make(w={"a": 0, "b": 0})
    with pytest.raises(ValueError, match="first starts at 0"):
        make(w=[(10, {"a": 1})])
