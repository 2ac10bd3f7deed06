"""What ``accelerator.prepare`` registered, as an unbroken state — and what is refused, with the fix.

:func:`collect` reads the Accelerator's registries (prepared models, optimizers, schedulers and
dataloaders, ``register_for_checkpointing`` objects, the ``GradScaler``) and names each part:
``model``, ``optimizer``, ``scheduler``, ``data`` (a suffix ``_1``, ``_2``, ... for the second and
later ones), ``custom_<i>``, ``scaler``, and ``accelerator`` (:class:`AcceleratorCounters`). The
objects are the live ones (unwrapped where Accelerate wraps), so a restore loads into them in place.
Everything that would make a resume inexact is found here, before anything is restored, and
raised as one :class:`unbroken.UnsupportedStateError` listing every problem.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType

from unbroken import UnsupportedStateError

from .loader import ResumableLoader

_REFUSED = {
    DistributedType.DEEPSPEED: "DeepSpeed through Accelerate is not supported by this integration: put the engine in "
                               "a plain unbroken state instead (state = {'engine': engine, 'data': loader}, see the "
                               "DeepSpeed section of docs/integrations.md)",
    DistributedType.MEGATRON_LM: "Megatron-LM through Accelerate is not supported "
                                 "(its checkpointing is Megatron's own)",
    DistributedType.XLA: "XLA/TPU is not supported by this integration",
}


class AcceleratorCounters:
    """``Stateful`` view of the Accelerator's own counters: ``accelerator.step`` (the position in the
    gradient-accumulation window, which decides the micro-batch that steps the optimizer) and
    ``save_iteration`` (``ProjectConfiguration.iteration``, the number of Accelerate's own
    ``save_state`` folders with automatic naming)."""

    def __init__(self, accelerator: Accelerator) -> None:
        self.accelerator = accelerator

    def state_dict(self) -> dict[str, int]:
        a = self.accelerator
        return {"step": int(a.step), "iteration": int(a.project_configuration.iteration)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.accelerator.step = int(state["step"])
        self.accelerator.project_configuration.iteration = int(state["iteration"])


def _name(kind: str, i: int) -> str:
    return kind if i == 0 else f"{kind}_{i}"


def check_setup(accelerator: Accelerator) -> None:
    """Refuse what this integration cannot resume exactly (before anything is restored)."""
    kind = accelerator.distributed_type
    if kind in _REFUSED:
        raise UnsupportedStateError(_REFUSED[kind])
    if kind == DistributedType.FSDP and not getattr(accelerator, "is_fsdp2", False):
        raise UnsupportedStateError(
            "FSDP1 is not supported (its flat parameters' optimizer state needs FSDP1's own state-dict calls): use "
            "FSDP2, FullyShardedDataParallelPlugin(fsdp_version=2) or `accelerate launch --fsdp_version 2`")
    pc = getattr(accelerator, "parallelism_config", None)
    if pc is not None and (getattr(pc, "tp_enabled", False) or getattr(pc, "cp_enabled", False)):
        raise UnsupportedStateError("tensor or context parallelism (parallelism_config tp/cp size > 1) is not "
                                    "supported: the data would be split over the wrong ranks")
    if not accelerator._models and not accelerator._optimizers:
        raise UnsupportedStateError("nothing is prepared yet: create the Checkpointer after "
                                    "`model, optimizer, ... = accelerator.prepare(...)`")


def _loader_problem(dl: Any, i: int, accelerator: Accelerator) -> str | None:
    if isinstance(dl, ResumableLoader):
        if accelerator.split_batches:
            return ("split_batches=True is not supported with a ResumableLoader (its batch_size is per process): "
                    "pass batch_size = global batch / num_processes and leave split_batches off")
        if (dl.rank, dl.world_size) != (accelerator.process_index, accelerator.num_processes):
            return (f"ResumableLoader #{i} takes rank {dl.rank} of {dl.world_size}, but this is process "
                    f"{accelerator.process_index} of {accelerator.num_processes}: create it after the Accelerator")
        return None
    batches = getattr(dl, "batch_sampler", None) or getattr(dl, "sampler", None)
    batches = getattr(batches, "batch_sampler", batches)  # the user's BatchSampler inside a BatchSamplerShard
    sampler = getattr(batches, "sampler", None)
    shuffled = sampler is not None and not isinstance(sampler, torch.utils.data.SequentialSampler)
    batch = getattr(batches, "batch_size", None) or getattr(dl, "batch_size", None) or "B"
    return (f"accelerator.prepare registered DataLoader #{i} ({type(dl).__name__}, batch_size={batch}"
            f"{', shuffled' if shuffled else ''}); its position in the epoch cannot be saved, so a resume would "
            f"replay or skip batches. Training data: unbroken.integrations.accelerate.ResumableLoader(dataset, "
            f"batch_size={batch}{', shuffle=True' if shuffled else ''}, seed=..., collate_fn=...), passed to "
            "accelerator.prepare as before. An evaluation "
            "loader, iterated whole every time: Checkpointer(accelerator, ..., eval_loaders=[that_loader]).")


def collect(accelerator: Accelerator, eval_loaders: Iterable[Any] = ()) -> dict[str, Any]:
    """The unbroken state of everything ``accelerator.prepare`` registered (see the module docstring)."""
    check_setup(accelerator)
    eval_loaders = list(eval_loaders)
    skip = {id(dl) for dl in eval_loaders}
    problems: list[str] = []
    state: dict[str, Any] = {}
    for i, model in enumerate(accelerator._models):
        module = accelerator.unwrap_model(model)  # no DDP wrapper: the same names on any number of processes
        state[_name("model", i)] = getattr(module, "_orig_mod", module)  # nor torch.compile's
    for i, opt in enumerate(accelerator._optimizers):
        inner = getattr(opt, "optimizer", opt)  # the torch optimizer inside AcceleratedOptimizer
        state[_name("optimizer", i)] = inner
    for i, sched in enumerate(accelerator._schedulers):
        state[_name("scheduler", i)] = getattr(sched, "scheduler", sched)  # inside AcceleratedScheduler
    loaders = [dl for dl in accelerator._dataloaders if id(dl) not in skip]
    for i, dl in enumerate(loaders):
        problem = _loader_problem(dl, i, accelerator)
        if problem:
            problems.append(problem)
    for i, dl in enumerate(dl for dl in loaders if isinstance(dl, ResumableLoader)):
        state[_name("data", i)] = dl
    for i, obj in enumerate(accelerator._custom_objects):
        state[f"custom_{i}"] = obj
    if accelerator.scaler is not None:
        state["scaler"] = accelerator.scaler
    state["accelerator"] = AcceleratorCounters(accelerator)
    unknown = [dl for dl in eval_loaders if not any(dl is d for d in accelerator._dataloaders)]
    if unknown:
        problems.append(f"eval_loaders names {len(unknown)} loader(s) that accelerator.prepare did not register")
    if problems:
        raise UnsupportedStateError(problems[0] if len(problems) == 1 else
                                    f"{len(problems)} problems:\n- " + "\n- ".join(problems))
    return state
