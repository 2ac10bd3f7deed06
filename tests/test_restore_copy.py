"""The copies of a restore (``unbroken.state.copying``): large plain CPU tensors go in with one
``memcpy`` in one thread, everything else through torch, and either way the live state holds
exactly the saved bytes: every dtype (bfloat16 included), modules, optimizers, plain tensors,
non-contiguous destinations, views sharing a storage, 0-d and empty tensors; a module whose
hooks change what it loads is loaded by torch alone; a flipped byte is still refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import unbroken
from unbroken.errors import CorruptCheckpointError
from unbroken.state import copying

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int8, torch.bool,
          torch.complex64]


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal (NaNs and signed zeros included), same dtype and shape."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def noise(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (n * torch.empty(0, dtype=dtype).element_size(),), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        return raw.bool()
    return raw.view(dtype)  # every bit pattern: NaN payloads, -0.0, subnormals


@pytest.mark.parametrize("dtype", DTYPES)
def test_copy_into_and_fresh_copy_are_bitwise_for_every_dtype(dtype: torch.dtype) -> None:
    src = noise(300_000, dtype, 1)  # over DIRECT_MIN_BYTES: the memcpy path
    dst = torch.zeros_like(src)
    version = dst._version
    copying.copy_into(dst, src)
    assert same(dst, src) and dst._version > version
    fresh = copying.fresh_copy(src)
    assert same(fresh, src) and fresh.untyped_storage().data_ptr() != src.untyped_storage().data_ptr()


def test_the_torch_path_takes_what_one_memcpy_cannot() -> None:
    base = noise(600_000, torch.float32, 2).reshape(600, 1000)
    dst = torch.zeros(1000, 600).t()  # non-contiguous destination
    copying.copy_into(dst, base)
    assert same(dst, base)
    small = torch.tensor(3.5)  # 0-d, below the threshold
    tgt = torch.tensor(0.0)
    copying.copy_into(tgt, small)
    assert same(tgt, small) and same(copying.fresh_copy(small), small)
    empty = torch.empty(0, 7, dtype=torch.bfloat16)
    assert same(copying.fresh_copy(empty), empty)
    shared = torch.zeros(2, 300_000)
    copying.copy_into(shared[0], shared[1] + 1)  # a view of a larger storage
    assert torch.equal(shared[0], torch.ones(300_000)) and torch.equal(shared[1], torch.zeros(300_000))
    with torch.inference_mode():
        frozen = torch.zeros(300_000)
    with pytest.raises(RuntimeError):  # as torch refuses it: an inference tensor is not written
        copying.copy_into(frozen, torch.ones(300_000))
    overlap = torch.arange(400_000, dtype=torch.float32)
    copying.copy_into(overlap[:200_000], overlap[100_000:300_000].clone())
    assert torch.equal(overlap[:200_000], torch.arange(100_000, 300_000, dtype=torch.float32))


class Holder:
    """A Stateful that keeps what it is given: tensors of many kinds, views sharing a storage."""

    def __init__(self) -> None:
        self.state: dict = {}

    def state_dict(self) -> dict:
        return self.state

    def load_state_dict(self, sd: dict) -> None:
        self.state = sd


def model_of(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.BatchNorm1d(512), torch.nn.Linear(512, 8))
    return m.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_restore_puts_back_every_byte_of_modules_optimizers_and_plain_tensors(tmp_path: Path,
                                                                                dtype: torch.dtype) -> None:
    model = model_of(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 512, dtype=dtype)).float().sum().backward()
    opt.step()
    base = noise(400_000, dtype, 3)
    holder = Holder()
    holder.state = {"a": base, "also_a": base, "zero_d": torch.tensor(2.0, dtype=dtype),
                    "empty": torch.empty(0, dtype=dtype), "nc": noise(360_000, dtype, 4).reshape(600, 600).t()}
    plain = {"t": noise(300_000, dtype, 5), "nc": torch.zeros(600, 500, dtype=dtype).t(),
             "row0": noise(300_000, dtype, 7), "row1": noise(300_000, dtype, 8)}
    plain["nc"].copy_(noise(300_000, dtype, 6).reshape(500, 600))
    state = {"model": model, "optimizer": opt, "holder": holder, "plain": plain}
    with unbroken.Checkpointer(tmp_path / "run", preemption=None) as ckpt:
        ckpt.save(state)
    want_model = {k: v.clone() for k, v in model.state_dict().items()}
    want_opt = {(i, k): v.clone() for i, s in opt.state_dict()["state"].items() for k, v in s.items()}
    want_holder = {k: v.clone() for k, v in holder.state.items()}
    want_plain = {k: v.clone() for k, v in plain.items()}

    model2 = model_of(dtype)
    torch.nn.init.zeros_(model2[0].weight)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=0.1)
    nc_live = torch.zeros(600, 500, dtype=dtype).t()  # a non-contiguous live tensor, loaded in place
    rows = torch.zeros(2, 300_000, dtype=dtype)  # two live views of one storage, each loaded in place
    plain2 = {"t": torch.zeros(300_000, dtype=dtype), "nc": nc_live, "row0": rows[0], "row1": rows[1]}
    holder2 = Holder()
    param = model2[0].weight
    version = param._version
    state2 = {"model": model2, "optimizer": opt2, "holder": holder2, "plain": plain2}
    with unbroken.Checkpointer(tmp_path / "run", preemption=None) as ckpt:
        assert ckpt.restore(state2) is not None
    assert model2[0].weight is param and param._version > version  # in place, autograd sees the write
    assert all(same(model2.state_dict()[k], v) for k, v in want_model.items())
    got_opt = {(i, k): v for i, s in opt2.state_dict()["state"].items() for k, v in s.items()}
    assert got_opt.keys() == want_opt.keys() and all(same(got_opt[k], v) for k, v in want_opt.items())
    assert all(same(holder2.state[k], v) for k, v in want_holder.items())
    assert holder2.state["a"] is holder2.state["also_a"]  # one tensor saved twice is one tensor again
    assert plain2["nc"] is nc_live and all(same(plain2[k], v) for k, v in want_plain.items())
    assert plain2["row0"].data_ptr() == rows.data_ptr() and same(rows, torch.stack([want_plain["row0"],
                                                                                   want_plain["row1"]]))
    for t in [t for s in opt2.state.values() for t in s.values()]:  # own memory, no view of the file
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size()


def test_a_module_with_a_load_hook_is_loaded_by_torch_as_before(tmp_path: Path) -> None:
    model = model_of(torch.float32)
    unbroken.save(tmp_path / "c", {"model": model})
    live = model_of(torch.float32)
    torch.nn.init.zeros_(live[0].weight)

    def double(module: torch.nn.Module, sd: dict, prefix: str, *args: object) -> None:
        sd[prefix + "weight"] = sd[prefix + "weight"] * 2

    live[0].register_load_state_dict_pre_hook(double)
    assert not copying._loads_as_is(live[0])
    unbroken.load(tmp_path / "c", {"model": live})
    assert torch.equal(live[0].weight, model[0].weight * 2) and torch.equal(live[2].weight, model[2].weight)


def test_a_flipped_byte_is_still_refused_and_nothing_is_loaded(tmp_path: Path) -> None:
    model = model_of(torch.float32)
    with unbroken.Checkpointer(tmp_path / "run", preemption=None) as ckpt:
        info = ckpt.save({"model": model})
    assert info is not None
    f = max((tmp_path / "run" / info.name).glob("*.safetensors"), key=lambda p: p.stat().st_size)
    with open(f, "r+b") as fh:
        fh.seek(f.stat().st_size // 2)
        byte = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([byte[0] ^ 0x01]))
    live = model_of(torch.float32)
    torch.nn.init.zeros_(live[0].weight)
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
        unbroken.load(tmp_path / "run" / info.name, {"model": live})
    assert torch.count_nonzero(live[0].weight) == 0
