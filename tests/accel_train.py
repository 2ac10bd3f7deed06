"""An Accelerate training job for tests/test_integration_accelerate.py (CPU ranks, gloo).

    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 tests/accel_train.py --run-dir RUN --out OUT
    ACCELERATE_USE_CPU=1 accelerate launch --use_fsdp --fsdp_version 2 --num_processes 2 tests/accel_train.py ...

The loop an Accelerate user writes: a model with dropout, AdamW + LambdaLR prepared with it,
gradient accumulation (2 micro-batches) through ``accelerator.accumulate``, gradient clipping, and
an evaluation at the end of every epoch over a prepared, sequential ``DataLoader`` (each of its
iterators draws a seed from the global torch RNG, so an evaluation skipped or repeated after a
resume shows). 72 samples, 4 per process per micro-batch: 9 global micro-batches per epoch, so the
last step of every epoch has a single micro-batch (Accelerate syncs at the end of the dataloader):
steps 5 and 10 end epochs 0 and 1. ``--batch`` keeps the global batch on another number of processes.

``--mode unbroken``: the data is ``unbroken.integrations.accelerate.ResumableLoader`` with the order of
Accelerate's seedable sampler (``order="epoch_seeded"``, so that an uninterrupted run is ``alone``'s), the one line
``Checkpointer(accelerator, run_dir, save_every=...)`` after ``prepare``, ``ckpt.step()`` per batch.
``--mode alone``: Accelerate's documented recipe, done carefully: ``DataLoader(shuffle=True)`` with
``use_seedable_sampler`` and ``set_epoch``, ``accelerator.save_state(CKPT/step_N)`` every
``--save-every`` steps, and on start ``load_state`` of the newest ``step_N`` plus
``skip_first_batches`` over the batches of the restored steps in their epoch; each sample's noise
is seeded by (epoch, index) in both modes, so the data never depends on the global RNG.

Both processes call ``unbroken.init_distributed()`` before the ``Accelerator`` (which adopts the
group): Accelerate's own ``init_process_group`` does not come back reliably after a torchrun
restart on gloo (docs/distributed.md); nothing of checkpointing. FSDP2 on CPU: Accelerate 1.15
ignores the FSDP plugin unless the distributed type is a GPU-like one (``accelerate/state.py``,
``AcceleratorState.__init__``), so with ``ACCELERATE_USE_FSDP`` and no GPU the job sets
``PartialState().distributed_type = MULTI_GPU`` before creating the Accelerator; Accelerate's own
FSDP2 preparation then runs (``fully_shard`` on a CPU mesh, DTensor parameters).

Every process appends one line per optimizer step to ``OUT/losses-r<rank>.jsonl`` (its micro-batch
losses and samples) and one per evaluation to ``OUT/eval-r<rank>.jsonl``; writes its exit status to
``OUT/exit-r<rank>`` and its pid to ``OUT/pid-r<rank>``. The full state (parameters, AdamW moments,
LR, ``accelerator.step``; gathered from FSDP2 shards) goes to ``OUT/final.safetensors`` at the end,
``OUT/state-N.safetensors`` after step N (``--dump-at``), ``OUT/restored.safetensors`` after a
restore (``--dump-restored``). ``--kill-in-save N`` (alone): process 0 SIGKILLs itself inside
``save_state`` of step N, once the model and optimizer are written, before the scheduler's file.
``--wait-at N``: after logging step N every process waits until ``OUT/go-N`` exists, so a test's
signal lands at that step whatever the machine's load (the file stays: later rounds do not wait).
``--rng-after-iter`` (alone): the torch RNG state ``load_state`` restored is set again right after the
resumed epoch's iterator is created (which draws a seed from it).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

import unbroken

N, D, C, MICRO, GA, SEED = 72, 16, 4, 4, 2, 5


class Data(Dataset):
    """Noisy copies of fixed points; the noise of a sample is keyed by (seed, epoch, index)."""

    epoch = 0  # alone: set by the loop (a plain DataLoader hands out plain ints)

    def __init__(self, n: int = N, offset: int = 0) -> None:
        g = torch.Generator().manual_seed(offset)
        self.x = torch.randn(n, D, generator=g)
        self.y = (self.x[:, 0] > 0).long() + 2 * (self.x[:, 1] > 0).long()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        epoch = getattr(i, "epoch", self.epoch)  # unbroken's SampleIndex knows its epoch
        g = torch.Generator().manual_seed((SEED * 1_000_003 + epoch) * 1_000_003 + int(i))
        return self.x[i] + torch.randn(D, generator=g) * 0.1, self.y[i], int(i)


def build():
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(D, 32), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, C))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.05 * s))
    return model, opt, sched


def accelerator_for(args):
    from accelerate import Accelerator
    from accelerate.state import PartialState
    from accelerate.utils import DataLoaderConfiguration, DistributedType

    if int(os.environ.get("WORLD_SIZE", "1")) > 1 or "LOCAL_RANK" in os.environ:
        unbroken.init_distributed("gloo")  # the Accelerator adopts this group (restart-safe)
    if os.environ.get("ACCELERATE_USE_FSDP") == "true" and not torch.cuda.is_available():
        PartialState(cpu=True).distributed_type = DistributedType.MULTI_GPU  # see the module docstring
    config = DataLoaderConfiguration(use_seedable_sampler=True, data_seed=SEED)  # (unbroken's loader: unused)
    return Accelerator(cpu=True, gradient_accumulation_steps=GA, dataloader_config=config)


def full_state(accelerator, model, opt, sched) -> dict[str, torch.Tensor]:
    """Parameters, optimizer state, LR and accelerator.step, full (a collective under FSDP2)."""
    def full(t):
        return t.full_tensor() if hasattr(t, "full_tensor") else t

    out = {f"model/{k}": full(v).detach().clone().contiguous()
           for k, v in accelerator.unwrap_model(model).state_dict().items()}
    for pid, st in opt.optimizer.state_dict()["state"].items():
        for k, v in st.items():
            out[f"optimizer/{pid}/{k}"] = full(v).detach().clone().contiguous().reshape(-1)
    out["lr"] = torch.tensor(sched.get_last_lr(), dtype=torch.float64)
    out["accelerator_step"] = torch.tensor(accelerator.step)
    return out


def dump(accelerator, model, opt, sched, path: Path) -> None:
    state = full_state(accelerator, model, opt, sched)
    if accelerator.is_main_process:
        from safetensors.torch import save_file

        save_file(state, str(path))


def main(args) -> int:
    accelerator = accelerator_for(args)
    rank, world = accelerator.process_index, accelerator.num_processes
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"pid-r{rank}").write_text(str(os.getpid()))
    print(f"rank {rank}: {accelerator.distributed_type.value}, fsdp2={accelerator.is_fsdp2}", flush=True)

    model, opt, sched = build()
    data = Data()
    eval_loader = DataLoader(Data(24, offset=7), batch_size=args.batch)
    if args.mode == "unbroken":
        from unbroken.integrations.accelerate import Checkpointer, ResumableLoader

        # the order of the seedable sampler "alone" uses: an uninterrupted run is the same run, bitwise
        train = ResumableLoader(data, batch_size=args.batch, shuffle=True, seed=SEED, order="epoch_seeded")
        model, opt, train, eval_loader, sched = accelerator.prepare(model, opt, train, eval_loader, sched)
        ckpt = Checkpointer(accelerator, args.run_dir, save_every=args.save_every, keep_last=3,
                            resume=args.resume_from or True, eval_loaders=[eval_loader])
        step = ckpt.progress.step
        print(f"rank {rank}: {f'resumed from step {step}' if ckpt.restored else 'fresh start'}", flush=True)
    else:
        train = DataLoader(data, batch_size=args.batch, shuffle=True)
        model, opt, train, eval_loader, sched = accelerator.prepare(model, opt, train, eval_loader, sched)
        install_save_fault(args.kill_in_save, rank, out)
        step = resume(accelerator, args, rank)
    # map-style batches per epoch (9) -> optimizer steps per epoch: Accelerate syncs at the epoch's end
    steps_per_epoch = -(-len(train) // GA)
    if args.dump_restored:
        dump(accelerator, model, opt, sched, out / "restored.safetensors")

    def evaluate(epoch: int) -> None:
        model.eval()
        with torch.no_grad():
            losses = [F.cross_entropy(model(x), y).item() for x, y, _ in eval_loader]
        with open(out / f"eval-r{rank}.jsonl", "a") as f:
            f.write(json.dumps({"epoch": epoch, "eval": sum(losses) / len(losses)}) + "\n")

    stop = args.stop_at or args.steps
    micro: list[float] = []
    samples: list[int] = []
    log = open(out / f"losses-r{rank}.jsonl", "a")
    epoch, skip = divmod(step, steps_per_epoch)
    while step < stop:
        if args.mode == "unbroken":
            epoch, batches = train.epoch, train
        else:
            train.set_epoch(epoch)
            data.epoch = epoch
            batches = accelerator.skip_first_batches(train, skip * GA) if skip else train
            if skip and args.rng_after_iter:  # the restored RNG, set again once the iterator has drawn from it
                rng, it = torch.get_rng_state(), iter(batches)
                first = next(it)  # Accelerate's iterator starts (and draws) at its first batch
                torch.set_rng_state(rng)
                batches = itertools.chain([first], it)
            skip = 0
        for x, y, idx in batches:
            with accelerator.accumulate(model):
                model.train()
                loss = F.cross_entropy(model(x), y)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
                opt.zero_grad()
            micro.append(loss.item())
            samples += idx.tolist()
            if accelerator.sync_gradients:
                step += 1
                log.write(json.dumps({"step": step, "losses": micro, "samples": samples, "world": world}) + "\n")
                log.flush()
                micro, samples = [], []
                print(f"rank {rank} step {step}", flush=True)
                if step in args.wait_at:
                    wait_for(out / f"go-{step}")
                if args.mode == "alone" and step % args.save_every == 0:
                    accelerator.save_state(str(Path(args.ckpt_dir) / f"step_{step}"))
            if args.mode == "unbroken":
                ckpt.step(loss=loss.detach())
                assert ckpt.progress.step == step
            if step in args.dump_at and accelerator.sync_gradients:
                dump(accelerator, model, opt, sched, out / f"state-{step}.safetensors")
            if step >= stop:
                break
        else:
            evaluate(epoch)
            epoch += 1
    log.close()
    if args.mode == "unbroken":
        ckpt.close()
    if step >= args.steps:
        dump(accelerator, model, opt, sched, out / "final.safetensors")
    print(f"rank {rank}: done", flush=True)
    return 0


def wait_for(path: Path, timeout_s: float = 300.0) -> None:
    """``--wait-at``: park here until the test has sent its signal (and created ``path``)."""
    deadline = time.monotonic() + timeout_s
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def install_save_fault(step: int | None, rank: int, out: Path) -> None:
    """``--kill-in-save``: process 0 SIGKILLs itself inside ``save_state`` of ``step``, once the model and
    optimizer are written (a file each with DDP, DCP folders with FSDP2), before the scheduler's file
    (once per ``out`` folder)."""
    if step is None:
        return
    import accelerate.checkpointing as ac

    real, marker = ac.save, out / "fault-fired"

    def save(obj, f, *a, **k):
        p = Path(f)
        if rank == 0 and p.parent.name == f"step_{step}" and p.name.startswith("scheduler") and not marker.exists():
            marker.write_text(str(os.getpid()))
            print(f"rank 0: killed inside save_state of step {step}, before {p.name}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        real(obj, f, *a, **k)

    ac.save = save


def resume(accelerator, args, rank: int) -> int:
    """Accelerate's recipe: ``load_state`` of the newest ``step_N`` folder (or ``--resume-from``)."""
    if args.resume_from:
        path = Path(args.resume_from)
    else:
        ckpt_dir = Path(args.ckpt_dir)
        found = sorted(ckpt_dir.glob("step_*"), key=lambda q: int(q.name.split("_")[1])) if ckpt_dir.is_dir() else []
        if not found:
            print(f"rank {rank}: fresh start", flush=True)
            return 0
        path = found[-1]
    accelerator.load_state(str(path))
    step = int(path.name.split("_")[1])
    print(f"rank {rank}: resumed from step {step} ({path.name})", flush=True)
    return step


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["unbroken", "alone"], default="unbroken")
    p.add_argument("--run-dir", help="unbroken: the run")
    p.add_argument("--ckpt-dir", help="alone: where save_state folders go")
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--save-every", type=int, default=4)
    p.add_argument("--stop-at", type=int, default=None)
    p.add_argument("--batch", type=int, default=MICRO, help="per process per micro-batch")
    p.add_argument("--resume-from", default=None, help="this checkpoint (unbroken) or save_state folder (alone)")
    p.add_argument("--dump-at", type=int, action="append", default=[])
    p.add_argument("--dump-restored", action="store_true")
    p.add_argument("--kill-in-save", type=int, default=None)
    p.add_argument("--wait-at", type=int, action="append", default=[],
                   help="after logging step N, every process waits until OUT/go-N exists")
    p.add_argument("--rng-after-iter", action="store_true",
                   help="alone: set the torch RNG load_state restored again after the resumed iterator is created")
    return p.parse_args(argv)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)
    args = parse()
    rank = os.environ.get("RANK", "0")
    try:
        code = main(args)
    except SystemExit as e:  # a preemption: 75 after the save
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    (Path(args.out) / f"exit-r{rank}").write_text(str(code))
    sys.stdout.flush()
    sys.stderr.flush()
    # FSDP2 on gloo: torch's teardown at exit sometimes aborts after all work is done (see
    # dist_train.py); leave without it, with the job's own status
    os._exit(code)
