"""A multi-rank training job for the distributed tests (run under torchrun or srun).

    torchrun --standalone --nproc_per_node 2 tests/dist_train.py --run-dir RUN --out OUT --mode ddp

Modes: ``ddp`` (DistributedDataParallel: replicated model and optimizer) and ``fsdp``
(FSDP2 ``fully_shard`` on CPU/gloo: sharded parameters and optimizer state, saved and
resharded through torch.distributed.checkpoint). Dropout draws from every rank's global
RNG, the data is a ResumableLoader sharded by rank with per-sample augmentation, AdamW
with a LambdaLR schedule. Every rank appends ``step loss`` lines to
``OUT/losses-r<rank>.jsonl``; at the end rank 0 writes the full parameters and optimizer
state to ``OUT/final.safetensors`` (gathered with ``full_tensor()`` in FSDP mode).
``--stop-at N`` ends the job after step N (to resume it with another world size).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import Dataset

import unbroken
import unbroken.data

N, D, C = 1024, 16, 4


class Data(Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(N, D, generator=g)
        self.y = (self.x[:, 0] > 0).long() + 2 * (self.x[:, 1] > 0).long()

    def __len__(self) -> int:
        return N

    def __getitem__(self, i):
        noise = torch.randn(D, generator=i.generator()) * 0.1  # keyed by (seed, epoch, sample)
        return self.x[i] + noise, self.y[i], int(i)


def model_and_optimizer(mode: str, ddp_options: dict | None = None):
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(D, 64), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, C))
    if mode == "ddp" and dist.is_initialized():
        model = torch.nn.parallel.DistributedDataParallel(model, **(ddp_options or {}))
    elif mode == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size() if dist.is_initialized() else 1,))
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.05 * s))
    return model, opt, sched


def full_state(model, opt) -> dict[str, torch.Tensor]:
    def full(t):
        return t.full_tensor() if hasattr(t, "full_tensor") else t

    out = {f"model/{k}": full(v).detach().clone().contiguous() for k, v in model.state_dict().items()}
    for pid, st in opt.state_dict()["state"].items():
        for k, v in st.items():
            out[f"optimizer/{pid}/{k}"] = full(v).detach().clone().contiguous().reshape(-1)
    return {k.replace("module.", ""): v for k, v in out.items()}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--run-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--mode", choices=["ddp", "fsdp"], default="ddp")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--save-every", type=int, default=4)
    p.add_argument("--stop-at", type=int, default=None)
    p.add_argument("--batch", type=int, default=8, help="per rank")
    p.add_argument("--fail-save-on-rank", type=int, default=None, help="this rank's writes fail (ENOSPC)")
    p.add_argument("--dump-restored", default=None, help="rank 0 writes the full restored state here")
    p.add_argument("--async-save", choices=["copy", "lazy"], default=None)
    p.add_argument("--incremental", action="store_true", help="incremental checkpoints (chunks)")
    p.add_argument("--touch-after", type=int, default=None,
                   help="rank 1 changes a parameter in place (by 1.0) right after this step's ckpt.step")
    p.add_argument("--ram", type=int, default=0, metavar="N", help="a RAM tier persisting every N saves "
                   "(root: UNBROKEN_RAM_ROOT)")
    p.add_argument("--ranks-per-node", type=int, default=0, metavar="K",
                   help="every K ranks a RAM root of their own (a node's memory, as on several nodes)")
    p.add_argument("--requeue", action="store_true", help="requeue the SLURM job after a preemption save")
    p.add_argument("--every-seconds", type=float, default=None,
                   help="a time trigger too: rank r saves every S*(r+1) s (EveryMinutes), "
                        "so the ranks' clocks disagree")
    p.add_argument("--ddp-options", type=json.loads, default=None, metavar="JSON",
                   help="keyword arguments of DistributedDataParallel")
    p.add_argument("--plain-init", action="store_true",
                   help="torch.distributed.init_process_group() instead of unbroken.init_distributed()")
    args = p.parse_args()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and args.plain_init:
        # torch's own call, as most scripts have it: the default group from env://, in the agent's
        # store that still holds the previous round's keys. Connecting lazily (at the first
        # collective, when every rank has published its new address) is what lets *torch's* group
        # come back after a restart; the Checkpointer's own group is created eagerly below.
        os.environ["TORCH_GLOO_LAZY_INIT"] = "1"
        dist.init_process_group("gloo")
        del os.environ["TORCH_GLOO_LAZY_INIT"]
        if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0 and dist.get_rank() == 1:
            time.sleep(2)  # ranks arrive apart, as they do: rank 0 creates its Checkpointer first
    elif int(os.environ.get("WORLD_SIZE", "1")) > 1:
        unbroken.init_distributed("gloo")  # init_process_group that survives torchrun restarts
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"pid-r{rank}").write_text(str(os.getpid()))  # for the tests that kill one rank

    model, opt, sched = model_and_optimizer(args.mode, args.ddp_options)
    loader = unbroken.data.ResumableLoader(Data(), batch_size=args.batch, shuffle=True, seed=5)
    ckpt = unbroken.Checkpointer(args.run_dir, save_every=args.save_every, keep_last=3,
                                 preemption=unbroken.Preemption(requeue=args.requeue),
                                 async_save={None: False, "copy": True, "lazy": "lazy"}[args.async_save],
                                 incremental=args.incremental, ram=ram_tier(args, rank),
                                 trigger=unbroken.policies.EveryMinutes(args.every_seconds * (rank + 1) / 60)
                                 if args.every_seconds else None)
    state = {"model": model, "optimizer": opt, "scheduler": sched, "data": loader}
    if args.fail_save_on_rank == rank:
        _make_writes_fail()
    info = ckpt.restore(state)
    print(f"rank {rank}: {f'resumed from step {info.step}' if info else 'fresh start'}", flush=True)
    if args.dump_restored:
        restored = full_state(model, opt)  # a collective in FSDP mode
        if rank == 0:
            from safetensors.torch import save_file

            save_file(restored, args.dump_restored)
    stop = args.stop_at or args.steps
    batches = iter(loader)
    with open(out / f"losses-r{rank}.jsonl", "a") as log:
        while ckpt.progress.step < stop:
            try:
                x, y, idx = next(batches)
            except StopIteration:
                batches = iter(loader)
                x, y, idx = next(batches)
            model.train()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
            log.write(json.dumps({"step": ckpt.progress.step + 1, "loss": loss.item(),
                                  "samples": idx.tolist()}) + "\n")
            log.flush()
            print(f"rank {rank} step {ckpt.progress.step + 1}", flush=True)
            ckpt.step(state, loss=loss.detach())
            if args.touch_after == ckpt.progress.step and rank == 1:
                with torch.no_grad():  # the values stay, the version counter moves
                    next(model.parameters()).mul_(1.0)
    ckpt.close()
    final = full_state(model, opt)
    if rank == 0 and ckpt.progress.step >= args.steps:
        from safetensors.torch import save_file

        save_file(final, str(out / "final.safetensors"))
    if dist.is_initialized():
        dist.destroy_process_group()
    print(f"rank {rank}: done", flush=True)
    if args.mode == "fsdp":
        # FSDP2 on gloo: torch's teardown at interpreter exit sometimes aborts ("terminate called
        # without an active exception", SIGABRT, on every rank, about 1 run in 5 on 2 cores), after
        # all work is done and the process group destroyed: the DeviceMesh's objects outlive it.
        # Not unbroken's doing (nothing of it runs then); leave without that teardown.
        sys.stderr.flush()
        os._exit(0)
    return 0


def ram_tier(args: argparse.Namespace, rank: int) -> unbroken.RamTier | None:
    if not args.ram:
        return None
    root = os.environ["UNBROKEN_RAM_ROOT"] + (f"/node{rank // args.ranks_per_node}" if args.ranks_per_node else "")
    return unbroken.RamTier(keep_last=2, persist_every=args.ram, root=root)


def _make_writes_fail() -> None:
    """Test hook: every tensor file this rank writes fails half-way with ENOSPC."""
    import errno

    from unbroken.checkpoint import persist

    real = persist.write_tensors

    def failing(staging, fname, entries):
        raise OSError(errno.ENOSPC, f"No space left on device (injected on rank {dist.get_rank()})")

    persist.write_tensors = failing
    import unbroken.run.collective as coll

    coll.write_tensors = failing
    _ = real


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.exit(main())
