"""Round-trips of every supported leaf type through ``unbroken.save``/``unbroken.load``,
and the errors for what cannot be saved without pickle."""

from __future__ import annotations

import collections
import itertools
import math
import os
import pathlib
import random
import struct
from collections import OrderedDict

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import unbroken
from unbroken.format.tensorfile import DTYPE_TO_ST

_counter = itertools.count()


def roundtrip(tmp_path, value):
    """Save ``{"x": value}`` as a fresh checkpoint folder and load it back."""
    path = tmp_path / f"ck{next(_counter)}"
    unbroken.save(path, {"x": value})
    out = unbroken.load(path)
    assert list(out) == ["x"]
    return out["x"]


def short_id(v) -> str:
    if type(v) is int and v.bit_length() > 256:
        return f"int_{v.bit_length()}bits" + ("_neg" if v < 0 else "")
    return repr(v)[:40]


def fbits(x: float) -> bytes:
    return struct.pack("<d", x)


def same(a, b) -> bool:
    """Exact structural equality: same types everywhere, floats bitwise, NaN == NaN."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return fbits(a) == fbits(b)
    if isinstance(a, complex):
        return same(a.real, b.real) and same(a.imag, b.imag)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return len(a) == len(b) and all(
            same(ka, kb) and same(va, vb) for (ka, va), (kb, vb) in zip(a.items(), b.items(), strict=True)
        )
    return a == b


def tbytes(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous().reshape(-1)
    if t.is_complex():
        t = torch.view_as_real(t).reshape(-1)
    return t.view(torch.uint8)


def assert_tensor_identical(a: torch.Tensor, b: torch.Tensor) -> None:
    assert type(b) is torch.Tensor
    assert a.dtype == b.dtype
    assert a.shape == b.shape
    assert torch.equal(tbytes(a), tbytes(b))


def random_bits(shape, dtype, seed=0) -> torch.Tensor:
    """A tensor of ``dtype`` whose bytes are random (NaN payloads, subnormals, ...)."""
    g = torch.Generator().manual_seed(seed)
    itemsize = torch.empty((), dtype=dtype).element_size()
    n = math.prod(shape)
    raw = torch.randint(0, 256, (n * itemsize,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


# --------------------------------------------------------------------- scalars

NEG_NAN = float("inf") - float("inf")  # on x86 this NaN has its sign bit set
PAYLOAD_NAN = struct.unpack(">d", bytes.fromhex("fff8000000000abc"))[0]  # negative, with a payload
assert math.isnan(PAYLOAD_NAN) and math.isnan(NEG_NAN)


@pytest.mark.parametrize("value", [
    None, True, False, 0, 1, -1, 2**63 - 1, 2**64, 2**64 + 1, -(2**64) - 7, 3**300, -(7**500),
    2**8192, 10**5000, -(10**5000),
    0.0, -0.0, 1.5, -2.25, 1e308, 5e-324, -5e-324, float("nan"), float("inf"), float("-inf"),
    NEG_NAN, -float("nan"), PAYLOAD_NAN,
    "", "plain", "héllo ☃ 𝄞 日本語", "\x00nul\ttab\nnl", "\ud800 lone surrogate", "@", '{"@": "tensor"}',
    b"", b"\x00\xff\x80bytes", bytearray(b"\x01\x02\x03"), bytearray(),
    1 + 2j, complex(-0.0, float("inf")), complex(float("nan"), -0.0), 0j,
], ids=short_id)
def test_scalar_roundtrip(tmp_path, value):
    out = roundtrip(tmp_path, value)
    assert type(out) is type(value)
    assert same(out, value)


def test_negative_zero_and_nan_sign_survive(tmp_path):
    out = roundtrip(tmp_path, [-0.0, NEG_NAN, float("nan")])
    assert math.copysign(1.0, out[0]) == -1.0
    assert math.isnan(out[1]) and math.copysign(1.0, out[1]) == math.copysign(1.0, NEG_NAN)
    assert fbits(out[1]) == fbits(NEG_NAN)
    assert fbits(out[2]) == fbits(float("nan"))


# ------------------------------------------------------------------ containers

@pytest.mark.parametrize("value", [
    [], (), [1, [2, [3, []]]], (1, "a", None), ((1, 2), ((3,), ()), [4, (5, 6)]),
    {}, {"a": 1, "b": [1, 2], "c": {"d": (1.5, None)}},
    {"z": 1, "a": 2, "m": 3},  # insertion order kept
    {1: "one", -2: "minus two", 2**70: "big"},
    {(1, 2): "tuple", ("a", (3.5, None)): "nested tuple"},
    {1.5: "f", -0.0: "negzero", float("inf"): "inf"},
    {True: 1, None: 2, b"k": 3, "s": 4, 7: 5, (1,): 6, 2.5: 7},  # mixed keys
    {"@": "tensor", "file": "x", "key": "y"},  # looks like a tag, is a dict
    [{"@": "float", "v": "nan"}],
], ids=short_id)
def test_container_roundtrip(tmp_path, value):
    out = roundtrip(tmp_path, value)
    assert same(out, value)
    if isinstance(value, dict):
        assert list(out) == list(value)


def test_ordered_dict_type_and_order(tmp_path):
    value = OrderedDict([("b", 1), ("a", OrderedDict([(3, "x"), (1, "y")])), ("c", {"plain": True})])
    out = roundtrip(tmp_path, value)
    assert type(out) is OrderedDict
    assert type(out["a"]) is OrderedDict
    assert type(out["c"]) is dict
    assert list(out) == ["b", "a", "c"]
    assert list(out["a"]) == [3, 1]
    assert same(out, value)


def test_plain_dict_stays_plain(tmp_path):
    assert type(roundtrip(tmp_path, {"a": 1})) is dict
    assert type(roundtrip(tmp_path, {1: 1})) is dict


@pytest.mark.parametrize("value", [
    set(), {1, 2, 3}, {"a", b"b", (1, 2), 2.5, None}, frozenset(), frozenset({1, "x", (2, 3)}),
    {frozenset({1, 2}), frozenset()},
], ids=["empty", "ints", "mixed", "frozenset-empty", "frozenset", "of-frozensets"])  # not repr: set order varies
def test_sets(tmp_path, value):
    out = roundtrip(tmp_path, value)
    assert type(out) is type(value)
    assert out == value
    assert sorted(map(repr, out)) == sorted(map(repr, value))  # element types kept


# ---------------------------------------------------------- torch/numpy values

def test_torch_size_dtype_device(tmp_path):
    dtypes = sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)
    devices = [torch.device("cpu"), torch.device("cuda", 1), torch.device("meta"), torch.device("cpu", 0)]
    value = {"sizes": [torch.Size([]), torch.Size([2, 0, 3])], "dtypes": dtypes, "devices": devices}
    out = roundtrip(tmp_path, value)
    assert all(type(s) is torch.Size for s in out["sizes"])
    assert out["sizes"] == value["sizes"]
    assert out["dtypes"] == dtypes and all(type(d) is torch.dtype for d in out["dtypes"])
    assert out["devices"] == devices and all(type(d) is torch.device for d in out["devices"])


NP_SCALAR_TYPES = [
    np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
    np.float16, np.float32, np.float64, np.longdouble, np.complex64, np.complex128, np.clongdouble,
]


@pytest.mark.parametrize("typ", NP_SCALAR_TYPES, ids=lambda t: t.__name__)
def test_numpy_scalars(tmp_path, typ):
    rng = np.random.default_rng(0)
    itemsize = np.dtype(typ).itemsize
    values = [typ(0), typ(1)]
    # random bit patterns too (NaN payloads, extremes), where every pattern is a valid value
    if np.dtype(typ).kind != "b":
        for _ in range(5):
            raw = rng.integers(0, 256, itemsize, dtype=np.uint8).tobytes()
            values.append(np.frombuffer(raw, dtype=typ)[0])
    out = roundtrip(tmp_path, values)
    assert len(out) == len(values)
    for a, b in zip(values, out, strict=True):
        assert type(b) is typ
        assert b.dtype == a.dtype
        assert b.tobytes() == a.tobytes()


def test_numpy_scalar_extremes(tmp_path):
    values = [np.uint64(2**64 - 1), np.int64(-(2**63)), np.float32("nan"), np.float16("-inf"),
              np.float64(-0.0), np.bool_(True), np.bool_(False)]
    out = roundtrip(tmp_path, values)
    for a, b in zip(values, out, strict=True):
        assert type(a) is type(b) and a.tobytes() == b.tobytes()


@pytest.mark.parametrize("dt", ["<i4", ">i4", "<f8", ">f2", "|b1", "|u1", "<c16", ">u8", "<U5", "|S3",
                                "<f16"])
def test_numpy_dtypes(tmp_path, dt):
    value = np.dtype(dt)
    out = roundtrip(tmp_path, value)
    assert isinstance(out, np.dtype)
    assert out == value and out.str == value.str


NP_ARRAY_DTYPES = ["?", "i1", "i2", "i4", "i8", "u1", "u2", "u4", "u8", "f2", "f4", "f8", "c8", "c16"]


def random_array(dt, shape, seed=0):
    dt = np.dtype(dt)
    rng = np.random.default_rng(seed)
    n = math.prod(shape)
    if dt.kind == "b":
        return rng.integers(0, 2, shape).astype(bool)
    raw = rng.integers(0, 256, n * dt.itemsize, dtype=np.uint8)
    return raw.view(dt).reshape(shape)


def assert_array_identical(a: np.ndarray, b: np.ndarray) -> None:
    assert type(b) is np.ndarray
    assert b.dtype == a.dtype and b.dtype.str == a.dtype.str
    assert b.shape == a.shape
    assert np.ascontiguousarray(b).tobytes() == np.ascontiguousarray(a).tobytes()


@pytest.mark.parametrize("dt", NP_ARRAY_DTYPES)
def test_numpy_arrays_every_dtype(tmp_path, dt):
    a = random_array(dt, (3, 5))
    assert_array_identical(a, roundtrip(tmp_path, a))


@pytest.mark.parametrize("dt", [d for d in NP_ARRAY_DTYPES if d not in ("?", "i1", "u1")])
def test_numpy_big_endian_arrays(tmp_path, dt):
    native = random_array(dt, (4, 3), seed=1)
    big = native.astype(np.dtype(dt).newbyteorder(">"))
    out = roundtrip(tmp_path, big)
    assert_array_identical(big, out)
    assert out.dtype.byteorder == ">"
    np.testing.assert_array_equal(out, native)


@pytest.mark.parametrize("make", [
    lambda: np.arange(24, dtype=np.float32).reshape(4, 6)[:, ::2],
    lambda: np.arange(24, dtype=np.int64).reshape(4, 6).T,
    lambda: np.asfortranarray(np.arange(12, dtype=np.uint16).reshape(3, 4)),
    lambda: np.arange(10, dtype=np.complex128)[::-3],
    lambda: np.array(7, dtype=np.int32),
    lambda: np.array(1.5 + 2j, dtype=np.complex64),
    lambda: np.zeros((0, 3), dtype=np.float64),
    lambda: np.frombuffer(b"\x01\x02\x03\x04", dtype=np.uint8),  # read-only
], ids=["sliced", "transposed", "fortran", "negative-stride", "0-d", "0-d-complex", "empty", "readonly"])
def test_numpy_array_layouts(tmp_path, make):
    a = make()
    assert_array_identical(a, roundtrip(tmp_path, a))


TORCH_DTYPES = list(DTYPE_TO_ST) + [torch.complex64, torch.complex128]


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
def test_torch_tensors_every_dtype_bitwise(tmp_path, dtype):
    value = {
        "matrix": random_bits((7, 5), dtype, seed=1),
        "scalar": random_bits((), dtype, seed=2),
        "empty": torch.empty((0, 3), dtype=dtype),
        "transposed": random_bits((4, 6), dtype, seed=3).t(),
        "stepped": random_bits((20,), dtype, seed=4)[1::3],
    }
    out = roundtrip(tmp_path, value)
    for k, v in value.items():
        assert_tensor_identical(v, out[k])
    assert out["scalar"].dim() == 0
    assert out["empty"].shape == (0, 3)


def test_float_tensor_nan_payloads_bitwise(tmp_path):
    pats = ["7ff8000000000000", "fff8000000000000", "7ff0000000000001", "7ff4000000000abc", "8000000000000000"]
    t = torch.frombuffer(bytearray(b"".join(bytes.fromhex(p)[::-1] for p in pats)), dtype=torch.float64)
    out = roundtrip(tmp_path, t.clone())
    assert torch.equal(tbytes(out), tbytes(t))


def test_shared_tensor_is_one_object(tmp_path):
    t = torch.randn(4, 3)
    z = torch.randn(3, dtype=torch.complex64)
    value = {"a": t, "b": [t, {"c": t}], "z1": z, "z2": z}
    path = tmp_path / "ck"
    unbroken.save(path, {"one": value, "two": t})  # also across top-level keys (different files)
    out = unbroken.load(path)
    one = out["one"]
    assert one["a"] is one["b"][0] is one["b"][1]["c"] is out["two"]
    assert torch.equal(one["a"], t)
    assert one["z1"] is one["z2"]
    assert torch.equal(one["z1"], z)


def test_views_and_base_come_back_with_correct_values(tmp_path):
    base = torch.arange(24, dtype=torch.float32)
    views = {
        "base": base,
        "reshaped": base.view(4, 6),
        "slice": base[3:9],
        "step": base[1::5],
        "transposed": base.view(4, 6).t(),
        "col": base.view(4, 6)[:, 2],
    }
    out = roundtrip(tmp_path, views)
    for k, v in views.items():
        assert out[k].shape == v.shape, k
        assert torch.equal(out[k], v), k


def test_requires_grad_preserved(tmp_path):
    p = torch.nn.Parameter(torch.randn(3))
    value = {"leaf": torch.randn(2, requires_grad=True), "plain": torch.randn(2), "param": p,
             "nonleaf": torch.randn(2, requires_grad=True) * 2}
    out = roundtrip(tmp_path, value)
    assert out["leaf"].requires_grad and out["leaf"].is_leaf
    assert not out["plain"].requires_grad
    assert out["param"].requires_grad
    assert out["nonleaf"].requires_grad
    for k, v in value.items():
        assert torch.equal(out[k].detach(), v.detach())


# ------------------------------------------------------------------ generators

def test_torch_generator_continues_stream(tmp_path):
    g = torch.Generator().manual_seed(1234)
    torch.rand(10, generator=g)
    out = roundtrip(tmp_path, g)
    assert type(out) is torch.Generator
    expected = torch.rand(50, generator=g)
    assert torch.equal(torch.rand(50, generator=out), expected)


@pytest.mark.parametrize("bitgen", ["PCG64", "PCG64DXSM", "MT19937", "Philox", "SFC64"])
def test_numpy_generator_continues_stream(tmp_path, bitgen):
    g = np.random.Generator(getattr(np.random, bitgen)(42))
    g.random(7)
    out = roundtrip(tmp_path, g)
    assert type(out) is np.random.Generator
    assert type(out.bit_generator) is type(g.bit_generator)
    np.testing.assert_array_equal(out.random(100), g.random(100))
    np.testing.assert_array_equal(out.integers(0, 2**63, 20), g.integers(0, 2**63, 20))


def test_numpy_randomstate_continues_stream(tmp_path):
    rs = np.random.RandomState(7)
    rs.rand(3)
    rs.standard_normal()  # leaves a cached gaussian
    out = roundtrip(tmp_path, rs)
    assert type(out) is np.random.RandomState
    np.testing.assert_array_equal(out.standard_normal(11), rs.standard_normal(11))
    np.testing.assert_array_equal(out.rand(20), rs.rand(20))


def test_python_random_continues_stream(tmp_path):
    r = random.Random(99)
    r.random()
    r.gauss(0, 1)  # leaves a cached gauss value
    out = roundtrip(tmp_path, r)
    assert type(out) is random.Random
    assert [out.gauss(0, 1) for _ in range(5)] == [r.gauss(0, 1) for _ in range(5)]
    assert [out.random() for _ in range(20)] == [r.random() for _ in range(20)]
    assert out.getrandbits(300) == r.getrandbits(300)


def test_pathlib_paths(tmp_path):
    value = [pathlib.Path("runs/exp1"), pathlib.Path("/abs/p"), pathlib.PurePosixPath("a/b"),
             pathlib.PureWindowsPath(r"C:\data\x")]
    out = roundtrip(tmp_path, value)
    assert out == value
    assert [str(p) for p in out] == [str(p) for p in value]
    assert isinstance(out[0], pathlib.Path)
    assert isinstance(out[3], pathlib.PureWindowsPath)


# ------------------------------------------------------------------ hypothesis

_keys = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: st.tuples(inner, inner),
    max_leaves=4,
)
_leaves = (
    st.none() | st.booleans() | st.integers() | st.integers(min_value=-(2**200), max_value=2**200)
    | st.floats() | st.text(max_size=20) | st.binary(max_size=20)
)
_trees = st.recursive(
    _leaves,
    lambda children: st.lists(children, max_size=4)
    | st.lists(children, max_size=4).map(tuple)
    | st.dictionaries(st.text(max_size=6), children, max_size=4)
    | st.dictionaries(_keys, children, max_size=4),
    max_leaves=25,
)


def same_nan_ok(a, b) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or fbits(a) == fbits(b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_nan_ok(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return len(a) == len(b) and all(
            same_nan_ok(ka, kb) and same_nan_ok(va, vb) for (ka, va), (kb, vb) in zip(a.items(), b.items(), strict=True)
        )
    return a == b


@settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tree=_trees)
def test_property_nested_trees_roundtrip(tmp_path, tree):
    out = roundtrip(tmp_path, tree)
    assert same_nan_ok(out, tree)


# ---------------------------------------------------------------- unsupported

class Custom:
    pass


Point = collections.namedtuple("Point", "x y")
OPT_PATH = 'state["optimizer"]["param_groups"][0]["foo"]'


def _cyclic():
    a: list = [1]
    a.append(a)
    return a


@pytest.mark.parametrize("bad, fix_hint", [
    (Custom(), "load_state_dict"),
    (lambda x: x, "load_state_dict"),
    (Point(1, 2), "load_state_dict"),
    (collections.defaultdict(list, {"a": [1]}), "load_state_dict"),
    (torch.eye(3).to_sparse(), "to_dense"),
    (np.array([1, "a", None], dtype=object), "numpy dtype"),
    (np.array(["a", "bc"]), "numpy array of dtype"),
], ids=["custom", "lambda", "namedtuple", "defaultdict", "sparse", "object-array", "string-array"])
def test_unsupported_types_name_their_path(tmp_path, bad, fix_hint):
    state = {"optimizer": {"lr": 0.1, "param_groups": [{"ok": torch.zeros(2), "foo": bad}]}}
    target = tmp_path / "ck"
    with pytest.raises(unbroken.UnsupportedStateError) as ei:
        unbroken.save(target, state)
    msg = str(ei.value)
    assert OPT_PATH in msg
    assert fix_hint in msg
    if fix_hint == "load_state_dict":
        assert "state_dict()" in msg
    assert not target.exists()
    assert os.listdir(tmp_path) == []  # no hidden staging folder left either


def test_object_instance_message_is_actionable(tmp_path):
    with pytest.raises(unbroken.UnsupportedStateError) as ei:
        unbroken.save(tmp_path / "ck", {"optimizer": {"param_groups": [{"foo": object()}]}})
    msg = str(ei.value)
    assert 'state["optimizer"]["param_groups"][0]["foo"]' in msg
    assert "state_dict" in msg and "load_state_dict" in msg
    assert isinstance(ei.value, unbroken.UnbrokenError)


def test_reference_cycle_is_refused(tmp_path):
    target = tmp_path / "ck"
    with pytest.raises(unbroken.UnsupportedStateError) as ei:
        unbroken.save(target, {"a": {"b": _cyclic()}})
    assert 'state["a"]["b"][1]' in str(ei.value)
    assert "cycle" in str(ei.value)
    assert os.listdir(tmp_path) == []


def test_dict_cycle_is_refused(tmp_path):
    d: dict = {}
    d["self"] = d
    with pytest.raises(unbroken.UnsupportedStateError, match=r'state\["a"\]\["self"\]'):
        unbroken.save(tmp_path / "ck", {"a": d})
    assert os.listdir(tmp_path) == []


def test_repeated_non_cyclic_reference_is_fine(tmp_path):
    shared = [1, 2]
    out = roundtrip(tmp_path, {"p": shared, "q": shared, "r": (shared, shared)})
    assert out["p"] == out["q"] == [1, 2]


def test_unsupported_after_tensors_leaves_nothing(tmp_path):
    state = {"model": {"w": torch.randn(100)}, "z": {"bad": [Custom()]}}
    with pytest.raises(unbroken.UnsupportedStateError, match=r'state\["z"\]\["bad"\]\[0\]'):
        unbroken.save(tmp_path / "ck", state)
    assert os.listdir(tmp_path) == []
