"""The independent reader (tools/unbroken_reader.py, written from docs/format.md) agrees with
the library on every checkpoint the library writes, byte for byte, and works without torch.

- Values: several states (every dtype, numpy arrays, nested containers, odd keys, nan/inf,
  bytes, generators, a Checkpointer run with RNG and PerRank state), the golden fixtures of
  every format version, and a 2-rank checkpoint with sharded DTensors (assembled from their
  chunks): what the reader decodes equals what ``unbroken.load`` returns, arrays bitwise.
- ``--verify`` passes on them and fails (exit 1, naming the file) on a flipped byte in a
  tensor file or in the manifest; newer format versions are refused.
- Format 3 (incremental checkpoints): every kind of value, a run whose checkpoints share the
  chunks of a frozen model, and 2 ranks with sharded tensors, read through chunk maps from the
  run's ``chunks/`` folder like the library; a damaged, missing, resized or linked chunk, one
  whose SHA-256 is not its id, and hostile chunk maps or ``chunks`` entries are refused.
- In a virtualenv without torch (numpy and xxhash linked in, no network), the CLI prints
  the tree, verifies and shows tensors whose values equal the library's.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import pathlib
import random
import re
import shutil
import struct
import subprocess
import sys
import sysconfig
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import xxhash

import unbroken
from unbroken.checkpoint.reader import read_checkpoint as library_read
from unbroken.store import split_checkpoint
from unbroken.policies import OnImprovement
from unbroken.state.codec import StatefulValue
from ports import free_port

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "unbroken_reader.py"
GOLDEN = Path(__file__).parent / "golden"
GOLDEN_CKPTS = sorted(GOLDEN.glob("v*/run/step-*"))

_spec = importlib.util.spec_from_file_location("unbroken_reader", TOOL)
reader = importlib.util.module_from_spec(_spec)
sys.modules["unbroken_reader"] = reader
_spec.loader.exec_module(reader)

pytestmark = pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
F8 = [torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz]


# ----------------------------------------------------------------------------- helpers
def cli(*args: Any, python: str = sys.executable, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([python, str(TOOL), *map(str, args)], capture_output=True, text=True, timeout=120,
                          env=env)


def lib_array(t: torch.Tensor) -> np.ndarray:
    """A library tensor in the reader's representation (raw=True: BF16/F8 as their bits)."""
    t = t.detach()
    if t.is_complex():
        if t.dtype == torch.complex32:
            return torch.view_as_real(t).float().numpy().view(np.complex64).reshape(tuple(t.shape))
        return t.resolve_conj().numpy()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    if t.dtype in F8:
        return t.view(torch.uint8).numpy()
    return t.numpy()


def same(lib: Any, rd: Any, where: str = "state") -> None:
    """Assert that a value ``unbroken.load`` returned equals the reader's (arrays bitwise)."""
    if isinstance(lib, StatefulValue):
        lib = lib.value
    if isinstance(rd, reader.Stateful):
        rd = rd.value
    if isinstance(lib, torch.Tensor):
        exp = lib_array(lib)
        assert isinstance(rd, np.ndarray), f"{where}: {type(rd)}"
        assert (rd.dtype, rd.shape) == (exp.dtype, exp.shape), \
            f"{where}: {rd.dtype}{rd.shape} vs {exp.dtype}{exp.shape}"
        assert rd.tobytes() == exp.tobytes(), f"{where}: bytes differ"
    elif isinstance(lib, np.ndarray):
        assert isinstance(rd, np.ndarray) and rd.dtype == lib.dtype and rd.shape == lib.shape, where
        assert rd.tobytes() == lib.tobytes(), f"{where}: bytes differ"
    elif isinstance(lib, np.generic):
        assert type(rd) is type(lib) and rd.dtype == lib.dtype and rd.tobytes() == lib.tobytes(), where
    elif type(lib) is float:
        assert type(rd) is float, where
        assert struct.pack("<d", lib) == struct.pack("<d", rd), f"{where}: {lib!r} vs {rd!r}"
    elif isinstance(lib, torch.dtype):
        assert isinstance(rd, reader.TorchDtype) and rd == str(lib).removeprefix("torch."), where
    elif isinstance(lib, torch.device):
        assert isinstance(rd, reader.TorchDevice) and rd == str(lib), where
    elif isinstance(lib, torch.Size):
        assert isinstance(rd, reader.TorchSize) and tuple(rd) == tuple(lib), where
    elif isinstance(lib, torch.Generator):
        assert isinstance(rd, reader.TorchGenerator) and rd.device == str(lib.device), where
        same(lib.get_state(), rd.state, where + ".state")
    elif isinstance(lib, np.random.Generator):
        assert isinstance(rd, np.random.Generator), where
        same(lib.bit_generator.state, rd.bit_generator.state, where + ".state")
    elif isinstance(lib, np.random.RandomState):
        assert isinstance(rd, np.random.RandomState), where
        same(lib.get_state(legacy=False), rd.get_state(legacy=False), where + ".state")
    elif isinstance(lib, random.Random):
        assert isinstance(rd, random.Random) and rd.getstate() == lib.getstate(), where
    elif isinstance(lib, pathlib.PurePath):
        assert isinstance(rd, pathlib.PurePath) and str(rd) == str(lib), where
        assert isinstance(rd, pathlib.PurePosixPath) == isinstance(lib, pathlib.PurePosixPath), where
    elif isinstance(lib, dict):
        assert (type(lib) is OrderedDict) == (type(rd) is OrderedDict) and isinstance(rd, dict), where
        assert list(lib) == list(rd), f"{where}: keys {list(lib)} vs {list(rd)}"
        for k in lib:
            same(lib[k], rd[k], f"{where}[{k!r}]")
        if hasattr(lib, "_metadata"):
            same(lib._metadata, rd._metadata, where + "._metadata")
    elif isinstance(lib, (list, tuple)):
        assert type(rd) is type(lib) and len(rd) == len(lib), where
        for i, (a, b) in enumerate(zip(lib, rd, strict=True)):
            same(a, b, f"{where}[{i}]")
    else:  # None, bool, int, str, bytes, bytearray, complex, set, frozenset
        assert type(rd) is type(lib) and rd == lib, f"{where}: {lib!r} vs {rd!r}"


def compare_with_library(ckpt: Path) -> None:
    """The shared state and every rank's part, decoded by both, are the same."""
    same(unbroken.load(ckpt), reader.read_checkpoint(ckpt, raw=True))
    ck = reader.open_checkpoint(ckpt)
    assert ck.verify() == []
    for r in range(ck.world_size):
        lib_rank = library_read(*split_checkpoint(ckpt), rank=r).rank_state
        rd_rank = ck.rank_state(r, raw=True)
        assert (lib_rank is None) == (rd_rank is None)
        if lib_rank is not None:
            same(lib_rank, rd_rank, f"rank{r}")


def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def reseal(ckpt: Path, **changes: Any) -> None:
    """Rewrite the manifest like a writer would (sizes, checksums, trailer), with ``changes``.
    The ``chunks`` of a format-3 manifest are kept as they are unless ``changes`` replaces them."""
    doc = json.loads((ckpt / "manifest.json").read_text())
    doc.pop("manifest_xxh3_128", None)
    doc.update(changes)
    for name in doc["files"]:
        raw = (ckpt / name).read_bytes()
        doc["files"][name] = {"size": len(raw), "xxh3_128": xxhash.xxh3_128(raw).hexdigest()}
    body = json.dumps(doc, indent=1).encode()[:-2]
    (ckpt / "manifest.json").write_bytes(body + b',\n "manifest_xxh3_128": "'
                                         + xxhash.xxh3_128(body).hexdigest().encode() + b'"\n}\n')


def values_of(out: str) -> dict[str, str]:
    return dict(line.split(": ", 1) for line in out.splitlines() if ": " in line)


# ----------------------------------------------------------------------------- states
class Counter:
    def __init__(self) -> None:
        self.n, self.hist = 3, [1.5, float("nan")]

    def state_dict(self) -> dict:
        return {"n": self.n, "hist": list(self.hist), "buf": torch.arange(4, dtype=torch.int16)}

    def load_state_dict(self, d: dict) -> None:
        self.n = d["n"]


def every_kind_state() -> dict:
    g = torch.Generator().manual_seed(3)
    shared = torch.randn(3, 2, generator=g)
    param = torch.nn.Parameter(torch.ones(2))
    dtypes = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
              torch.int8, torch.uint8, torch.bool, torch.uint16, torch.uint32, torch.uint64, *F8]
    weird = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-40, 3.0e38, -2.5])
    return {
        "dtypes": {str(d).removeprefix("torch."): (torch.randn(4, 3, generator=g) * 40).to(d) for d in dtypes},
        "special": {"f32": weird, "f16": weird.half(), "bf16": weird.bfloat16(), "f64": weird.double(),
                    "bf16_all": torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16),
                    **{f"f8_all_{str(d)[6:]}": torch.arange(256, dtype=torch.int32).to(torch.uint8).view(d)
                       for d in F8}},
        "complex": {"c64": torch.randn(3, generator=g, dtype=torch.complex64),
                    "c128": torch.randn(2, 2, generator=g, dtype=torch.complex128),
                    "c32": torch.tensor([1 + 2j, -0.5j], dtype=torch.complex64).to(torch.complex32),
                    "c0": torch.tensor(1 - 1j, dtype=torch.complex64), "c_empty": torch.zeros(0, dtype=torch.complex64),
                    "odd": torch.ones(3)},  # a complex tensor after an odd float32 one: 4-byte aligned only
        "shapes": {"scalar": torch.tensor(2.5), "empty": torch.zeros(0, 4), "empty_bf16": torch.zeros(2, 0).bfloat16(),
                   "strided": torch.arange(12.0).reshape(3, 4).t(), "big": torch.arange(100_000, dtype=torch.int32),
                   "alias_a": shared, "alias_b": shared, "view": shared[1:], "param": param},
        "numpy": {"i2": np.arange(6, dtype=np.int16).reshape(2, 3), "be": np.arange(5, dtype=">i4"),
                  "bef": np.array([1.5, -2.0], dtype=">f8"), "bool": np.array([True, False, True]),
                  "c64": np.array([1 + 2j, 3], dtype=np.complex64), "f16": np.arange(3, dtype=np.float16),
                  "u64": np.array([0, 2**64 - 1], dtype=np.uint64), "zero_d": np.array(7.25), "empty": np.zeros((0, 2)),
                  "fortran": np.asfortranarray(np.arange(6.0).reshape(2, 3)),
                  "readonly": np.frombuffer(b"\x01\x02\x03\x04", dtype=np.uint8),
                  "scalars": [np.float32(1.5), np.int64(-5), np.bool_(True), np.uint8(200), np.complex128(1 - 2j),
                              np.float16(0.1), np.float64("nan")],
                  "dtypes": [np.dtype("<f4"), np.dtype(">i8"), np.dtype("<U5"), np.dtype("S3"), np.dtype(bool)]},
        "containers": {"tuple": (1, (2, (3, "x")), []), "set": {1, 2, "a", (1, 2)}, "frozen": frozenset({b"x", 3.5}),
                       "list": [None, True, False, 0, -1, 1.25, "ü✓"], "nested": {"a": {"b": {"c": [{"d": ()}]}}},
                       "int_keys": {1: "a", -2: "b"}, "mixed_keys": {"s": 1, 2: 2, (3, 4): 3, None: 4, b"k": 5, 2.5: 6,
                                                                     frozenset({1}): 7},
                       "ordered": OrderedDict([("z", 1), ("a", 2)]), "empty_dict": {}, "empty_set": set(),
                       "deep": [[[[[[[[[[1]]]]]]]]]]},
        "scalars": {"nan": float("nan"), "neg_nan": -float("nan"),
                    "payload_nan": struct.unpack(">d", bytes.fromhex("7ff8000000000abc"))[0],
                    "inf": float("inf"), "ninf": -float("inf"), "neg_zero": -0.0, "tiny": 5e-324,
                    "big": 2**70, "huge": 2**9000 + 1, "neg_huge": -(2**9000), "cplx": complex(1.5, -float("inf")),
                    "bytes": bytes(range(256)), "bytearray": bytearray(b"\x00ab"), "str": "a\u0000b\"\\\n✓"},
        "torch_things": {"dtype": torch.bfloat16, "dtype2": torch.float8_e4m3fn, "device": torch.device("cpu"),
                         "cuda": torch.device("cuda", 1), "size": torch.Size([2, 0, 3]), "gen": g},
        "rngs": {"np_gen": np.random.default_rng(5), "philox": np.random.Generator(np.random.Philox(7)),
                 "np_rs": np.random.RandomState(11), "py": random.Random(13)},
        "paths": {"posix": pathlib.PurePosixPath("/data/x.bin"), "win": pathlib.PureWindowsPath("C:\\data\\x.bin")},
        "model": torch.nn.Linear(3, 2),
        "counter": Counter(),
    }


# ----------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Checkpoints written by the library: unbroken.save of every kind of value, and a
    Checkpointer run (RNG, PerRank, trigger state) of a small model trained two steps."""
    base = tmp_path_factory.mktemp("saved")
    out = {"every": base / "every"}
    unbroken.save(out["every"], every_kind_state(), step=7, metrics={"acc": 0.5})

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    state = {"model": model, "optimizer": opt, "scheduler": sched, "counter": unbroken.PerRank(Counter()),
             "np_rng": np.random.default_rng(1)}
    ck = unbroken.Checkpointer(base / "run", preemption=None, trigger=OnImprovement("loss"), keep_last=None)
    for _ in range(2):
        loss = model(torch.randn(5, 4)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        ck.step(state, loss=loss.item())
        ck.save(state)
    ck.close()
    out["run"] = Path(ck.last_saved.path)
    return out


# ------------------------------------------------------------------------------ tests
def test_every_kind_of_value_decodes_like_the_library(saved: dict[str, Path]) -> None:
    ckpt = saved["every"]
    compare_with_library(ckpt)
    rd = reader.read_checkpoint(ckpt)
    # aliases stay one object, as in the library
    assert rd["shapes"]["alias_a"] is rd["shapes"]["alias_b"]
    assert rd["counter"]["n"] == 3 and math.isnan(rd["counter"]["hist"][1])
    assert rd["counter"]["buf"].dtype == np.int16
    kept = reader.read_checkpoint(ckpt, keep_stateful=True)
    assert isinstance(kept["model"], reader.Stateful) and kept["model"].cls == "torch.nn.modules.linear.Linear"
    assert math.copysign(1, rd["scalars"]["neg_nan"]) == -1


def test_bf16_and_float8_convert_exactly_to_float32(saved: dict[str, Path]) -> None:
    """Every bit pattern: the reader's float32 equals torch's .float() (bitwise; NaN as NaN)."""
    lib = unbroken.load(saved["every"])["special"]
    rd = reader.read_checkpoint(saved["every"])["special"]
    raw = reader.read_checkpoint(saved["every"], raw=True)["special"]
    converted = [(k, t) for k, t in lib.items() if t.dtype in (torch.bfloat16, *F8)]
    assert len(converted) == 6
    for key, t in converted:
        want = t.float().numpy()
        got = rd[key]
        assert got.dtype == np.float32 and got.shape == want.shape, key
        nan = np.isnan(want)
        assert np.array_equal(nan, np.isnan(got)), key
        assert want[~nan].tobytes() == got[~nan].tobytes(), key
        same(t, raw[key], key)
    assert raw["bf16_all"].dtype == np.uint16 and raw["f8_all_float8_e5m2"].dtype == np.uint8


def test_checkpointer_run_with_rng_and_per_rank_state(saved: dict[str, Path]) -> None:
    ckpt = saved["run"]
    compare_with_library(ckpt)
    ck = reader.open_checkpoint(ckpt)
    assert ck.format_version == 2 and ck.world_size == 1 and ck.trailer == "ok"
    assert ck.manifest["step"] == 2 and ck.manifest["seq"] == 3 and ck.ranks() == [0]
    extra = reader.unwrap(ck.state())["__unbroken__"]
    assert extra["progress"] == {"step": 2, "epoch": 0, "micro_step": 0, "samples": 0}
    assert extra["per_rank"] == ["counter"] and extra["trigger"]["OnImprovement#0"]["metric"] == "loss"
    mine = ck.rank_state(0)
    assert isinstance(mine["rng"], reader.Stateful) and mine["rng"].cls == "unbroken.state.rng.GlobalRNG"
    rng = mine["rng"].value
    assert set(rng) >= {"python", "numpy", "torch"} and rng["torch"].dtype == np.uint8
    assert reader.unwrap(mine["state"])["counter"]["n"] == 3


@pytest.mark.parametrize("ckpt", GOLDEN_CKPTS, ids=lambda p: p.parts[-3])
def test_golden_checkpoints(ckpt: Path) -> None:
    """Every format version's golden checkpoint: same values as the library, and the bytes
    stored in expected.json."""
    compare_with_library(ckpt)
    expected = json.loads((ckpt.parent.parent / "expected.json").read_text())
    rd = reader.read_checkpoint(ckpt, raw=True)
    for key, want in expected["plain"].items():
        arr = rd["plain"][key]
        if arr.dtype.kind == "c":  # expected.json holds the real view
            arr = arr.view(np.float32 if arr.dtype == np.complex64 else np.float64).reshape(want["shape"])
        assert list(arr.shape) == want["shape"] and arr.tobytes().hex() == want["hex"], key
    for key, want in expected["model"].items():
        assert rd["model"][key].tobytes().hex() == want["hex"], key
    assert reader.open_checkpoint(ckpt).trailer == ("none" if ckpt.parts[-3] == "v1" else "ok")
    r = cli(ckpt, "--verify")
    assert r.returncode == 0, r.stderr
    assert "plain: dict (28 items)" in r.stdout and "ctensor: tensor complex64 [2] (stored F32 [2, 2])" in r.stdout


def test_cli_prints_manifest_and_tree(saved: dict[str, Path]) -> None:
    r = cli(saved["run"])
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "format: unbroken version 2 (self-checksum ok)" in out
    assert "step: 2  seq: 3  kind: regular  world size: 1" in out
    assert re.search(r"\d+  [0-9a-f]{32}  state\.json", out) and "r00000-t01-rng.safetensors" in out
    assert "model: <torch.nn.modules.container.Sequential> OrderedDict (4 items, with _metadata)" in out
    assert "0.weight: tensor F32 [8, 4] cpu  @ t00-model.safetensors:model/0.weight" in out
    assert "rank-00000.json (rank 0):" in out and "rng: <unbroken.state.rng.GlobalRNG> dict" in out

    r = cli(saved["every"])
    assert r.returncode == 0, r.stderr
    for line in ["c32: tensor complex32 [2] (stored F16 [2, 2])", "nan: nan", "neg_nan: nan (bits fff8000000000000)",
                 "huge: int (9001 bits)", "dtype: torch.bfloat16", "np_gen: numpy Generator (PCG64)",
                 "posix: PurePosixPath('/data/x.bin')", "be: ndarray I32 [5] numpy >i4",
                 "param: tensor F32 [2] cpu requires_grad"]:
        assert line in r.stdout, line


def test_cli_tensor_values_equal_the_library(saved: dict[str, Path]) -> None:
    lib = unbroken.load(saved["every"])
    for name, t in [("dtypes/float32", lib["dtypes"]["float32"]), ("dtypes/bfloat16", lib["dtypes"]["bfloat16"]),
                    ("dtypes/int8", lib["dtypes"]["int8"]), ("dtypes/float8_e5m2", lib["dtypes"]["float8_e5m2"])]:
        r = cli(saved["every"], "--tensor", name, "--values", 20)
        assert r.returncode == 0, r.stderr
        v = values_of(r.stdout)
        flat = t.float().reshape(-1)
        assert v["shape"] == str(list(t.shape)) and v["numpy"] in ("float32", "int8")
        assert eval(v["values"].split(" (first")[0]) == flat[:20].tolist(), name  # repr of exact floats
        assert float(v["min"]) == flat.min().item() and float(v["max"]) == flat.max().item(), name
        assert math.isclose(float(v["mean"]), flat.double().mean().item(), rel_tol=1e-12), name
    r = cli(saved["every"], "--tensor", "complex/c64")
    assert r.returncode == 0 and "numpy: complex64" in r.stdout
    assert eval(values_of(r.stdout)["values"]) == lib["complex"]["c64"].tolist()
    r = cli(saved["every"], "--tensor", "no/such")
    assert r.returncode == 2 and "no tensor 'no/such'" in r.stderr


@pytest.mark.parametrize("target", ["tensor", "manifest", "state"])
def test_verify_fails_on_a_flipped_byte(saved: dict[str, Path], tmp_path: Path, target: str) -> None:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved["run"], ckpt)
    assert cli(ckpt, "--verify").returncode == 0
    if target == "tensor":
        name = "t00-model.safetensors"
        flip(ckpt / name, (ckpt / name).stat().st_size - 3)  # in the data: the header stays valid
    elif target == "state":
        name = "state.json"
        text = (ckpt / name).read_bytes()
        flip(ckpt / name, text.index(b'AdamW'))  # 'A' -> '@' in a class name: still valid JSON
    else:
        name = "manifest.json"
        text = (ckpt / name).read_bytes()
        flip(ckpt / name, text.index(b'"seq": ') + 7)  # seq 3 -> 2: a rollback if undetected
    r = cli(ckpt, "--verify")
    assert r.returncode == 1, r.stdout
    assert name in r.stderr and ("checksum mismatch" in r.stderr), r.stderr
    with pytest.raises(unbroken.CorruptCheckpointError):
        unbroken.verify(ckpt)
    if target != "manifest":  # the reader still opens it (and reads it) without --verify
        assert cli(ckpt).returncode == 0
        with pytest.raises(reader.FormatError, match=re.escape(name)):
            reader.read_checkpoint(ckpt, verify=True)


def test_verify_v1_and_size_mismatch(tmp_path: Path) -> None:
    v1 = next(p for p in GOLDEN_CKPTS if p.parts[-3] == "v1")
    ckpt = tmp_path / "v1"
    shutil.copytree(v1, ckpt)
    flip(ckpt / "t02-plain.safetensors", 300)
    r = cli(ckpt, "--verify")
    assert r.returncode == 1 and "t02-plain.safetensors: checksum mismatch" in r.stderr
    with open(ckpt / "t00-model.safetensors", "ab") as f:
        f.write(b"\0")
    r = cli(ckpt, "--verify")
    assert r.returncode == 1 and "t00-model.safetensors has 217 bytes, the manifest says 216" in r.stderr


def test_newer_format_and_unsafe_names_are_refused(saved: dict[str, Path], tmp_path: Path) -> None:
    ckpt = tmp_path / "newer"
    shutil.copytree(saved["run"], ckpt)
    reseal(ckpt, format_version=4)
    with pytest.raises(unbroken.NewerFormatError):
        unbroken.load(ckpt)
    r = cli(ckpt)
    assert r.returncode == 1 and "format version 4 is newer" in r.stderr
    with pytest.raises(reader.NewerFormatError):
        reader.read_checkpoint(ckpt)

    doc = json.loads((saved["run"] / "manifest.json").read_text())
    for bad in ["../state.json", "/etc/passwd", ".hidden", "a/b"]:
        ckpt = tmp_path / f"bad{len(bad)}"
        shutil.copytree(saved["run"], ckpt)
        files = dict(doc["files"])
        files[bad] = files["state.json"]
        body = json.dumps({**{k: v for k, v in doc.items() if k != "manifest_xxh3_128"}, "files": files},
                          indent=1).encode()[:-2]
        (ckpt / "manifest.json").write_bytes(body + b',\n "manifest_xxh3_128": "'
                                             + xxhash.xxh3_128(body).hexdigest().encode() + b'"\n}\n')
        with pytest.raises(reader.FormatError, match="unsafe"):
            reader.open_checkpoint(ckpt)
        with pytest.raises(unbroken.CorruptCheckpointError):
            unbroken.load(ckpt)


def test_malformed_tensor_header_is_refused(saved: dict[str, Path], tmp_path: Path) -> None:
    ckpt = tmp_path / "hdr"
    shutil.copytree(saved["run"], ckpt)
    f = ckpt / "t00-model.safetensors"
    raw = bytearray(f.read_bytes())
    raw[:8] = struct.pack("<Q", len(raw))  # the header claims more bytes than the file has
    f.write_bytes(bytes(raw))
    reseal(ckpt)
    with pytest.raises(reader.FormatError, match="t00-model.safetensors: header claims"):
        reader.read_checkpoint(ckpt, verify=True)
    with pytest.raises(unbroken.CorruptCheckpointError):
        unbroken.load(ckpt)


HOSTILE_NODES = {
    "unknown tag": {"@": "pickle", "v": "cos\nsystem"},
    "untagged object": {"a": 1},
    "unlisted file": {"@": "tensor", "file": "manifest.json", "key": "x", "device": "cpu"},
    "missing key": {"@": "tensor", "file": "t00-model.safetensors", "key": "nope", "device": "cpu"},
    "ndarray dtype mismatch": {"@": "ndarray", "file": "t00-model.safetensors", "key": "model/0.weight",
                               "dtype": "<f8"},
    "complex of a non-pair": {"@": "tensor", "file": "t00-model.safetensors", "key": "model/0.weight",
                              "device": "cpu", "complex": True},
    "object numpy dtype": {"@": "np_dtype", "v": "O"},
    "numpy scalar size": {"@": "np_scalar", "dtype": "<f8", "hex": "0000"},
    "bit generator": {"@": "np_generator", "state": {"@": "dict", "v": {"bit_generator": "os.system"}}},
    "NaN bits of a number": {"@": "float", "v": "nan", "bits": "3ff0000000000000"},
    "bad base64": {"@": "bytes", "b64": "!!"},
}


@pytest.mark.parametrize("case", sorted(HOSTILE_NODES))
def test_hostile_state_trees_are_refused_by_both(saved: dict[str, Path], tmp_path: Path, case: str) -> None:
    """A checksum-valid state.json with one bad node: the library and the reader both refuse it."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved["run"], ckpt)
    doc = json.loads((ckpt / "state.json").read_text())
    doc["state"]["extra"] = HOSTILE_NODES[case]
    (ckpt / "state.json").write_text(json.dumps(doc))
    reseal(ckpt)
    with pytest.raises(unbroken.CorruptCheckpointError):
        unbroken.load(ckpt)
    with pytest.raises(reader.FormatError):
        reader.read_checkpoint(ckpt, verify=True)


# ------------------------------------------------------------------- without torch
@pytest.fixture(scope="module")
def torchless_python(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A fresh virtualenv with numpy and xxhash linked in from this one, and no torch."""
    venv = tmp_path_factory.mktemp("notorch") / "venv"
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    ours = Path(sysconfig.get_paths()["purelib"])
    for name in ("numpy", "numpy.libs", "xxhash"):
        if (ours / name).exists():
            os.symlink(ours / name, Path(site) / name)
    probe = subprocess.run([python, "-c", "import torch"], capture_output=True, text=True)
    assert probe.returncode != 0 and "No module named 'torch'" in probe.stderr
    assert subprocess.run([python, "-c", "import unbroken"], capture_output=True).returncode != 0
    assert subprocess.run([python, "-c", "import numpy, xxhash"], capture_output=True).returncode == 0
    return python


def test_reader_runs_without_torch(torchless_python: str, saved: dict[str, Path], tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    ckpt = saved["run"]
    r = cli(ckpt, python=torchless_python, env=env)
    assert r.returncode == 0, r.stderr
    assert "step: 2  seq: 3" in r.stdout and "0.weight: tensor F32 [8, 4]" in r.stdout
    r = cli(ckpt, "--verify", python=torchless_python, env=env)
    assert r.returncode == 0 and r.stdout.startswith("verified:"), r.stderr

    lib = unbroken.load(ckpt)
    for name, t in [("model/0.weight", lib["model"]["0.weight"]),
                    ("optimizer/state/0/exp_avg_sq", lib["optimizer"]["state"][0]["exp_avg_sq"]),
                    ("optimizer/state/3/step", lib["optimizer"]["state"][3]["step"])]:
        r = cli(ckpt, "--tensor", name, "--values", 1000, python=torchless_python, env=env)
        assert r.returncode == 0, r.stderr
        v = values_of(r.stdout)
        flat = t.reshape(-1)
        assert eval(v["values"]) == flat.tolist(), name
        assert float(v["min"]) == flat.min().item() and float(v["max"]) == flat.max().item(), name
    r = cli(saved["every"], "--tensor", "dtypes/bfloat16", "--values", 12, python=torchless_python, env=env)
    assert r.returncode == 0 and eval(values_of(r.stdout)["values"]) == lib_bf16_values(saved["every"])

    bad = tmp_path / "bad"
    shutil.copytree(ckpt, bad)
    flip(bad / "t01-optimizer.safetensors", (bad / "t01-optimizer.safetensors").stat().st_size - 1)
    r = cli(bad, "--verify", python=torchless_python, env=env)
    assert r.returncode == 1 and "t01-optimizer.safetensors: checksum mismatch" in r.stderr

    # no xxhash at all: --verify says so and exits 2; reading still works
    no_xxhash = ["-c", "import sys, runpy; sys.modules['xxhash'] = None; sys.argv = sys.argv[1:]; "
                       f"runpy.run_path({str(TOOL)!r}, run_name='__main__')"]
    r = subprocess.run([torchless_python, *no_xxhash, str(TOOL), str(ckpt), "--verify"], capture_output=True,
                       text=True, env=env)
    assert r.returncode == 2 and "xxhash" in r.stderr
    r = subprocess.run([torchless_python, *no_xxhash, str(TOOL), str(ckpt)], capture_output=True, text=True, env=env)
    assert r.returncode == 0 and "self-checksum present (not checked: no xxhash)" in r.stdout


def lib_bf16_values(ckpt: Path) -> list[float]:
    return unbroken.load(ckpt)["dtypes"]["bfloat16"].float().reshape(-1).tolist()


# ------------------------------------------------------------ 2 ranks, sharded tensors
JOB = r'''
import os, sys, torch, torch.distributed as dist
import unbroken
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import distribute_tensor, Shard, Replicate
unbroken.init_distributed("gloo")
rank = dist.get_rank()
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
g = torch.Generator().manual_seed(0)
full = {"a": torch.randn(5, 3, generator=g), "b": torch.arange(14, dtype=torch.float32).reshape(2, 7),
        "c": torch.randn(7, generator=g).to(torch.bfloat16), "r": torch.arange(4, dtype=torch.int64)}
state = {"sh": {"a": distribute_tensor(full["a"], mesh, [Shard(0)]),      # 5 rows: uneven chunks 3 + 2
                "b": distribute_tensor(full["b"], mesh, [Shard(1)]),      # along dim 1
                "c": distribute_tensor(full["c"], mesh, [Shard(0)]),      # bf16
                "r": distribute_tensor(full["r"], mesh, [Replicate()]),   # written once
                "plain": torch.ones(2)},
         "per": unbroken.PerRank({"rank": rank})}
ck = unbroken.Checkpointer(sys.argv[1], preemption=None, incremental=sys.argv[3:] == ["incremental"])
ck.save(state)
ck.close()
if rank == 0:
    unbroken.save(sys.argv[2], full)
dist.destroy_process_group()
'''


def run_job(base: Path, *extra: str) -> None:
    """JOB on 2 ranks (gloo, CPU): ``base/run`` and ``base/full``."""
    (base / "job.py").write_text(JOB)
    port = free_port()  # below the ephemeral range (:mod:`ports`)
    procs = []
    for rank in range(2):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
               "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, str(base / "job.py"), str(base / "run"), str(base / "full"),
                                       *extra], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(outs)[-3000:]


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A checkpoint written by 2 ranks (gloo, CPU) with DTensors sharded unevenly along dim 0,
    along dim 1, replicated, and in bf16; plus the full tensors saved by rank 0."""
    base = tmp_path_factory.mktemp("sharded")
    run_job(base)
    (ckpt,) = (base / "run").glob("step-*")
    return ckpt, base / "full"


@pytest.fixture(scope="module")
def sharded_incremental(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The same job saving incrementally (format 3): the pieces are chunk maps and chunks."""
    base = tmp_path_factory.mktemp("sharded_inc")
    run_job(base, "incremental")
    (ckpt,) = (base / "run").glob("step-*")
    return ckpt, base / "full"


def test_sharded_tensors_assemble_like_the_library(sharded: tuple[Path, Path], tmp_path: Path) -> None:
    ckpt, full = sharded
    compare_with_library(ckpt)
    ck = reader.open_checkpoint(ckpt)
    assert ck.world_size == 2 and ck.ranks() == [0, 1]
    assert {"sharded.json", "s00000.safetensors", "s00001.safetensors"} <= set(ck.files)
    rd = reader.read_checkpoint(ckpt, raw=True)
    originals = unbroken.load(full)
    for key in "abcr":
        same(originals[key], rd["sh"][key], key)
    assert list(ck.sharded_metadata()["tensors"]["sh/a"]["chunks"]) == [((0, 0), (3, 3)), ((3, 0), (2, 3))]
    assert len(ck.sharded_metadata()["tensors"]["sh/r"]["chunks"]) == 1  # replicated: written once
    for r in range(2):
        assert reader.unwrap(ck.rank_state(r)["state"]) == {"per": {"rank": r}}
    unassembled = ck.state(assemble=False)["sh"]["a"]
    assert unassembled == reader.ShardedRef("sh/a", (5, 3), "float32")

    r = cli(ckpt, "--verify")
    assert r.returncode == 0, r.stderr
    assert "a: dtensor float32 [5, 3]  sharded: fqn 'sh/a', 2 chunks in s00000.safetensors, s00001.safetensors" \
        in r.stdout
    r = cli(ckpt, "--tensor", "sh/c", "--values", 10)
    v = values_of(r.stdout)
    assert r.returncode == 0 and v["source"] == "sharded, assembled from 2 chunks" and v["shape"] == "[7]"
    assert eval(v["values"]) == originals["c"].float().tolist()
    r = cli(ckpt, "--tensor", "0")  # a piece key: in both s<r> files
    assert r.returncode == 2 and "s00000.safetensors:0, s00001.safetensors:0" in r.stderr
    assert cli(ckpt, "--tensor", "s00001.safetensors:0").returncode == 0

    # --verify covers every rank's files, not only rank 0's
    other = tmp_path / "rank1"
    shutil.copytree(ckpt, other)
    flip(other / "r00001-t00-rng.safetensors", (other / "r00001-t00-rng.safetensors").stat().st_size - 1)
    r = cli(other, "--verify")
    assert r.returncode == 1 and "r00001-t00-rng.safetensors: checksum mismatch" in r.stderr

    # pieces that overlap but add up to the right element count must not assemble
    bad = tmp_path / "overlap"
    shutil.copytree(ckpt, bad)
    doc = json.loads((bad / "sharded.json").read_text())
    chunks = doc["tensors"]["sh/b"]["chunks"]
    assert chunks == [{"offsets": [0, 0], "sizes": [2, 4]}, {"offsets": [0, 4], "sizes": [2, 3]}]
    doc["tensors"]["sh/b"]["chunks"][1]["offsets"] = [0, 3]
    for s in doc["storage"]:
        if s["fqn"] == "sh/b" and s["offset"] == [0, 4]:
            s["offset"] = [0, 3]
    (bad / "sharded.json").write_text(json.dumps(doc, indent=1))
    reseal(bad)
    with pytest.raises(reader.FormatError, match="overlap"):
        reader.read_checkpoint(bad, verify=True)


def test_sharded_incremental_pieces_are_chunk_maps(sharded_incremental: tuple[Path, Path]) -> None:
    """Saved incrementally, each rank's pieces are a chunk map s<r>.chunks.json and chunks;
    sharded.json still names s<r>.safetensors, which the reader resolves through the map."""
    ckpt, full = sharded_incremental
    compare_with_library(ckpt)
    ck = reader.open_checkpoint(ckpt)
    assert ck.format_version == 3 and ck.world_size == 2 and ck.chunks
    assert {"sharded.json", "s00000.chunks.json", "s00001.chunks.json"} <= set(ck.files)
    assert not any(f.endswith(".safetensors") for f in ck.files)
    assert {f for f, _ in ck.sharded_metadata()["storage"].values()} == {"s00000.safetensors", "s00001.safetensors"}
    rd = reader.read_checkpoint(ckpt, raw=True)
    originals = unbroken.load(full)
    for key in "abcr":
        same(originals[key], rd["sh"][key], key)
    r = cli(ckpt, "--verify")
    assert r.returncode == 0, r.stderr
    assert "a: dtensor float32 [5, 3]  sharded: fqn 'sh/a', 2 chunks in s00000.safetensors, s00001.safetensors" \
        in r.stdout
    r = cli(ckpt, "--tensor", "sh/c", "--values", 10)
    assert r.returncode == 0 and eval(values_of(r.stdout)["values"]) == originals["c"].float().tolist()


# ------------------------------------------------------- format 3: incremental checkpoints
@pytest.fixture(scope="module")
def incremental(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Incremental checkpoints (format 3) written by the library: every kind of value (plus two
    distinct tensors with equal bytes: one chunk), and a run of 3 checkpoints of a frozen model
    and a trained head (RNG, PerRank), which share the frozen model's chunks."""
    base = tmp_path_factory.mktemp("incremental")
    state = every_kind_state()
    state["twins"] = {"a": torch.full((3,), 2.5), "b": torch.full((3,), 2.5)}
    state["optimizer"] = torch.optim.SGD(state["model"].parameters(), lr=0.1)
    ck = unbroken.Checkpointer(base / "every", preemption=None, rng=False, incremental=True)
    ck.save(state)
    ck.close()
    out: dict[str, Any] = {"every": Path(ck.last_saved.path)}

    torch.manual_seed(0)
    frozen = torch.nn.Linear(16, 16).requires_grad_(False)
    head = torch.nn.Linear(16, 2)
    opt = torch.optim.AdamW(head.parameters(), lr=1e-2)
    state = {"frozen": frozen, "head": head, "optimizer": opt, "counter": unbroken.PerRank(Counter())}
    ck = unbroken.Checkpointer(base / "run", preemption=None, incremental=True, keep_last=None)
    for _ in range(3):
        loss = head(frozen(torch.randn(4, 16))).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        ck.step(state, loss=loss.item())
        ck.save(state)
    ck.close()
    out["all"] = sorted((base / "run").glob("step-*"), key=lambda p: reader.read_manifest(p)["seq"])
    out["last"] = Path(ck.last_saved.path)
    return out


def chunk_of(ckpt: Path, key: str) -> tuple[str, str]:
    """(chunk map, chunk id) of the tensor ``key`` of an incremental checkpoint."""
    for m in sorted(ckpt.glob("*.chunks.json")):
        tensors = json.loads(m.read_text())["tensors"]
        if key in tensors:
            return m.name, tensors[key]["chunk"]
    raise KeyError(key)


def test_incremental_checkpoints_decode_like_the_library(incremental: dict[str, Any]) -> None:
    for ckpt in [incremental["every"], *incremental["all"]]:
        compare_with_library(ckpt)
        ck = reader.open_checkpoint(ckpt)
        assert ck.format_version == 3 and ck.trailer == "ok" and ck.chunks and ck.chunk_maps
        assert not any(f.endswith(".safetensors") for f in ck.files)
        assert ck.chunks_path == ckpt.parent / "chunks"
        assert set(ck.chunks) <= {p.name for p in ck.chunks_path.iterdir()}
    rd = reader.read_checkpoint(incremental["every"])
    assert rd["shapes"]["alias_a"] is rd["shapes"]["alias_b"]  # one (file, key): one object
    twins = rd["twins"]  # one chunk, two tensors: two arrays (the library gives each its own memory too)
    assert twins["a"] is not twins["b"] and not np.shares_memory(twins["a"], twins["b"])
    assert chunk_of(incremental["every"], "twins/a")[1] == chunk_of(incremental["every"], "twins/b")[1]
    lib = unbroken.load(incremental["every"])["twins"]
    assert lib["a"].data_ptr() != lib["b"].data_ptr()

    first, last = incremental["all"][0], incremental["all"][-1]
    assert chunk_of(first, "frozen/weight") == chunk_of(last, "frozen/weight")  # stored once, shared
    assert chunk_of(first, "head/weight") != chunk_of(last, "head/weight")
    ck = reader.open_checkpoint(last)
    assert ck.header("t00-frozen.safetensors")["frozen/weight"].chunk == chunk_of(last, "frozen/weight")[1]
    assert ck.find_tensor("frozen/weight") == ("file", "t00-frozen.safetensors", "frozen/weight")


def test_cli_on_an_incremental_checkpoint(incremental: dict[str, Any]) -> None:
    ckpt = incremental["last"]
    _, cid = chunk_of(ckpt, "frozen/weight")
    r = cli(ckpt)
    assert r.returncode == 0, r.stderr
    n = len(reader.read_manifest(ckpt)["chunks"])
    assert "format: unbroken version 3 (self-checksum ok)" in r.stdout
    assert re.search(rf"chunks: {n} \(.*\) in {re.escape(str(ckpt.parent / 'chunks'))}\n", r.stdout)
    assert re.search(rf"\d+  [0-9a-f]{{32}}  {cid}\n", r.stdout)
    assert f"weight: tensor F32 [16, 16] cpu  @ t00-frozen.safetensors:frozen/weight (chunk {cid[:16]})" in r.stdout
    r = cli(ckpt, "--verify")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("verified: manifest.json (self-checksum ok), ") and f" and {n} chunks " in r.stdout
    r = cli(ckpt, "--tensor", "frozen/weight", "--values", 1000)
    assert r.returncode == 0, r.stderr
    v = values_of(r.stdout)
    assert v["source"] == "t00-frozen.safetensors" and v["chunk"] == f"{cid} (through t00-frozen.chunks.json)"
    assert eval(v["values"]) == unbroken.load(ckpt)["frozen"]["weight"].reshape(-1).tolist()
    r = cli(ckpt, "--tensor", "t00-frozen.safetensors:frozen/bias")
    assert r.returncode == 0 and values_of(r.stdout)["shape"] == "[16]"


@pytest.mark.parametrize("damage", ["flip", "missing", "size", "symlink", "sha256"])
def test_damaged_chunks_are_refused(incremental: dict[str, Any], tmp_path: Path, damage: str) -> None:
    """A chunk of the checkpoint (here: the head's weight) damaged in the run's chunks/ folder."""
    run = tmp_path / "run"
    shutil.copytree(incremental["last"].parent, run)
    ckpt = run / incremental["last"].name
    _, cid = chunk_of(ckpt, "head/weight")
    path = run / "chunks" / cid
    size = path.stat().st_size
    if damage == "flip":
        flip(path, size - 2)
        want = f"chunk {cid}: checksum mismatch"
    elif damage == "missing":
        path.unlink()
        want = f"chunk {cid} is missing from {run / 'chunks'}"
    elif damage == "size":
        with open(path, "ab") as f:
            f.write(b"\0")
        want = f"chunk {cid} has {size + 1} bytes, the manifest says {size}"
    elif damage == "symlink":
        shutil.copy(path, tmp_path / "elsewhere")
        path.unlink()
        path.symlink_to(tmp_path / "elsewhere")
        want = f"chunk {cid} cannot be opened"
    else:  # other bytes of the same size, listed with their xxh3: only the SHA-256 (the id) tells
        other = bytes(b ^ 0xFF for b in path.read_bytes())
        path.write_bytes(other)
        doc = json.loads((ckpt / "manifest.json").read_text())
        doc["chunks"][cid]["xxh3_128"] = xxhash.xxh3_128(other).hexdigest()
        reseal(ckpt, chunks=doc["chunks"])
        want = f"chunk {cid}: its SHA-256 is "
    r = cli(ckpt, "--verify")
    assert r.returncode == 1 and want in r.stderr, r.stderr
    with pytest.raises(reader.FormatError, match=re.escape(want)):
        reader.read_checkpoint(ckpt, verify=True)
    if damage != "sha256":  # the library checks sizes and xxh3 (not the SHA-256) when it loads
        with pytest.raises(unbroken.CorruptCheckpointError, match=cid):
            unbroken.load(ckpt)
    if damage != "flip":  # reading the tensor (no --verify) finds it too: sizes are always checked
        with pytest.raises(reader.FormatError, match=cid) if damage != "sha256" else _nothing():
            reader.read_checkpoint(ckpt)
    # the other checkpoints do not use that chunk: still intact
    assert reader.verify_checkpoint(run / incremental["all"][0].name) == []


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> bool:
        return False


def test_chunks_folder_given_explicitly(incremental: dict[str, Any], tmp_path: Path) -> None:
    """The chunks are looked for beside the checkpoint folder unless --chunks / chunks= names them
    (a checkpoint copied out of its run, or one in quarantine/ whose chunks stay in the run)."""
    ckpt = tmp_path / "alone" / incremental["last"].name
    shutil.copytree(incremental["last"], ckpt)
    r = cli(ckpt, "--verify")
    assert r.returncode == 1 and f"is missing from {tmp_path / 'alone' / 'chunks'}" in r.stderr
    chunks = incremental["last"].parent / "chunks"
    r = cli(ckpt, "--verify", "--chunks", chunks)
    assert r.returncode == 0, r.stderr
    same(unbroken.load(incremental["last"]), reader.read_checkpoint(ckpt, raw=True, chunks=chunks))
    assert reader.open_checkpoint(ckpt, chunks=chunks).chunks_path == chunks
    assert reader.verify_checkpoint(ckpt, chunks=chunks) == []


def _edit_map(key: str, change: Any) -> Any:
    def edit(ckpt: Path) -> None:
        mname, _ = chunk_of(ckpt, key)
        doc = json.loads((ckpt / mname).read_text())
        change(doc["tensors"][key], doc)
        (ckpt / mname).write_text(json.dumps(doc))
    return edit


def _both_listed(ckpt: Path) -> None:
    """A valid tensor file beside the chunk map that stands for the same name."""
    from safetensors.torch import save_file

    mname, _ = chunk_of(ckpt, "model/weight")
    tname = mname.replace(".chunks.json", ".safetensors")
    save_file({k: torch.full(tuple(e["shape"]), 7.0) for k, e in json.loads((ckpt / mname).read_text())["tensors"]
               .items()}, str(ckpt / tname))
    doc = json.loads((ckpt / "manifest.json").read_text())
    doc["files"][tname] = {"size": 0, "xxh3_128": "0" * 32}  # reseal fills it in
    (ckpt / "manifest.json").write_text(json.dumps(doc, indent=1))


def _duplicate_key(ckpt: Path) -> None:
    mname, _ = chunk_of(ckpt, "model/weight")
    text = (ckpt / mname).read_text()
    (ckpt / mname).write_text(text.replace('"dtype":"F32"', '"dtype":"F32","dtype":"F32"', 1))


def _tree_refers_to_map(ckpt: Path) -> None:
    mname, _ = chunk_of(ckpt, "model/weight")
    doc = json.loads((ckpt / "state.json").read_text())
    doc["state"]["extra"] = {"@": "tensor", "file": mname, "key": "model/weight", "device": "cpu"}
    (ckpt / "state.json").write_text(json.dumps(doc))


def _manifest_chunks(change: Any) -> Any:
    def edit(ckpt: Path) -> None:
        doc = json.loads((ckpt / "manifest.json").read_text())
        change(doc["chunks"], doc)
        (ckpt / "manifest.json").write_text(json.dumps(doc, indent=1))
    return edit


HOSTILE_MAPS: dict[str, tuple[Any, str]] = {  # edit, what the reader's message says
    "unknown dtype": (_edit_map("model/weight", lambda e, d: e.update(dtype="F31")), "unknown dtype 'F31'"),
    "float dimension": (_edit_map("model/weight", lambda e, d: e.update(shape=[2.0, 3])), "bad shape"),
    "bool dimension": (_edit_map("model/weight", lambda e, d: e.update(shape=[2, 3, True])), "bad shape"),
    "negative dimensions": (_edit_map("model/weight", lambda e, d: e.update(shape=[-2, -3])), "bad shape"),
    "65 dimensions": (_edit_map("model/weight", lambda e, d: e.update(shape=[1] * 63 + [2, 3])), "bad shape"),
    "size does not fit": (_edit_map("model/weight", lambda e, d: e.update(shape=[2, 2])), "does not fit chunk"),
    "dtype does not fit": (_edit_map("model/weight", lambda e, d: e.update(dtype="F64")), "does not fit chunk"),
    "stride overflow": (_edit_map("shapes/empty", lambda e, d: e.update(shape=[0, 2**61, 2**61])),
                        "overflows 64-bit strides"),
    "unlisted chunk": (_edit_map("model/weight", lambda e, d: e.update(chunk="0" * 64)),
                       "which the manifest does not list"),
    "path as chunk id": (_edit_map("model/weight", lambda e, d: e.update(chunk="../every/state.json")),
                         "invalid chunk id"),
    "uppercase chunk id": (_edit_map("model/weight", lambda e, d: e.update(chunk=e["chunk"].upper())),
                           "invalid chunk id"),
    "extra field": (_edit_map("model/weight", lambda e, d: e.update(offset=0)), "malformed entry"),
    "missing field": (_edit_map("model/weight", lambda e, d: e.pop("chunk")), "malformed entry"),
    "not a chunk map": (_edit_map("model/weight", lambda e, d: d.update(format="unbroken-chunkmap-2")),
                        "is not a chunk map"),
    "tensors not an object": (_edit_map("model/weight", lambda e, d: d.update(tensors=[])),
                              "tensors is not an object"),
    "duplicate key": (_duplicate_key, "duplicate key 'dtype'"),
    "tree refers to the map": (_tree_refers_to_map, "tensor reference to non-tensor file"),
    "tensor file and map both listed": (_both_listed, "lists both"),
    "maps in a format-2 manifest": (lambda ckpt: reseal(ckpt, format_version=2),
                                    "tensor reference to unlisted file"),
    "chunks not an object": (_manifest_chunks(lambda c, d: d.update(chunks=list(c))), "chunks is not an object"),
    "invalid id in the manifest": (_manifest_chunks(lambda c, d: c.update({"x" * 64: next(iter(c.values()))})),
                                   "invalid chunk id"),
    "id with a newline in the manifest": (_manifest_chunks(lambda c, d: c.update({"a" * 64 + "\n": next(iter(
        c.values()))})), "invalid chunk id"),
    "negative chunk size": (_manifest_chunks(lambda c, d: next(iter(c.values())).update(size=-1)),
                            "bad size or checksum for chunk"),
}
LIBRARY_GAPS: set[str] = set()  # cases only the tool refuses (none: the library refuses every one too)


@pytest.mark.parametrize("case", sorted(HOSTILE_MAPS))
def test_hostile_chunk_maps_are_refused(incremental: dict[str, Any], tmp_path: Path, case: str) -> None:
    """A checksum-valid chunk map (or ``chunks`` entry) with one defect: the reader refuses it,
    naming the problem; so does the library."""
    run = tmp_path / "run"
    shutil.copytree(incremental["every"].parent, run)
    ckpt = run / incremental["every"].name
    edit, message = HOSTILE_MAPS[case]
    edit(ckpt)
    reseal(ckpt)
    with pytest.raises(reader.FormatError, match=re.escape(message)):
        reader.read_checkpoint(ckpt, verify=True)
    if case not in LIBRARY_GAPS:
        with pytest.raises(unbroken.CorruptCheckpointError):
            unbroken.load(ckpt)


def test_incremental_reader_runs_without_torch(torchless_python: str, incremental: dict[str, Any]) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    ckpt = incremental["last"]
    r = cli(ckpt, "--verify", python=torchless_python, env=env)
    assert r.returncode == 0 and r.stdout.startswith("verified:"), r.stderr
    lib = unbroken.load(ckpt)
    for name, t in [("frozen/weight", lib["frozen"]["weight"]), ("head/weight", lib["head"]["weight"])]:
        r = cli(ckpt, "--tensor", name, "--values", 1000, python=torchless_python, env=env)
        assert r.returncode == 0, r.stderr
        assert eval(values_of(r.stdout)["values"]) == t.reshape(-1).tolist(), name


def test_exported_copy_is_a_self_contained_format_2_checkpoint(incremental: dict[str, Any], tmp_path: Path) -> None:
    """``unbroken export CKPT --to DIR --format checkpoint`` of an incremental checkpoint: the
    reader finds a format-2 checkpoint with tensor files and no chunks, holding the same values."""
    from unbroken.convert.exporting import export_checkpoint

    out = export_checkpoint(incremental["last"], tmp_path / "exported")
    ck = reader.open_checkpoint(out)
    assert ck.format_version == 2 and not ck.chunks and not ck.chunk_maps
    assert "t00-frozen.safetensors" in ck.files and not any(f.endswith(".chunks.json") for f in ck.files)
    assert ck.verify() == []
    same(unbroken.load(incremental["last"]), reader.read_checkpoint(out, raw=True))
    for r in range(ck.world_size):
        same(library_read(*split_checkpoint(incremental["last"]), rank=r).rank_state, ck.rank_state(r, raw=True))
