"""``unbroken import``: turn another tool's checkpoint into a verified, pickle-free unbroken checkpoint.

Four sources, recognized by their shape:

* an **HF Trainer** ``checkpoint-N/`` folder (``trainer_state.json``): model weights
  (``model.safetensors``, sharded ``model-*.safetensors`` or ``pytorch_model.bin``),
  ``optimizer.pt``, ``scheduler.pt``, ``scaler.pt``, ``rng_state.pth`` (rank 0's) and the
  trainer state; ``training_args.bin`` (a pickled ``TrainingArguments`` object: settings,
  not state) is left out;
* a **Lightning** ``.ckpt`` file: ``state_dict``, the optimizer and LR-scheduler states,
  ``global_step``, ``epoch``, the loops' progress, the AMP scaler, the hyper-parameters;
* a **torch.save** ``.pt``/``.pth``/``.bin`` file: a dict of tensors (a model's weights) or a
  dict of named parts (``{"model": ..., "optimizer": ...}``);
* a **DeepSpeed** ZeRO 1/2/3 checkpoint folder (``engine.save_checkpoint(dir)``, or the HF Trainer
  with DeepSpeed: a folder with a ``latest`` file, or a ``global_stepN/`` tag folder itself): the
  fp32 master weights and optimizer moments put back together per parameter from every rank's
  partitions, under the key ``engine`` (:mod:`unbroken.convert.deepspeed`), for
  ``state = {"engine": engine, ...}`` on any world size and ZeRO stage.

The imported state has the keys a plain loop uses: ``model``, ``optimizer``, ``scheduler``,
``scaler`` (those the source has) plus, where the source has them, ``trainer_state``
(HF), ``lightning`` (Lightning's counters and loop progress), ``config`` (the HF model
config) and ``hyper_parameters``; a DeepSpeed checkpoint becomes ``engine`` alone. The step and
epoch become the checkpoint's progress; an HF RNG state becomes the checkpoint's RNG state (other
sources: the RNGs are reseeded from the checkpoint on resume). Restore it into a state with the
parts you have and ``strict=False``. Every pickle is loaded safely (:mod:`unbroken.convert.pickles`),
and what it may expand to is bounded before anything walks it (:mod:`unbroken.convert.bounds`).
``run`` must be a run, or a new or empty folder (:func:`check_run_folder`).
"""

from __future__ import annotations

import os
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..api import CheckpointInfo
from ..checkpointer.manager import Checkpointer
from ..errors import TargetExistsError, UnbrokenError, UnsupportedStateError
from ..state.validate import validate_state
from .bounds import check_config, check_count, check_tensors, check_tree, read_json
from .deepspeed import is_deepspeed_folder, read_deepspeed
from .pickles import load_pickle


@dataclass
class Imported:
    """A source read into unbroken's terms: the state tree, progress, RNG and what was left out."""

    kind: str
    state: dict[str, Any]
    progress: dict[str, int]
    rng: dict[str, Any] | None = None
    left_out: list[str] = field(default_factory=list)


def detect(src: str | os.PathLike[str]) -> str:
    """``"hf"``, ``"deepspeed"``, ``"lightning"`` or ``"torch"`` for the source at ``src``; raises if it is none."""
    path = Path(src)
    if path.is_dir():
        if is_deepspeed_folder(path):  # before HF: the HF Trainer's folder holds DeepSpeed's too
            return "deepspeed"
        if (path / "trainer_state.json").is_file():
            return "hf"
        raise UnbrokenError(f"{src} is a folder with neither trainer_state.json nor a DeepSpeed 'latest' file or "
                            "*_optim_states.pt files: not an HF Trainer checkpoint folder, nor a DeepSpeed one")
    if not path.is_file():
        raise UnbrokenError(f"{src} does not exist")
    return "lightning" if path.suffix == ".ckpt" else "torch"


def read_source(src: str | os.PathLike[str], trust_pickle: bool = False) -> Imported:
    """Read ``src`` (see the module docstring) without writing anything."""
    kind = detect(src)
    reader = {"hf": _read_hf, "deepspeed": _read_deepspeed, "lightning": _read_lightning, "torch": _read_torch}[kind]
    imported = reader(Path(src), trust_pickle)
    check_tree(imported.state, str(src))  # shared references walked once, before any walk per value
    check_tensors(imported.state, str(src))  # no expanded view written out at a size the source does not hold
    _drop_unsavable(imported)
    return imported


def import_checkpoint(src: str | os.PathLike[str], run: str | os.PathLike[str], *, trust_pickle: bool = False,
                      storage_options: Mapping[str, Any] | None = None) -> tuple[CheckpointInfo, Imported]:
    """Read ``src`` and commit it as the newest checkpoint of the run ``run`` (a folder or URL,
    created if needed); returns the checkpoint's info and what was imported. Takes the run's
    writer lock for the commit, so it fails while a training process writes the run. A local
    ``run`` must be new, empty, or a run: a folder holding other files (a project, a checkpoint)
    is refused with :class:`~unbroken.errors.TargetExistsError` before the source is read."""
    check_run_folder(run)
    imported = read_source(src, trust_pickle)
    ckpt = Checkpointer(run, keep_last=None, preemption=None, rng=imported.rng is not None,
                        storage_options=storage_options)
    try:
        info = ckpt.save(imported.state, kind="imported", rng=imported.rng, progress=imported.progress)
    finally:
        ckpt.close()
    assert info is not None  # a synchronous save
    return info, imported


_RUN_FILES = ("tags.json", "fresh-starts.json", "run-id", "quarantine", "submit.slurm", "chunks", "index.sqlite")


def check_run_folder(run: str | os.PathLike[str]) -> None:
    """Refuse a local ``run`` that is a file, or a folder with entries that are neither a run's
    (checkpoints, its lock, index, tags, chunks: see :func:`unbroken.api.is_run`) nor hidden: an
    import adds a checkpoint to a run, never to a user's folder or inside a checkpoint."""
    from ..api import is_run
    from ..store import is_url

    if is_url(os.fspath(run)):
        return
    path = Path(run)
    if os.path.lexists(path) and not path.is_dir():
        raise TargetExistsError(f"{run} exists and is not a folder: give a run folder (new, empty, or a run) as RUN")
    if not path.is_dir() or is_run(path):
        return
    foreign = sorted(n for n in os.listdir(path) if not n.startswith((".", *_RUN_FILES)))
    if foreign:
        what = "a checkpoint" if (path / "manifest.json").exists() else "not a run"
        raise TargetExistsError(f"{run} is {what} and holds files unbroken did not write ({', '.join(foreign[:5])}"
                                f"{', ...' if len(foreign) > 5 else ''}): import adds checkpoints to a run, or to a "
                                "new or empty folder; give one as RUN (nothing was written)")


# ---------------------------------------------------------------------------------- sources
def _progress(step: Any, epoch: Any, source: Path) -> dict[str, int]:
    return {"step": check_count(step, "step", str(source)),
            "epoch": check_count(epoch, "epoch", str(source), integral=False), "micro_step": 0, "samples": 0}


def _read_deepspeed(folder: Path, trust: bool) -> Imported:
    state, progress, notes = read_deepspeed(folder, trust)
    if (folder / "trainer_state.json").is_file():
        notes.append("the HF Trainer's own files beside DeepSpeed's (trainer_state.json, RNG states): only the "
                     "DeepSpeed engine's state is imported")
    return Imported("deepspeed", state, progress, left_out=notes)


def _read_hf(folder: Path, trust: bool) -> Imported:
    trainer_state = read_json(folder / "trainer_state.json", "the HF Trainer state")
    state: dict[str, Any] = {"model": _hf_weights(folder, trust)}
    for key, name in (("optimizer", "optimizer.pt"), ("scheduler", "scheduler.pt"), ("scaler", "scaler.pt")):
        if (folder / name).is_file():
            state[key] = load_pickle(folder / name, trust)
    state["trainer_state"] = trainer_state
    notes: list[str] = []
    if (folder / "config.json").is_file():
        state["config"] = read_json(folder / "config.json", "the HF model config")
        check_config(state["config"], len(state["model"]), folder / "config.json")
        notes += _fill_tied(state["model"], state["config"], folder / "config.json")
    rng_file = next((folder / n for n in ("rng_state.pth", "rng_state_0.pth") if (folder / n).is_file()), None)
    out = Imported("hf", state, _progress(trainer_state.get("global_step"), trainer_state.get("epoch"),
                                            folder / "trainer_state.json"),
                   rng=_hf_rng(load_pickle(rng_file, trust), rng_file) if rng_file is not None else None)
    out.left_out += notes
    if (folder / "training_args.bin").is_file():
        out.left_out.append("training_args.bin (a pickled TrainingArguments object: settings, not training state)")
    others = sorted(p.name for p in folder.glob("rng_state_*.pth") if p.name != "rng_state_0.pth")
    if others:
        out.left_out.append(f"{', '.join(others)} (other ranks' RNG states: a resume reseeds those ranks)")
    return out


def _hf_weights(folder: Path, trust: bool) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index, "the weight index").get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise UnbrokenError(f"{index}: 'weight_map' is not an object of file names; fix or remove the index")
        files = sorted(set(weight_map.values()))
        weights: dict[str, torch.Tensor] = {}
        for name in files:
            weights.update(load_file(_inside(folder, name)))
        return weights
    if (folder / "model.safetensors").is_file():
        return load_file(folder / "model.safetensors")
    if (folder / "pytorch_model.bin").is_file():
        return load_pickle(folder / "pytorch_model.bin", trust)
    raise UnbrokenError(f"{folder} has no model weights (model.safetensors, its index, or pytorch_model.bin)")


def _fill_tied(weights: dict[str, torch.Tensor], config: dict[str, Any], path: Path) -> list[str]:
    """HF files store tied weights once (``lm_head.weight`` is ``wte.weight``); the model's
    ``state_dict`` has both names. Build the model from its config on the meta device (no
    memory, no download), find the parameters shared under several names, and add the missing
    names; returns a note if that cannot be done (then restore with ``strict=False``)."""
    try:
        import transformers
    except ImportError:
        return ["tied weights (installing transformers lets the import add their second names)"]
    arch = (config.get("architectures") or [None])[0]
    cls = getattr(transformers, arch, None) if isinstance(arch, str) else None
    if cls is None or "model_type" not in config:
        return [f"tied weights (the config names no known architecture: {arch!r})"]
    try:
        cfg = transformers.AutoConfig.for_model(**config)
        with torch.device("meta"):
            model = cls(cfg)
        model.tie_weights()
    except Exception as e:  # noqa: BLE001 - any failure of transformers on this config, named below
        raise UnbrokenError(f"{path}: transformers cannot build {arch} from it ({type(e).__name__}: {e}); "
                            "fix or remove config.json") from None
    names_of: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(param), []).append(name)
    for names in names_of.values():
        present = [n for n in names if n in weights]
        for name in names:
            if present and name not in weights:
                weights[name] = weights[present[0]]
    return []


def _inside(folder: Path, name: str) -> Path:
    """``folder / name`` for a file name taken from an index file: no path components."""
    if Path(name).name != name or name in ("", ".", ".."):
        raise UnbrokenError(f"{folder}: the weight index names {name!r}, which is not a plain file name")
    return folder / name


def _hf_rng(saved: Any, path: Path) -> dict[str, Any] | None:
    """An HF ``rng_state.pth`` (python, numpy legacy tuple, torch CPU) as unbroken's RNG state."""
    if not isinstance(saved, dict) or not {"python", "numpy", "cpu"} <= set(saved):
        return None
    try:
        legacy = np.random.RandomState()
        legacy.set_state(saved["numpy"])
        py = random.Random()
        py.setstate(saved["python"])  # validates it
    except (TypeError, ValueError, OverflowError) as e:
        raise UnbrokenError(f"{path} is not a valid HF RNG state ({type(e).__name__}: {e}); remove it to import "
                            "without RNG state (a resume then reseeds)") from None
    if not isinstance(saved["cpu"], torch.Tensor) or saved["cpu"].dtype != torch.uint8:
        raise UnbrokenError(f"{path}: its 'cpu' entry is not a torch RNG state (a uint8 tensor); remove it to "
                            "import without RNG state")
    return {"python": py.getstate(), "numpy": legacy.get_state(legacy=False), "torch": saved["cpu"]}


def _read_lightning(file: Path, trust: bool) -> Imported:
    ck = load_pickle(file, trust)
    if not isinstance(ck, dict) or "state_dict" not in ck:
        raise UnbrokenError(f"{file} is not a Lightning checkpoint (no 'state_dict')")
    optims, scheds = ck.get("optimizer_states") or [], ck.get("lr_schedulers") or []
    for key, value, kind in (("state_dict", ck["state_dict"], dict), ("optimizer_states", optims, list),
                             ("lr_schedulers", scheds, list), ("hyper_parameters", ck.get("hyper_parameters") or {},
                                                               dict), ("callbacks", ck.get("callbacks") or {}, dict)):
        if not isinstance(value, kind):
            raise UnbrokenError(f"{file}: its {key!r} is a {type(value).__name__}, not a {kind.__name__}: not a "
                                "Lightning checkpoint it can import")
    state: dict[str, Any] = {"model": ck["state_dict"]}
    if optims:
        state["optimizer"] = optims[0] if len(optims) == 1 else optims
    if scheds:
        state["scheduler"] = scheds[0] if len(scheds) == 1 else scheds
    for key in ("MixedPrecision", "native_amp_scaling_state"):
        if key in ck:
            state["scaler"] = ck[key]
    state["lightning"] = {k: ck[k] for k in ("global_step", "epoch", "loops", "pytorch-lightning_version")
                          if k in ck}
    if ck.get("hyper_parameters"):
        state["hyper_parameters"] = dict(ck["hyper_parameters"])
    out = Imported("lightning", state, _progress(ck.get("global_step"), ck.get("epoch"), file))
    if ck.get("callbacks"):
        out.left_out.append(f"callbacks ({', '.join(map(str, ck['callbacks']))}: their own state)")
    return out


def _read_torch(file: Path, trust: bool) -> Imported:
    obj = load_pickle(file, trust)
    if isinstance(obj, torch.nn.Module):
        obj = obj.state_dict()
    if not isinstance(obj, dict) or not obj or not all(isinstance(k, str) for k in obj):
        raise UnbrokenError(f"{file} holds a {type(obj).__name__}, not a dict with string keys")
    if all(isinstance(v, torch.Tensor) for v in obj.values()):
        return Imported("torch", {"model": obj}, _progress(0, 0, file))
    state = dict(obj)
    step = next((state[k] for k in ("global_step", "step") if isinstance(state.get(k), (int, float))), 0)
    epoch = state.get("epoch") if isinstance(state.get("epoch"), (int, float)) else 0  # (a user's own "epoch")
    return Imported("torch", state, _progress(step, epoch, file))


def _drop_unsavable(imported: Imported) -> None:
    """Leave out (and say so) the top-level parts the codec cannot save, e.g. hyper-parameters
    holding objects; the model weights must be savable."""
    for key in list(imported.state):
        try:
            validate_state({key: imported.state[key]})
        except UnsupportedStateError as e:
            if key in ("model", "engine"):
                raise
            del imported.state[key]
            imported.left_out.append(f"{key} ({e})")
