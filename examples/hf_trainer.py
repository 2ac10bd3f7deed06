"""The Hugging Face Trainer, made resumable by one line: ``enable(trainer, run)``.

    pip install -e '.[hf]'
    python examples/hf_trainer.py --run-dir runs/hf --steps 60

Kill it at any moment (``kill -9``, Ctrl-C, a preempted node) and run the same command
again: it continues from the newest valid checkpoint and ends with bitwise the same model,
optimizer and logged losses as a run that was never interrupted. The last line,
``final train_loss ... sha256 ...``, fingerprints the result so that two runs can be compared.

A tiny random-init GPT-2 on synthetic tokens (no download), with dropout, shuffling,
gradient accumulation and a warmup + cosine schedule; the Trainer's own checkpointing is off
(``save_strategy="no"``): unbroken saves instead.
"""

from __future__ import annotations

import argparse
import hashlib
import sys

import torch
import transformers
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from unbroken.integrations.hf import enable


class Tokens(torch.utils.data.Dataset):
    """Synthetic token sequences: a fixed random set, the same in every process."""

    def __init__(self, n: int = 96, length: int = 16, vocab: int = 64) -> None:
        self.x = torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.x[i], "labels": self.x[i]}


def fingerprint(trainer: Trainer) -> str:
    """sha256 of the parameters and the optimizer's moments."""
    h = hashlib.sha256()
    for name, t in sorted(trainer.model.state_dict().items()):
        h.update(name.encode() + t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    for pid, moments in sorted(trainer.optimizer.state_dict()["state"].items()):
        for k, v in sorted(moments.items()):
            h.update(f"{pid}/{k}".encode() + (v.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
                                              if torch.is_tensor(v) else repr(v).encode()))
    return h.hexdigest()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run-dir", default="runs/hf")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--save-every", type=int, default=10)
    a = p.parse_args(argv)
    transformers.logging.set_verbosity_error()
    transformers.set_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2))
    args = TrainingArguments(output_dir=f"{a.run_dir}-hf-output", max_steps=a.steps, per_device_train_batch_size=4,
                             gradient_accumulation_steps=2, learning_rate=3e-3, lr_scheduler_type="cosine",
                             warmup_steps=5, logging_steps=5, save_strategy="no", report_to=[], use_cpu=True,
                             disable_tqdm=True, seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens())
    callback = enable(trainer, a.run_dir, save_every=a.save_every, keep_last=3)   # <- the one line
    result = trainer.train()           # resumes from the newest valid checkpoint, or starts fresh
    print(f"resumed from step {callback.restored.step}" if callback.restored else "fresh start", flush=True)
    print(f"final train_loss {result.training_loss!r} step {trainer.state.global_step} "
          f"sha256 {fingerprint(trainer)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
