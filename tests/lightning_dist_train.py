"""A Lightning job on several CPU ranks for tests/test_integration_lightning_dist.py.

    python tests/lightning_dist_train.py --devices 2 --strategy ddp --run-dir RUN --out OUT    # Lightning's launcher
    torchrun --nproc_per_node 2 tests/lightning_dist_train.py --strategy ddp ...               # or torchrun

``--strategy``: ``ddp``; ``fsdp2`` (``ModelParallelStrategy``, ``fully_shard`` in ``configure_model``);
``fsdp`` and ``deepspeed``: Lightning's ``FSDPStrategy`` / ``DeepSpeedStrategy``, which Lightning refuses
on CPU, through the two-line subclasses below (``--cpu-bypass``) that only take those refusals away.

A LightningModule with dropout, a ResumableLoader (per-rank batch ``--batch``, per-sample augmentation
from ``i.generator()``), AdamW with a warmup + cosine schedule per step, ``accumulate_grad_batches``.
Every micro-batch appends ``{"step", "epoch", "batch", "loss", "samples"}`` to ``OUT/losses-r<rank>.jsonl``
and prints ``rank R step S``. Rank 0 writes the full (gathered) parameters and optimizer state:
``OUT/final.safetensors`` at the end, ``OUT/restored.safetensors`` once restored (``--dump-restored``),
``OUT/step-K.safetensors`` after optimizer step K (``--dump-at K``). ``OUT/pid-r<rank>`` holds each pid.

``--data plain``: a ``DataLoader(shuffle=True)`` (Lightning's ``DistributedSampler`` deals it);
``--data distributed-order``: ``ResumableLoader(order="distributed")``, that sampler's order (with both the
noise is keyed by the sample alone). ``--mode plain``: Lightning alone, no checkpointing at all.
``--mode unbroken``: ``UnbrokenCallback(run, save_every=N)``. ``--mode lightning``: Lightning alone,
``ModelCheckpoint(every_n_train_steps=N, save_last=True)`` and ``fit(ckpt_path="last")``;
``--lightning-kill-in-save N``: the rank ``--kill-rank`` SIGKILLs itself inside Lightning's Nth save
(see :func:`kill_in_lightning_save`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
from pathlib import Path

if "LOCAL_RANK" in os.environ and "TORCHELASTIC_RUN_ID" not in os.environ:
    os.environ["RANK"] = os.environ["LOCAL_RANK"]  # Lightning's launcher sets no RANK: unbroken's fault points read it

import torch
import pytorch_lightning as pl
import torch.distributed as dist

import unbroken
import unbroken.data

N, DIM, CLASSES = 100, 16, 4
BUCKET = 10**5  # DeepSpeed's buckets, in elements: more than the model's 1,348 parameters (one bucket, as by default)


PLAIN_NOISE = False  # --data plain / distributed-order: noise keyed by the sample alone (a plain int has no epoch)


class Data(torch.utils.data.Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(N, DIM, generator=g)
        self.y = torch.randint(0, CLASSES, (N,), generator=g)

    def __len__(self) -> int:
        return N

    def __getitem__(self, i):
        g = i.generator() if hasattr(i, "generator") and not PLAIN_NOISE else torch.Generator().manual_seed(int(i))
        noise = torch.randn(DIM, generator=g) * 0.1  # keyed by (seed, epoch, sample); --data plain: by the sample
        return self.x[int(i)] + noise, self.y[int(i)], int(i)


class Model(pl.LightningModule):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.args = args
        self.net = torch.nn.Sequential(torch.nn.Linear(DIM, 64), torch.nn.ReLU(), torch.nn.Dropout(0.3),
                                       torch.nn.Linear(64, CLASSES))
        self.log_file = None

    def configure_model(self) -> None:
        if self.args.strategy == "fsdp2":
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]  # every rank (data_parallel_size=world size)
            for layer in self.net:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

    def train_dataloader(self):
        if self.args.data == "plain":  # Lightning deals it to the ranks through its DistributedSampler
            return torch.utils.data.DataLoader(Data(), batch_size=self.args.batch, shuffle=True)
        if self.args.data == "distributed-order":  # that sampler's order: seed_everything(0) gives it seed 0
            return unbroken.data.ResumableLoader(Data(), batch_size=self.args.batch, shuffle=True, seed=0,
                                                 order="distributed")
        return unbroken.data.ResumableLoader(Data(), batch_size=self.args.batch, shuffle=True, seed=7)

    def training_step(self, batch, batch_idx):
        x, y, idx = batch
        loss = torch.nn.functional.cross_entropy(self.net(x), y)
        rank = self.trainer.global_rank
        if self.log_file is None:
            self.log_file = open(Path(self.args.out) / f"losses-r{rank}.jsonl", "a")
        self.log_file.write(json.dumps({"step": self.trainer.global_step, "epoch": self.current_epoch,
                                        "batch": batch_idx, "loss": loss.item(), "samples": idx.tolist()}) + "\n")
        self.log_file.flush()
        print(f"rank {rank} step {self.trainer.global_step}", flush=True)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=3e-2, weight_decay=0.01)
        warmup, total = 3, self.args.steps

        def lr(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


# ------------------------------------------------------------------------ the full state, gathered
def full_state(trainer: pl.Trainer) -> dict[str, torch.Tensor]:
    """Every parameter and optimizer value, whole (a collective under FSDP and ZeRO-3)."""
    strategy, module = trainer.strategy, trainer.lightning_module
    out: dict[str, torch.Tensor] = {}
    if "DeepSpeed" in type(strategy).__name__:
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        for name, p in module.named_parameters():
            out[f"model/{name}"] = safe_get_full_fp32_param(p)
            for key in ("exp_avg", "exp_avg_sq"):
                out[f"optimizer/{name}/{key}"] = safe_get_full_optimizer_state(p, key)
    elif "FSDP" in type(strategy).__name__:  # FSDPStrategy, or the CPU subclass below
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        msd, osd = get_state_dict(strategy.model, trainer.optimizers,
                                  options=StateDictOptions(full_state_dict=True))
        out.update({f"model/{k}": v for k, v in msd.items()})
        for name, st in osd["state"].items():
            out.update({f"optimizer/{name}/{k}": v for k, v in st.items()})
    else:
        def full(t: torch.Tensor) -> torch.Tensor:
            return t.full_tensor() if hasattr(t, "full_tensor") else t

        out.update({f"model/{k}": full(v) for k, v in module.state_dict().items()})
        names = [n for n, _ in module.named_parameters()]
        for pid, st in trainer.optimizers[0].state_dict()["state"].items():
            out.update({f"optimizer/{names[pid]}/{k}": full(v) for k, v in st.items()})
    return {k.replace("_forward_module.", "").replace("module.", ""): v.detach().to("cpu").clone().reshape(-1)
            for k, v in out.items() if isinstance(v, torch.Tensor)}


class Dumps(pl.Callback):
    """Rank 0 writes the full state when restored, after step ``--dump-at``, and at the end."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.last = args, -1

    def _write(self, trainer: pl.Trainer, name: str) -> None:
        state = full_state(trainer)  # every rank takes part
        if trainer.global_rank == 0:
            from safetensors.torch import save_file

            save_file(state, str(Path(self.args.out) / name))

    def on_train_start(self, trainer, pl_module) -> None:
        self.last = trainer.global_step
        if self.args.dump_restored:
            self._write(trainer, "restored.safetensors")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step != self.last:
            self.last = trainer.global_step
            if trainer.global_step in self.args.dump_at:
                self._write(trainer, f"step-{trainer.global_step}.safetensors")
            if trainer.global_step == self.args.stop_at:
                trainer.should_stop = True

    def on_train_end(self, trainer, pl_module) -> None:
        self._write(trainer, "final.safetensors")
        if trainer.global_rank == 0:
            (Path(self.args.out) / "final.json").write_text(json.dumps(
                {"global_step": trainer.global_step, "epoch": trainer.current_epoch, "world": trainer.world_size}))


# ------------------------------------------------------------------- what Lightning refuses on CPU
def cpu_strategy(name: str):
    """Lightning's FSDPStrategy / DeepSpeedStrategy without their CPU refusals (only those)."""
    if name == "fsdp":
        from pytorch_lightning.strategies import FSDPStrategy

        class CPUFSDPStrategy(FSDPStrategy):
            # accelerator_connector.py refuses `type(strategy) is FSDPStrategy` on CPU; and Lightning passes
            # device_id=root_device.index (None on CPU), which torch's FSDP refuses without an accelerator
            def _setup_model(self, model):
                from torch.distributed.fsdp import FullyShardedDataParallel

                model = FullyShardedDataParallel(model, device_id=torch.device("cpu"),
                                                 sharding_strategy=self.sharding_strategy, **self.kwargs)
                return super()._setup_model(model)

        return CPUFSDPStrategy()
    from pytorch_lightning.accelerators import CPUAccelerator
    from pytorch_lightning.strategies import DeepSpeedStrategy

    class CPUDeepSpeedStrategy(DeepSpeedStrategy):
        def setup_environment(self) -> None:
            # DeepSpeedStrategy.setup_environment refuses every accelerator but CUDA; and CPU devices have no index,
            # which setup_distributed checks and _setup_model_and_optimizer hands to DeepSpeed as its device_rank
            assert isinstance(self.accelerator, CPUAccelerator)
            self.parallel_devices = [torch.device("cpu", i) for i in range(len(self.parallel_devices or ()))]
            super(DeepSpeedStrategy, self).setup_environment()

    # DeepSpeed's buckets default to 2e8 elements (800 MB, touched every step: 1.4 s a step on CPU)
    return CPUDeepSpeedStrategy(stage=int(os.environ.get("ZERO_STAGE", "2")), process_group_backend="gloo",
                                allgather_bucket_size=BUCKET, reduce_bucket_size=BUCKET)


def kill_in_lightning_save(nth: int, rank: int) -> None:
    """SIGKILL rank ``rank`` inside the ``nth`` file it writes for Lightning's checkpoints: a ``.ckpt`` file
    (DDP: rank 0 writes it) once its bytes are in fsspec's temporary file, before the move over the path
    (Lightning writes through an fsspec transaction); a distributed checkpoint (FSDP2: a folder, each rank
    its ``.distcp`` file) half-way through this rank's file, before DCP's ``.metadata``."""
    if int(os.environ.get("RANK", "0")) != rank:
        return
    count = [0]

    def hit() -> bool:
        count[0] += 1
        return count[0] == nth

    from fsspec.implementations.local import LocalFileOpener

    commit = LocalFileOpener.commit

    def killing_commit(self):
        if hit():
            print("KILLED IN SAVE", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return commit(self)

    LocalFileOpener.commit = killing_commit
    import torch.distributed.checkpoint.filesystem as fs

    write_file = fs._write_files_from_queue

    def torn_file(create_stream, *a, **kw):
        if not hit():
            return write_file(create_stream, *a, **kw)

        def half_then_kill(path, mode):
            opened = create_stream(path, mode)  # a context manager: kept alive with the stream it opened
            real = opened.__enter__()

            class Torn:
                context = opened

                def __enter__(self):
                    return self

                def __exit__(self, *exc):
                    return False

                def write(self, data):
                    real.write(bytes(memoryview(data).cast("B")[: max(1, len(memoryview(data).cast("B")) // 2)]))
                    real.flush()
                    os.fsync(real.fileno())
                    print("KILLED IN SAVE", flush=True)
                    os.kill(os.getpid(), signal.SIGKILL)

                def __getattr__(self, name):
                    return getattr(real, name)

            return Torn()

        return write_file(half_then_kill, *a, **kw)

    fs._write_files_from_queue = torn_file


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--strategy", choices=["ddp", "fsdp2", "fsdp", "deepspeed"], default="ddp")
    p.add_argument("--mode", choices=["unbroken", "lightning", "plain"], default="unbroken")
    p.add_argument("--data", choices=["resumable", "plain", "distributed-order"], default="resumable")
    p.add_argument("--devices", type=int, default=2, help="Lightning's launcher (ignored under torchrun)")
    p.add_argument("--run-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--save-every", type=int, default=3)
    p.add_argument("--batch", type=int, default=4, help="per rank")
    p.add_argument("--accumulate", type=int, default=2)
    p.add_argument("--dump-restored", action="store_true")
    p.add_argument("--dump-at", type=int, action="append", default=[])
    p.add_argument("--stop-at", type=int)
    p.add_argument("--ckpt-path", help="fit(ckpt_path=...)")
    p.add_argument("--lightning-kill-in-save", type=int)
    p.add_argument("--kill-rank", type=int, default=0)
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torchrun = "TORCHELASTIC_RUN_ID" in os.environ
    if torchrun:
        unbroken.init_distributed("gloo")  # before Lightning's own init_process_group: survives torchrun restarts
    (out / f"pid-r{os.environ.get('RANK', '0')}").write_text(str(os.getpid()))
    global PLAIN_NOISE
    PLAIN_NOISE = args.data != "resumable"
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    pl.seed_everything(0, verbose=False)
    if args.lightning_kill_in_save:
        kill_in_lightning_save(args.lightning_kill_in_save, args.kill_rank)
    if args.strategy == "fsdp2":
        from pytorch_lightning.strategies import ModelParallelStrategy

        world = int(os.environ["WORLD_SIZE"]) if torchrun else args.devices
        strategy = ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)
    elif args.strategy in ("fsdp", "deepspeed"):
        strategy = cpu_strategy(args.strategy)
    else:
        strategy = args.strategy
    callbacks: list = [Dumps(args)]
    if args.mode == "unbroken":
        from unbroken.integrations.lightning import UnbrokenCallback

        callbacks.insert(0, UnbrokenCallback(args.run_dir, save_every=args.save_every))
        ckpt_path = args.ckpt_path
    elif args.mode == "plain":  # Lightning alone, no checkpointing at all
        ckpt_path = None
    else:
        from pytorch_lightning.callbacks import ModelCheckpoint

        callbacks.insert(0, ModelCheckpoint(dirpath=args.run_dir, every_n_train_steps=args.save_every,
                                            save_last=True, save_top_k=1))
        ckpt_path = args.ckpt_path or "last"
    devices = int(os.environ["WORLD_SIZE"]) if torchrun else args.devices
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=args.steps,
                         accumulate_grad_batches=args.accumulate, callbacks=callbacks, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         enable_checkpointing=args.mode == "lightning")  # unbroken alone: no Lightning .ckpt
    trainer.fit(Model(args), ckpt_path=ckpt_path)
    print(f"rank {trainer.global_rank}: FINISHED {trainer.global_step}", flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # torch's teardown of FSDP2/DeepSpeed objects at exit can abort after the work is done


if __name__ == "__main__":
    sys.exit(main())
