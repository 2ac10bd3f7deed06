"""Jobs for Trainers unbroken does not construct: LLaMA-Factory SFT, TRL's SFTTrainer, a plain Trainer.

Used by tests/test_llamafactory.py (``prepare``, ``llamafactory``, ``trl``: in the LLaMA-Factory test
environment of ``scripts/llamafactory_env.sh``, with unbroken from the work tree on ``PYTHONPATH``) and
tests/test_integration_hf_builtelsewhere.py (``plain``: the project's environment). Nothing is
downloaded: ``prepare --assets DIR`` writes a tiny randomly initialised Llama (2 layers, attention
dropout), a word-level tokenizer and an alpaca-format dataset of 26 examples with its
``dataset_info.json``. Every job trains 20 steps (``--steps``) with batches of 2 and
``gradient_accumulation_steps=2`` (13 micro-batches an epoch: every 7th step has one), AdamW, warmup +
cosine, clipping:

- ``llamafactory``: ``llamafactory.train.tuner.run_exp(args, callbacks=[...])``, full SFT with the
  ``default`` template and a loss logged every step; LLaMA-Factory builds the Trainer and calls
  ``train(resume_from_checkpoint=...)`` itself (its last ``output_dir/checkpoint-N`` when there is one
  and ``overwrite_output_dir`` is false). Its own saves: ``save_strategy="no"`` with unbroken (as the
  docs recommend), every ``--save-every`` steps with ``--mode alone`` or ``--hf-saves``;
- ``trl``: ``SFTTrainer(..., callbacks=[...])`` built inside a function, prompt-completion data;
- ``plain``: :func:`plain_trainer`.

``--mode unbroken`` adds ``UnbrokenTrainerCallback(OUT/run, save_every=--save-every)`` to the callbacks,
and nothing else; ``--mode alone`` relies on the framework's own checkpoints. Prints ``fresh start`` /
``resumed from step N`` when training begins, ``step N <sha256 of the parameters>`` after each optimizer
step, ``log {...}`` for each logged entry, and at the end ``final <sha256>`` of the parameters, optimizer
state and scheduler; ``OUT/final.json`` has that hash, the counters, the log history (timings left out)
and ``train_loss``.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.machinery
import importlib.util
import json
import os
import random
import signal
import sys
import types
from pathlib import Path
from typing import Any

import torch

TIMING = ("runtime", "per_second")
WORDS = [f"w{i}" for i in range(40)]
SPECIAL = ["<pad>", "<unk>", "<s>", "</s>", "Human:", "Assistant:", "System:", "\n"]


def torchaudio_standin() -> None:
    """LLaMA-Factory 0.9.5 imports ``torchaudio`` at module level (``llamafactory/data/mm_plugin.py``) and
    uses it only to load audio inputs; PyPI has no torchaudio build for torch 2.13 on CPU (its newest,
    2.11.0, is a CUDA build: ``libc10_cuda.so`` missing). A module that fails on use stands in for it."""
    if "torchaudio" in sys.modules or importlib.util.find_spec("torchaudio") is not None:
        return
    stub = types.ModuleType("torchaudio", "stand-in: no torchaudio build for this torch")
    stub.__spec__ = importlib.machinery.ModuleSpec("torchaudio", None)

    def missing(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise ModuleNotFoundError(f"torchaudio.{name}: torchaudio is not installed in this test environment")

    stub.__getattr__ = missing  # type: ignore[attr-defined]
    sys.modules["torchaudio"] = stub


def prepare(assets: Path) -> None:
    """The tiny model, tokenizer and dataset (deterministic; no download)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                         attention_dropout=0.1, pad_token_id=0, bos_token_id=2, eos_token_id=3,
                         tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    (assets / "model").mkdir(parents=True, exist_ok=True)
    model.save_pretrained(assets / "model")
    fast.save_pretrained(assets / "model")
    rnd = random.Random(1)
    rows = [{"instruction": " ".join(rnd.choices(WORDS, k=rnd.randint(3, 8))), "input": "",
             "output": " ".join(rnd.choices(WORDS, k=rnd.randint(2, 6)))} for _ in range(26)]
    (assets / "data").mkdir(exist_ok=True)
    (assets / "data" / "tiny.json").write_text(json.dumps(rows))
    (assets / "data" / "dataset_info.json").write_text(json.dumps({"tiny": {"file_name": "tiny.json"}}))


def digest_params(model: torch.nn.Module, h: Any = None) -> Any:
    h = h or hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(f"{name}{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h


def digest(model: torch.nn.Module, optimizer: Any, scheduler: Any) -> str:
    h = digest_params(model)
    opt = optimizer.state_dict()
    for pid in sorted(opt["state"]):
        for k, v in sorted(opt["state"][pid].items()):
            h.update(f"{pid}/{k}".encode())
            raw = v.contiguous().view(-1).view(torch.uint8).numpy().tobytes() if torch.is_tensor(v) else repr(v)
            h.update(raw if isinstance(raw, bytes) else raw.encode())
    h.update(json.dumps(opt["param_groups"], sort_keys=True, default=repr).encode())
    h.update(json.dumps(scheduler.state_dict(), sort_keys=True, default=repr).encode())
    return h.hexdigest()


def report(final: dict[str, Any]) -> Any:
    """The job's view of training, as a callback: the lines the test parses, and ``final`` at the end."""
    from transformers import TrainerCallback

    class Report(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            print(f"resumed from step {state.global_step}" if state.global_step else "fresh start", flush=True)

        def on_step_end(self, args, state, control, model=None, **kw):
            print(f"step {state.global_step} {digest_params(model).hexdigest()}", flush=True)

        def on_log(self, args, state, control, logs=None, **kw):
            print("log " + json.dumps({k: v for k, v in (logs or {}).items() if not any(t in k for t in TIMING)}),
                  flush=True)

        def on_train_end(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kw):
            logs = [{k: v for k, v in e.items() if not any(t in k for t in TIMING)} for e in state.log_history]
            final.update(sha256=digest(model, optimizer, lr_scheduler), global_step=state.global_step,
                         epoch=repr(state.epoch), total_flos=repr(state.total_flos),
                         log_history=json.loads(json.dumps(logs, default=repr)))

    return Report()


def kill_inside_hf_save(n: int) -> None:
    """A test hook in this process: the Trainer's ``n``-th own save is SIGKILLed after the weights are
    written, before the optimizer, scheduler, RNG and ``trainer_state.json``."""
    from transformers import Trainer

    original, calls = Trainer._save_optimizer_and_scheduler, [0]

    def save_optimizer(self: Trainer, output_dir: str) -> None:
        calls[0] += 1
        if calls[0] == n:
            os.kill(os.getpid(), signal.SIGKILL)
        original(self, output_dir)

    Trainer._save_optimizer_and_scheduler = save_optimizer  # type: ignore[method-assign]


def llamafactory_sft(a: argparse.Namespace, assets: Path, out: Path, callbacks: list[Any]) -> float:
    """LLaMA-Factory builds the Trainer and calls ``train()``; we only pass callbacks."""
    from llamafactory.train.tuner import run_exp

    args = dict(
        stage="sft", do_train=True, finetuning_type="full", model_name_or_path=str(assets / "model"),
        template="default", dataset="tiny", dataset_dir=str(assets / "data"), cutoff_len=48,
        output_dir=str(out / "lf"), per_device_train_batch_size=2, gradient_accumulation_steps=2,
        max_steps=a.steps, learning_rate=3e-3, weight_decay=0.01, lr_scheduler_type="cosine", warmup_steps=2,
        max_grad_norm=1.0, logging_steps=1, report_to="none", seed=7, disable_tqdm=True, plot_loss=False,
        use_cpu=True, dataloader_num_workers=0,
    )
    if a.mode == "alone" or a.hf_saves:
        args.update(save_strategy="steps", save_steps=a.save_every)
    else:
        args.update(save_strategy="no")  # what the docs recommend with unbroken
    run_exp(args, callbacks=callbacks)
    return json.loads((out / "lf" / "train_results.json").read_text())["train_loss"]


def trl_sft(a: argparse.Namespace, assets: Path, out: Path, callbacks: list[Any]) -> float:
    """TRL's SFTTrainer (a Trainer subclass) built inside a function that takes only callbacks."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, set_seed
    from trl import SFTConfig, SFTTrainer

    rows = json.loads((assets / "data" / "tiny.json").read_text())
    data = Dataset.from_list([{"prompt": r["instruction"], "completion": " " + r["output"]} for r in rows])
    config = SFTConfig(
        output_dir=str(out / "trl"), per_device_train_batch_size=2, gradient_accumulation_steps=2,
        max_steps=a.steps, learning_rate=3e-3, weight_decay=0.01, lr_scheduler_type="cosine", warmup_steps=2,
        max_grad_norm=1.0, logging_steps=3, report_to="none", seed=7, disable_tqdm=True, use_cpu=True,
        max_length=48, save_strategy="steps" if a.mode == "alone" else "no", save_steps=a.save_every)
    set_seed(config.seed)
    model = AutoModelForCausalLM.from_pretrained(assets / "model")
    trainer = SFTTrainer(model=model, args=config, train_dataset=data,
                         processing_class=AutoTokenizer.from_pretrained(assets / "model"), callbacks=callbacks)
    return trainer.train().training_loss


def plain_trainer(a: argparse.Namespace, assets: Path, out: Path, callbacks: list[Any]) -> float:
    """A plain ``transformers.Trainer`` built inside a function that takes only callbacks, resumed the
    way LLaMA-Factory does it: its own saves on, ``train(resume_from_checkpoint=<output_dir's last
    checkpoint-N>)``. Runs in the project's environment: a tiny random-init Llama built here, random
    token sequences, an evaluation every 7 steps and a loss logged every 3 (its accumulators span saves)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments, set_seed
    from transformers.trainer_utils import get_last_checkpoint

    class Tokens(torch.utils.data.Dataset):
        def __init__(self, n: int, seed: int) -> None:
            self.x = torch.randint(0, 64, (n, 16), generator=torch.Generator().manual_seed(seed))

        def __len__(self) -> int:
            return len(self.x)

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return {"input_ids": self.x[i], "labels": self.x[i]}

    args = TrainingArguments(
        output_dir=str(out / "hf"), per_device_train_batch_size=2, gradient_accumulation_steps=2,
        max_steps=a.steps, learning_rate=3e-3, weight_decay=0.01, lr_scheduler_type="cosine", warmup_steps=2,
        logging_steps=3, eval_strategy="steps", eval_steps=7, per_device_eval_batch_size=4, report_to=[],
        use_cpu=True, disable_tqdm=True, seed=7, save_strategy="steps", save_steps=a.save_every)
    set_seed(args.seed)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16,
                                         attention_dropout=0.1))
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(26, 1), eval_dataset=Tokens(8, 2),
                      callbacks=callbacks)
    last = get_last_checkpoint(args.output_dir) if os.path.isdir(args.output_dir) else None
    return trainer.train(resume_from_checkpoint=last).training_loss


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("command", choices=["prepare", "llamafactory", "trl", "plain"])
    p.add_argument("--assets", help="what prepare writes (not used by plain)")
    p.add_argument("--out", help="where a run writes")
    p.add_argument("--mode", choices=["unbroken", "alone"], default="unbroken")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--save-every", type=int, default=4)
    p.add_argument("--hf-saves", action="store_true", help="unbroken mode: the Trainer's own saves every "
                   "--save-every steps as well (LLaMA-Factory then passes its last checkpoint to train())")
    p.add_argument("--kill-in-hf-save", type=int, default=0,
                   help="SIGKILL inside the Nth save of the Trainer's own checkpointing (after the weights)")
    a = p.parse_args(argv)
    assets = Path(a.assets or ".")
    if a.command == "prepare":
        prepare(assets)
        return 0
    torch.set_num_threads(1)
    if a.command != "plain":
        torchaudio_standin()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.kill_in_hf_save:
        kill_inside_hf_save(a.kill_in_hf_save)
    final: dict[str, Any] = {}
    callbacks = [report(final)]
    if a.mode == "unbroken":
        from unbroken.integrations.hf import UnbrokenTrainerCallback

        callbacks.append(UnbrokenTrainerCallback(out / "run", save_every=a.save_every, keep_last=3))
    train = {"llamafactory": llamafactory_sft, "trl": trl_sft, "plain": plain_trainer}[a.command]
    final["train_loss"] = repr(train(a, assets, out, callbacks))
    (out / "final.json").write_text(json.dumps(final, sort_keys=True))
    print(f"final {final['sha256']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
