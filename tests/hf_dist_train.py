"""Training job for tests/test_integration_hf_dist.py: the HF Trainer on several ranks (torchrun, gloo, CPU).

    torchrun --standalone --nproc_per_node 2 tests/hf_dist_train.py --stack ddp --mode unbroken --out OUT

A tiny random-init GPT-2 with dropout under ``transformers.Trainer``, on one of the stacks

- ``ddp``: what the Trainer does by itself under torchrun (accelerate's DistributedDataParallel);
- ``fsdp2`` / ``fsdp1``: ``fsdp=True`` with ``fsdp_config={"fsdp_version": 2 or 1}`` (accelerate's FSDP
  plugin, full sharding, GPT2Block wrapped). On CPU accelerate applies the plugin only with
  ``--force-fsdp-on-cpu`` (it marks the CPU group as an accelerator group before the Trainer builds its
  Accelerator; without it the Trainer trains with DDP);
- ``zero2`` / ``zero3``: ``TrainingArguments(deepspeed={"zero_optimization": {"stage": 2 or 3}, ...})`` with
  the Trainer's torch AdamW (``optim="adamw_torch"``; no DeepSpeed optimizer, nothing compiled for it).

The global batch is fixed: 4 samples per rank per micro-batch, ``16 / (4 * world)`` micro-batches per
optimizer step (2 on 2 ranks, 4 on 1), so 1 or 2 ranks train on the same 16 samples in every step; an
epoch is 80 samples (5 steps). AdamW, warmup + cosine, clipping, logging every 2 steps, an evaluation
every 5 steps.

``--mode unbroken``: ``enable(trainer, OUT/run, save_every=...)`` and ``save_strategy="no"``.
``--mode hf``: the Trainer's own checkpointing (``save_strategy="steps"`` into ``OUT/hf``,
``resume_from_checkpoint=True`` when a checkpoint exists). Both call ``unbroken.init_distributed()``
first (torch's default group that survives torchrun restarts); that is HF alone's only use of unbroken.

Every rank appends one JSON line per optimizer step to ``OUT/steps-r<rank>.jsonl`` (its micro-batch
losses, the samples it trained on, ``state.epoch``, the world size) and prints ``rank R step N``. At the
end rank 0 writes ``OUT/final.safetensors`` (the full parameters, AdamW moments and learning rates,
gathered: ``full_tensor()`` under FSDP, DeepSpeed's ``safe_get_full_*`` under ZeRO; the fp32 masters
under ZeRO) and ``OUT/final.json`` (global_step, epoch, total_flos, train_loss, log_history without
timings). ``--dump-at N`` writes the same full state after step N to ``OUT/state-N.safetensors``,
``--dump-restored`` right after the restore to ``OUT/restored.safetensors``.

Faults: ``--faults-in-round R`` keeps ``UNBROKEN_FAULTS`` only in torchrun's restart round R (the
others never see it), ``--hf-kill-in-save N`` SIGKILLs rank ``--kill-rank`` inside the Trainer's own
Nth save (hf mode: after the weights, before the optimizer and ``trainer_state.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed on CPU (the ZeRO stacks), read when it is imported

# torch and transformers first thing: the suite's fork server starts this script with them imported
# (tests/zygote.py)
import torch
import torch.distributed as dist
import transformers
from transformers import (GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback,
                          TrainingArguments, set_seed)
from transformers.trainer_utils import get_last_checkpoint

if "--faults-in-round" in sys.argv:  # before unbroken is imported: it reads UNBROKEN_FAULTS once
    _round = sys.argv[sys.argv.index("--faults-in-round") + 1]
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != _round:
        os.environ.pop("UNBROKEN_FAULTS", None)

import unbroken

N, SEQ, VOCAB, BATCH, GLOBAL = 80, 16, 64, 4, 16
TIMING = ("runtime", "per_second")


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = N, seed: int = 1234) -> None:
        self.x = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(seed))
        self.index = {row.numpy().tobytes(): i for i, row in enumerate(self.x)}  # 80 random rows: all distinct
        self.fetched = 0  # samples loaded by this process (a resume that replays data loads more)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        self.fetched += 1
        return {"input_ids": self.x[i], "labels": self.x[i]}


class ScriptTrainer(Trainer):
    """Records each micro-batch's loss on this rank and the samples it trained on (from the batch
    itself: a loader that prefetches does not shift them)."""

    micro: list[float]
    samples: list[int]

    def training_step(self, model, inputs, num_items_in_batch=None):  # type: ignore[override]
        data = self.train_dataset
        self.samples = getattr(self, "samples", []) + [data.index[r.numpy().tobytes()] for r in inputs["input_ids"]]
        loss = super().training_step(model, inputs, num_items_in_batch)
        self.micro = getattr(self, "micro", []) + [loss.item()]
        return loss


def stack_args(stack: str) -> dict:
    if stack.startswith("fsdp"):
        extra = {"sync_module_states": False} if stack == "fsdp1" else {}  # True needs an accelerator device
        return {"fsdp": True, "fsdp_config": {"fsdp_version": int(stack[-1]), **extra,
                                              "transformer_layer_cls_to_wrap": ["GPT2Block"]}}
    if stack.startswith("zero"):
        return {"deepspeed": {"zero_optimization": {"stage": int(stack[-1])}, "train_batch_size": "auto",
                              "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                              "gradient_clipping": "auto", "steps_per_print": 10**9, "wall_clock_breakdown": False}}
    return {}


def full_state(trainer: Trainer) -> dict[str, torch.Tensor]:
    """The full parameters (fp32 masters under ZeRO), AdamW moments, learning rates and scheduler
    position: a collective under FSDP and ZeRO-3 (every rank calls it)."""
    out: dict[str, torch.Tensor] = {}
    engine = trainer.model_wrapped if trainer.is_deepspeed_enabled else None
    if engine is not None:
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        if hasattr(engine.optimizer, "_lazy_init_hp_params_optimizer_state"):  # ZeRO 1/2: DeepSpeed 0.19.8 links
            engine.optimizer._hp_optimizer_states_linked = False  # the moments of the 2nd parameter group to
            engine.optimizer._lazy_init_hp_params_optimizer_state()  # an empty state (first step of group 0)
        for name, p in engine.module.named_parameters():
            out[f"param/{name}"] = safe_get_full_fp32_param(p).detach().clone().contiguous()
            for k in ("exp_avg", "exp_avg_sq"):
                out[f"{k}/{name}"] = safe_get_full_optimizer_state(p, k).detach().clone().contiguous()
        groups = engine.optimizer.param_groups
    else:
        def full(t: torch.Tensor) -> torch.Tensor:
            return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone().contiguous()

        opt = trainer.optimizer.optimizer
        for name, p in trainer.model.named_parameters():
            out[f"param/{name}"] = full(p)
            for k, v in sorted(opt.state.get(p, {}).items()):
                out[f"{k}/{name}"] = full(v).reshape(-1) if v.dim() else full(v)
        groups = opt.param_groups
    out["lr"] = torch.tensor([float(g["lr"]) for g in groups], dtype=torch.float64)
    out["scheduler_last_epoch"] = torch.tensor(trainer.lr_scheduler.state_dict()["last_epoch"])
    return {k.replace("_fsdp_wrapped_module.", "").replace("module.", ""): v for k, v in out.items()}


def dump(trainer: Trainer, path: Path) -> None:
    state = full_state(trainer)
    if trainer.args.process_index == 0:
        from safetensors.torch import save_file

        save_file(state, str(path))


class Report(TrainerCallback):
    def __init__(self, trainer: ScriptTrainer, out: Path, a: argparse.Namespace) -> None:
        self.trainer, self.out, self.a = trainer, out, a
        self.rank = trainer.args.process_index

    def on_train_begin(self, args, state, control, **kwargs):
        print(f"rank {self.rank}: " + (f"resumed from step {state.global_step}" if state.global_step
                                       else "fresh start"), flush=True)
        t = self.trainer
        param = type(next(t.model_wrapped.parameters())).__name__
        print(f"rank {self.rank}: training under {type(t.model_wrapped).__name__} ({param} parameters)", flush=True)
        if self.a.dump_restored:
            dump(self.trainer, self.out / "restored.safetensors")

    def on_step_end(self, args, state, control, **kwargs):
        t = self.trainer
        row = {"step": state.global_step, "losses": getattr(t, "micro", []), "samples": getattr(t, "samples", []),
               "epoch": repr(state.epoch), "world": args.world_size}
        t.micro, t.samples = [], []
        with open(self.out / f"steps-r{self.rank}.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        print(f"rank {self.rank} step {state.global_step}", flush=True)
        if state.global_step in self.a.dump_at:
            dump(self.trainer, self.out / f"state-{state.global_step}.safetensors")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--stack", choices=["ddp", "fsdp2", "fsdp1", "zero2", "zero3"], required=True)
    p.add_argument("--mode", choices=["unbroken", "hf"], required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--save-every", type=int, default=3)
    p.add_argument("--resume", default=None, help="unbroken mode: resume_from_checkpoint (a path)")
    p.add_argument("--dump-at", type=int, action="append", default=[])
    p.add_argument("--dump-restored", action="store_true")
    p.add_argument("--faults-in-round", type=int, default=None)
    p.add_argument("--hf-kill-in-save", type=int, default=0)
    p.add_argument("--kill-rank", type=int, default=0)
    p.add_argument("--force-fsdp-on-cpu", action="store_true")
    p.add_argument("--ddp-find-unused-false", action="store_true",
                   help="ddp_find_unused_parameters=False (HF's default is True without gradient checkpointing)")
    a = p.parse_args()
    if "WORLD_SIZE" in os.environ:  # torchrun (1 rank included: accelerate then builds a group of 1)
        unbroken.init_distributed("gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"pid-r{rank}").write_text(str(os.getpid()))
    set_seed(7)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2))
    args = TrainingArguments(
        output_dir=str(out / "hf"), per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=GLOBAL // (BATCH * world), max_steps=a.steps, learning_rate=3e-3,
        weight_decay=0.01, lr_scheduler_type="cosine", warmup_steps=3, max_grad_norm=1.0, optim="adamw_torch",
        logging_steps=2, eval_strategy="steps", eval_steps=5, per_device_eval_batch_size=4, report_to=[],
        use_cpu=True, ddp_backend="gloo", disable_tqdm=True, seed=7, save_strategy="steps" if a.mode == "hf" else "no",
        save_steps=a.save_every, **stack_args(a.stack),
        **({"ddp_find_unused_parameters": False} if a.ddp_find_unused_false else {}))
    data = Tokens()
    if a.stack.startswith("fsdp") and a.force_fsdp_on_cpu:
        from accelerate.state import PartialState
        from accelerate.utils import DistributedType

        PartialState._shared_state["distributed_type"] = DistributedType.MULTI_GPU
    trainer = ScriptTrainer(model=model, args=args, train_dataset=data, eval_dataset=Tokens(8, seed=99))
    trainer.add_callback(Report(trainer, out, a))
    if a.mode == "unbroken":
        from unbroken.integrations.hf import enable

        enable(trainer, out / "run", save_every=a.save_every, keep_last=None)
        result = trainer.train(resume_from_checkpoint=a.resume)
    else:
        if a.hf_kill_in_save and rank == a.kill_rank:
            original, calls = trainer._save_optimizer_and_scheduler, [0]

            def save_optimizer(output_dir: str) -> None:
                calls[0] += 1
                if calls[0] == a.hf_kill_in_save:
                    os.kill(os.getpid(), signal.SIGKILL)
                original(output_dir)

            trainer._save_optimizer_and_scheduler = save_optimizer
        hf_dir = out / "hf"
        resume = hf_dir.is_dir() and get_last_checkpoint(str(hf_dir)) is not None
        result = trainer.train(resume_from_checkpoint=True if resume else None)
    final = full_state(trainer)
    print(f"rank {rank} fetched {data.fetched}", flush=True)
    if rank == 0:
        from safetensors.torch import save_file

        save_file(final, str(out / "final.safetensors"))
        logs = [{k: v for k, v in e.items() if not any(t in k for t in TIMING)} for e in trainer.state.log_history]
        summary = {"global_step": trainer.state.global_step, "epoch": repr(trainer.state.epoch),
                   "total_flos": repr(trainer.state.total_flos), "train_loss": repr(result.training_loss),
                   "log_history": json.loads(json.dumps(logs, default=repr))}
        (out / "final.json").write_text(json.dumps(summary, sort_keys=True))
    finish(rank)


def finish(rank: int) -> None:
    """Leave once the work is done, without torch's teardown at interpreter exit (which aborts now and
    then on gloo after the group is destroyed with FSDP2 and DeepSpeed, as in dist_train.py / ds_train.py)."""
    if dist.is_initialized():
        dist.destroy_process_group()
    print(f"rank {rank}: done", flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)
    main()
