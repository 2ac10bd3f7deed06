"""``unbroken import`` of a DeepSpeed ZeRO checkpoint folder (``engine.save_checkpoint(dir)``).

Such a folder (also what the HF Trainer writes with DeepSpeed) holds a ``latest`` file naming a
tag folder (``global_step6/``) with, per rank ``r`` of the data-parallel group,
``zero_pp_rank_{r}_mp_rank_00_optim_states.pt`` (``bf16_`` in front when bf16 is enabled: the
rank's flat fp32 partitions and its optimizer's state of them), and
``mp_rank_00_model_states.pt`` (ZeRO 1/2) or ``zero_pp_rank_{r}_mp_rank_00_model_states.pt``
(ZeRO-3: the module, parameter names and shapes, frozen parameters, buffers, the LR scheduler,
the step counters). Either the run folder or the tag folder can be given.

As DeepSpeed's ``zero_to_fp32.py`` does for the weights, every parameter is put back together
from the flat partitions of every rank: the fp32 master weights *and* every per-element
optimizer state (Adam's ``exp_avg``, ``exp_avg_sq``). The result is the state
:class:`unbroken.dist.deepspeed.DeepSpeedState` saves, with full one-dimensional tensors
in place of each rank's piece, under the key ``engine``: ``state = {"engine": engine, ...}`` and
``Checkpointer(run, strict=False).restore(state)`` resume it on any world size and any ZeRO stage
1-3. The checkpoint's step is DeepSpeed's ``global_steps``, its samples ``global_samples``. A
DeepSpeed checkpoint has no data position: a :class:`~unbroken.data.ResumableLoader` in the state
keeps its own (the start of the data, for a new one), and is saved from then on.

Every file is loaded by :func:`unbroken.convert.pickles.load_pickle` (``weights_only``): the
three DeepSpeed globals these pickles hold (the loss-scaler object, ZeRO's stage enum and, in
``param_slice_mappings``, ``fragment_address``) are read into inert stand-ins, so nothing of
DeepSpeed is imported or run (DeepSpeed need not be installed). Not supported: model (tensor)
parallelism (``mp_rank`` other than 00: refused), pipeline and MoE checkpoints, DeepSpeed's
separate bf16 optimizer (bf16 without ZeRO: refused); DeepSpeed's data sampler and random-LTD
states are left out (and listed).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..dist.deepspeed import FORMAT, SCALAR_TYPES
from ..errors import UnbrokenError
from .bounds import check_count
from .pickles import load_pickle

_OPTIM = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_TAG = re.compile(r"^[A-Za-z0-9_.\-]+$")


class Record:
    """An inert stand-in for a DeepSpeed object in a pickle (a loss scaler, a fragment address):
    only its attributes, set by the unpickler; no DeepSpeed code is imported or run."""

    def __repr__(self) -> str:
        return f"Record({vars(self)})"


def _enum_value(value: Any) -> Any:
    """Stand-in for an enum class called with its value (``ZeroStageEnum(2)``): the value."""
    return value


STAND_INS: dict[str, Callable[..., Any]] = {
    "deepspeed.runtime.zero.config.ZeroStageEnum": _enum_value,
    "deepspeed.runtime.fp16.loss_scaler.LossScaler": Record,
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler": Record,
    "deepspeed.utils.tensor_fragment.fragment_address": Record,
}


def is_deepspeed_folder(path: Path) -> bool:
    """A DeepSpeed checkpoint folder (with a ``latest`` file) or one of its tag folders."""
    return path.is_dir() and ((path / "latest").is_file() or any(_OPTIM.match(p.name) for p in path.iterdir()))


def tag_folder(path: Path) -> Path:
    """The tag folder of ``path``: the one ``latest`` names, or ``path`` itself."""
    latest = path / "latest"
    if not latest.is_file():
        return path
    tag = latest.read_text(errors="replace").strip()
    if not _TAG.match(tag) or tag in (".", ".."):
        raise UnbrokenError(f"{latest} names {tag[:80]!r}, not a tag folder name: fix it, or give the tag folder "
                            "(e.g. global_step6/) itself")
    if not (path / tag).is_dir():
        raise UnbrokenError(f"{latest} names the tag {tag!r}, but {path / tag} does not exist (a save that never "
                            "finished, or a deleted tag): give one of the tag folders that exist instead")
    return path / tag


def _load(path: Path, trust: bool) -> Any:
    return load_pickle(path, trust, stand_ins=STAND_INS)


def _get(obj: dict[str, Any], key: str, path: Path) -> Any:
    if not isinstance(obj, dict) or key not in obj:
        raise UnbrokenError(f"{path} has no {key!r}: not a DeepSpeed ZeRO checkpoint file this unbroken reads")
    return obj[key]


def _rank_files(folder: Path) -> list[Path]:
    """Every rank's optimizer file, in rank order; a clear error when one is missing."""
    found: dict[int, Path] = {}
    for p in folder.iterdir():
        m = _OPTIM.match(p.name)
        if m:
            if m.group(3) != "00":
                raise UnbrokenError(f"{p} belongs to model-parallel rank {m.group(3)}: checkpoints with model (tensor) "
                                    "parallelism are not supported by unbroken import")
            found[int(m.group(2))] = p
    if not found:
        raise UnbrokenError(f"{folder} has no zero_pp_rank_*_mp_rank_00_optim_states.pt: not a DeepSpeed ZeRO "
                            "checkpoint (stage 0 checkpoints keep a plain optimizer; load them with DeepSpeed)")
    ranks = sorted(found)  # (never a list as long as the largest rank named: a file may claim rank 10**9)
    if ranks[-1] + 1 != len(ranks):
        missing = next((i for i, r in enumerate(ranks) if i != r), len(ranks))
        raise UnbrokenError(f"{folder} lacks the optimizer file of rank {missing} (files of {len(ranks)} ranks, the "
                            f"highest {ranks[-1]}): the checkpoint is incomplete (a rank did not finish saving); "
                            "use another tag")
    return [found[r] for r in range(len(found))]


def read_deepspeed(path: Path, trust: bool) -> tuple[dict[str, Any], dict[str, int], list[str]]:
    """(state, progress, notes) of the DeepSpeed checkpoint at ``path`` (see the module docstring)."""
    folder = tag_folder(path)
    try:
        return _read(folder, trust)
    except UnbrokenError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, RuntimeError) as e:
        raise UnbrokenError(f"{folder} is not a DeepSpeed ZeRO checkpoint this unbroken can read ({type(e).__name__}: "
                            f"{e}); nothing was written") from None


def _read(folder: Path, trust: bool) -> tuple[dict[str, Any], dict[str, int], list[str]]:
    files = _rank_files(folder)
    optim = [_get(_load(f, trust), "optimizer_state_dict", f) for f in files]
    if "zero_stage" not in optim[0] and files[0].name.startswith("bf16_"):
        raise UnbrokenError(f"{files[0]} was written by DeepSpeed's bf16 optimizer (ZeRO stage 0 with bf16), which "
                            "unbroken import does not read yet; resume it with DeepSpeed, then save with unbroken")
    stage = int(_get(optim[0], "zero_stage", files[0]))
    world = _get(optim[0], "partition_count", files[0])
    world = max(world) if isinstance(world, (list, tuple)) else int(world)
    if world != len(files):
        raise UnbrokenError(f"{folder} has the optimizer files of {len(files)} ranks, but its checkpoint was written "
                            f"by {world} ranks: it is incomplete (or holds files of two saves); use another tag")
    if stage not in (1, 2, 3):
        raise UnbrokenError(f"{files[0]}: ZeRO stage {stage} is not one unbroken import reads (1, 2 or 3)")
    model_names = ([f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(world)] if stage == 3
                   else ["mp_rank_00_model_states.pt"])
    for name in model_names:
        if not (folder / name).is_file():
            raise UnbrokenError(f"{folder} lacks {name}: the checkpoint is incomplete (a rank did not finish "
                                "saving); use another tag")
    models = [_load(folder / n, trust) for n in model_names]
    m0 = models[0]
    shapes = _get(m0, "param_shapes", folder / model_names[0])
    if not isinstance(shapes, list) or not all(isinstance(g, dict) for g in shapes):
        raise UnbrokenError(f"{folder / model_names[0]}: its 'param_shapes' is not a list of groups of shapes")
    if stage == 3:
        master, moments, inner = _zero3(optim, shapes, files)
    else:
        master, moments, inner = _zero12(optim, shapes, world, files)
    module = _get(m0, "module", folder / model_names[0])
    buffer_names = set(m0.get("buffer_names") or [])
    frozen = _frozen(models, stage, world, shapes, buffer_names, m0.get("shared_params") or {})
    config = m0.get("ds_config") if isinstance(m0.get("ds_config"), dict) else {}
    params = _param_info(shapes, module, master, frozen, models[0], _lp_dtype(config))
    accumulation = config.get("gradient_accumulation_steps")
    accumulation = accumulation if isinstance(accumulation, int) and accumulation > 0 else 1
    steps = {c: check_count(m0.get(c), c, str(folder / model_names[0]))
             for c in ("global_steps", "global_samples", "skipped_steps")}
    state = {"format": FORMAT, "mode": "zero3" if stage == 3 else "hp", "stage": stage, "world_size": world,
             "counters": {**steps, "micro_steps": steps["global_steps"] * accumulation},
             "accumulation": accumulation, "caller_boundary": False, "scheduler": m0.get("lr_scheduler"),
             "loss_scaler": _scaler_numbers(optim[0].get("loss_scaler")),
             "params": params, "master": master, "optimizer_state": moments, "groups": inner, "frozen": frozen,
             "buffers": {n: t for n, t in module.items() if n in buffer_names and isinstance(t, torch.Tensor)}}
    notes = [f"the data position (a DeepSpeed checkpoint has none; {steps['global_samples']} samples were consumed)"]
    if m0.get("shared_params"):
        notes.append(f"tied parameters {sorted(m0['shared_params'])} are saved under the name they share")
    for key in ("data_sampler", "random_ltd"):
        if m0.get(key) is not None:
            notes.append(f"DeepSpeed's {key} state")
    progress = {"step": steps["global_steps"], "epoch": 0, "micro_step": 0, "samples": steps["global_samples"]}
    return {"engine": state}, progress, notes


def _param_info(shapes: list[dict[str, Any]], module: Any, master: dict[str, torch.Tensor],
                frozen: dict[str, torch.Tensor], model: dict[str, Any], lp: torch.dtype) -> dict[str, Any]:
    """Shape, dtype (the module's) and trainability of every parameter, as DeepSpeedState records them."""
    params: dict[str, Any] = {}
    for group in shapes:
        for name, shape in group.items():
            live = module.get(name) if isinstance(module, dict) else None
            dtype = live.dtype if isinstance(live, torch.Tensor) and live.numel() == master[name].numel() else lp
            params[name] = {"shape": [int(s) for s in shape], "dtype": _dtype_name(dtype), "trainable": True}
    for name, t in frozen.items():
        params[name] = {"shape": [int(s) for s in _frozen_shape(model, name, t)], "dtype": _dtype_name(t.dtype),
                        "trainable": False}
    return params


def _inner_state(osd: dict[str, Any], path: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(per flat partition its optimizer state, param groups) of a rank's inner (torch) optimizer."""
    sd = _get(osd, "optimizer_state_dict" if "optimizer_state_dict" in osd else "base_optimizer_state", path)
    if not isinstance(sd, dict) or "state" not in sd or "param_groups" not in sd:
        raise UnbrokenError(f"{path}: the optimizer state is not a torch optimizer state dict (an elastic ZeRO "
                            "checkpoint?); unbroken import reads the default (rigid) ZeRO checkpoints")
    ids = [i for g in sd["param_groups"] for i in g["params"]]
    return [sd["state"].get(i, {}) for i in ids], sd["param_groups"]


def _element_keys(states: list[dict[str, Any]], flats: list[torch.Tensor]) -> list[str]:
    for st, flat in zip(states, flats, strict=True):
        if st:
            return sorted(k for k, v in st.items()
                          if torch.is_tensor(v) and v.dim() == 1 and v.numel() >= flat.numel())
    return []


def _groups(states: list[dict[str, Any]], groups: list[dict[str, Any]], keys: list[str]) -> list[dict[str, Any]]:
    """``hyper`` and ``scalars`` (``step``) per param group, as DeepSpeedState saves them."""
    out, i = [], 0
    for g in groups:
        first = next((states[j] for j in range(i, i + len(g["params"])) if states[j]), {})
        i += len(g["params"])
        out.append({"hyper": {k: v for k, v in g.items() if k != "params"},
                    "scalars": {k: v for k, v in first.items() if k not in keys}})
    return out


def _zero12(optim: list[dict[str, Any]], shapes: list[dict[str, Any]], world: int,
            files: list[Path]) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]], list[Any]]:
    """ZeRO 1/2: per group, each rank holds a slice of one flat vector of the group's parameters."""
    flats = [_get(o, "single_partition_of_fp32_groups", f) for o, f in zip(optim, files, strict=True)]
    inner = [_inner_state(o, f) for o, f in zip(optim, files, strict=True)]
    keys = _element_keys(inner[0][0], flats[0])
    paddings = optim[0].get("param_alignment_paddings")
    master: dict[str, torch.Tensor] = {}
    moments: dict[str, dict[str, torch.Tensor]] = {k: {} for k in keys}
    if any(len(f) != len(shapes) for f in flats):
        raise UnbrokenError(f"{files[0].parent}: the ranks' fp32 groups do not match the {len(shapes)} parameter "
                            "groups")
    for gi, group in enumerate(shapes):
        vectors = {"fp32": torch.cat([f[gi] for f in flats])}
        for k in keys:
            vectors[k] = torch.cat([st[0][gi][k].reshape(-1)[:f[gi].numel()]
                                    for st, f in zip(inner, flats, strict=True)])
        offset = 0
        for pi, (name, shape) in enumerate(group.items()):
            n = math.prod(int(s) for s in shape)
            if offset + n > vectors["fp32"].numel():
                raise UnbrokenError(f"{files[0].parent}: parameter {name!r} lies past the end of group {gi}'s "
                                    "partitions: the files do not belong to one checkpoint")
            master[name] = vectors["fp32"].narrow(0, offset, n).clone()
            for k in keys:
                moments[k][name] = vectors[k].narrow(0, offset, n).clone()
            offset += n + (int(paddings[gi][pi]) if paddings is not None else 0)
        align = 2 * world
        if math.ceil(offset / align) != math.ceil(vectors["fp32"].numel() / align):
            raise UnbrokenError(f"{files[0].parent}: group {gi}'s parameters take {offset} elements, its partitions "
                                f"{vectors['fp32'].numel()}: the files do not belong to one checkpoint")
    return master, moments, _groups(inner[0][0], inner[0][1], keys)


def _zero3(optim: list[dict[str, Any]], shapes: list[dict[str, Any]],
           files: list[Path]) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]], list[Any]]:
    """ZeRO-3: each parameter is split in ``world`` equal (padded) pieces, rank ``r`` holding piece ``r``;
    a rank's pieces of every parameter follow each other through its flat sub-groups."""
    world = len(files)
    flats = [_get(o, "fp32_flat_groups", f) for o, f in zip(optim, files, strict=True)]
    inner = [_inner_state(o, f) for o, f in zip(optim, files, strict=True)]
    if any(len(st) != len(fl) for (st, _), fl in zip(inner, flats, strict=True)):
        raise UnbrokenError(f"{files[0].parent}: the optimizer's state does not match the fp32 sub-groups")
    keys = _element_keys(inner[0][0], flats[0])
    per_rank = [{"fp32": torch.cat([t.reshape(-1) for t in fl])} for fl in flats]
    for r, (st, fl) in enumerate(zip(inner, flats, strict=True)):
        for k in keys:
            per_rank[r][k] = torch.cat([s[k].reshape(-1)[:t.numel()] for s, t in zip(st[0], fl, strict=True)])
    master: dict[str, torch.Tensor] = {}
    moments: dict[str, dict[str, torch.Tensor]] = {k: {} for k in keys}
    offset = 0
    for name, shape in ((n, s) for g in shapes for n, s in g.items()):
        n = math.prod(int(s) for s in shape)
        piece = math.ceil(n / world)
        if offset + piece > per_rank[0]["fp32"].numel():
            raise UnbrokenError(f"{files[0].parent}: parameter {name!r} lies past the end of the partitions: the "
                                "files do not belong to one checkpoint")
        for k in ("fp32", *keys):
            full = torch.cat([v[k].narrow(0, offset, piece) for v in per_rank]).narrow(0, 0, n).clone()
            (master if k == "fp32" else moments[k])[name] = full
        offset += piece
    if offset != per_rank[0]["fp32"].numel():
        raise UnbrokenError(f"{files[0].parent}: the parameters take {offset} elements of each rank's "
                            f"{per_rank[0]['fp32'].numel()}: the files do not belong to one checkpoint")
    return master, moments, _groups(inner[0][0], inner[0][1], keys)


def _frozen(models: list[dict[str, Any]], stage: int, world: int, shapes: list[dict[str, Any]],
            buffers: set[str], shared: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Frozen parameters: ZeRO-3 pieces put together (one-dimensional), else as the module holds them."""
    fragments = models[0].get("frozen_param_fragments")
    if stage == 3:
        out = {}
        for name, shape in (models[0].get("frozen_param_shapes") or {}).items():
            n = math.prod(int(s) for s in shape)
            whole = torch.cat([m["frozen_param_fragments"][name].reshape(-1) for m in models])
            if whole.numel() < n:
                raise UnbrokenError(f"the ranks' pieces of the frozen parameter {name!r} hold {whole.numel()} of its "
                                    f"{n} elements: the files do not belong to one checkpoint")
            out[name] = whole.narrow(0, 0, n).clone()
        return out
    if fragments:
        return dict(fragments)
    trained = {n for g in shapes for n in g}
    module = models[0].get("module") or {}
    return {n: t for n, t in module.items()
            if isinstance(t, torch.Tensor) and n not in trained and n not in buffers and n not in shared}


def _frozen_shape(model: dict[str, Any], name: str, t: torch.Tensor) -> Any:
    shapes = model.get("frozen_param_shapes") or {}
    return shapes[name] if name in shapes else t.shape


def _lp_dtype(config: dict[str, Any]) -> torch.dtype:
    """The module's weight dtype by the DeepSpeed config (bf16 / fp16 enabled, else fp32)."""
    for key, dtype in (("bf16", torch.bfloat16), ("bfloat16", torch.bfloat16), ("fp16", torch.float16)):
        section = config.get(key)
        if isinstance(section, dict) and section.get("enabled") is True:
            return dtype
    return torch.float32


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _scaler_numbers(scaler: Any) -> dict[str, Any] | None:
    if scaler is None:
        return None
    return {k: v for k, v in vars(scaler).items() if type(v) in SCALAR_TYPES}
