"""The job of tests/ds_train.py checkpointed by DeepSpeed alone, as a careful user does it (under torchrun, CPU, gloo).

    DS_ACCELERATOR=cpu torchrun --standalone --nproc_per_node 2 benchmarks/peers/ds_alone_train.py \\
        --ckpt-dir CKPT --out OUT

The same model, data, global batch, dropout, AdamW + LambdaLR, clipping and frozen parameter as
ds_train.py (imported from it), the same per-step log lines and ``--dump-at`` /
``--dump-restored`` / final dumps. What differs is the checkpointing, DeepSpeed's documented
recipe: ``engine.save_checkpoint(ckpt_dir, client_state={"step": step})`` every ``--save-every``
steps, and on start ``engine.load_checkpoint(ckpt_dir)`` when ``ckpt_dir/latest`` exists.
DeepSpeed keeps no data position, so the data is a plain DataLoader over a DistributedSampler
(seed, ``set_epoch``) and a resumed process skips the micro-batches the restored steps consumed
(loading them, as users do). Each sample's noise is drawn from a generator seeded by (epoch,
index), so the data never depends on the global RNG. The one unbroken call is
``unbroken.init_distributed`` (as in ds_train.py), for a reason that has nothing to do with
checkpointing: with torch's own process-group init, a ``torchrun --max-restarts`` round on gloo
can meet the dead round's addresses in the agent's store (measured once with this job: the
restarted rank 0 failed in DeepSpeed's ``new_group`` with "Gloo connectFullMesh failed ...
Connection refused").

With ``--rng-in-client-state`` the job also puts ``torch.get_rng_state()`` in ``client_state``
and restores it after a load: DeepSpeed keeps only rank 0's ``client_state``, which is right
here only because every rank of this job draws the same dropout masks.

Two fault points inside ``save_checkpoint`` (test hooks around DeepSpeed's checkpoint engine,
which writes each file with ``torch.save``; a SIGKILL mid-file leaves a prefix of its bytes):

- ``--kill-after-files S``: rank 0 SIGKILLs itself once its last file of the save of step S
  (its ZeRO optimizer partition) is written, before it writes ``latest``.
- ``--kill-mid-file S``: rank 1 writes the first half of the bytes of its ZeRO optimizer
  partition of the save of step S, waits until rank 0 has written ``latest`` (nothing in
  ``save_checkpoint`` makes rank 0 wait for the other ranks' files first), then SIGKILLs itself.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler

import unbroken

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))  # the jobs of the tests it measures against
from ds_train import MICRO, D, Data, build, dump, finish

SEED = 5


class PlainData(Data):
    """ds_train's dataset indexed by plain ints: each sample's noise seeded by (epoch, index)."""

    epoch = 0

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        g = torch.Generator().manual_seed((SEED * 1_000_003 + self.epoch) * 1_000_003 + int(i))
        return self.x[i] + torch.randn(D, generator=g) * 0.1, self.y[i], int(i)


def _kill_self(marker: Path) -> None:
    marker.write_text(str(os.getpid()))
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def install_save_faults(engine: Any, ckpt_dir: Path, out: Path, rank: int, after_files: int | None,
                        mid_file: int | None) -> None:
    """Wrap the engine's checkpoint engine ``save`` with the fault points of the module docstring;
    a fault fires once per ``out`` folder (not again in the restarted rounds)."""
    inner = engine.checkpoint_engine.save
    marker = out / "fault-fired"

    def save(state_dict: Any, path: str) -> None:
        target = Path(path)
        is_zero = target.name.endswith("optim_states.pt") and not marker.exists()
        if is_zero and rank == 1 and mid_file is not None and target.parent.name == f"global_step{mid_file}":
            buf = io.BytesIO()
            torch.save(state_dict, buf)
            data = buf.getvalue()
            with open(target, "wb") as f:
                f.write(data[: len(data) // 2])
                f.flush()
                os.fsync(f.fileno())
            print(f"rank 1: wrote {len(data) // 2} of {len(data)} bytes of {target.name}", flush=True)
            latest = ckpt_dir / "latest"
            for _ in range(1200):  # rank 0 writes `latest` without waiting for this file (or, if it ever did, never)
                if latest.exists() and latest.read_text() == target.parent.name:
                    break
                time.sleep(0.05)
            print(f"rank 1: killed inside the save of step {mid_file}, `latest` reads "
                  f"{latest.read_text() if latest.exists() else None!r}", flush=True)
            _kill_self(marker)
        inner(state_dict, path)
        if is_zero and rank == 0 and after_files is not None and target.parent.name == f"global_step{after_files}":
            print(f"rank 0: killed inside the save of step {after_files}, after its files, before `latest`",
                  flush=True)
            _kill_self(marker)

    engine.checkpoint_engine.save = save


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--save-every", type=int, default=3)
    p.add_argument("--stop-at", type=int, default=None)
    p.add_argument("--dump-at", type=int, action="append", default=[])
    p.add_argument("--dump-restored", action="store_true")
    p.add_argument("--pause-at", type=int, default=None,
                   help="after logging this step, wait (for the test's signal) before going on")
    p.add_argument("--kill-after-files", type=int, default=None)
    p.add_argument("--kill-mid-file", type=int, default=None)
    p.add_argument("--rng-in-client-state", action="store_true",
                   help="also save rank 0's torch RNG state in client_state and restore it on every rank")
    args = p.parse_args()
    unbroken.init_distributed("gloo")  # restart-safe process group, as in ds_train.py (no checkpointing)
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    out, ckpt_dir = Path(args.out), Path(args.ckpt_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"pid-r{rank}").write_text(str(os.getpid()))

    engine = build(args.stage, world)
    install_save_faults(engine, ckpt_dir, out, rank, args.kill_after_files, args.kill_mid_file)
    data = PlainData()
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=SEED)
    loader = DataLoader(data, batch_size=MICRO, sampler=sampler)
    step = 0
    if (ckpt_dir / "latest").exists():
        path, client = engine.load_checkpoint(str(ckpt_dir))
        if path is None:
            raise RuntimeError(f"load_checkpoint({ckpt_dir}) loaded nothing")
        step = int(client["step"])
        print(f"rank {rank}: resumed from step {step} ({path})", flush=True)
    else:
        print(f"rank {rank}: fresh start", flush=True)
    if args.dump_restored:
        dump(engine, rank, out / "restored.safetensors")
    # DeepSpeed keeps no data position: skip the micro-batches of the restored steps
    epoch, skip = divmod(step * engine.gradient_accumulation_steps(), len(loader))
    sampler.set_epoch(epoch)
    data.epoch = epoch
    batches = iter(loader)
    for _ in range(skip):
        next(batches)
    if step and args.rng_in_client_state:  # after iter(loader), which draws its base seed from this RNG
        torch.set_rng_state(client["rng"])
    stop = args.stop_at or args.steps
    with open(out / f"losses-r{rank}.jsonl", "a") as log:
        while step < stop:
            micro, samples = [], []
            for _ in range(engine.gradient_accumulation_steps()):
                try:
                    x, y, idx = next(batches)
                except StopIteration:
                    epoch += 1
                    sampler.set_epoch(epoch)
                    data.epoch = epoch
                    batches = iter(loader)
                    x, y, idx = next(batches)
                engine.train()
                loss = F.cross_entropy(engine(x), y)
                engine.backward(loss)
                engine.step()
                micro.append(loss.item())
                samples += idx.tolist()
            step += 1
            log.write(json.dumps({"step": step, "losses": micro, "samples": samples, "world": world}) + "\n")
            log.flush()
            print(f"rank {rank} step {step}", flush=True)
            if step == args.pause_at:
                time.sleep(120)
            if step % args.save_every == 0:
                client_state: dict[str, Any] = {"step": step}
                if args.rng_in_client_state:
                    client_state["rng"] = torch.get_rng_state()
                engine.save_checkpoint(str(ckpt_dir), client_state=client_state)
            if step in args.dump_at:
                dump(engine, rank, out / f"state-{step}.safetensors")
    if step >= args.steps:
        dump(engine, rank, out / "final.safetensors")
    finish(rank)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.exit(main())
