"""``unbroken import`` and ``unbroken export``: other tools' checkpoints in, model weights out.

The work is :mod:`unbroken.convert`; these commands print what was done. ``import`` commits
the converted checkpoint as the newest of the run (taking the run's writer lock, so it is
refused while a training process writes the run); every pickle is loaded with
``weights_only`` unless ``--trust-pickle`` is given.
"""

from __future__ import annotations

from pathlib import Path

import typer
from rich.markup import escape

from .base import JSON_OPTION, app, emit_json, options_for, out, size


@app.command("import")
def import_(source: Path = typer.Argument(..., metavar="SRC", help="An HF Trainer checkpoint-N/ folder, a DeepSpeed "
                                          "checkpoint folder (with 'latest', or its global_stepN/), a Lightning .ckpt, "
                                          "or a torch.save .pt/.pth/.bin file."),
            run: str = typer.Argument(..., metavar="RUN", help="The run folder (or URL) to add it to; created if "
                                      "needed. The imported checkpoint becomes its newest."),
            trust_pickle: bool = typer.Option(False, "--trust-pickle", help="Load pickles the safe (weights_only) "
                                              "loader refuses. They can run code: only for files you trust."),
            json_: bool = JSON_OPTION) -> None:
    """Convert another tool's checkpoint into a verified, pickle-free checkpoint of RUN.

    Restore it with the parts your state has and strict=False (see docs/integrations.md)."""
    from ..convert import import_checkpoint  # torch

    info, imported = import_checkpoint(source, run, trust_pickle=trust_pickle, storage_options=options_for(run))
    if json_:
        emit_json({"source": str(source), "kind": imported.kind, "checkpoint": info.path, "step": info.step,
                   "epoch": info.progress.get("epoch", 0), "size_bytes": info.size_bytes,
                   "parts": sorted(imported.state), "rng": imported.rng is not None, "left_out": imported.left_out})
        return
    out().print(escape(f"imported {imported.kind} checkpoint {source} -> {info.path} "
                       f"(step {info.step}, {size(info.size_bytes)})"))
    out().print(escape(f"parts: {', '.join(sorted(imported.state))}; RNG state: "
                       f"{'imported' if imported.rng is not None else 'not in the source (reseeded on resume)'}"))
    for note in imported.left_out:
        out().print(escape(f"left out: {note}"))


@app.command()
def export(checkpoint: str = typer.Argument(..., metavar="CKPT", help="A checkpoint, or a run (its newest valid "
                                            "checkpoint); a folder or URL."),
           to: Path = typer.Option(..., "--to", help="The safetensors file to write, or a folder with --format "
                                                     "hf or checkpoint."),
           fmt: str = typer.Option("safetensors", "--format", metavar="safetensors|hf|checkpoint",
                                   help="One safetensors file; an HF model folder (model.safetensors + "
                                        "config.json) that from_pretrained reads; or the whole checkpoint as a "
                                        "self-contained unbroken checkpoint folder (chunks of an incremental "
                                        "run copied in)."),
           dtype: str | None = typer.Option(None, "--dtype", metavar="bf16|fp16|fp32",
                                               help="Cast floating-point tensors (others stay as they are)."),
           key: str | None = typer.Option(None, "--key", help="The part of the state that holds the weights "
                                             "(default: 'model', or the one DeepSpeed engine the state has)."),
           config: Path | None = typer.Option(None, "--config", help="A config.json for --format hf, when "
                                                 "the checkpoint has no 'config' part."),
           force: bool = typer.Option(False, "--force", help="Replace an existing target file (for --format hf: "
                                      "model.safetensors and config.json in the folder). Never a folder, and "
                                      "never anything inside a checkpoint or a run."),
           json_: bool = JSON_OPTION) -> None:
    """Write a checkpoint's model weights for inference or the HF Hub, or a self-contained copy of
    the whole checkpoint (verified on read). An existing target is refused unless --force."""
    from ..convert import export_weights  # torch

    files = export_weights(checkpoint, to, key=key, dtype=dtype, fmt=fmt, config=config,
                           storage_options=options_for(checkpoint), force=force)
    if json_:
        emit_json({"checkpoint": checkpoint, "format": fmt, "dtype": dtype, "files": [str(f) for f in files]})
        return
    for f in files:
        n = sum(p.stat().st_size for p in f.rglob("*") if p.is_file()) if f.is_dir() else f.stat().st_size
        out().print(escape(f"wrote {f} ({size(n)})"))
