"""What a ``transformers.Trainer`` carries from step to step, as ``Stateful`` objects.

:class:`TrainerCounters` is the same on every rank (saved once); :class:`RankCounters` is what each
rank accumulates on its own between two logging steps (saved per rank, in ``unbroken.PerRank``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

import torch
from transformers import Trainer
from transformers.trainer_callback import ExportableState

log = logging.getLogger("unbroken")
MODEL_CONFIG = "model_config"
"""The key of the model's config in the saved state (``unbroken export --format hf`` reads it)."""


class TrainerCounters:
    """``Stateful`` view of what the Trainer itself carries from step to step.

    ``TrainerState``'s progress (``global_step``, ``epoch``, ``total_flos``,
    ``num_input_tokens_seen``, ``log_history``, best metric / step / checkpoint), the loss
    totals behind the logged ``loss`` and the final ``train_loss`` (the Trainer's
    ``_total_loss_scalar``, ``_globalstep_last_logged``; each rank's own accumulators are
    :class:`RankCounters`), the ``TrainerControl`` flags and the attributes of ``ExportableState``
    callbacks; with TRL's trainers also their token count and the metric values awaiting the next
    log (``_total_train_tokens``, ``_metrics``). All of it is the same on every rank (the Trainer
    gathers what it logs). The configuration-derived fields (``max_steps``, ``logging_steps``, ...) are not restored:
    they come from this run's arguments. ``model_config`` (the model's HF config as JSON, for
    ``unbroken export --format hf``) is saved, never restored: the model comes from this run's code.
    """

    _STATE = ("global_step", "epoch", "total_flos", "num_input_tokens_seen", "log_history", "best_metric",
              "best_global_step", "best_model_checkpoint")
    _TRAINER = (("total_loss_scalar", "_total_loss_scalar"), ("globalstep_last_logged", "_globalstep_last_logged"),
                ("trl_total_train_tokens", "_total_train_tokens"))  # TRL's SFTTrainer: the logged num_tokens

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    def _callbacks(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        seen: dict[Any, Any] = {}
        for cb in self.trainer.callback_handler.callbacks:
            if isinstance(cb, ExportableState):
                name = type(cb).__name__
                seen[name] = seen.get(name, -1) + 1
                out[f"{name}.{seen[name]}"] = cb
        return out

    def state_dict(self) -> dict[str, Any]:
        t, s = self.trainer, self.trainer.state
        out: dict[str, Any] = {k: getattr(s, k) for k in self._STATE}
        out.update({k: getattr(t, attr) for k, attr in self._TRAINER if hasattr(t, attr)})
        out["control"] = dict(t.control.state()["args"])
        metrics = _trl_metrics(t)
        if metrics is not None:
            out["trl_metrics"] = {mode: {k: list(v) for k, v in values.items()} for mode, values in metrics.items()}
        out["callbacks"] = {k: dict(cb.state().get("attributes", {})) for k, cb in self._callbacks().items()}
        config: Any = getattr(t.model, "config", None)
        if hasattr(config, "to_json_string"):  # what save_pretrained writes as config.json (all fields)
            out[MODEL_CONFIG] = {"architectures": [type(t.model).__name__],
                                 **{k: v for k, v in json.loads(config.to_json_string(use_diff=False)).items()
                                    if v is not None or k != "architectures"}}
        return out

    def load_state_dict(self, saved: Mapping[str, Any]) -> None:
        t, s = self.trainer, self.trainer.state
        for k in self._STATE:
            if k == "log_history":
                s.log_history[:] = list(saved[k])
            elif k in saved:
                setattr(s, k, saved[k])
        _set_attributes(t, self._TRAINER, saved)
        for flag, value in saved.get("control", {}).items():
            setattr(t.control, flag, value)
        metrics = _trl_metrics(t)
        if metrics is not None and "trl_metrics" in saved:
            for mode, values in saved["trl_metrics"].items():
                live = metrics.setdefault(mode, {})
                live.clear()  # the live mapping keeps its type (TRL's defaultdict(list))
                live.update({k: list(v) for k, v in values.items()})
        live_cbs = self._callbacks()
        for k, attrs in saved.get("callbacks", {}).items():
            if k in live_cbs:
                for name, value in attrs.items():
                    setattr(live_cbs[k], name, value)
            else:
                log.warning("the checkpoint has the state of callback %s, which this Trainer does not have", k)


class RankCounters:
    """``Stateful`` view of what one rank accumulates between two logging steps: the Trainer's
    ``_tr_loss`` (this rank's summed losses, gathered over the ranks and averaged only when the
    Trainer logs) and ``current_flos`` (summed over the ranks when the Trainer stores them).
    Saved per rank (``unbroken.PerRank``); with another world size each rank the checkpoint had
    gets its own back and a new rank starts from zero, so the first ``loss`` logged after such a
    resume averages what the kept ranks accumulated."""

    _TRAINER = (("tr_loss", "_tr_loss"), ("current_flos", "current_flos"))

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        t = self.trainer
        return {k: getattr(t, attr) for k, attr in self._TRAINER if hasattr(t, attr)}

    def load_state_dict(self, saved: Mapping[str, Any]) -> None:
        _set_attributes(self.trainer, self._TRAINER, saved)


def _trl_metrics(trainer: Trainer) -> dict[str, Any] | None:
    """TRL's trainers keep the values averaged into each log (``entropy``, ``mean_token_accuracy``, ...)
    since the last logging step in ``_metrics`` (``{"train": {name: [values]}, "eval": ...}``), outside
    ``TrainerState``; ``None`` for a Trainer without them."""
    metrics = getattr(trainer, "_metrics", None)
    if isinstance(metrics, dict) and all(isinstance(v, dict) and all(isinstance(x, list) for x in v.values())
                                         for v in metrics.values()):
        return metrics
    return None


def _set_attributes(trainer: Trainer, names: tuple[tuple[str, str], ...], saved: Mapping[str, Any]) -> None:
    for k, attr in names:
        if k not in saved:
            continue
        live = getattr(trainer, attr, None)
        if isinstance(live, torch.Tensor):
            with torch.no_grad():
                live.copy_(saved[k])  # the same tensor object: the loop holds it
        else:
            setattr(trainer, attr, saved[k])
