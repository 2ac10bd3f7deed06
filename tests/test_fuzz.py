"""Fuzz tests (hypothesis) of everything a checkpoint holds: whatever the bytes, reading them
either works or raises ``CorruptCheckpointError`` (``NewerFormatError`` for a newer format
version; ``StateMismatchError`` where a restore does not fit the live objects) - never a
``KeyError``, ``TypeError``, ``struct.error``, ``MemoryError``, ``RecursionError``,
``OverflowError``, a crash or a hang.

Targets, each fed small inputs, each case under a hang guard (:func:`bounded`):

* ``manifest.json``: random byte flips, inserts and deletes of a valid manifest, with and
  without a re-sealed self-checksum trailer; random JSON values in every field (and in the
  file entries), re-sealed so that they reach the field checks.
* tensor file headers: random headers from strategies (known, unknown and non-string dtypes;
  huge, negative and non-integer dimensions; overlapping and out-of-range offsets; duplicate
  keys; deep nesting; ``NaN``; non-UTF-8 bytes; wrong header lengths), near-valid files with
  one field perturbed, and byte mutations of real files. Whatever is accepted must load, give
  every tensor the bytes its entry names, and match the official ``safetensors`` reader.
* ``state.json`` trees: mutations of a real state tree (every supported type, numpy and torch
  generators, the global RNG and ``Progress``) read through the real reader and restored
  into live objects, random tagged trees for the decoder, and random global-RNG and progress
  states for ``GlobalRNG.check``/``Progress.check``: a state they accept must load, and every
  generator decoded must draw (an unchecked numpy position crashed the process).

Examples per target: ``UNBROKEN_FUZZ_EXAMPLES`` (default 500, about 25 s for the file on
two slow cores). A long run (about 50k examples per target; hours on two cores)::

    UNBROKEN_FUZZ_EXAMPLES=50000 .venv/bin/python -m pytest tests/test_fuzz.py -q -p no:cacheprovider
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import random
import re
import string
import struct
from collections import OrderedDict
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from collections.abc import Iterator

import numpy as np
import pytest
import safetensors.torch
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import unbroken
from unbroken.errors import CorruptCheckpointError, NewerFormatError, StateMismatchError
from unbroken.format.manifest import FORMAT_VERSION, MANIFEST, TRAILER_END, TRAILER_KEY, FileEntry, Manifest, new_hasher
from unbroken.format.tensorfile import ST_TO_DTYPE, TensorEntry, load_tensor_file, parse_header, write_tensor_file
from unbroken.checkpoint.reader import read_checkpoint
from unbroken.state.apply import apply_state
from unbroken.state.decoder import Decoder
from unbroken.state.rng import GlobalRNG
from unbroken.state.stateful import Progress

from hang import hang_guard

EXAMPLES = int(os.environ.get("UNBROKEN_FUZZ_EXAMPLES", "400"))
CASE_LIMIT_S = 120.0
"""A hang guard, not a time limit: one small case takes milliseconds, but a loaded machine may stop this
worker for seconds, and a slow case is not a failure. Only a case that never ends is."""
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))


def category(e: Exception) -> str:
    """A refusal's kind, for the statistics (pytest --hypothesis-show-statistics)."""
    text = re.sub(r"'[^']*'|\"[^\"]*\"|[0-9]+", "_", str(e))
    return re.sub(r"^[^ ]*(safetensors|json|mem:ck): ", "", text)[:40]


def bounded(limit: float = CASE_LIMIT_S) -> Any:
    """Fail (instead of hanging the run) if a case never ends: a hang guard (:mod:`hang`), not a time limit."""
    return hang_guard(limit, "a fuzz case")


@contextmanager
def global_rng_kept() -> Iterator[None]:
    py, npst, cpu = random.getstate(), np.random.get_state(), torch.get_rng_state()
    try:
        yield
    finally:
        random.setstate(py)
        np.random.set_state(npst)
        torch.set_rng_state(cpu)


# ------------------------------------------------------------------ JSON values

SPECIAL_INTS = [0, 1, -1, 3, 4, 5, 8, 623, 624, 625, 5056, 2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64,
                -(2**63), 10**20, 10**300, 10**400]
SPECIAL_STRS = ["", "nan", "inf", "-inf", "\ud800", "a\udfff", "é", "\x00", "state.json", "manifest.json", "../x",
                "/etc/passwd", "MT19937", "PCG64", "Philox", "SFC64", "F32", "U8", "<u4", "<f8", "float32", "cpu",
                "cuda", "cuda:1", "meta", "mps", "0x10", "-0x1", "zz", "7ff8000000000001", "eHk=", "@", "v"]
TAGS = sorted(name[3:] for name in vars(Decoder) if name.startswith("_d_")) + ["nope", "__class__", "_node"]
FIELDS = ["v", "hex", "b64", "bits", "dtype", "file", "key", "state", "device", "class", "items", "ordered",
          "meta", "requires_grad", "complex", "posix", "fqn", "shape", "bit_generator", "pos", "has_gauss"]

leaves = (st.none() | st.booleans() | st.integers() | st.sampled_from(SPECIAL_INTS) | st.floats()
          | st.text(max_size=8) | st.sampled_from(SPECIAL_STRS))
keys = st.text(max_size=6) | st.sampled_from(FIELDS + SPECIAL_STRS)
jvalues = st.recursive(leaves, lambda c: st.lists(c, max_size=4) | st.dictionaries(keys, c, max_size=4),
                       max_leaves=12)


def tagged(children: st.SearchStrategy[Any]) -> st.SearchStrategy[dict[str, Any]]:
    """A node of the state tree: a known (or unknown) tag and some of the fields tags use."""
    field_values = children | st.sampled_from(SPECIAL_STRS) | st.sampled_from(SPECIAL_INTS)
    return st.fixed_dictionaries({"@": st.sampled_from(TAGS)},
                                 optional=dict.fromkeys(FIELDS, field_values))


trees = st.recursive(leaves, lambda c: st.lists(c, max_size=4) | st.dictionaries(keys, c, max_size=3) | tagged(c),
                     max_leaves=16)


# Mostly ASCII (so that most mutations keep the text UTF-8 and reach the JSON parser and beyond).
some_bytes = (st.text(string.printable, min_size=1, max_size=8).map(str.encode) | st.binary(min_size=1, max_size=8)
              | st.sampled_from([b"{", b"}", b"[", b'"', b",", b":", b"\\", b"\xff", b"NaN", b"1e999", b"-",
                                 b"0" * 40]))


def mutate_bytes(data: st.DataObject, raw: bytes) -> bytes:
    """1 to 4 random byte flips, inserts, deletes or overwrites."""
    buf = bytearray(raw)
    for _ in range(data.draw(st.integers(1, 4))):
        op = data.draw(st.sampled_from(["flip", "insert", "delete", "overwrite"]))
        pos = data.draw(st.integers(0, len(buf)))
        if op == "flip" and pos < len(buf):
            buf[pos] ^= data.draw(st.integers(1, 127) | st.integers(128, 255))
        elif op == "insert":
            buf[pos:pos] = data.draw(some_bytes)
        elif op == "delete":
            del buf[pos : pos + data.draw(st.integers(1, 8))]
        else:
            new = data.draw(some_bytes)
            buf[pos : pos + len(new)] = new
    return bytes(buf)


def mutate_tree(data: st.DataObject, node: Any, depth: int = 0) -> Any:
    """``node`` with one place replaced, tweaked, dropped or added (a copy; ``node`` is kept)."""
    if isinstance(node, (dict, list)) and node and depth < 40 and (depth < 2 or data.draw(st.integers(0, 4)) > 0):
        if isinstance(node, dict):
            k = data.draw(st.sampled_from(list(node)))
            return {**node, k: mutate_tree(data, node[k], depth + 1)}
        i = data.draw(st.integers(0, len(node) - 1))
        return node[:i] + [mutate_tree(data, node[i], depth + 1)] + node[i + 1 :]
    op = data.draw(st.sampled_from(["value", "tagged", "tweak", "drop", "add", "wrap"]))
    if op == "value":
        return data.draw(jvalues)
    if op == "tagged":
        return data.draw(tagged(jvalues))
    if op == "tweak":
        if type(node) is int:
            return node + data.draw(st.sampled_from([1, -1, 2**32, -(2**32), 10**6, 2**64])) * data.draw(
                st.sampled_from([1, -1]))
        if type(node) is str:
            return data.draw(st.sampled_from(SPECIAL_STRS + [node[:-1], node + "x", node.upper()]))
        if type(node) is list:
            return node[:-1] if node and data.draw(st.booleans()) else node + [data.draw(jvalues)]
        return data.draw(leaves)
    if op == "drop" and isinstance(node, dict) and node:
        k = data.draw(st.sampled_from(list(node)))
        return {a: b for a, b in node.items() if a != k}
    if op == "add" and isinstance(node, dict):
        return {**node, data.draw(keys): data.draw(jvalues)}
    if op == "wrap":
        return data.draw(st.sampled_from([[node], {"@": "tuple", "v": [node]}, {"@": "stateful", "class": "x",
                                                                                 "v": node}]))
    return data.draw(jvalues)


# ------------------------------------------------------------------- manifests

def seal(prefix: bytes) -> bytes:
    """``prefix`` (a manifest without its trailer) with a valid self-checksum trailer."""
    h = new_hasher()
    h.update(prefix)
    return prefix + TRAILER_KEY + h.hexdigest().encode() + TRAILER_END


def manifest_prefix(raw: bytes) -> bytes:
    return raw[: -len(TRAILER_KEY) - 32 - len(TRAILER_END)]


VALID_MANIFEST = Manifest(step=20, seq=3, files={"state.json": FileEntry(120, "0" * 32),
                                                 "t00-model.safetensors": FileEntry(4096, "ab" * 16)},
                          created=1_700_000_000.5, metrics={"loss": 0.25, "acc": 1}, progress={"step": 20, "epoch": 2},
                          environment={"python": "3.11", "data": {"files": [], "count": 0}}, probe={"p": 1.5},
                          tags=["best"], world_size=2).to_json()


def check_manifest(raw: bytes) -> None:
    """``Manifest.from_json(raw)`` works or raises a checkpoint error; what it accepts is usable."""
    with bounded():
        try:
            m = Manifest.from_json(raw)
        except NewerFormatError:
            event("manifest: newer format")
            doc = json.loads(raw)
            assert type(doc["format_version"]) is int and doc["format_version"] > FORMAT_VERSION
            return
        except CorruptCheckpointError as e:
            event(f"manifest: refused ({category(e)})")
            return
        event("manifest: accepted")
        # What the rest of unbroken does with a manifest must work: print it, index it, rewrite it.
        import datetime
        import sqlite3

        datetime.datetime.fromtimestamp(m.created)
        assert m.total_bytes >= 0
        again = Manifest.from_json(m.to_json())
        assert dataclasses.asdict(again) == dataclasses.asdict(m) or any(
            v != v for v in m.probe.values())  # NaN probe values compare unequal
        json.dumps([m.metrics, m.progress, m.environment, m.tags])
        db = sqlite3.connect(":memory:")
        db.execute("CREATE TABLE c (step INTEGER, seq INTEGER, epoch INTEGER, created REAL, kind TEXT, size INTEGER)")
        db.execute("INSERT INTO c VALUES (?, ?, ?, ?, ?, ?)",
                   (m.step, m.seq, m.progress.get("epoch"), m.created, m.kind, m.total_bytes))
        db.close()


@FUZZ
@given(data=st.data(), reseal=st.booleans())
def test_manifest_byte_mutations(data: st.DataObject, reseal: bool) -> None:
    if reseal:
        raw = seal(mutate_bytes(data, manifest_prefix(VALID_MANIFEST)))
    else:
        raw = mutate_bytes(data, VALID_MANIFEST)
    check_manifest(raw)


MANIFEST_FIELDS = ["format", "format_version", "step", "seq", "kind", "tags", "probe", "created", "metrics", "progress",
                   "world_size", "files", "environment"]


@FUZZ
@given(data=st.data())
def test_manifest_field_values(data: st.DataObject) -> None:
    doc = json.loads(VALID_MANIFEST)
    doc.pop("manifest_xxh3_128")
    for _ in range(data.draw(st.integers(1, 3))):
        where = data.draw(st.sampled_from(MANIFEST_FIELDS + ["file entry", "file field", "new file", "drop"]))
        files = doc.get("files")
        if where in ("file entry", "file field", "new file") and not isinstance(files, dict):
            files = doc["files"] = {}
        if where == "file entry":
            name = data.draw(st.sampled_from(sorted(files) or ["state.json"]))
            files[name] = data.draw(jvalues)
        elif where == "file field":
            name = data.draw(st.sampled_from(sorted(files) or ["state.json"]))
            entry = dict(files[name]) if isinstance(files.get(name), dict) else {}
            entry[data.draw(st.sampled_from(["size", "xxh3_128", "extra"]))] = data.draw(
                jvalues | st.sampled_from(["0" * 32, "A" * 32, "g" * 32]))
            files[name] = entry
        elif where == "new file":
            files[data.draw(keys)] = {"size": data.draw(st.sampled_from(SPECIAL_INTS)), "xxh3_128": "1" * 32}
        elif where == "drop":
            doc.pop(data.draw(st.sampled_from(MANIFEST_FIELDS)), None)
        elif where == "format_version":
            doc[where] = data.draw(st.integers(-2, 5) | jvalues)
        else:
            doc[where] = data.draw(jvalues)
    text = json.dumps(doc, indent=1, allow_nan=True).encode("utf-8", "surrogatepass")
    assert text.endswith(b"\n}")
    check_manifest(seal(text[:-2]))


# ---------------------------------------------------------------- tensor files

dtype_names = st.sampled_from(sorted(ST_TO_DTYPE))
bad_dtypes = st.sampled_from(["F128", "float32", "f32", "", "C64", "BOOL ", "I4"]) | jvalues
dims = (st.integers(0, 4) | st.sampled_from([2**31, 2**40, 2**62, 2**63 - 1, 2**63, 2**64, -1, -(2**63)])
        | st.floats() | st.booleans() | st.text(max_size=2) | st.none() | st.lists(st.integers(0, 2), max_size=2))
offsets = st.integers(-2, 80) | st.sampled_from([2**63 - 1, 2**63, 2**64, -(2**63)]) | st.floats() | st.booleans()


class Raw:
    """Verbatim JSON text inside a generated header (NaN, deep nesting, broken syntax)."""

    def __init__(self, text: str) -> None:
        self.text = text


class Obj(list):  # type: ignore[type-arg]
    """A JSON object being built: its ``(key, value)`` pairs, duplicates allowed (told apart
    from a generated JSON array, which may hold anything, by its type)."""


def dump(v: Any) -> str:
    if isinstance(v, Raw):
        return v.text
    if type(v) is Obj:
        return "{" + ",".join(json.dumps(k) + ":" + dump(x) for k, x in v) + "}"
    if isinstance(v, list) and any(isinstance(x, (Raw, Obj)) for x in v):
        return "[" + ",".join(dump(x) for x in v) + "]"
    return json.dumps(v)


raw_values = st.builds(Raw, st.sampled_from(["NaN", "Infinity", "-Infinity", "1e999", "[", "{", "}", '"\\ud800"',
                                             "01", "1.", "tru", '"\\x"'])
                       | st.integers(1, 3000).map(lambda k: "[" * k + "]" * k)
                       | st.integers(1, 3000).map(lambda k: '{"a":' * k + "1" + "}" * k))


@st.composite
def tensor_files(draw: Any) -> bytes:
    """A safetensors file: a valid layout of a few tensors, then 0 to 3 defects (a field made
    wrong, garbage or raw JSON text in an entry, an extra or missing field, a duplicate key,
    odd ``__metadata__``, a non-UTF-8 byte, a wrong header length, a wrong data length)."""
    specs = draw(st.lists(st.tuples(dtype_names, st.lists(st.integers(0, 3), max_size=3)), max_size=5))
    order = draw(st.permutations(range(len(specs))))
    spans: dict[int, list[int]] = {}
    pos = 0
    for i in order:
        dtype, shape = specs[i]
        n = ST_TO_DTYPE[dtype].itemsize * int(np.prod(shape, dtype=np.int64))
        spans[i] = [pos, pos + n]
        pos += n
    names = draw(st.lists(st.text(max_size=4), min_size=len(specs), max_size=len(specs), unique=True))
    pairs: Any = Obj((names[i], Obj([("dtype", d), ("shape", sh), ("data_offsets", spans[i])]))
                     for i, (d, sh) in enumerate(specs))
    if draw(st.booleans()):
        pairs.insert(draw(st.integers(0, len(pairs))), ("__metadata__", Obj([("format", "pt")])))
    data_len, n_delta, junk = pos, 0, b""
    for _ in range(draw(st.sampled_from([0, 0, 1, 1, 1, 2, 3]))):
        defect = draw(st.sampled_from(["field", "field", "garbage", "raw", "extra", "missing", "order", "duplicate",
                                       "metadata", "key", "utf8", "header length", "data length", "top"]))
        i = draw(st.integers(0, len(pairs) - 1)) if pairs else None
        entry = pairs[i][1] if i is not None and type(pairs[i][1]) is Obj and len(pairs[i][1]) == 3 else None
        if defect == "field" and entry is not None:
            j = draw(st.integers(0, 2))
            entry[j] = (entry[j][0], draw([bad_dtypes, st.lists(dims, max_size=4) | jvalues,
                                           st.lists(offsets, max_size=3) | jvalues][j]))
        elif defect == "garbage" and i is not None:
            pairs[i] = (pairs[i][0], draw(jvalues))
        elif defect == "raw" and entry is not None:
            j = draw(st.integers(0, 2))
            entry[j] = (entry[j][0], draw(raw_values))
        elif defect == "extra" and entry is not None:
            entry.append((draw(st.sampled_from(["dtype", "shape", "data_offsets", "extra"])), draw(jvalues)))
        elif defect == "missing" and entry is not None:
            del entry[draw(st.integers(0, 2))]
        elif defect == "order" and entry is not None:
            entry[:] = draw(st.permutations(entry))
        elif defect == "duplicate" and i is not None:
            pairs.insert(draw(st.integers(0, len(pairs))), (pairs[i][0], copy.deepcopy(pairs[i][1])))
        elif defect == "metadata":
            pairs.insert(0, ("__metadata__", draw(jvalues | st.dictionaries(st.text(max_size=3), st.text(max_size=3),
                                                                          max_size=2).map(lambda d: Obj(d.items())))))
        elif defect == "key" and i is not None:
            pairs[i] = (draw(st.sampled_from(["\ud800", "__metadata__", "", "a" * 300]) | st.text(max_size=3)),
                        pairs[i][1])
        elif defect == "utf8":
            junk = draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x00"]))
        elif defect == "header length":
            n_delta = draw(st.sampled_from([1, -1, 8, -8, 2**32, 2**63, 2**64 - 1]))
        elif defect == "data length":
            data_len = max(0, data_len + draw(st.sampled_from([1, -1, 3, -4, 8])))
        elif defect == "top":
            pairs = draw(st.sampled_from([[Raw("[1,2]")], [Raw('"x"')], [Raw("null")], [Raw(dump(pairs) + "x")]]))
            break
    if type(pairs) is not Obj:
        text = "".join(r.text for r in pairs if isinstance(r, Raw))
    else:
        text = dump(pairs)
    head = text.encode("utf-8", "surrogatepass")
    if junk:
        at = draw(st.integers(0, len(head)))
        head = head[:at] + junk + head[at:]
    head += b" " * (-len(head) % 8)
    n = (len(head) + n_delta) % 2**64
    return struct.pack("<Q", n) + head + draw(st.binary(min_size=data_len, max_size=data_len))


def check_tensor_file(raw: bytes) -> None:
    """Parsing and loading ``raw`` work or raise ``CorruptCheckpointError``; what is accepted
    loads every tensor from the bytes its entry names, exactly as the official reader does."""
    with bounded():
        try:
            header, start = parse_header(memoryview(raw), "f.safetensors")
        except CorruptCheckpointError as e:
            assert "f.safetensors" in str(e)
            event(f"tensor file: refused ({category(e)})")
            with pytest.raises(CorruptCheckpointError):
                load_tensor_file(bytearray(raw), "f.safetensors")
            return
        event(f"tensor file: accepted, {min(len(header), 3)}+ tensors")
        table = load_tensor_file(bytearray(raw), "f.safetensors")
        assert set(table) == set(header)
        official = safetensors.torch.load(raw)
        assert set(official) == set(header)
        for key, info in header.items():
            t = table[key]
            begin, end = info["data_offsets"]
            assert t.dtype == ST_TO_DTYPE[info["dtype"]] and list(t.shape) == info["shape"]
            assert t.numel() * t.element_size() == end - begin
            if t.numel():
                got = t.reshape(-1).view(torch.uint8)
                assert got.numpy().tobytes() == raw[start + begin : start + end]
                assert torch.equal(got, official[key].reshape(-1).view(torch.uint8))
            assert official[key].shape == t.shape and official[key].dtype == t.dtype


@FUZZ
@given(raw=tensor_files())
def test_tensor_file_headers(raw: bytes) -> None:
    check_tensor_file(raw)


def real_tensor_file(seed: int) -> bytes:
    g = torch.Generator().manual_seed(seed)
    tensors = {"w": torch.randn(3, 2, generator=g), "b": torch.zeros(0, 4, dtype=torch.int64),
               "c": torch.randint(0, 255, (5,), dtype=torch.uint8, generator=g),
               "s": torch.tensor(7, dtype=torch.int16)}
    chunks: list[bytes] = []
    import io

    f = io.BytesIO()
    write_tensor_file(f, [TensorEntry(k, v) for k, v in tensors.items()], lambda b: chunks.append(bytes(b)),
                      metadata={"format": "unbroken"})
    return f.getvalue()


REAL_FILES = [real_tensor_file(i) for i in range(3)]


@FUZZ
@given(data=st.data(), which=st.integers(0, len(REAL_FILES) - 1))
def test_tensor_file_byte_mutations(data: st.DataObject, which: int) -> None:
    check_tensor_file(mutate_bytes(data, REAL_FILES[which]))


# ------------------------------------------------------------------ state trees

class MemStore:
    """The files of one checkpoint, in memory (the part of the Store protocol the reader uses)."""

    def __init__(self, files: dict[str, bytes]) -> None:
        self.files = files

    def read(self, name: str, file: str, size: int | None = None, hasher: Any = None) -> bytearray:
        if file not in self.files or (size is not None and len(self.files[file]) != size):
            raise CorruptCheckpointError(f"{file}: missing or of the wrong size")
        if hasher is not None:
            hasher.update(self.files[file])
        return bytearray(self.files[file])

    def describe(self, name: str) -> str:
        return f"mem:{name}"


def live_state() -> dict[str, Any]:
    """A state with every kind of value the decoder builds, and the objects restore loads into."""
    return {
        "model": {"w": torch.arange(6.0).reshape(2, 3), "empty": torch.zeros(0, 3),
                  "half": torch.ones(2, dtype=torch.half)},
        "opt": {"state": {0: {"step": torch.tensor(3.0)}}, "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99)}]},
        "misc": [1, 2.5, float("nan"), -(2**70), "s", b"xy", bytearray(b"z"), {3, 4}, frozenset({5}), 1 + 2j,
                 None, True, OrderedDict(a=1), {(1, 2): "tuple key"}],
        "types": [torch.float16, np.dtype("<u4"), np.float32(1.5), torch.device("cpu"), torch.Size([2, 3]),
                  Path("a/b")],
        "array": np.arange(5, dtype=np.int16),
        "gens": {"mt": np.random.Generator(np.random.MT19937(1)), "pcg": np.random.Generator(np.random.PCG64(2)),
                 "philox": np.random.Generator(np.random.Philox(3)), "sfc": np.random.Generator(np.random.SFC64(4)),
                 "rs": np.random.RandomState(5), "py": random.Random(6), "torch": torch.Generator().manual_seed(7)},
        "rng": GlobalRNG(),
        "progress": Progress(step=11, epoch=2, micro_step=1, samples=352),
    }


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    path = tmp_path_factory.mktemp("fuzz") / "ck"
    unbroken.save(path, live_state())
    return {p.name: p.read_bytes() for p in path.iterdir()}


def with_state_json(files: dict[str, bytes], state_json: bytes) -> MemStore:
    """The checkpoint ``files`` with another ``state.json``, listed with its right size and
    checksum in a re-sealed manifest: corruption only the state checks can catch."""
    m = Manifest.from_json(files[MANIFEST])
    h = new_hasher()
    h.update(state_json)
    m = dataclasses.replace(m, files={**m.files, "state.json": FileEntry(len(state_json), h.hexdigest())})
    return MemStore({**files, "state.json": state_json, MANIFEST: m.to_json()})


def exercise(x: Any) -> None:
    """Use what was decoded: draw from every generator (a bad numpy state crashes here)."""
    if isinstance(x, dict):
        for v in list(x.values()):
            exercise(v)
    elif isinstance(x, (list, tuple)):
        for v in x:
            exercise(v)
    elif isinstance(x, np.random.Generator):
        x.random(700)
        x.integers(0, 10, 3)
    elif isinstance(x, np.random.RandomState):
        x.random_sample(700)
        x.standard_normal(3)
    elif isinstance(x, random.Random):
        x.random()
        x.gauss(0, 1)
    elif isinstance(x, torch.Generator):
        torch.rand(700, generator=x)
    elif hasattr(x, "value") and hasattr(x, "cls"):
        exercise(x.value)


def check_state_json(files: dict[str, bytes], state_json: bytes) -> None:
    """Read and restore a checkpoint with this ``state.json``: it works or raises a checkpoint error."""
    with bounded(), global_rng_kept():
        try:
            loaded = read_checkpoint(with_state_json(files, state_json), "ck")
        except CorruptCheckpointError as e:
            event(f"state: refused ({category(e)})")
            return
        exercise(loaded.state)
        live = live_state()
        try:
            apply_state(live, copy.copy(loaded.state), strict=False)
        except (CorruptCheckpointError, StateMismatchError) as e:
            event(f"state: read, not restored ({type(e).__name__})")
            return
        event("state: read and restored")
        exercise(live)


@FUZZ
@given(data=st.data())
@pytest.mark.slow  # runs long: the whole suite, not the fast tier (docs/testing.md)
def test_state_tree_mutations(checkpoint: dict[str, bytes], data: st.DataObject) -> None:
    tree = json.loads(checkpoint["state.json"])
    for _ in range(data.draw(st.integers(1, 3))):
        tree = mutate_tree(data, tree)
    check_state_json(checkpoint, json.dumps(tree).encode("utf-8", "surrogatepass"))


@FUZZ
@given(data=st.data())
def test_state_json_byte_mutations(checkpoint: dict[str, bytes], data: st.DataObject) -> None:
    check_state_json(checkpoint, mutate_bytes(data, checkpoint["state.json"]))


@FUZZ
@given(tree=trees)
@pytest.mark.slow  # runs long: the whole suite, not the fast tier (docs/testing.md)
def test_state_tree_random(checkpoint: dict[str, bytes], tree: Any) -> None:
    check_state_json(checkpoint, json.dumps({"state": {"x": tree}}).encode("utf-8", "surrogatepass"))


class DictSink:
    """Tensors of an encoded tree kept in memory; ``resolve`` gives them back to the decoder."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}

    def add(self, tensor: torch.Tensor, path: Any) -> dict[str, Any]:
        key = str(len(self.tensors))
        self.tensors[key] = tensor
        return {"file": "mem", "key": key}

    def resolve(self, ref: dict[str, Any]) -> torch.Tensor:
        if ref.get("key") not in self.tensors:
            raise CorruptCheckpointError(f"no tensor {ref.get('key')!r}")
        return self.tensors[ref["key"]]


GENERATORS = {
    "MT19937": lambda: np.random.Generator(np.random.MT19937(1)),
    "PCG64": lambda: np.random.Generator(np.random.PCG64(2)),
    "PCG64DXSM": lambda: np.random.Generator(np.random.PCG64DXSM(3)),
    "Philox": lambda: np.random.Generator(np.random.Philox(4)),
    "SFC64": lambda: np.random.Generator(np.random.SFC64(5)),
    "RandomState": lambda: np.random.RandomState(6),
    "random": lambda: random.Random(7),
    "torch": lambda: torch.Generator().manual_seed(8),
}


@FUZZ
@given(data=st.data(), which=st.sampled_from(sorted(GENERATORS)))
def test_generator_states(data: st.DataObject, which: str) -> None:
    """A generator's saved state with one integer, array or field changed: refused, or a
    generator that draws (numpy trusts positions it is given: out of range, it read outside
    its buffer and crashed the process)."""
    from unbroken.state.codec import Encoder

    sink = DictSink()
    gen = GENERATORS[which]()
    if isinstance(gen, np.random.Generator):
        gen.random(3)  # a state in the middle of a buffer
    node = Encoder(sink).encode(gen)
    for _ in range(data.draw(st.sampled_from([0, 0, 0, 1, 2]))):
        node = mutate_tree(data, node)
    if data.draw(st.booleans()):  # an integer field of the state set to an edge value
        def ints(x: Any, at: tuple[Any, ...]) -> Iterator[tuple[Any, ...]]:
            if type(x) is int:
                yield at
            elif isinstance(x, dict):
                for k, v in x.items():
                    yield from ints(v, at + (k,))
            elif isinstance(x, list):
                for i, v in enumerate(x):
                    yield from ints(v, at + (i,))
        places = list(ints(node, ()))
        if places:
            path = data.draw(st.sampled_from(places))
            target = node
            for k in path[:-1]:
                target = target[k]
            target[path[-1]] = data.draw(st.sampled_from(SPECIAL_INTS) | st.integers(-5, 700))
    key = data.draw(st.sampled_from(sorted(sink.tensors) or ["0"]))
    if sink.tensors and data.draw(st.booleans()):  # an array of the state changed
        t = sink.tensors[key]
        sink.tensors[key] = data.draw(st.sampled_from([
            t[:-1], torch.from_numpy(t.numpy()[::-1].copy()), torch.zeros_like(t), t.to(torch.int64), t.reshape(1, -1),
            torch.full_like(t, 255), torch.cat([t, t])]))
    with bounded():
        try:
            out = Decoder(sink.resolve).decode(json.loads(json.dumps(node)))
        except CorruptCheckpointError:
            event(f"{which}: refused")
            return
        event(f"{which}: decoded")
        exercise(out)


# --------------------------------------------------------- global RNG, progress

def mutated_rng_state(data: st.DataObject) -> Any:
    """A real global-RNG state with one part made wrong (or random JSON)."""
    state = GlobalRNG().state_dict()
    state["python"] = list(state["python"])
    state["python"][1] = list(state["python"][1])
    state["numpy"] = copy.deepcopy(state["numpy"])
    what = data.draw(st.sampled_from(["py version", "py word", "py index", "py words", "py gauss", "np key",
                                      "np pos", "np field", "np drop", "torch", "cuda", "drop", "whole"]))
    if what == "py version":
        state["python"][0] = data.draw(st.sampled_from([2, 4, "3", 3.0, None]))
    elif what == "py word":
        state["python"][1][data.draw(st.integers(0, 623))] = data.draw(leaves)
    elif what == "py index":
        state["python"][1][624] = data.draw(st.sampled_from([-1, 0, 624, 625, 2**64]))
    elif what == "py words":
        state["python"][1] = state["python"][1][: data.draw(st.integers(0, 626))] or data.draw(jvalues)
    elif what == "py gauss":
        state["python"][2] = data.draw(leaves)
    elif what == "np key":
        key = state["numpy"]["state"]["key"]
        state["numpy"]["state"]["key"] = data.draw(st.sampled_from([
            key[:-1], key.astype(np.int64), key.astype(np.uint64), key.reshape(24, 26), np.zeros(624, np.uint32),
            key.tolist(), [2**40] * 624, "key"]))
    elif what == "np pos":
        state["numpy"]["state"]["pos"] = data.draw(st.sampled_from([-1, 0, 624, 625, 10**8, 2**64, 1.5, "1"]))
    elif what == "np field":
        state["numpy"][data.draw(st.sampled_from(["has_gauss", "gauss", "bit_generator"]))] = data.draw(leaves)
    elif what == "np drop":
        state["numpy"].pop(data.draw(st.sampled_from(sorted(state["numpy"]))))
    elif what == "torch":
        state["torch"] = data.draw(st.sampled_from([
            torch.zeros(5056, dtype=torch.uint8), torch.zeros(5055, dtype=torch.uint8),
            torch.get_rng_state().view(torch.int8), torch.get_rng_state().reshape(16, 316),
            torch.get_rng_state().float(), "bytes", None]))
    elif what == "cuda":
        state["cuda"] = data.draw(st.sampled_from([[torch.zeros(16, dtype=torch.uint8)], "x", [1], [],
                                                   [torch.zeros(2, 8, dtype=torch.uint8)]]))
    elif what == "drop":
        state.pop(data.draw(st.sampled_from(sorted(state))))
    else:
        return data.draw(jvalues)
    return state


@FUZZ
@given(data=st.data())
def test_global_rng_states(data: st.DataObject) -> None:
    state = mutated_rng_state(data)
    with bounded(), global_rng_kept():
        try:
            GlobalRNG.check(state)
        except (CorruptCheckpointError, StateMismatchError) as e:
            assert "RNG state" in str(e)
            before = (random.getstate(), torch.get_rng_state())
            with pytest.raises(type(e)):
                GlobalRNG().load_state_dict(state)
            assert (random.getstate(), torch.get_rng_state().tolist()) == (before[0], before[1].tolist())
            return
        GlobalRNG().load_state_dict(state)
        random.random()
        np.random.random_sample(700)
        torch.rand(700)


@FUZZ
@given(state=st.dictionaries(st.sampled_from(["step", "epoch", "micro_step", "samples", "other"]),
                             leaves | st.sampled_from([np.int64(3), np.uint64(2**64 - 1), np.float32(1.0),
                                                       np.bool_(True)]),
                             max_size=5) | jvalues)
def test_progress_states(state: Any) -> None:
    with bounded():
        p = Progress(step=1, epoch=2, micro_step=3, samples=4)
        try:
            Progress.check(state)
        except CorruptCheckpointError as e:
            assert "progress" in str(e)
            with pytest.raises(CorruptCheckpointError):
                p.load_state_dict(state)
            assert p == Progress(step=1, epoch=2, micro_step=3, samples=4)
            return
        p.load_state_dict(state)
        assert all(type(v) is int and 0 <= v < 2**63 for v in dataclasses.asdict(p).values())
