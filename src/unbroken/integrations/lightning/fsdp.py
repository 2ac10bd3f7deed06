"""FSDP1 (``FullyShardedDataParallel``, Lightning's ``FSDPStrategy``): the model and optimizer state, sharded.

FSDP1 keeps each rank's share of flattened parameters; the module's own ``state_dict()`` on a rank is
not the model. ``torch.distributed.checkpoint.state_dict.get_state_dict`` gives the sharded view
(``full_state_dict=False``): every parameter and every per-element optimizer state as a
``ShardedTensor`` whose local shard on a rank is a range of rows (``torch.chunk`` along dimension 0).
A range of rows of a contiguous tensor is a range of its flattened elements, so each local shard is
saved as a :class:`~unbroken.dist.flatshard.FlatShard` piece through DCP: each rank writes its rows,
nothing is gathered, and at load every rank receives the elements of *its* rows, whatever world size
wrote them (``set_state_dict`` then puts them into FSDP's flat parameters). Tensors that are not
sharded (buffers, ``step`` counters, and every tensor on one rank, where FSDP does not shard) are
whole pieces of the same kind, so a checkpoint of 2 ranks loads on 1 and back. Hyperparameters are
saved as they are.

An optimizer that has not stepped has no state; ``get_state_dict`` would create it with a step at a
learning rate of 0 (which counts as Adam's first step), so a fresh optimizer is saved without
state and given one only when a checkpoint is loaded into it (:meth:`FSDPState.prepare_load`).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ...dist.flatshard import FlatShard
from ...errors import StateMismatchError, UnsupportedStateError
from ...state.adapters import Adapter

FORMAT = 1


def is_fsdp1(module: Any) -> bool:
    """``module`` is or contains an FSDP1 ``FullyShardedDataParallel`` unit."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # a torch without distributed
        return False
    return isinstance(module, torch.nn.Module) and any(isinstance(m, FullyShardedDataParallel)
                                                       for m in module.modules())


def _options() -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=False)


def _piece(t: Any) -> Any:
    """A tensor as this rank's :class:`FlatShard` of it: a ``ShardedTensor``'s rows, or all of a plain tensor (a
    buffer, a ``step`` counter, every tensor when FSDP runs unsharded on one rank); anything else unchanged."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    if type(t) in (torch.Tensor, torch.nn.Parameter) and t.is_contiguous():
        return FlatShard(t.detach().view(-1), 0, t.numel())
    if not isinstance(t, ShardedTensor):
        return t
    size = tuple(t.size())
    numel = math.prod(size)
    shards = t.local_shards()
    if not shards:
        return FlatShard(torch.empty(0, dtype=t.metadata().tensor_properties.dtype), 0, numel)
    if len(shards) > 1:
        raise UnsupportedStateError(f"an FSDP state tensor has {len(shards)} shards on one rank; unbroken reads one")
    local, meta = shards[0].tensor, shards[0].metadata
    offsets, sizes = list(meta.shard_offsets), list(meta.shard_sizes)
    if any(offsets[1:]) or tuple(sizes[1:]) != size[1:] or not local.is_contiguous():
        raise UnsupportedStateError(f"an FSDP state tensor is sharded other than by rows ({offsets}, {sizes} of "
                                    f"{list(size)}); unbroken reads FSDP1's row shards")
    row = math.prod(size[1:])
    return FlatShard(local.view(-1), offsets[0] * row, numel)


def _pieces(tree: dict[str, Any]) -> dict[str, Any]:
    return {k: _pieces(v) if isinstance(v, dict) else _piece(v) for k, v in tree.items()}


def _copy_into(live: Any, saved: Any, where: str) -> None:
    """Put ``saved`` (a loaded piece, or a full tensor at one process) into the live ``FlatShard``/tensor."""
    with torch.no_grad():
        if isinstance(live, FlatShard):
            if isinstance(saved, FlatShard):
                if (saved.offset, saved.local.numel()) != (live.offset, live.local.numel()):
                    raise StateMismatchError(f"{where}: a saved piece does not fit this rank's rows")
                src = saved.local
            else:
                src = saved.reshape(-1).narrow(0, live.offset, live.local.numel())
            if live.local.numel() and src.data_ptr() != live.local.data_ptr():
                live.local.copy_(src)
        elif isinstance(live, torch.Tensor) and isinstance(saved, torch.Tensor):
            if saved.data_ptr() != live.data_ptr():
                live.copy_(saved.reshape(live.shape))


class FSDPState(Adapter):
    """The model and optimizers of an FSDP1 root module, sharded (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, optimizers: list[torch.optim.Optimizer]) -> None:
        super().__init__(model)
        self.optimizers = list(optimizers)
        self._live: tuple[dict[str, Any], dict[str, Any] | None] | None = None

    def _torch_state(self) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """``get_state_dict``'s sharded dicts (a collective); no optimizer state while one has none."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        if self.optimizers and all(opt.state for opt in self.optimizers):
            msd, osd = get_state_dict(self.target, self.optimizers, options=_options())
        else:
            msd, osd = get_model_state_dict(self.target, options=_options()), None
        self._live = (msd, osd)
        return msd, osd

    def state_dict(self) -> dict[str, Any]:
        msd, osd = self._torch_state()
        out: dict[str, Any] = {"format": FORMAT, "model": _pieces(msd), "optimizer": None}
        if osd is not None:
            out["optimizer"] = {"state": _pieces(osd["state"]), "param_groups": osd["param_groups"]}
        return out

    def check(self, saved: Any) -> None:
        if not isinstance(saved, dict) or saved.get("format") != FORMAT or "model" not in saved:
            raise StateMismatchError("the checkpoint's FSDP state is not in a format this unbroken reads (was it "
                                     "saved under another strategy? DDP, FSDP1 and FSDP2 checkpoints do not mix)")
        msd, _ = self._live if self._live is not None else self._torch_state()
        if set(msd) != set(saved["model"]):
            diff = sorted(set(msd) ^ set(saved["model"]))
            raise StateMismatchError(f"the FSDP model's state differs from the checkpoint's (first: {diff[0]!r}); "
                                     "load a checkpoint of this model")
        groups = saved["optimizer"]["param_groups"] if saved.get("optimizer") else None
        if groups is not None and len(groups) != sum(len(o.param_groups) for o in self.optimizers):
            raise StateMismatchError("the optimizers have other parameter groups than the checkpoint's")

    def prepare_load(self, saved: Any) -> None:
        """Give a fresh optimizer a state to load into (overwritten by the load)."""
        self.check(saved)
        if saved.get("optimizer") and not all(opt.state for opt in self.optimizers):
            from torch.distributed.checkpoint.state_dict import _init_optim_state

            for opt in self.optimizers:
                _init_optim_state(opt)
            self._live = None  # the next state_dict() has the optimizer state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

        sd = state_dict
        self.prepare_load(sd)
        msd, osd = self._live if self._live is not None and (self._live[1] is not None or not sd["optimizer"]) \
            else self._torch_state()
        for name, live in _pieces(msd).items():
            _copy_into(live, sd["model"][name], f"model {name}")
        if sd["optimizer"] is None or osd is None:
            set_model_state_dict(self.target, msd, options=_options())
            return
        live_state = _pieces(osd["state"])
        for name, st in sd["optimizer"]["state"].items():
            if name not in live_state:
                raise StateMismatchError(f"the optimizer has no state for {name!r}, the checkpoint has")
            for key, value in st.items():
                if isinstance(live_state[name].get(key), (FlatShard, torch.Tensor)) and \
                        isinstance(value, (FlatShard, torch.Tensor)):
                    _copy_into(live_state[name][key], value, f"optimizer {name} {key}")
                else:
                    osd["state"][name][key] = value
        osd["param_groups"] = sd["optimizer"]["param_groups"]
        set_state_dict(self.target, self.optimizers, model_state_dict=msd, optim_state_dict=osd, options=_options())
