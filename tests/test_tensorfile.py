"""The safetensors files unbroken writes and reads: interoperability with the official
``safetensors`` package, alignment, and strict header validation."""

from __future__ import annotations

import io
import json
import math
import struct

import pytest
import safetensors
import safetensors.torch
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from unbroken import CorruptCheckpointError
from unbroken.format import tensorfile
from unbroken.format.tensorfile import (
    DTYPE_TO_ST,
    ST_TO_DTYPE,
    TensorEntry,
    layout,
    load_tensor_file,
    parse_header,
    write_tensor_file,
)

ALL_DTYPES = list(DTYPE_TO_ST)


def random_bits(shape, dtype, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (math.prod(shape) * itemsize,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


def tbytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def assert_identical(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(tbytes(a), tbytes(b))


def write_ours(tensors: dict[str, torch.Tensor], metadata=None) -> bytes:
    f = io.BytesIO()
    chunks: list[bytes] = []
    n = write_tensor_file(f, [TensorEntry(k, v) for k, v in tensors.items()],
                          lambda b: chunks.append(bytes(b)), metadata=metadata)
    data = f.getvalue()
    assert n == len(data)
    assert b"".join(chunks) == data  # the checksum sees exactly the bytes written
    return data


def mixed_tensors(seed=0) -> dict[str, torch.Tensor]:
    """Every dtype, odd sizes (so a naive layout would be misaligned), 0-d and empty."""
    out = {}
    for i, dt in enumerate(ALL_DTYPES):
        name = str(dt).removeprefix("torch.")
        out[f"{name}/odd"] = random_bits((3, 1 + i % 3), dt, seed=seed + i)
        out[f"{name}/scalar"] = random_bits((), dt, seed=seed + 100 + i)
        out[f"{name}/empty"] = torch.empty((0, 3), dtype=dt)
    return out


# ------------------------------------------------------------ interoperability

@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_official_reader_reads_our_files(tmp_path, dtype):
    tensors = {
        "a": random_bits((5, 7), dtype, seed=1),
        "b": random_bits((), dtype, seed=2),
        "c": torch.empty((0, 3), dtype=dtype),
        "small_u8": random_bits((3,), torch.uint8, seed=3),  # odd-sized companion
        "f64": random_bits((2,), torch.float64, seed=4),
    }
    path = tmp_path / "x.safetensors"
    path.write_bytes(write_ours(tensors, metadata={"format": "unbroken"}))
    with safetensors.safe_open(str(path), framework="pt") as f:
        assert set(f.keys()) == set(tensors)
        assert f.metadata() == {"format": "unbroken"}
        for k, v in tensors.items():
            assert_identical(v, f.get_tensor(k))
    loaded = safetensors.torch.load_file(str(path))
    assert set(loaded) == set(tensors)
    for k, v in tensors.items():
        assert_identical(v, loaded[k])


def test_official_reader_reads_mixed_file(tmp_path):
    tensors = mixed_tensors()
    path = tmp_path / "mixed.safetensors"
    path.write_bytes(write_ours(tensors))
    loaded = safetensors.torch.load_file(str(path))
    assert set(loaded) == set(tensors)
    for k, v in tensors.items():
        assert_identical(v, loaded[k])
    # and the bytes-level API agrees
    loaded2 = safetensors.torch.load(path.read_bytes())
    for k, v in tensors.items():
        assert_identical(v, loaded2[k])


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_we_read_official_files(tmp_path, dtype):
    tensors = {"a": random_bits((4, 3), dtype, seed=5), "b": random_bits((), dtype, seed=6),
               "c": torch.empty((0,), dtype=dtype), "u8": random_bits((5,), torch.uint8, seed=7)}
    path = tmp_path / "official.safetensors"
    safetensors.torch.save_file(tensors, str(path), metadata={"who": "official"})
    out = load_tensor_file(bytearray(path.read_bytes()), "official.safetensors")
    assert set(out) == set(tensors)  # __metadata__ is not a tensor
    for k, v in tensors.items():
        assert_identical(v, out[k])


def test_we_read_official_mixed_file():
    tensors = mixed_tensors(seed=50)
    out = load_tensor_file(bytearray(safetensors.torch.save(tensors)), "m")
    assert set(out) == set(tensors)
    for k, v in tensors.items():
        assert_identical(v, out[k])


def handmade(entries: list[tuple[str, torch.Tensor]], pad_header: bool = True) -> bytes:
    """A valid safetensors file with tensors in the given order, no alignment padding."""
    header, offset, data = {}, 0, b""
    for key, t in entries:
        raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        header[key] = {"dtype": DTYPE_TO_ST[t.dtype], "shape": list(t.shape),
                       "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
        data += raw
    h = json.dumps(header).encode()
    if pad_header:
        h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + data


@pytest.mark.parametrize("pad_header", [True, False], ids=["padded-header", "unpadded-header"])
def test_we_read_unaligned_layouts(pad_header):
    entries = [
        ("u8", random_bits((3,), torch.uint8, seed=1)),
        ("f32", random_bits((5,), torch.float32, seed=2)),
        ("i16", random_bits((3,), torch.int16, seed=3)),
        ("f64", random_bits((2, 3), torch.float64, seed=4)),
        ("bf16", random_bits((7,), torch.bfloat16, seed=5)),
        ("u64", random_bits((1,), torch.uint64, seed=6)),
    ]
    raw = handmade(entries, pad_header)
    # at least one tensor really is misaligned in this buffer
    header, start = parse_header(memoryview(raw), "h")
    assert any((start + h["data_offsets"][0]) % torch.empty((), dtype=ST_TO_DTYPE[h["dtype"]]).element_size()
               for h in header.values())
    ours = load_tensor_file(bytearray(raw), "h")
    official = safetensors.torch.load(raw)
    for key, t in entries:
        assert_identical(t, ours[key])
        assert_identical(official[key], ours[key])


def test_loaded_tensors_share_the_buffer():
    tensors = {"a": torch.arange(6, dtype=torch.float32), "b": torch.arange(3, dtype=torch.int64)}
    buf = bytearray(write_ours(tensors))
    out = load_tensor_file(buf, "x")
    header, start = parse_header(memoryview(buf), "x")
    begin = start + header["b"]["data_offsets"][0]
    buf[begin : begin + 8] = struct.pack("<q", 42)
    assert out["b"][0].item() == 42  # zero-copy: no hidden copy between verify and load


def test_on_half_called_once_midway():
    tensors = [TensorEntry("a", torch.zeros(1000, dtype=torch.float64)),
               TensorEntry("b", torch.zeros(10, dtype=torch.uint8))]
    f = io.BytesIO()
    seen = []
    head, _ = layout(tensors)
    write_tensor_file(f, tensors, lambda b: None, on_half=lambda: seen.append(len(f.getvalue())))
    assert len(seen) == 1
    total = 8010
    assert seen[0] == len(head) + total // 2


def test_on_half_called_for_empty_file():
    calls = []
    write_tensor_file(io.BytesIO(), [], lambda b: None, on_half=lambda: calls.append(1))
    assert calls == [1]


# -------------------------------------------------------------------- alignment

_dtypes = st.sampled_from(ALL_DTYPES)
_shapes = st.lists(st.integers(0, 5), max_size=3)


@settings(max_examples=80, deadline=None, database=None)
@given(specs=st.lists(st.tuples(_dtypes, _shapes), min_size=1, max_size=8),
       meta=st.none() | st.dictionaries(st.text(max_size=10), st.text(max_size=30), max_size=3))
def test_alignment_property(specs, meta):
    tensors = {f"t{i}": random_bits(tuple(shape), dt, seed=i) for i, (dt, shape) in enumerate(specs)}
    raw = write_ours(tensors, metadata=meta or None)
    (n,) = struct.unpack("<Q", raw[:8])
    assert (8 + n) % 8 == 0  # data section starts 8-aligned
    header, start = parse_header(memoryview(raw), "x")
    assert start == 8 + n
    for key, h in header.items():
        itemsize = torch.empty((), dtype=ST_TO_DTYPE[h["dtype"]]).element_size()
        assert h["data_offsets"][0] % itemsize == 0, key
        assert (start + h["data_offsets"][0]) % itemsize == 0, key
    out = load_tensor_file(bytearray(raw), "x")
    for k, v in tensors.items():
        assert_identical(v, out[k])


# ------------------------------------------------------------ header validation

def build(header, data: bytes = b"", n: int | None = None) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw) if n is None else n) + raw + data


def ent(dtype="F32", shape=(2,), offs=(0, 8)):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offs)}


DATA8 = b"\x00" * 8
VALID = {
    "ok": build({"a": ent()}, DATA8),
    "ok_two": build({"a": ent(offs=(0, 8)), "b": ent("U8", (3,), (8, 11))}, DATA8 + b"abc"),
    "ok_meta": build({"__metadata__": {"k": "v"}, "a": ent()}, DATA8),
    "ok_empty_file": build({}),
    "ok_empty_tensor_huge_dims": build({"a": ent("F32", (0, 2**40), (0, 0))}),
}

BAD = {
    "shorter_than_8": b"\x01\x02\x03",
    "header_longer_than_file": build({"a": ent()}, DATA8, n=1000),
    "header_len_2_64": build({"a": ent()}, DATA8, n=2**64 - 1),
    "not_json": build(b"{this is not json}", DATA8),
    "not_utf8": build(b"\xff\xfe\xfd\xfc", DATA8),
    "json_array": build(b"[1, 2, 3]"),
    "json_string": build(b'"hello"'),
    "deeply_nested": build(b"[" * 100000 + b"]" * 100000),
    "duplicate_keys": build(b'{"a":' + json.dumps(ent()).encode() + b',"a":' + json.dumps(ent()).encode() + b"}",
                            DATA8),
    "duplicate_field": build(b'{"a":{"dtype":"F32","dtype":"F32","shape":[2],"data_offsets":[0,8]}}', DATA8),
    "unknown_dtype": build({"a": ent(dtype="F128")}, DATA8),
    "lowercase_dtype": build({"a": ent(dtype="float32")}, DATA8),
    "dtype_list": build({"a": ent(dtype=["F32"])}, DATA8),
    "dtype_int": build({"a": ent(dtype=4)}, DATA8),
    "negative_dim": build({"a": ent(shape=(-2,))}, DATA8),
    "negative_dims_cancel": build({"a": ent(shape=(-1, -2))}, DATA8),
    "float_dim": build({"a": ent(shape=(2.0,))}, DATA8),
    "bool_dim": build({"a": {"dtype": "F32", "shape": [True, True], "data_offsets": [0, 8]}}, DATA8),
    "str_dim": build({"a": ent(shape=("2",))}, DATA8),
    "shape_not_list": build({"a": {"dtype": "F32", "shape": 2, "data_offsets": [0, 8]}}, DATA8),
    "dim_beyond_int64": build({"a": ent(shape=(0, 2**70), offs=(0, 0))}),
    "entry_not_object": build({"a": [1, 2]}, DATA8),
    "entry_missing_field": build({"a": {"dtype": "F32", "shape": [2]}}, DATA8),
    "entry_extra_field": build({"a": {**ent(), "extra": 1}}, DATA8),
    "offsets_past_end": build({"a": ent(offs=(0, 800))}, DATA8),
    "offsets_negative": build({"a": ent(offs=(-8, 0))}, DATA8),
    "offsets_reversed": build({"a": ent(shape=(0,), offs=(8, 0))}, DATA8),
    "offsets_float": build({"a": ent(offs=(0.0, 8.0))}, DATA8),
    "offsets_three": build({"a": ent(offs=(0, 8, 8))}, DATA8),
    "offsets_not_list": build({"a": {"dtype": "F32", "shape": [2], "data_offsets": 8}}, DATA8),
    "shape_span_mismatch_small": build({"a": ent(shape=(1,), offs=(0, 8))}, DATA8),
    "shape_span_mismatch_big": build({"a": ent(shape=(3,), offs=(0, 8))}, DATA8),
    "hole_at_start": build({"a": ent(shape=(1,), offs=(4, 8))}, DATA8),
    "hole_between": build({"a": ent(shape=(1,), offs=(0, 4)), "b": ent(shape=(1,), offs=(8, 12))}, DATA8 + b"1234"),
    "overlap": build({"a": ent(offs=(0, 8)), "b": ent(offs=(4, 12))}, DATA8 + b"1234"),
    "same_span_twice": build({"a": ent(offs=(0, 8)), "b": ent(offs=(0, 8))}, DATA8),
    "trailing_bytes": build({"a": ent()}, DATA8 + b"xtra"),
    "data_but_no_tensors": build({}, DATA8),
    "huge_numel_small_span": build({"a": ent(shape=(10**12,), offs=(0, 8))}, DATA8),
    "huge_numel_claimed_span": build({"a": ent(shape=(10**6, 10**6), offs=(0, 4 * 10**12))}, DATA8),
    "huge_numel_overflowing": build({"a": ent(shape=(2**62, 2**62, 2**62), offs=(0, 8))}, DATA8),
    # a million dimensions: rejected without multiplying out a million-digit number
    "million_dims": build({"a": ent(shape=(2,) * 1_000_000, offs=(0, 8))}, DATA8),
}


@pytest.mark.parametrize("name", list(VALID))
def test_valid_handmade_files_parse(name):
    raw = VALID[name]
    header, start = parse_header(memoryview(raw), name)
    out = load_tensor_file(bytearray(raw), name)
    assert set(out) == set(header) and "__metadata__" not in out
    if name == "ok_empty_tensor_huge_dims":
        assert out["a"].shape == (0, 2**40)


@pytest.mark.parametrize("name", list(BAD))
def test_bad_headers_are_rejected(name):
    raw = BAD[name]
    with pytest.raises(CorruptCheckpointError) as ei:
        parse_header(memoryview(raw), f"{name}.safetensors")
    assert f"{name}.safetensors" in str(ei.value)  # says which file
    with pytest.raises(CorruptCheckpointError):
        load_tensor_file(bytearray(raw), f"{name}.safetensors")


def test_header_over_max_header_is_rejected(monkeypatch):
    raw = VALID["ok"]
    (n,) = struct.unpack("<Q", raw[:8])
    parse_header(memoryview(raw), "x")  # fine at the real limit
    monkeypatch.setattr(tensorfile, "MAX_HEADER", n - 1)
    with pytest.raises(CorruptCheckpointError):
        parse_header(memoryview(raw), "x")
    with pytest.raises(CorruptCheckpointError):
        load_tensor_file(bytearray(raw), "x")


def test_every_truncation_of_a_real_file_is_rejected():
    raw = write_ours({"a": random_bits((3, 3), torch.float32), "b": random_bits((5,), torch.int16)})
    for cut in range(len(raw)):
        with pytest.raises(CorruptCheckpointError):
            load_tensor_file(bytearray(raw[:cut]), "x")
    load_tensor_file(bytearray(raw), "x")


def test_layout_refuses_unsupported_dtype():
    with pytest.raises(TypeError):
        layout([TensorEntry("c", torch.zeros(2, dtype=torch.complex64))])
