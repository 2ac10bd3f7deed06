"""A DeepSpeed ZeRO training job for the DeepSpeed tests (run under torchrun, on CPU with gloo).

    DS_ACCELERATOR=cpu torchrun --standalone --nproc_per_node 2 tests/ds_train.py --run-dir RUN --out OUT --stage 2

The state is ``{"engine": engine, "data": loader}``: the engine as DeepSpeed returns it,
an unbroken ResumableLoader sharded by rank. The global batch is fixed (16 samples per
optimizer step): 4 per rank per micro-batch, ``16 / (4 * world)`` micro-batches per step,
so 1, 2 or 4 ranks train on the same samples per step, across epoch ends too: an epoch is 104
samples (6.5 steps) and the loader is ``continuous`` (the epoch's last step is completed from
the next epoch's order). Dropout draws from each rank's
global RNG; AdamW with a LambdaLR schedule handed to DeepSpeed. Every rank appends one
line per optimizer step to ``OUT/losses-r<rank>.jsonl`` (its micro-batch losses and the
samples it consumed). With ``--dump-at N`` rank 0 writes the consolidated fp32 master
weights and Adam moments after step N, gathered with DeepSpeed's own
``safe_get_full_*`` API (a collective), to ``OUT/state-N.safetensors``; with
``--dump-restored`` the same right after the restore, to ``OUT/restored.safetensors``; at
the end to ``OUT/final.safetensors``. ``--ds-save-at N`` also writes DeepSpeed's own
checkpoint after step N (``engine.save_checkpoint(OUT/ds, tag="global_stepN")``, for the import
tests); ``--restore-nonstrict`` restores with ``Checkpointer(strict=False)`` (a run imported from a DeepSpeed
checkpoint has no ``data`` part); ``--buffer`` gives the model a persistent buffer and adds
the frozen parameter and the buffers (``frozen/<name>``, ``buffer/<name>``) to ``final.safetensors``
(for the export tests).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed
import torch
import torch.distributed as dist
import torch.nn.functional as F
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
from torch.utils.data import Dataset

import unbroken
import unbroken.data

N, D, C, MICRO, GLOBAL = 104, 16, 4, 4, 16  # 104: an epoch ends inside step 7


class Data(Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(N, D, generator=g)
        self.y = (self.x[:, 0] > 0).long() + 2 * (self.x[:, 1] > 0).long()

    def __len__(self) -> int:
        return N

    def __getitem__(self, i):
        noise = torch.randn(D, generator=i.generator()) * 0.1
        return self.x[i] + noise, self.y[i], int(i)


def build(stage: int, world: int, buffer: bool = False):
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(D, 33), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(33, 17), torch.nn.ReLU(), torch.nn.Linear(17, C))
    if buffer:  # a persistent buffer the forward does not use (the export tests compare it)
        model[5].register_buffer("calibration", torch.linspace(-1, 1, C, dtype=torch.float64))
    model[0].bias.requires_grad_(False)  # a frozen parameter: kept as it is
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.05 * s))
    config = {"train_batch_size": GLOBAL, "train_micro_batch_size_per_gpu": MICRO,
              "gradient_accumulation_steps": GLOBAL // (MICRO * world), "gradient_clipping": 1.0,
              "zero_optimization": {"stage": stage}, "steps_per_print": 10**9, "wall_clock_breakdown": False}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, lr_scheduler=sched, config=config)
    return engine


def consolidated(engine) -> dict[str, torch.Tensor]:
    """Full fp32 masters and moments, by DeepSpeed's own API (a collective: every rank calls it)."""
    out = {}
    for name, p in engine.module.named_parameters():
        if not p.requires_grad:
            continue
        out[f"fp32/{name}"] = safe_get_full_fp32_param(p).detach().clone().contiguous()
        for key in ("exp_avg", "exp_avg_sq"):
            out[f"{key}/{name}"] = safe_get_full_optimizer_state(p, key).detach().clone().contiguous()
    out["lr"] = torch.tensor([g["lr"] for g in engine.optimizer.param_groups], dtype=torch.float64)
    out["global_steps"] = torch.tensor(engine.global_steps)
    return out


def frozen_and_buffers(engine) -> dict[str, torch.Tensor]:
    """The frozen parameters (gathered under ZeRO-3: a collective) and the buffers, as the module holds them."""
    out = {}
    for name, p in engine.module.named_parameters():
        if not p.requires_grad:
            with deepspeed.zero.GatheredParameters([p], enabled=hasattr(p, "ds_id")):
                out[f"frozen/{name}"] = p.detach().clone().contiguous()
    for name, b in engine.module.named_buffers():
        out[f"buffer/{name}"] = b.detach().clone().contiguous()
    return out


def dump(engine, rank: int, path: Path, extra: bool = False) -> None:
    state = consolidated(engine)
    if extra:
        state.update(frozen_and_buffers(engine))
    if rank == 0:
        from safetensors.torch import save_file

        save_file(state, str(path))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--run-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--save-every", type=int, default=3)
    p.add_argument("--stop-at", type=int, default=None)
    p.add_argument("--dump-at", type=int, action="append", default=[])
    p.add_argument("--dump-restored", action="store_true")
    p.add_argument("--ds-save-at", type=int, action="append", default=[])
    p.add_argument("--restore-nonstrict", action="store_true")
    p.add_argument("--buffer", action="store_true")
    args = p.parse_args()
    unbroken.init_distributed("gloo")
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"pid-r{rank}").write_text(str(os.getpid()))

    engine = build(args.stage, world, args.buffer)
    loader = unbroken.data.ResumableLoader(Data(), batch_size=MICRO, shuffle=True, seed=5, continuous=True)
    ckpt = unbroken.Checkpointer(args.run_dir, save_every=args.save_every, keep_last=3,
                                 strict=not args.restore_nonstrict)
    state = {"engine": engine, "data": loader}
    info = ckpt.restore(state)
    print(f"rank {rank}: {f'resumed from step {info.step}' if info else 'fresh start'}", flush=True)
    if args.dump_restored:
        dump(engine, rank, out / "restored.safetensors")
    stop = args.stop_at or args.steps
    batches = iter(loader)
    with open(out / f"losses-r{rank}.jsonl", "a") as log:
        while ckpt.progress.step < stop:
            micro, samples = [], []
            for _ in range(engine.gradient_accumulation_steps()):
                try:
                    x, y, idx = next(batches)
                except StopIteration:
                    batches = iter(loader)
                    x, y, idx = next(batches)
                engine.train()
                loss = F.cross_entropy(engine(x), y)
                engine.backward(loss)
                engine.step()
                micro.append(loss.item())
                samples += idx.tolist()
            log.write(json.dumps({"step": ckpt.progress.step + 1, "losses": micro, "samples": samples,
                                  "world": world}) + "\n")
            log.flush()
            print(f"rank {rank} step {ckpt.progress.step + 1}", flush=True)
            ckpt.step(state)
            if ckpt.progress.step in args.dump_at:
                dump(engine, rank, out / f"state-{ckpt.progress.step}.safetensors")
            if ckpt.progress.step in args.ds_save_at:
                engine.save_checkpoint(str(out / "ds"), tag=f"global_step{ckpt.progress.step}")
    ckpt.close()
    if ckpt.progress.step >= args.steps:
        dump(engine, rank, out / "final.safetensors", extra=args.buffer)
    finish(rank)


def finish(rank: int) -> None:
    """End the job once its work is done. DeepSpeed on gloo, like FSDP2 in dist_train.py: torch's
    teardown at interpreter exit sometimes aborts ("terminate called without an active exception",
    SIGABRT) after the process group is destroyed (seen once in ~40 runs here). Not unbroken's doing:
    nothing of it runs then (the Checkpointer is closed). Leave without that teardown."""
    dist.destroy_process_group()
    print(f"rank {rank}: done", flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.exit(main())
