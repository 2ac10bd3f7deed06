"""Checkpoints written on a GPU machine load on a CPU-only machine.

There is no GPU here, so the GPU-written checkpoint is made the way it would look:
the state tree records ``"device": "cuda:0"`` for tensors (the bytes in the tensor
files are device-independent). Loading must give CPU tensors, or copy into the live
tensor on whatever device it is.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from sealing import load_doc, save_doc

import unbroken
from unbroken.format.manifest import new_hasher


def _retag_as_cuda(ckpt: Path) -> None:
    state_file = ckpt / "state.json"
    tree = json.loads(state_file.read_text())

    def walk(node):
        if isinstance(node, dict):
            if node.get("@") == "tensor":
                node["device"] = "cuda:0"
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(tree)
    raw = json.dumps(tree).encode()
    state_file.write_bytes(raw)
    manifest = load_doc(ckpt)
    h = new_hasher()
    h.update(raw)
    manifest["files"]["state.json"] = {"size": len(raw), "xxh3_128": h.hexdigest()}
    save_doc(ckpt, manifest)


def test_gpu_written_checkpoint_loads_on_cpu(tmp_path: Path) -> None:
    model = torch.nn.Linear(3, 2)
    ema = torch.randn(5)
    unbroken.save(tmp_path / "c", {"model": model, "ema": ema, "extra": {"t": torch.arange(4)}})
    _retag_as_cuda(tmp_path / "c")
    assert '"cuda:0"' in (tmp_path / "c" / "state.json").read_text()

    plain = unbroken.load(tmp_path / "c")
    assert plain["ema"].device.type == "cpu" and torch.equal(plain["ema"], ema)
    assert torch.equal(plain["model"]["weight"], model.weight.detach())

    fresh = torch.nn.Linear(3, 2)
    live = {"model": fresh, "ema": torch.zeros(5), "extra": {}}
    unbroken.load(tmp_path / "c", live)
    assert torch.equal(fresh.weight, model.weight) and torch.equal(live["ema"], ema)
    assert live["extra"]["t"].device.type == "cpu"
