"""A DeepSpeed engine in the state, saved completely and resumable at any world size.

Put the engine in the state as it is (``state = {"engine": engine, "data": loader}``);
:mod:`unbroken.checkpoint.adapting` sees it through :class:`DeepSpeedState`. What is saved:

- ZeRO stages 1, 2 and 3 (and the bf16 optimizer): the fp32 master weights and every
  per-element optimizer state (Adam's moments, ...) **per parameter**: for each parameter,
  a one-dimensional tensor of its ``numel`` elements, of which each rank writes the slice
  it owns (:class:`~unbroken.dist.flatshard.FlatShard`, through DCP). Loading gives every
  rank the elements of the slices it owns *now*, so another world size, or another ZeRO
  stage, resumes from the same checkpoint with no offline conversion (DeepSpeed needs its
  "universal checkpoint" step for that). The low-precision module weights are derived
  from the masters at load, as DeepSpeed does after every step; frozen parameters are
  saved as they are (under ZeRO-3 as slices too), buffers once.
- The optimizer's per-group values (``step``, the hyperparameters as a scheduler left
  them), the LR scheduler, the loss scaler's numbers and the engine's step and sample
  counters.
- ZeRO stage 0 (no partitioning): the module's and the optimizer's own state dicts.

A save between the micro-batches of one optimizer step is refused: call ``ckpt.step()``
after the last ``engine.step()`` of an accumulation cycle. DeepSpeed's own data loader,
curriculum and data-efficiency states are not covered: feed the engine from an unbroken
:class:`~unbroken.data.ResumableLoader`. Offloading parameters or optimizer states to NVMe
is refused (the partitions are not in memory).
"""

from __future__ import annotations

from typing import Any, Iterator

import torch

from .flatshard import FlatShard
from ..errors import StateMismatchError, UnsupportedStateError
from ..state.adapters import Adapter

FORMAT = 1
COUNTERS = ("global_steps", "global_samples", "micro_steps", "skipped_steps")
SCALAR_TYPES = (int, float, bool)


def _dist() -> Any:
    from deepspeed import comm

    return comm


class DeepSpeedState(Adapter):
    """The training state of a ``deepspeed.DeepSpeedEngine`` (see the module docstring)."""

    @property
    def engine(self) -> Any:
        return self.target

    # ------------------------------------------------------------------ layout
    def _mode(self) -> str:
        """``zero3`` (partitioned weights), ``hp`` (ZeRO 1/2, bf16: partitioned masters) or ``plain``."""
        if self.engine.zero_optimization_partition_weights():
            return "zero3"
        trainable = [p for p in self.engine.module.parameters() if p.requires_grad]
        if trainable and all(hasattr(p, "_hp_mapping") for p in trainable):
            return "hp"
        return "plain"

    def _inner(self) -> torch.optim.Optimizer:
        return self.engine.optimizer.optimizer

    def _params(self) -> Iterator[tuple[str, Any]]:  # (DeepSpeed's parameters carry ds_* attributes)
        seen: set[int] = set()
        for name, p in self.engine.module.named_parameters():
            if id(p) not in seen:  # a tied weight once
                seen.add(id(p))
                yield name, p

    def _flats(self) -> list[tuple[int, torch.Tensor]]:
        """(parameter group, flat fp32 partition) for each partition the optimizer steps. ZeRO-3 hands
        its sub-groups to the optimizer one at a time, leaving the groups' ``params`` empty between steps."""
        opt = self.engine.optimizer
        if self._mode() == "zero3":
            return [(opt.sub_group_to_group_id[j], flat) for j, flat in enumerate(opt.fp32_partitioned_groups_flat)]
        return [(i, flat) for i, g in enumerate(self._inner().param_groups) for flat in g["params"]]

    def _element_keys(self) -> list[str]:
        """The optimizer's per-element states (``exp_avg``, ...): those shaped like the flat partition."""
        inner = self._inner()
        for _, flat in self._flats():
            st = inner.state.get(flat)
            if st:
                return sorted(k for k, v in st.items() if torch.is_tensor(v) and v.shape == flat.shape)
        return []

    def _init_optimizer_state(self) -> None:
        """Create the optimizer's state as its first step would, without changing a weight: one step
        with zero gradients at a learning rate of 0 (the state is overwritten by the load)."""
        inner, flats = self._inner(), self._flats()
        params = [g["params"] for g in inner.param_groups]
        lrs = [g.get("lr") for g in inner.param_groups]
        grads = [flat.grad for _, flat in flats]
        try:
            for g in inner.param_groups:
                g["params"] = []
                if "lr" in g:
                    g["lr"] = torch.tensor(0.0) if torch.is_tensor(g["lr"]) else 0.0
            for i, flat in flats:
                inner.param_groups[i]["params"].append(flat)
                flat.grad = torch.zeros_like(flat)
            inner.step()
        finally:
            for g, ps, lr in zip(inner.param_groups, params, lrs):
                g["params"] = ps
                if lr is not None:
                    g["lr"] = lr
            for (_, flat), grad in zip(flats, grads):
                flat.grad = grad

    def _link_optimizer_state(self) -> None:
        """Point every parameter's ``_hp_mapping`` at its slice of the optimizer state (ZeRO 1/2, bf16).
        DeepSpeed links them once, right after the first parameter group's first step, so with several
        groups (the HF Trainer's decay / no-decay groups) the later groups' parameters stay linked to an
        empty state (DeepSpeed 0.19.8: ``get_optim_state_fragment`` raises ``exp_avg not found``)."""
        self.engine.optimizer._hp_optimizer_states_linked = False
        self.engine.optimizer._lazy_init_hp_params_optimizer_state()

    def _slice3(self, p: Any) -> tuple[int, int]:
        """(offset, length) of this rank's elements of a ZeRO-3 parameter (its partition, unpadded)."""
        size = p.ds_tensor.ds_numel if hasattr(p.ds_tensor, "ds_numel") else p.ds_tensor.numel()
        rank = _dist().get_rank(group=p.ds_process_group)
        offset = min(rank * size, p.ds_numel)
        return offset, max(0, min(size, p.ds_numel - offset))

    def _pieces(self, p: Any, mode: str, keys: list[str]) -> tuple[int, dict[str, torch.Tensor]]:
        """(offset, {"fp32" or an optimizer key: this rank's live elements}) of a trainable parameter."""
        if mode == "hp":
            m = p._hp_mapping
            if m is None:
                return 0, {k: torch.empty(0) for k in ("fp32", *keys)}
            out = {"fp32": m.hp_fragment}
            out.update({k: m.get_optim_state_fragment(k) for k in keys})
            return int(m.lp_fragment_address.start), out
        from deepspeed.utils import safe_get_local_fp32_param, safe_get_local_optimizer_state

        offset, n = self._slice3(p)
        out = {"fp32": safe_get_local_fp32_param(p).narrow(0, 0, n)}
        out.update({k: safe_get_local_optimizer_state(p, k).narrow(0, 0, n) for k in keys})
        return offset, out

    def _caller_boundary(self) -> bool | None:
        """The boundary flag of a caller that sets it itself (accelerate, hence the HF Trainer: one
        ``engine.step()`` per optimizer step, so ``micro_steps`` counts optimizer steps), or ``None``
        when DeepSpeed counts the micro-batches (``engine.step()`` after every one)."""
        flag = getattr(self.engine, "_is_gradient_accumulation_boundary", None)
        return None if flag is None else bool(flag)

    def _refuse_unsupported(self) -> None:
        e = self.engine
        boundary = self._caller_boundary()
        if boundary is False or (boundary is None and e.micro_steps % max(1, e.gradient_accumulation_steps())):
            raise UnsupportedStateError(
                f"the DeepSpeed engine is between the micro-batches of an optimizer step (micro step {e.micro_steps}, "
                f"{e.gradient_accumulation_steps()} per step): call ckpt.step() after the last engine.step() of "
                "an accumulation cycle")
        opt = e.optimizer
        if getattr(opt, "swap_optimizer", False) or getattr(opt, "params_in_nvme_and_cpu", False):
            raise UnsupportedStateError("a DeepSpeed engine offloading to NVMe is not supported: its partitions are "
                                        "not in memory")

    # -------------------------------------------------------------------- save
    def state_dict(self) -> dict[str, Any]:
        self._refuse_unsupported()
        e, mode = self.engine, self._mode()
        out: dict[str, Any] = {"format": FORMAT, "mode": mode, "stage": int(e.zero_optimization_stage()),
                               "world_size": int(e.dp_world_size),
                               "counters": {c: int(getattr(e, c)) for c in COUNTERS},
                               "accumulation": int(e.gradient_accumulation_steps()),
                               "caller_boundary": self._caller_boundary() is not None,
                               "scheduler": e.lr_scheduler.state_dict() if e.lr_scheduler is not None else None,
                               "loss_scaler": _scaler_numbers(getattr(e.optimizer, "loss_scaler", None))}
        if mode == "plain":
            out["module"] = e.module.state_dict()
            out["optimizer"] = e.optimizer.state_dict() if e.optimizer is not None else None
            return out
        keys = self._element_keys()
        if mode == "hp" and keys:
            self._link_optimizer_state()
        shapes: dict[str, Any] = {}
        master: dict[str, FlatShard] = {}
        state: dict[str, dict[str, FlatShard]] = {k: {} for k in keys}
        frozen: dict[str, FlatShard | torch.Tensor] = {}
        for name, p in self._params():
            numel = int(p.ds_numel if mode == "zero3" else p.numel())
            shapes[name] = {"shape": list(p.ds_shape if mode == "zero3" else p.shape),
                            "dtype": str(p.dtype).removeprefix("torch."), "trainable": p.requires_grad}
            if not p.requires_grad:
                if mode == "zero3":
                    offset, n = self._slice3(p)
                    frozen[name] = FlatShard(p.ds_tensor.narrow(0, 0, n), offset, numel)
                else:
                    frozen[name] = p.detach()
                continue
            offset, pieces = self._pieces(p, mode, keys)
            master[name] = FlatShard(pieces["fp32"], offset, numel)
            for k in keys:
                state[k][name] = FlatShard(pieces[k], offset, numel)
        inner, flats = self._inner(), self._flats()
        groups = []
        for i, g in enumerate(inner.param_groups):
            first: dict[str, Any] = next((inner.state[f] for gi, f in flats if gi == i and inner.state.get(f)), {})
            groups.append({"hyper": {k: v for k, v in g.items() if k != "params"},
                           "scalars": {k: v for k, v in first.items() if k not in keys}})
        out.update(params=shapes, master=master, optimizer_state=state, groups=groups, frozen=frozen,
                   buffers=_buffers(e.module))
        return out

    # -------------------------------------------------------------------- load
    def check(self, saved: Any) -> None:
        if not isinstance(saved, dict) or saved.get("format") != FORMAT:
            raise StateMismatchError("the checkpoint's DeepSpeed engine state is not in a format this unbroken reads")
        mode = self._mode()
        if (saved.get("mode") == "plain") != (mode == "plain"):
            raise StateMismatchError(
                f"the checkpoint was saved from a DeepSpeed engine with ZeRO stage {saved.get('stage')}, the engine "
                f"now has stage {self.engine.zero_optimization_stage()}: stage 0 and stages 1-3 do not share a layout")
        if mode == "plain":
            return
        live = {n: int(p.ds_numel if mode == "zero3" else p.numel()) for n, p in self._params()}
        want = {n: _numel(v["shape"]) for n, v in saved["params"].items()}
        if live != want:
            diff = sorted(set(live) ^ set(want)) or sorted(n for n in live if live[n] != want[n])
            raise StateMismatchError(f"the DeepSpeed engine's parameters differ from the checkpoint's "
                                     f"(first: {diff[0]!r}); load a checkpoint of this model")
        trainable = {n for n, p in self._params() if p.requires_grad}
        if trainable != set(saved["master"]):
            raise StateMismatchError("the DeepSpeed engine trains other parameters than the checkpoint's "
                                     f"({sorted(trainable ^ set(saved['master']))[:3]})")
        live_keys = self._element_keys()
        if live_keys and live_keys != sorted(saved["optimizer_state"]):
            raise StateMismatchError(f"the optimizer keeps {live_keys}, the checkpoint {sorted(saved['optimizer_state'])}:"
                                     " another optimizer")
        if len(self._inner().param_groups) != len(saved["groups"]):
            raise StateMismatchError(f"the optimizer has {len(self._inner().param_groups)} parameter groups, the "
                                     f"checkpoint {len(saved['groups'])}")

    def prepare_load(self, saved: Any) -> None:
        """Give a fresh engine optimizer state to load into (torch optimizers create it at the
        first step), and under ZeRO-3 release gathered parameters first (as DeepSpeed does)."""
        self.check(saved)
        mode = self._mode()
        if mode == "zero3":
            self.engine.optimizer.checkpoint_event_prologue()
        if mode != "plain" and saved["optimizer_state"] and not self._element_keys():
            self._init_optimizer_state()
            if mode == "hp":
                self._link_optimizer_state()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        e, mode, sd = self.engine, self._mode(), state_dict
        self.prepare_load(sd)  # checks; again, harmless, when the restore called it before loading the pieces
        if mode == "plain":
            e.module.load_state_dict(sd["module"])
            if sd["optimizer"] is not None:
                e.optimizer.load_state_dict(sd["optimizer"])
        else:
            self._load_partitions(sd, mode)
        for c in COUNTERS:
            setattr(e, c, int(sd["counters"][c]))
        # micro-batches per rank: at another world size, another number per optimizer step (unless the
        # caller sets the boundary: then micro_steps counts optimizer steps, on any world size)
        if not sd.get("caller_boundary"):
            e.micro_steps = int(sd["counters"]["micro_steps"]) // max(1, int(sd["accumulation"])) * \
                e.gradient_accumulation_steps()
        if e.lr_scheduler is not None and sd["scheduler"] is not None:
            e.lr_scheduler.load_state_dict(sd["scheduler"])
        scaler = getattr(e.optimizer, "loss_scaler", None)
        for k, v in (sd["loss_scaler"] or {}).items():
            if scaler is not None and isinstance(getattr(scaler, k, None), SCALAR_TYPES):
                setattr(scaler, k, v)

    def _load_partitions(self, sd: dict[str, Any], mode: str) -> None:
        keys = sorted(sd["optimizer_state"])
        params = dict(self._params())
        with torch.no_grad():
            for name in sd["master"]:
                p = params[name]
                offset, pieces = self._pieces(p, mode, keys)
                for k, live in pieces.items():
                    src = sd["master"][name] if k == "fp32" else sd["optimizer_state"][k][name]
                    _copy_piece(live, src, offset)
                if mode == "zero3":
                    _set3(p, pieces, keys)
            for name, src in sd["frozen"].items():
                p = params[name]
                if mode == "zero3":
                    offset, n = self._slice3(p)
                    _copy_piece(p.ds_tensor.narrow(0, 0, n), src, offset)
                else:
                    p.copy_(src.local.view(p.shape) if isinstance(src, FlatShard) else src.view(p.shape))
            live_buffers = _buffers(self.engine.module)
            for name, t in sd["buffers"].items():
                if name in live_buffers:
                    live_buffers[name].copy_(t)
        inner = self._inner()
        for g, saved in zip(inner.param_groups, sd["groups"]):
            g.update({k: v for k, v in saved["hyper"].items() if k != "params"})
        for i, flat in self._flats():
            st = inner.state.setdefault(flat, {})
            for k, v in sd["groups"][i]["scalars"].items():
                st[k] = v.clone() if torch.is_tensor(v) else v
        self._refresh_weights(mode)

    def _refresh_weights(self, mode: str) -> None:
        """The module's (low-precision) weights from the masters, as DeepSpeed does after a step."""
        opt = self.engine.optimizer
        if mode == "hp":
            opt.update_lp_params()
            return
        with torch.no_grad():
            for i, fp32 in enumerate(opt.fp32_partitioned_groups_flat):
                lp = opt.fp16_partitioned_groups_flat[i]
                if lp is None:
                    raise UnsupportedStateError("ZeRO-3 parameters offloaded out of memory are not supported")
                if fp32.numel():
                    lp.copy_(fp32)
                for part, q in zip(opt.fp16_partitioned_groups[i], opt.unflatten(lp, opt.fp16_partitioned_groups[i])):
                    part.data = q.data
        opt.checkpoint_event_epilogue()


def _copy_piece(live: torch.Tensor, src: Any, offset: int) -> None:
    """Copy this rank's elements from ``src``: the live piece itself (DCP loaded into it: nothing
    to do), a loaded piece, or the full flat tensor (no DCP pairing: one process)."""
    if isinstance(src, FlatShard):
        if src.offset != offset or src.local.numel() != live.numel():
            raise StateMismatchError(f"a DeepSpeed piece at {src.offset} of {src.local.numel()} elements does not fit "
                                     f"this rank's ({offset}, {live.numel()})")
        src = src.local
    else:
        src = src.reshape(-1).narrow(0, offset, live.numel())
    if live.numel() and src.data_ptr() != live.data_ptr():
        live.copy_(src)


def _set3(p: torch.nn.Parameter, pieces: dict[str, torch.Tensor], keys: list[str]) -> None:
    """Write ZeRO-3 pieces back through DeepSpeed's API (they may be copies when offloaded)."""
    from deepspeed.utils import (safe_get_local_fp32_param, safe_get_local_optimizer_state,
                                 safe_set_local_fp32_param, safe_set_local_optimizer_state)

    full = safe_get_local_fp32_param(p)
    if full.data_ptr() != pieces["fp32"].data_ptr():
        full[:pieces["fp32"].numel()] = pieces["fp32"]
        safe_set_local_fp32_param(p, full)
    for k in keys:
        full = safe_get_local_optimizer_state(p, k)
        if full.data_ptr() != pieces[k].data_ptr():
            full[:pieces[k].numel()] = pieces[k]
            safe_set_local_optimizer_state(p, full, k)


def _buffers(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The persistent buffers of ``module`` (replicated under every ZeRO stage)."""
    out = {}
    for prefix, m in module.named_modules():
        for name, b in m._buffers.items():
            if b is not None and name not in m._non_persistent_buffers_set:
                out[f"{prefix}.{name}" if prefix else name] = b
    return out


def _scaler_numbers(scaler: Any) -> dict[str, Any] | None:
    if scaler is None:
        return None
    return {k: v for k, v in vars(scaler).items() if type(v) in SCALAR_TYPES}


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n
