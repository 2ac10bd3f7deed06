"""What a Trainer trains with — one process, DDP, FSDP2 or DeepSpeed — and the state unbroken saves for it.

The Trainer (through accelerate) picks the stack; the callback asks :func:`training_state` for the
objects to save, the first moment they exist (``on_train_begin``), and :func:`check_stack` refuses
what it cannot save exactly before any training.

- **One process, DDP** (the Trainer's default under ``torchrun``): ``trainer.model`` is the plain
  model (DDP wraps it in ``trainer.model_wrapped``), replicated on every rank; unbroken writes it
  once, its files shared among the ranks.
- **FSDP2** (``fsdp_config={"fsdp_version": 2}``): ``trainer.model`` is the ``fully_shard``-ed
  model, its parameters and the AdamW moments DTensors; unbroken saves each rank's shards through
  DCP's planners and reshards them at load, to another world size too.
- **DeepSpeed** (``TrainingArguments(deepspeed=...)``): ``trainer.model_wrapped`` is the
  ``DeepSpeedEngine``. Its ``state_dict()`` holds no optimizer state (and under ZeRO-3 empty
  placeholders), so the *engine* goes into the state as it is and unbroken's DeepSpeed adapter
  saves the fp32 masters and moments per parameter, the engine's counters, the loss scaler
  (:mod:`unbroken.dist.deepspeed`). The Trainer's LR scheduler, which the engine does not hold
  unless the DeepSpeed config names one, is saved beside it.
- **FSDP1** (``fsdp_version`` 1): refused. Its flat parameters and the state-dict type accelerate
  configures (a full state dict gathered on rank 0 only, by default) are not a per-rank state
  unbroken could save and reshard; FSDP2 is.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from transformers import Trainer


def deepspeed_engine(trainer: Trainer) -> Any | None:
    """The Trainer's ``DeepSpeedEngine`` once training has prepared it, else ``None``."""
    if not getattr(trainer, "is_deepspeed_enabled", False):
        return None
    engine_class = getattr(sys.modules.get("deepspeed"), "DeepSpeedEngine", None)
    return trainer.model_wrapped if engine_class is not None and isinstance(trainer.model_wrapped, engine_class) \
        else None


def fsdp_version(trainer: Trainer) -> int | None:
    """1 or 2 when accelerate runs the model under FSDP, else ``None`` (accelerate 1.x applies its FSDP
    plugin on accelerator devices only: on CPU ``fsdp=...`` trains with DDP)."""
    if not getattr(trainer, "is_fsdp_enabled", False):
        return None
    return int(getattr(trainer.accelerator.state.fsdp_plugin, "fsdp_version", 1) or 1)


def check_stack(trainer: Trainer) -> None:
    """Refuse, before any training, a stack whose state unbroken cannot save exactly."""
    if fsdp_version(trainer) == 1:
        raise ValueError("unbroken.integrations.hf does not support FSDP1 (fsdp_version 1: flat parameters, a state "
                         "dict gathered on one rank); use FSDP2, whose sharded state unbroken saves and reshards: "
                         "TrainingArguments(fsdp=True, fsdp_config={'fsdp_version': 2, ...})")


def training_state(trainer: Trainer) -> dict[str, Any]:
    """The Trainer's model, optimizer, scheduler and scaler as unbroken saves them (the callback adds
    ``data`` and ``trainer``): ``{"engine": ..., "scheduler": ...}`` under DeepSpeed, else
    ``{"model": ..., "optimizer": ..., "scheduler": ..., "scaler": ...}`` (those that exist)."""
    check_stack(trainer)
    engine = deepspeed_engine(trainer)
    if engine is not None:
        st: dict[str, Any] = {"engine": engine}
        if trainer.lr_scheduler is not None and trainer.lr_scheduler is not engine.lr_scheduler:
            st["scheduler"] = trainer.lr_scheduler  # the Trainer steps it; the engine's own is saved inside
        return st
    if getattr(trainer, "is_deepspeed_enabled", False):
        raise RuntimeError("unbroken: the Trainer runs DeepSpeed but trainer.model_wrapped is not a DeepSpeedEngine "
                           f"({type(trainer.model_wrapped).__name__}) when training begins")
    inner = getattr(trainer.optimizer, "optimizer", None)  # the torch optimizer inside accelerate's wrapper
    if not isinstance(inner, torch.optim.Optimizer):
        inner = trainer.optimizer
    st = {"model": trainer.model, "optimizer": inner}
    if trainer.lr_scheduler is not None:
        st["scheduler"] = trainer.lr_scheduler
    scaler = getattr(trainer.accelerator, "scaler", None)
    if scaler is not None:
        st["scaler"] = scaler
    return st
