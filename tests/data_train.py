"""A training job over the data of tests/test_data_e2e.py, killed and resumed by the tests.

    python tests/data_train.py --mode stream --run-dir RUN --out OUT --steps 24 --save-every 4 --workers 2

Modes (all with a tiny model with dropout, AdamW, every step's samples logged):

* ``hfmap``: a map-style ``datasets.Dataset`` with a random ``set_transform`` (global torch RNG),
  wrapped in ``unbroken.data.Seeded``, through a ``ResumableLoader``;
* ``stream``: a sharded streaming ``datasets.IterableDataset`` with ``.map`` and
  ``.shuffle(seed, buffer_size)``, through ``unbroken.data.StreamLoader``;
* ``stream-sdl``: the same stream through torchdata's ``StatefulDataLoader``, which
  ``datasets`` recommends for resuming (its state goes into the checkpoint as is): the
  framework alone, measured;
* ``mixture``: three map-style sources in an ``unbroken.data.Mixture`` with a curriculum
  (``--change``: at a resume, other weights and a source added; ``--plan N``: the same change
  planned from sample N on, for the reference);
* ``packer``: variable-length token sequences packed into rows by ``unbroken.data.Packer``
  through ``CarryOver``, a tiny language model.

Each step appends ``{"step", "loss", "samples"}`` to ``OUT/records.jsonl`` and prints ``step N``;
at the end the parameters and optimizer moments go to ``OUT/final.safetensors``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import unbroken
import unbroken.data as ud

D, C, V = 8, 4, 32


def features(i: int) -> list[float]:
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randn(D, generator=g).tolist()


def hf_map(n: int, offset: int = 0):
    from datasets import Dataset

    ids = list(range(offset, offset + n))
    return Dataset.from_dict({"x": [features(i) for i in ids], "y": [i % C for i in ids], "id": ids})


def augment(batch: dict) -> dict:
    """A ``set_transform`` as users write them: noise from the global torch RNG."""
    batch["x"] = [torch.tensor(x) + 0.1 * torch.randn(D) for x in batch["x"]]
    return batch


def gen(shards):
    for s in shards:
        for j in range(20):
            i = s * 100 + j
            yield {"x": features(i), "y": i % C, "id": i}


def stream():
    from datasets import IterableDataset

    ds = IterableDataset.from_generator(gen, gen_kwargs={"shards": list(range(4))})
    ds = ds.map(lambda ex: {"x": [v * 2.0 for v in ex["x"]]})
    return ds.shuffle(seed=7, buffer_size=16).with_format("torch")


def tokens(n: int):
    from datasets import Dataset

    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(1, V, (int(torch.randint(3, 14, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]
    return Dataset.from_dict({"input_ids": seqs, "id": list(range(n))})


def build_data(args):
    if args.mode == "hfmap":
        ds = hf_map(96)
        ds.set_transform(augment, columns=["x"], output_all_columns=True)
        return ud.ResumableLoader(ud.Seeded(ds), batch_size=8, shuffle=True, seed=3, num_workers=args.workers)
    if args.mode == "stream":
        return ud.StreamLoader(stream(), batch_size=8, num_workers=args.workers)
    if args.mode == "stream-sdl":
        from torchdata.stateful_dataloader import StatefulDataLoader

        return StatefulDataLoader(stream(), batch_size=8, num_workers=args.workers)
    if args.mode == "mixture":
        sources = {"a": hf_map(40).with_format("torch"), "b": hf_map(24, 500).with_format("torch")}
        first = {"a": 0.7, "b": 0.3}
        weights: list = [(0, first), (96, {"a": 0.4, "b": 0.6})]  # a curriculum: from step 12 on
        later = {"a": 0.2, "b": 0.3, "c": 0.5}
        if args.change or args.plan is not None:
            sources["c"] = hf_map(16, 900).with_format("torch")
        if args.change:
            weights = [(0, later)]
        elif args.plan is not None:
            weights = [w for w in weights if w[0] < args.plan] + [(args.plan, later)]
        mix = ud.Mixture(sources, weights, seed=11, block=16)
        return mix.loader(batch_size=8, num_workers=args.workers)
    if args.mode == "packer":
        loader = ud.ResumableLoader(tokens(64), batch_size=3, shuffle=True, seed=2, num_workers=args.workers,
                                    collate_fn=list)
        return ud.CarryOver(loader, ud.Packer(seq_len=12, batch_size=2, eos=0))
    raise SystemExit(f"unknown mode {args.mode}")


def model_and_optimizer(mode: str):
    torch.manual_seed(1)
    if mode == "packer":
        model = torch.nn.Sequential(torch.nn.Embedding(V, 16), torch.nn.Dropout(0.1), torch.nn.Linear(16, V))
    else:
        model = torch.nn.Sequential(torch.nn.Linear(D, 16), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                    torch.nn.Linear(16, C))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def loss_and_samples(mode: str, model, batch) -> tuple[torch.Tensor, list]:
    if mode == "packer":
        ids = batch["input_ids"]
        logits = model(ids[:, :-1])
        return F.cross_entropy(logits.reshape(-1, V), ids[:, 1:].reshape(-1)), ids.tolist()
    x, y = batch["x"], batch["y"]
    return F.cross_entropy(model(x.float()), y.long()), batch["id"].tolist()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", required=True)
    p.add_argument("--run-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--save-every", type=int, default=4)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--change", action="store_true", help="mixture: other weights and a source added")
    p.add_argument("--plan", type=int, default=None, help="mixture: the same change planned from this sample on")
    args = p.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model, opt = model_and_optimizer(args.mode)
    data = build_data(args)
    ckpt = unbroken.Checkpointer(args.run_dir, save_every=args.save_every, keep_last=2)
    state = {"model": model, "optimizer": opt, "data": data}
    info = ckpt.restore(state)
    print(f"resumed from step {info.step}" if info else "fresh start", flush=True)
    if info:  # what the checkpoint carried besides a position, for the tests to check
        carried = {"step": info.step}
        if isinstance(data, ud.StreamLoader):
            carried.update(buffer=len(data.buffer.items), pending=len(data.pending))
        if isinstance(data, ud.CarryOver):
            carried.update(tokens=len(data.collator.tokens), ready=len(data.ready))
        with open(out / "restored.jsonl", "a") as f:
            f.write(json.dumps(carried) + "\n")
    batches = iter(data)
    with open(out / "records.jsonl", "a") as log:
        while ckpt.progress.step < args.steps:
            try:
                batch = next(batches)
            except StopIteration:
                batches = iter(data)
                batch = next(batches)
            model.train()
            loss, samples = loss_and_samples(args.mode, model, batch)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            log.write(json.dumps({"step": ckpt.progress.step + 1, "loss": loss.item(), "samples": samples}) + "\n")
            log.flush()
            print(f"step {ckpt.progress.step + 1}", flush=True)
            ckpt.step(state, loss=loss.detach())
    ckpt.close()
    from safetensors.torch import save_file

    final = {f"model/{k}": v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    for pid, st in opt.state_dict()["state"].items():
        final.update({f"optimizer/{pid}/{k}": v.detach().clone().contiguous().reshape(-1) for k, v in st.items()})
    save_file(final, str(out / "final.safetensors"))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
