"""``unbroken.data.JsonlReader`` (resume by shard and byte offset) and ``Counted`` (resume
any iterable by count, with ``skip(n)`` when the source has it, else by replay).

Includes a real kill test: a subprocess reading and checkpointing records is SIGKILLed
at a seeded point, and a second process restores and finishes.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import warnings
from itertools import islice
from pathlib import Path
from typing import Any
from collections.abc import Iterator

import pytest

from unbroken.data import Counted, JsonlReader, Skippable

SNIPPETS = ["", "a", "héllo wörld", "日本語のテキスト", "emoji 🎉🚀", "x" * 300, 'quote " and \\ backslash',
            "tab\tand\u2028separator", "ünïcödé " * 20]


def make_shards(root: Path, sizes: tuple[int, ...] = (7, 1, 12)) -> tuple[list[Path], list[Any]]:
    """Shards of JSONL with varying line lengths, unicode, blank lines, CRLF, and a last
    line without its newline; returns the paths and every record in order."""
    rng = random.Random(0)
    paths, records, k = [], [], 0
    for s, size in enumerate(sizes):
        lines = ["\n"] if s == 0 else []  # a leading blank line
        for j in range(size):
            rec = {"id": k, "text": rng.choice(SNIPPETS) * rng.randint(0, 3), "n": rng.random()}
            k += 1
            records.append(rec)
            end = "\r\n" if j % 5 == 3 else "\n"
            lines.append(json.dumps(rec, ensure_ascii=bool(j % 2)) + end)
            if rng.random() < 0.3:
                lines.append(rng.choice(["\n", "   \n", "\t\r\n"]))  # blank lines are skipped
        text = "".join(lines)
        if s == len(sizes) - 1:
            text = text.rstrip("\r\n")
        p = root / f"shard-{s:02d}.jsonl"
        p.write_bytes(text.encode("utf-8"))
        paths.append(p)
    return paths, records


def roundtrip(state: dict) -> dict:
    return json.loads(json.dumps(state))


@pytest.fixture
def shards(tmp_path: Path) -> tuple[list[Path], list[Any]]:
    return make_shards(tmp_path)


# ----------------------------------------------------------------------- reading
def test_reads_every_record_in_order(shards) -> None:
    paths, records = shards
    assert len(records) == 20
    assert list(JsonlReader(paths)) == records
    assert list(JsonlReader([str(p) for p in paths])) == records  # str paths too


def test_text_mode(tmp_path: Path) -> None:
    p = tmp_path / "a.txt"
    p.write_bytes("first\n\nsecond ü\r\n  \nthird".encode())
    assert list(JsonlReader([p], parse="text")) == ["first", "second ü", "third"]
    with pytest.raises(ValueError):
        JsonlReader([p], parse="csv")


def test_resume_after_every_record(shards) -> None:
    paths, records = shards
    for k in range(len(records) + 1):
        reader = JsonlReader(paths)
        it = iter(reader)
        head = [next(it) for _ in range(k)]
        assert head == records[:k]
        state = roundtrip(reader.state_dict())
        assert state["records"] == k
        fresh = JsonlReader(paths)
        fresh.load_state_dict(state)
        assert list(fresh) == records[k:], k  # including across shard boundaries
        # and the rest of the original iterator is the same
        assert list(it) == records[k:]


def test_state_is_a_byte_offset_not_a_count(shards) -> None:
    # The resume is a seek: what it reads first is the line right after the offset.
    paths, records = shards
    reader = JsonlReader(paths)
    it = iter(reader)
    for _ in range(3):
        next(it)
    state = reader.state_dict()
    assert state["shard"] == 0 and state["shard_name"] == "shard-00.jsonl"
    rest = paths[0].read_bytes()[state["offset"]:].decode()
    first = next(line for line in rest.splitlines() if line.strip())
    assert json.loads(first) == records[3]


def test_loop_counts_epochs_and_resumes_inside_a_later_epoch(shards) -> None:
    paths, records = shards
    n = len(records)
    reader = JsonlReader(paths, loop=True)
    got = list(islice(iter(reader), 2 * n + 5))
    assert got == records + records + records[:5]
    assert reader.state_dict()["epoch"] == 2 and reader.state_dict()["records"] == 2 * n + 5
    fresh = JsonlReader(paths, loop=True)
    fresh.load_state_dict(roundtrip(reader.state_dict()))
    assert list(islice(iter(fresh), n)) == records[5:] + records[:5]
    assert fresh.state_dict()["epoch"] == 3
    reader = JsonlReader(paths, loop=True)
    list(islice(iter(reader), n))  # exactly one epoch consumed: the epoch turns on the next read
    assert reader.state_dict()["epoch"] == 0
    next(iter(reader))
    assert reader.state_dict()["epoch"] == 1


def test_ranks_split_the_shards(tmp_path: Path) -> None:
    paths, records = make_shards(tmp_path, sizes=(3, 4, 5, 6, 2))
    by_shard = [[r for r in records if lo <= r["id"] < hi] for lo, hi in [(0, 3), (3, 7), (7, 12), (12, 18), (18, 20)]]
    r0 = list(JsonlReader(paths, rank=0, world_size=2))
    r1 = list(JsonlReader(paths, rank=1, world_size=2))
    assert r0 == by_shard[0] + by_shard[2] + by_shard[4]
    assert r1 == by_shard[1] + by_shard[3]
    # a rank's state resumes that rank
    reader = JsonlReader(paths, rank=1, world_size=2)
    it = iter(reader)
    for _ in range(5):
        next(it)
    fresh = JsonlReader(paths, rank=1, world_size=2)
    fresh.load_state_dict(roundtrip(reader.state_dict()))
    assert list(fresh) == r1[5:]
    with pytest.raises(ValueError, match="no shard"):
        JsonlReader(paths[:2], rank=2, world_size=3)


# -------------------------------------------------------------------- refusals
def state_after(paths, k: int, **kw: Any) -> dict:
    reader = JsonlReader(paths, **kw)
    it = iter(reader)
    for _ in range(k):
        next(it)
    return roundtrip(reader.state_dict())


def test_refuses_another_world_size_or_shard_count(shards, tmp_path: Path) -> None:
    paths, _ = shards
    state = state_after(paths, 4)
    with pytest.raises(ValueError, match="ranks"):
        JsonlReader(paths, rank=0, world_size=3).load_state_dict(state)
    extra = tmp_path / "shard-03.jsonl"
    extra.write_text('{"id": 99}\n')
    with pytest.raises(ValueError, match="shards"):
        JsonlReader(paths + [extra]).load_state_dict(state)
    with pytest.raises(ValueError):
        JsonlReader(paths[:2]).load_state_dict(state)


def test_refuses_a_renamed_shard(shards, tmp_path: Path) -> None:
    paths, _ = shards
    state = state_after(paths, 10)  # in shard 2 (shard 0 has 7 records, shard 1 one)
    assert state["shard"] == 2
    moved = paths[2].with_name("renamed.jsonl")
    paths[2].rename(moved)
    with pytest.raises(ValueError, match="renamed.jsonl"):
        JsonlReader(paths[:2] + [moved]).load_state_dict(state)


def test_refuses_a_shard_shorter_than_the_offset(shards) -> None:
    paths, records = shards
    state = state_after(paths, 10)
    data = paths[2].read_bytes()
    paths[2].write_bytes(data[: state["offset"] - 1])
    with pytest.raises(ValueError, match="shorter"):
        JsonlReader(paths).load_state_dict(state)
    paths[2].write_bytes(data[: state["offset"]])  # exactly at the offset is fine
    JsonlReader(paths).load_state_dict(state)


@pytest.mark.parametrize("key,value,message", [("shard", 99, "shard is 99, outside from 0 to"),
                                               ("offset", -5, "offset is -5, outside at least 0"),
                                               ("records", 1.5, r"records is 1.5 \(float\), not an integer")])
def test_refuses_a_crafted_position(shards, key: str, value: object, message: str) -> None:
    """A crafted stream position (issue 33 §5) is refused with its key and value before anything changes."""
    paths, _ = shards
    state = state_after(paths, 10) | {key: value}
    with pytest.raises(ValueError, match=message):
        JsonlReader(paths).load_state_dict(state)


def test_finished_reader_stays_finished(shards) -> None:
    paths, _ = shards
    reader = JsonlReader(paths)
    list(reader)
    state = roundtrip(reader.state_dict())
    assert state["shard"] == 3
    fresh = JsonlReader(paths)
    fresh.load_state_dict(state)
    assert list(fresh) == []


# ---------------------------------------------------------------- a real kill
CHILD = textwrap.dedent("""
    import json, sys
    import unbroken
    from unbroken.data import JsonlReader

    paths, run, every = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    reader = JsonlReader(paths)
    meta = {"count": 0}
    state = {"data": reader, "meta": meta}
    ckpt = unbroken.Checkpointer(run, save_every=every, keep_last=2)
    ckpt.restore(state)
    print("START", meta["count"], reader.state_dict()["records"], flush=True)
    for rec in reader:
        print("REC", json.dumps(rec), flush=True)  # "process" the record
        meta["count"] += 1
        if ckpt.step(state) is not None:           # saves every `every` records
            print("SAVED", meta["count"], flush=True)
        print("WAIT", flush=True)                  # the parent decides when we go on
        if sys.stdin.readline().strip() != "go":
            break
    print("DONE", meta["count"], flush=True)
""")


def run_child(paths: list[Path], run: Path, every: int, kill_after: int | None) -> list[str]:
    """Run the reader; SIGKILL it after ``kill_after`` processed records. Returns its lines."""
    proc = subprocess.Popen([sys.executable, "-c", CHILD, json.dumps([str(p) for p in paths]), str(run), str(every)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, encoding="utf-8",
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert proc.stdin is not None and proc.stdout is not None
    lines, done = [], 0
    try:
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if line.startswith("REC"):
                done += 1
            if line.startswith("WAIT"):
                if kill_after is not None and done == kill_after:
                    proc.kill()  # a real SIGKILL, no cleanup in the child
                    break
                proc.stdin.write("go\n")
                proc.stdin.flush()
        lines += [x.rstrip("\n") for x in proc.stdout]
    finally:
        proc.stdin.close()
        rc = proc.wait(timeout=60)
    if kill_after is None:
        assert rc == 0, lines
    else:
        assert rc == -signal.SIGKILL, lines
    return lines


def recs(lines: list[str]) -> list[Any]:
    return [json.loads(x[4:]) for x in lines if x.startswith("REC ")]


@pytest.mark.parametrize("seed", [1, 2])
def test_sigkill_and_resume_commits_every_record_exactly_once(tmp_path: Path, seed: int) -> None:
    (tmp_path / "data").mkdir()
    paths, records = make_shards(tmp_path / "data", sizes=(9, 4, 10))
    every = 4
    kill_after = random.Random(seed).randint(every + 1, len(records) - 2)
    run = tmp_path / "run"

    killed = run_child(paths, run, every, kill_after)
    assert killed[0] == "START 0 0"
    first = recs(killed)
    assert len(first) == kill_after and first == records[:kill_after]
    last_saved = max(int(x.split()[1]) for x in killed if x.startswith("SAVED"))
    assert last_saved == kill_after // every * every

    resumed = run_child(paths, run, every, None)
    # the resumed run starts precisely at the checkpointed record
    assert resumed[0] == f"START {last_saved} {last_saved}"
    second = recs(resumed)
    assert second[0] == records[last_saved]
    assert resumed[-1] == f"DONE {len(records)}"
    # The records the killed run processed after its last checkpoint are read again:
    # that work was lost with the kill (at-least-once), exactly as the model's updates
    # since that checkpoint are. What was committed is every record exactly once.
    assert first[last_saved:] == second[: kill_after - last_saved]
    committed = first[:last_saved] + second
    assert committed == records


# ----------------------------------------------------------------------- Counted
class SkippableSource:
    """An iterable that can fast-forward, and records how it was asked to."""

    def __init__(self, items: list[int]) -> None:
        self.items, self.skips, self._start = items, [], 0

    def skip(self, n: int) -> None:
        self.skips.append(n)
        self._start = n

    def __iter__(self) -> Iterator[int]:
        start, self._start = self._start, 0
        return iter(self.items[start:])


def consume(counted: Counted, k: int) -> list[Any]:
    it = iter(counted)
    return [next(it) for _ in range(k)]


def test_counted_uses_skip_when_the_source_has_it() -> None:
    items = list(range(100, 130))
    assert isinstance(SkippableSource(items), Skippable)
    for k in (0, 1, 17, 30):
        src = SkippableSource(items)
        c = Counted(src)
        assert consume(c, k) == items[:k]
        state = roundtrip(c.state_dict())
        assert state == {"consumed": k}
        src2 = SkippableSource(items)
        c2 = Counted(src2)
        c2.load_state_dict(state)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no replay warning
            assert list(c2) == items[k:]
        assert src2.skips == ([k] if k else [])
        assert c2.consumed == 0  # the pass is complete


def test_counted_replays_without_skip_and_warns() -> None:
    items = [{"i": i} for i in range(25)]
    c = Counted(lambda: iter(items))  # a factory: a fresh iterator per epoch
    assert consume(c, 9) == items[:9]
    fresh = Counted(lambda: (dict(x) for x in items))
    fresh.load_state_dict(roundtrip(c.state_dict()))
    with pytest.warns(UserWarning, match="replaying 9 items"):
        rest = list(fresh)
    assert rest == items[9:]
    assert fresh.consumed == 0  # the pass is complete
    # a plain re-iterable (a list) works the same way
    c = Counted(items)
    consume(c, 4)
    fresh = Counted(items)
    fresh.load_state_dict(c.state_dict())
    with pytest.warns(UserWarning, match="replaying 4"):
        assert list(fresh) == items[4:]


def test_counted_without_restore_neither_skips_nor_warns() -> None:
    src = SkippableSource([1, 2, 3])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert list(Counted(src)) == [1, 2, 3]
        assert list(Counted(lambda: iter([4, 5]))) == [4, 5]
    assert src.skips == []


@pytest.mark.parametrize("skippable", [False, True])
def test_counted_over_several_passes(skippable: bool) -> None:
    # The count is per pass: after a whole pass a resume must not skip past the end
    # (it used to carry on counting, and the replay then raised inside the generator).
    items = list(range(10))
    make = (lambda: SkippableSource(items)) if skippable else (lambda: items)
    c = Counted(make())
    assert list(c) == items
    assert c.state_dict() == {"consumed": 0}
    assert consume(c, 3) == items[:3]
    assert c.state_dict() == {"consumed": 3}
    fresh = Counted(make())
    fresh.load_state_dict(roundtrip(c.state_dict()))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the replay warning (not skippable)
        assert list(fresh) == items[3:]
    assert list(fresh) == items  # and the next pass is whole
    # stopping right after a pass's last item: the resume ends that pass, then a new one
    c = Counted(make())
    assert consume(c, 10) == items
    fresh = Counted(make())
    fresh.load_state_dict(c.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert list(fresh) == []
    assert list(fresh) == items
