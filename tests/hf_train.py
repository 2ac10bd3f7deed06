"""Training job for tests/test_integration_hf.py: a tiny random-init GPT-2 under ``transformers.Trainer``.

Dropout, a shuffled synthetic token dataset whose epoch does not divide into whole
accumulation steps (17 micro-batches of 4, ``gradient_accumulation_steps=2``: the last step
of each epoch has one micro-batch), AdamW, warmup + cosine, gradient clipping, logging every
3 steps (so the logged loss averages over steps), an evaluation every 7 steps.

``--mode unbroken``: the Trainer saves through ``unbroken.integrations.hf.enable`` and
``save_strategy="no"``. ``--mode hf``: the Trainer's own checkpointing
(``save_strategy="steps"``, ``resume_from_checkpoint=True`` when a checkpoint exists). ``--mode plain``:
the same script with no checkpointing at all (the framework alone, to compare an uninterrupted run with).

Prints ``fresh start`` / ``resumed from step N`` when training begins, ``step N <losses> <epoch>``
(every micro-batch loss and ``state.epoch`` with ``repr``) after each optimizer step, and at the
end ``final <sha256>`` of the parameters, optimizer state and scheduler; ``final.json`` in
``--out`` holds that hash, the counters and the log history (without timings).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
from pathlib import Path

import torch
import transformers
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments, set_seed
from transformers.trainer_utils import get_last_checkpoint

N, SEQ, VOCAB, BATCH, ACCUM = 68, 16, 64, 4, 2
TIMING = ("runtime", "per_second")


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = N, seed: int = 1234) -> None:
        self.x = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(seed))
        self.fetched = 0  # samples loaded by this process (a resume that replays data would load more)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        self.fetched += 1
        return {"input_ids": self.x[i], "labels": self.x[i]}


class ScriptTrainer(Trainer):
    """Records each micro-batch's loss; raises once at ``crash_at`` (2nd micro-batch: after a backward)."""

    crash_at = 0
    marker: Path | None = None

    def training_step(self, model, inputs, num_items_in_batch=None):  # type: ignore[override]
        self.micro = getattr(self, "micro", [])
        step = self.state.global_step + 1
        if step == self.crash_at and len(self.micro) == 1 and self.marker and not self.marker.exists():
            self.marker.touch()
            raise RuntimeError(f"injected failure in step {step}")
        loss = super().training_step(model, inputs, num_items_in_batch)
        self.micro.append(loss.item())
        return loss


class Report(TrainerCallback):
    def __init__(self, trainer: ScriptTrainer) -> None:
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        print(f"resumed from step {state.global_step}" if state.global_step else "fresh start", flush=True)

    def on_step_end(self, args, state, control, **kwargs):
        losses = " ".join(repr(x) for x in getattr(self.trainer, "micro", []))
        self.trainer.micro = []
        print(f"step {state.global_step} {losses} epoch={state.epoch!r}", flush=True)


def digest(trainer: Trainer) -> str:
    h = hashlib.sha256()
    for name, t in sorted(trainer.model.state_dict().items()):
        h.update(f"{name}{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    opt = trainer.optimizer.state_dict()
    for pid in sorted(opt["state"]):
        for k, v in sorted(opt["state"][pid].items()):
            h.update(f"{pid}/{k}".encode())
            raw = v.contiguous().view(-1).view(torch.uint8).numpy().tobytes() if torch.is_tensor(v) else repr(v)
            h.update(raw if isinstance(raw, bytes) else raw.encode())
    h.update(json.dumps(opt["param_groups"], sort_keys=True, default=repr).encode())
    h.update(json.dumps(trainer.lr_scheduler.state_dict(), sort_keys=True, default=repr).encode())
    return h.hexdigest()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["unbroken", "hf", "plain"], required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--crash-at", type=int, default=0, help="raise in this step (once per --out)")
    p.add_argument("--workers", type=int, default=0, help="dataloader_num_workers")
    p.add_argument("--resume", default=None, help="resume_from_checkpoint: a path, 'true' or 'false'")
    p.add_argument("--incremental", action="store_true", help="incremental checkpoints (chunks)")
    p.add_argument("--hf-kill-in-save", type=int, default=0,
                   help="hf mode: SIGKILL inside the Nth Trainer save, after the weights, before the optimizer")
    p.add_argument("--random-sampler", action="store_true",
                   help="accelerator_config use_seedable_sampler=False: torch's RandomSampler")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    set_seed(a.seed)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2))
    hf_dir = out / "hf"
    args = TrainingArguments(
        output_dir=str(hf_dir), per_device_train_batch_size=BATCH, gradient_accumulation_steps=ACCUM,
        max_steps=a.steps, learning_rate=3e-3, weight_decay=0.01, lr_scheduler_type="cosine", warmup_steps=4,
        logging_steps=3, eval_strategy="steps", eval_steps=7, per_device_eval_batch_size=4, report_to=[],
        use_cpu=True, disable_tqdm=True, seed=a.seed, dataloader_num_workers=a.workers,
        save_strategy="steps" if a.mode == "hf" else "no", save_steps=a.save_every,
        accelerator_config={"use_seedable_sampler": not a.random_sampler})
    data = Tokens()
    trainer = ScriptTrainer(model=model, args=args, train_dataset=data, eval_dataset=Tokens(8, seed=99))
    trainer.crash_at, trainer.marker = a.crash_at, out / f"crashed-{a.crash_at}"
    trainer.add_callback(Report(trainer))
    if a.mode == "unbroken":
        from unbroken.integrations.hf import enable

        enable(trainer, out / "run", save_every=a.save_every, keep_last=3, incremental=a.incremental)
        resume = {None: None, "true": True, "false": False}.get(a.resume, a.resume)
        result = trainer.train(resume_from_checkpoint=resume)
    elif a.mode == "plain":
        result = trainer.train()
    else:
        if a.hf_kill_in_save:
            original, calls = trainer._save_optimizer_and_scheduler, [0]

            def save_optimizer(output_dir: str) -> None:
                calls[0] += 1
                if calls[0] == a.hf_kill_in_save:
                    os.kill(os.getpid(), signal.SIGKILL)
                original(output_dir)

            trainer._save_optimizer_and_scheduler = save_optimizer
        resume = hf_dir.is_dir() and get_last_checkpoint(str(hf_dir)) is not None
        result = trainer.train(resume_from_checkpoint=True if resume else None)
    sha = digest(trainer)
    logs = [{k: v for k, v in e.items() if not any(t in k for t in TIMING)} for e in trainer.state.log_history]
    final = {"sha256": sha, "global_step": trainer.state.global_step, "epoch": repr(trainer.state.epoch),
             "total_flos": repr(trainer.state.total_flos), "train_loss": repr(result.training_loss),
             "log_history": json.loads(json.dumps(logs, default=repr))}
    (out / "final.json").write_text(json.dumps(final, sort_keys=True))
    print(f"fetched {data.fetched}", flush=True)
    print(f"final {sha}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
