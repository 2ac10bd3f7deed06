"""What the model and optimizers of a Lightning strategy are to unbroken.

- One device, ``DDPStrategy`` (``"ddp"``, ``"ddp_spawn"``, ...): the ``LightningModule`` and
  ``trainer.optimizers`` as they are; every rank holds the same values (replicated), which unbroken
  writes once, its files split over the ranks.
- ``ModelParallelStrategy`` (FSDP2 ``fully_shard`` and tensor parallelism in ``configure_model``): the
  same two objects; their parameters and the optimizer's state are DTensors, which unbroken saves
  sharded through DCP (each rank its pieces) and reshards at load.
- ``FSDPStrategy`` (FSDP1): the module's own ``state_dict()`` on a rank is not the model, so the
  wrapped root and the optimizers go in as one :class:`~.fsdp.FSDPState` (sharded rows, through DCP).
- ``DeepSpeedStrategy``: the ``DeepSpeedEngine`` (``trainer.strategy.model``), which unbroken sees through
  its DeepSpeed adapter (fp32 masters and optimizer moments per parameter, each rank its ZeRO slice);
  ``trainer.optimizers`` holds DeepSpeed's ZeRO optimizer, which is part of the engine.

LR schedulers are Lightning's in every case (Lightning steps them; under DeepSpeed too).
"""

from __future__ import annotations

from typing import Any

from ...checkpoint.adapting import adapter_for
from .fsdp import FSDPState, is_fsdp1


def model_state(trainer: Any, pl_module: Any) -> dict[str, Any]:
    """The model and optimizer entries of the state unbroken saves for ``trainer``'s strategy."""
    wrapped = getattr(trainer.strategy, "model", None)
    if wrapped is not None and adapter_for(wrapped) is not None:  # a DeepSpeed engine
        return {"engine": wrapped}
    opts = list(trainer.optimizers)
    if wrapped is not None and is_fsdp1(wrapped):
        return {"model": FSDPState(wrapped, opts)}
    state: dict[str, Any] = {"model": pl_module}
    for i, opt in enumerate(opts):
        state["optimizer" if len(opts) == 1 else f"optimizer_{i}"] = opt
    return state


def between_micro_batches(trainer: Any) -> bool:
    """True while a DeepSpeed engine is inside an accumulation cycle: Lightning hands accumulation to
    DeepSpeed, calls its ``step()`` at every micro-batch and counts each in ``global_step``, but the
    optimizer steps only at the cycle's last one."""
    engine = getattr(trainer.strategy, "model", None)
    if engine is None or adapter_for(engine) is None:
        return False
    return bool(engine.micro_steps % max(1, engine.gradient_accumulation_steps()))
