"""The state stored in the golden checkpoints: deterministic, no RNG, every kind of leaf.

`python tests/golden/golden_state.py write` writes ``tests/golden/v<N>/`` for the
current format version N: the checkpoint, and ``expected.json`` with the exact bytes of
every tensor in it. A written version is never rewritten: the test suite loads every
``v*`` folder forever, so a reader change that breaks old checkpoints fails.
``write <N>`` writes version N instead, for a version the current code still writes: 2 (a
plain save) or 3 (an incremental save, ``Checkpointer(..., incremental=True)``: the run
folder then holds its ``chunks/`` folder too, which is part of the fixture). Version 1 can
no longer be written.

Tensors are compared with the bytes stored in ``expected.json``, never with a
recomputation: an AdamW step (and any float arithmetic) may round differently on
another CPU (an Intel Xeon differs from the AMD EPYC the v1 fixture was written on in
the last bits). Non-tensor leaves are Python literals and are compared with
:func:`golden_state`.
"""

from __future__ import annotations

import json
import sys
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch


def golden_state() -> dict:
    lin = torch.nn.Linear(3, 2)
    with torch.no_grad():
        lin.weight.copy_(torch.arange(6, dtype=torch.float32).reshape(2, 3) / 7)
        lin.bias.copy_(torch.tensor([-1.5, 2.25]))
    opt = torch.optim.AdamW(lin.parameters(), lr=0.01, betas=(0.9, 0.95))
    lin(torch.ones(1, 3)).sum().backward()
    opt.step()
    return {
        "model": lin,
        "optimizer": opt,
        "plain": {
            "int": 7, "big": 2**70, "neg": -3, "float": 0.1, "nan": float("nan"), "inf": float("-inf"),
            "str": "ünïcode ✓", "bytes": b"\x00\xff", "tuple": (1, (2, 3)), "list": [1, "a", None, True],
            "int_keys": {1: "a", 2: "b"}, "ordered": OrderedDict([("z", 1), ("a", 2)]), "set": {3, 1, 2},
            "complex": 1 + 2j, "dtype": torch.bfloat16, "device": torch.device("cpu"),
            "size": torch.Size([2, 3]),
            "np_scalar": np.float32(1.5), "np_array": np.arange(6, dtype=np.int16).reshape(2, 3),
            "bf16": torch.arange(4, dtype=torch.bfloat16) / 3, "f16": torch.arange(4, dtype=torch.float16),
            "i64": torch.arange(5, dtype=torch.int64) * 10**12, "bool": torch.tensor([True, False, True]),
            "u8": torch.arange(7, dtype=torch.uint8), "empty": torch.zeros(0, 3), "scalar": torch.tensor(3.25),
            "ctensor": torch.tensor([1 + 1j, 2 - 1j], dtype=torch.complex64),
            "strided": torch.arange(12.0).reshape(3, 4).t(),
        },
        "generator": torch.Generator().manual_seed(1234),
    }


def tensor_bytes(tree, prefix: str = "") -> dict:
    """Every tensor in a (state_dict-like) tree: ``{path: {dtype, shape, hex}}``."""
    out = {}
    if isinstance(tree, torch.Tensor):
        t = tree.detach().contiguous()
        if t.is_complex():
            t = torch.view_as_real(t).contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        out[prefix] = {"dtype": str(t.dtype), "shape": list(t.shape), "hex": raw.hex()}
    elif isinstance(tree, dict):
        for k, v in tree.items():
            out.update(tensor_bytes(v, f"{prefix}/{k}" if prefix else str(k)))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            out.update(tensor_bytes(v, f"{prefix}/{i}"))
    return out


def expected_of(state: dict) -> dict:
    """What ``expected.json`` holds for a golden state: the bytes of every tensor."""
    return {"model": tensor_bytes(state["model"].state_dict()),
            "optimizer": tensor_bytes(state["optimizer"].state_dict()["state"]),
            "plain": tensor_bytes(state["plain"]),
            "generator": tensor_bytes(state["generator"].get_state())}


WRITABLE = {2: {"incremental": False}, 3: {"incremental": True}}
"""The format versions the current code writes, and the Checkpointer options that write each."""


def write(version: int | None = None) -> Path:
    import unbroken
    from unbroken.format.manifest import FORMAT_VERSION, Manifest

    version = FORMAT_VERSION if version is None else version
    if version not in WRITABLE:
        raise SystemExit(f"format version {version} cannot be written by this code (it writes {sorted(WRITABLE)})")
    target = Path(__file__).parent / f"v{version}" / "run" / "step-000000042"
    if target.exists():
        raise SystemExit(f"{target} exists: golden checkpoints are never rewritten")
    target.parent.mkdir(parents=True)
    ckpt = unbroken.Checkpointer(target.parent, preemption=None, rng=False, **WRITABLE[version])
    ckpt.progress.step = 42
    state = golden_state()
    ckpt.save(state, metrics={"loss": 0.5})
    ckpt.close()
    written = Manifest.from_json((target / "manifest.json").read_bytes()).format_version
    if written != version:
        raise SystemExit(f"{target}: written as format version {written}, not {version}; delete it")
    (target.parent.parent / "expected.json").write_text(json.dumps(expected_of(state), indent=1) + "\n")
    for derived in (".lock", "index.sqlite"):  # not part of the format
        (target.parent / derived).unlink(missing_ok=True)
    return target


if __name__ == "__main__" and sys.argv[1:2] == ["write"] and len(sys.argv) <= 3:
    print(write(int(sys.argv[2]) if len(sys.argv) == 3 else None))
