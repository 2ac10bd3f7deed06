"""Incremental checkpoints in one process: what is written, what is shared, damaged chunks,
retention and tags, garbage collection, export, hostile chunk maps, S3 and a remote tier."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import unbroken
from unbroken.checkpoint.chunks import chunk_id, collect
from unbroken.errors import CorruptCheckpointError
from unbroken.format import chunkmap
from unbroken.format.manifest import FileEntry, Manifest
from unbroken.policies import KeepBest
from unbroken.checkpoint.reader import read_manifest
from unbroken.store import open_store

from typer.testing import CliRunner

from unbroken.cli import app


def run_cli(*args: str):
    return CliRunner().invoke(app, list(args))


class Lora(torch.nn.Module):
    """A frozen base and a low-rank adapter: what incremental checkpoints are for."""

    def __init__(self, seed: int = 0, n: int = 256) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.base = torch.nn.Linear(n, n)
        self.base.requires_grad_(False)
        self.a = torch.nn.Parameter(torch.randn(4, n) * 0.01)
        self.b = torch.nn.Parameter(torch.zeros(n, 4))  # zeros, like LoRA's B: equal bytes to "zeros" below
        self.register_buffer("zeros", torch.zeros(n, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + x @ self.a.T @ self.b.T


def make(seed: int = 0) -> dict:
    model = Lora(seed)
    opt = torch.optim.AdamW([model.a, model.b], lr=0.05)
    return {"model": model, "optimizer": opt}


def train(state: dict, n: int = 1) -> None:
    for _ in range(n):
        loss = state["model"](torch.randn(8, 256)).pow(2).mean()
        loss.backward()
        state["optimizer"].step()
        state["optimizer"].zero_grad()


def flat(state: dict) -> dict[str, torch.Tensor]:
    out = {f"model/{k}": v.clone() for k, v in state["model"].state_dict().items()}
    for i, s in state["optimizer"].state_dict()["state"].items():
        out.update({f"opt/{i}/{k}": v.clone() for k, v in s.items()})
    return out


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def ckpt(run: Path, **kw) -> unbroken.Checkpointer:
    kw.setdefault("keep_last", None)
    kw.setdefault("save_every", 1)
    return unbroken.Checkpointer(run, incremental=True, preemption=None, **kw)


def manifests(run: Path) -> dict[str, Manifest]:
    store = open_store(run)
    return {n: read_manifest(store, n) for n in store.list_committed()}


def chunk_of(run: Path, tensor: torch.Tensor) -> Path:
    return run / "chunks" / chunk_id(tensor.contiguous().reshape(-1).view(torch.uint8).numpy())


def test_unchanged_tensors_are_written_once_and_resume_is_exact(tmp_path: Path) -> None:
    run, state = tmp_path / "run", make()
    c = ckpt(run)
    c.restore(state)
    stats = []
    for _ in range(4):
        train(state)
        c.step(state)
        stats.append(c.run.chunks.last)
    c.close()
    frozen = sum(t.numel() * t.element_size() for t in state["model"].base.state_dict().values())
    assert stats[0].written_bytes > frozen
    for s in stats[1:]:  # later saves: only the adapter, its optimizer state and the RNG/step values
        assert s.reused_bytes >= frozen and s.written_bytes < frozen / 4
    ms = manifests(run)
    assert all(m.format_version == 3 for m in ms.values())
    assert chunk_of(run, state["model"].base.weight).is_file()
    # every checkpoint folder holds only small files: the tensor bytes are in chunks/
    for name in ms:
        assert not list((run / name).glob("*.safetensors"))
    fresh = make(seed=1)
    c2 = ckpt(run)
    info = c2.restore(fresh)
    c2.close()
    assert info is not None and info.step == 4 and same(flat(fresh), flat(state))


def test_equal_bytes_in_two_places_are_two_tensors_after_restore(tmp_path: Path) -> None:
    """LoRA's B starts at zeros, like the ``zeros`` buffer: one chunk, but restored as two tensors
    (an in-place update of one must not change the other)."""
    run, state = tmp_path / "run", make()
    c = ckpt(run)
    c.step(state)
    c.close()
    m = next(iter(manifests(run).values()))
    assert chunk_of(run, state["model"].b).name in m.chunks
    fresh = make(seed=3)
    unbroken.load(run, fresh)
    assert fresh["model"].b.data_ptr() != fresh["model"].zeros.data_ptr()
    with torch.no_grad():
        fresh["model"].b.add_(1.0)
    assert torch.equal(fresh["model"].zeros, torch.zeros(256, 4))
    loaded = unbroken.load(run)
    b, z = loaded["model"]["b"], loaded["model"]["zeros"]
    b.add_(1.0)
    assert torch.equal(z, torch.zeros(256, 4))


def test_a_damaged_shared_chunk_is_reported_everywhere_and_restore_falls_back_past_all(tmp_path: Path) -> None:
    run, state = tmp_path / "run", make()
    c = ckpt(run)
    train(state)
    c.step(state)
    first = flat(state)
    with torch.no_grad():  # a new "base" from the 2nd save on: saves 2-4 share it, save 1 does not
        state["model"].base.weight.mul_(0.5)
    for _ in range(3):
        train(state)
        c.step(state)
    c.close()
    shared = chunk_of(run, state["model"].base.weight)
    users = sorted(n for n, m in manifests(run).items() if shared.name in m.chunks)
    assert len(users) == 3
    raw = bytearray(shared.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    shared.write_bytes(bytes(raw))

    result = run_cli("verify", str(run))
    assert result.exit_code == 1
    for name in users:
        assert f"{name}" in result.output and shared.name[:16] in result.output
    assert "ok" in result.output  # the first checkpoint does not use it
    for name in users:
        with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
            unbroken.verify(run / name)

    fresh = make(seed=7)
    c2 = ckpt(run)
    info = c2.restore(fresh)
    assert info is not None and info.step == 1 and same(flat(fresh), first)
    quarantine = run / "quarantine"
    assert sorted(p.name for p in quarantine.iterdir() if p.is_dir() and p.name != "chunks") == users
    assert (quarantine / "chunks" / shared.name).is_file()
    assert not shared.exists()
    train(fresh)
    with torch.no_grad():
        fresh["model"].base.weight.mul_(0.5)
    c2.step(fresh)  # the damaged chunk is written again (the base is the restored checkpoint)
    c2.close()
    for name in manifests(run):
        unbroken.verify(run / name)


def test_retention_keep_best_and_tags_collect_exactly_the_unused_chunks(tmp_path: Path) -> None:
    run, state = tmp_path / "run", make()
    c = ckpt(run, keep_last=2, retention=KeepBest(1, "val", "min"))
    losses = [5.0, 1.0, 4.0, 3.0, 6.0, 7.0, 8.0]
    for i, v in enumerate(losses):
        train(state)
        c.step(state, val=v)
        if i == 2:
            c.tag("keep-me")
            at_tag = flat(state)
    c.close()
    ms = manifests(run)
    assert sorted(m.step for m in ms.values()) == [2, 3, 6, 7]  # best (val 1.0), tagged, last two
    used = set().union(*(m.chunks for m in ms.values()))
    assert set(open_store(run).list_chunks()) == used
    for name in ms:
        unbroken.verify(run / name)
    tagged = make(seed=2)
    unbroken.load(run, tagged, tag="keep-me")
    assert same(flat(tagged), at_tag)


def test_collection_refuses_to_sweep_when_a_manifest_is_unreadable(tmp_path: Path) -> None:
    run, state = tmp_path / "run", make()
    c = ckpt(run)
    for _ in range(3):
        train(state)
        c.step(state)
    c.close()
    store = open_store(run)
    before = set(store.list_chunks())
    (run / "step-000000003" / "manifest.json").write_text("{}")
    garbage = run / "chunks" / ("0" * 64)
    garbage.write_bytes(b"left by a save that died")
    out = collect(store)
    assert out.deleted == [] and "unreadable" in out.skipped
    assert set(store.list_chunks()) == before | {garbage.name}
    (run / "step-000000003").rename(tmp_path / "moved-away")
    out = collect(store)
    assert garbage.name in out.deleted
    for name in store.list_committed():
        unbroken.verify(run / name)


def test_export_writes_a_self_contained_checkpoint(tmp_path: Path) -> None:
    run, state = tmp_path / "run", make()
    c = ckpt(run)
    train(state, 2)
    c.step(state)
    c.close()
    result = run_cli("export", str(run), "--to", str(tmp_path / "copy"), "--format", "checkpoint")
    assert result.exit_code == 0, result.output
    m = read_manifest(open_store(tmp_path), "copy")
    assert m.format_version == 2 and not m.chunks
    import shutil

    shutil.rmtree(run)  # the copy needs nothing of the run
    unbroken.verify(tmp_path / "copy")
    fresh = make(seed=9)
    unbroken.load(tmp_path / "copy", fresh)
    assert same(flat(fresh), flat(state))


def entry(size: int) -> FileEntry:
    return FileEntry(size, "0" * 32)


@pytest.mark.parametrize("doc,match", [
    ({"format": "unbroken-chunkmap", "tensors": {"w": {"dtype": "F32", "shape": [2], "chunk": "../" + "a" * 61}}},
     "invalid chunk id"),
    ({"format": "unbroken-chunkmap", "tensors": {"w": {"dtype": "F32", "shape": [2], "chunk": "b" * 64}}},
     "does not list"),
    ({"format": "unbroken-chunkmap", "tensors": {"w": {"dtype": "F32", "shape": [3], "chunk": "a" * 64}}},
     "does not fit"),
    ({"format": "unbroken-chunkmap", "tensors": {"w": {"dtype": "F32", "shape": [2 ** 40, 2 ** 40],
                                                       "chunk": "a" * 64}}}, "bad shape"),
    ({"format": "unbroken-chunkmap", "tensors": {"w": {"dtype": "F32", "shape": [0, 2 ** 61, 2 ** 61],
                                                       "chunk": "a" * 64}}}, "bad shape"),
    ({"format": "unbroken-chunkmap", "tensors": {"w": {"dtype": "object", "shape": [2], "chunk": "a" * 64}}},
     "unknown dtype"),
    ({"format": "unbroken-chunkmap", "tensors": {"w": {"dtype": "F32", "shape": [-2], "chunk": "a" * 64}}},
     "bad shape"),
    ({"format": "unbroken-chunkmap", "tensors": {"w": {"dtype": "F32", "shape": [2], "chunk": "a" * 64,
                                                       "exec": "x"}}}, "malformed entry"),
    ({"format": "pickle", "tensors": {}}, "not a chunk map"),
])
def test_hostile_chunk_maps_are_refused(doc: dict, match: str) -> None:
    files = {"@" + "a" * 64: entry(8)}
    with pytest.raises(CorruptCheckpointError, match=match):
        chunkmap.decode(json.dumps(doc).encode(), "t00-model.chunks.json", files)


def test_manifest_chunk_ids_are_checked(tmp_path: Path) -> None:
    m = Manifest(step=1, seq=0, files={"state.json": entry(2), "@" + "c" * 64: entry(8)})
    assert m.format_version == 3
    raw = m.to_json()
    assert Manifest.from_json(raw).chunks == {"c" * 64: entry(8)}
    assert Manifest(step=1, seq=0, files={"state.json": entry(2)}).format_version == 2
    bad = Manifest(step=1, seq=0, files={"state.json": entry(2), "@" + "../etc/passwd".ljust(64, "x"): entry(8)})
    with pytest.raises(CorruptCheckpointError, match="invalid chunk id"):
        Manifest.from_json(bad.to_json())


def test_a_missing_chunk_is_corruption_not_a_crash(tmp_path: Path) -> None:
    run, state = tmp_path / "run", make()
    c = ckpt(run)
    train(state)
    c.step(state)
    c.close()
    os.unlink(chunk_of(run, state["model"].a))
    with pytest.raises(CorruptCheckpointError, match="missing"):
        unbroken.verify(run / "step-000000001")
    fresh = make(seed=4)  # another adapter: the live state cannot give the chunk back
    c2 = ckpt(run)
    with pytest.raises(unbroken.NoValidCheckpointError, match="step-000000001.*chunk .* is missing"):
        c2.restore(fresh)  # never a silent restart from step 0
    assert c2.restore(fresh, if_unrestorable="start_fresh") is None  # on purpose
    c2.close()


def test_s3_run_and_collection(tmp_path: Path, s3, s3_url: str) -> None:
    state = make()
    c = unbroken.Checkpointer(s3_url, incremental=True, keep_last=2, save_every=1, preemption=None,
                              storage_options=s3.storage_options)
    c.restore(state)
    for _ in range(4):
        train(state)
        c.step(state)
    assert c.run.chunks.last.reused_bytes > 0
    c.close()
    store = open_store(s3_url, s3.storage_options)
    names = store.list_committed()
    assert len(names) == 2
    used = set().union(*(read_manifest(store, n).chunks for n in names))
    assert set(store.list_chunks()) == used  # the chunks of the two pruned checkpoints are gone
    assert "chunks" not in store.list_uncommitted()
    fresh = make(seed=5)
    c2 = unbroken.Checkpointer(s3_url, incremental=True, keep_last=2, preemption=None,
                               storage_options=s3.storage_options)
    info = c2.restore(fresh)
    c2.close()
    assert info is not None and info.step == 4 and same(flat(fresh), flat(state))


def test_remote_tier_gets_only_new_chunks_and_restores_after_local_loss(tmp_path: Path, s3, s3_url: str) -> None:
    import shutil

    state = make()
    remote = unbroken.Remote(s3_url, keep_last=3, storage_options=s3.storage_options, retry_wait_s=0.5,
                             retry_max_wait_s=1.0, close_timeout_s=60)
    c = unbroken.Checkpointer(tmp_path / "run", incremental=True, keep_last=2, save_every=1, remote=remote,
                              preemption=None)
    c.restore(state)
    for _ in range(5):
        train(state)
        c.step(state)
    assert c.wait(60)
    c.close()
    store = open_store(s3_url, s3.storage_options)
    names = store.list_committed()
    assert len(names) == 3
    used = set().union(*(read_manifest(store, n).chunks for n in names))
    assert set(store.list_chunks()) == used
    shutil.rmtree(tmp_path / "run")
    fresh = make(seed=6)
    c2 = unbroken.Checkpointer(tmp_path / "run", incremental=True, keep_last=2, remote=remote, preemption=None)
    info = c2.restore(fresh)
    c2.close()
    assert info is not None and info.step == 5 and same(flat(fresh), flat(state))
    local = open_store(tmp_path / "run")
    for name in local.list_committed():
        unbroken.verify(tmp_path / "run" / name)


def test_switching_incremental_on_and_off_in_one_run(tmp_path: Path) -> None:
    """Full checkpoints, then incremental ones, then full again, in one run: each restore is
    exact, and once retention has deleted every incremental checkpoint a plain (not
    incremental) Checkpointer collects the chunks they left."""
    run, state = tmp_path / "run", make()
    history = []
    for incremental in (False, True, False):
        c = unbroken.Checkpointer(run, incremental=incremental, keep_last=2, save_every=1, preemption=None)
        fresh = make(seed=11)
        info = c.restore(fresh)
        if history:
            assert info is not None and info.step == len(history) and same(flat(fresh), history[-1])
        state = fresh if history else state
        for _ in range(3):
            train(state)
            c.step(state)
            history.append(flat(state))
        kinds = {m.format_version for m in manifests(run).values()}
        assert kinds == ({3} if incremental else {2})
        c.close()
    assert manifests(run) and open_store(run).list_chunks() == {}


def test_a_resized_chunk_is_quarantined_and_a_quarantined_checkpoint_still_loads(tmp_path: Path) -> None:
    run, state = tmp_path / "run", make()
    c = ckpt(run)
    train(state)
    c.step(state)
    c.close()
    target = chunk_of(run, state["model"].a)
    target.write_bytes(target.read_bytes() + b"x")
    c2 = ckpt(run)
    with pytest.raises(unbroken.NoValidCheckpointError, match="4097 bytes"):  # the only checkpoint is damaged
        c2.restore(make(seed=2))
    c2.close()
    assert (run / "quarantine" / "chunks" / target.name).is_file() and not target.exists()
    # the quarantined checkpoint keeps its other chunks in the run: it is inspectable, and loads
    # once the damaged chunk is put back
    target.write_bytes((run / "quarantine" / "chunks" / target.name).read_bytes()[:-1])
    fresh = make(seed=8)
    unbroken.load(run / "quarantine" / "step-000000001", fresh)
    assert same(flat(fresh), flat(state))


def test_verify_checks_that_a_chunk_is_what_its_name_says(tmp_path: Path) -> None:
    """A chunk whose bytes do not have the SHA-256 it is named by (and whose xxh3 the manifest
    agrees with: a manifest written for the wrong id) is found by `unbroken verify`."""
    run, state = tmp_path / "run", make()
    c = ckpt(run)
    train(state)
    c.step(state)
    c.close()
    name = "step-000000001"
    store = open_store(run)
    m = read_manifest(store, name)
    good = chunk_of(run, state["model"].a).name
    wrong = "f" * 64
    os.rename(run / "chunks" / good, run / "chunks" / wrong)
    files = {("@" + wrong if k == "@" + good else k): v for k, v in m.files.items()}
    mapname = next(f for f in files if f.startswith("t00"))
    raw = (run / name / mapname).read_bytes().replace(good.encode(), wrong.encode())
    (run / name / mapname).write_bytes(raw)
    import xxhash

    files[mapname] = FileEntry(len(raw), xxhash.xxh3_128(raw).hexdigest())
    (run / name / "manifest.json").write_bytes(Manifest(step=m.step, seq=m.seq, files=files, created=m.created,
                                                        progress=m.progress).to_json())
    unbroken.load(run / name)  # a restore checks the checksum, which agrees
    with pytest.raises(CorruptCheckpointError, match="SHA-256"):
        unbroken.verify(run / name)


def test_cli_inspect_lists_the_tensors_of_an_incremental_checkpoint(tmp_path: Path) -> None:
    run, state = tmp_path / "run", make()
    c = ckpt(run)
    train(state)
    c.step(state)
    c.close()
    path = str(run / "step-000000001")
    result = run_cli("inspect", path)
    assert result.exit_code == 0, result.output
    assert "incremental:" in result.output and "model/base.weight" in result.output
    doc = json.loads(run_cli("inspect", path, "--json").output)
    by_name = {t["name"]: t for t in doc["tensors"]}
    assert by_name["model/base.weight"]["shape"] == [256, 256]
    assert by_name["model/base.weight"]["chunk"] == chunk_of(run, state["model"].base.weight).name
    assert set(doc["chunks"]) == set(read_manifest(open_store(run), "step-000000001").chunks)
    assert not any(f.startswith("@") for f in doc["files"])
    result = run_cli("inspect", path, "--tensor", "model/a")
    assert result.exit_code == 0 and "shape [4, 256]" in result.output, result.output


def test_restore_by_tag_or_path_dedups_only_against_the_same_run(tmp_path: Path) -> None:
    """A checkpoint of this run restored by tag or path is the base of the next save (its frozen
    chunks are reused); one of another run is not (its chunks are not in this run's store)."""
    run, other, state = tmp_path / "run", tmp_path / "other", make()
    c = ckpt(run)
    train(state)
    c.step(state)
    c.tag("first")
    train(state)
    c.step(state)
    c.close()
    o = ckpt(other)
    o.step(make(seed=5))
    o.close()
    frozen = state["model"].base.weight.numel() * 4
    for how in ("tag", "path"):
        fresh = make(seed=6)
        c = ckpt(run)
        if how == "tag":
            c.restore(fresh, tag="first")
        else:
            c.restore(fresh, run / "step-000000001")
        train(fresh)
        c.step(fresh)
        assert c.run.chunks.last.reused_bytes >= frozen, how
        c.close()
    fresh = make(seed=5)
    c = ckpt(run)
    c.restore(fresh, other / "step-000000001")
    c.step(fresh)
    # (within the save, B and the zeros buffer still share one chunk)
    assert c.run.chunks.last.reused_bytes < frozen < c.run.chunks.last.written_bytes
    c.close()
    for name in manifests(run):
        unbroken.verify(run / name)
