"""``unbroken inspect``: one checkpoint's manifest and tensors, or the numbers of one tensor."""

from __future__ import annotations

import difflib
from typing import TYPE_CHECKING, Any

import typer
from rich.markup import escape
from rich.table import Table

from ..checkpoint.manifests import read_manifest
from ..errors import UnbrokenError
from ..format.manifest import Manifest, is_chunk
from .base import JSON_OPTION, app, emit_json, fail, metrics_text, number, open_checkpoint, out, size, when

if TYPE_CHECKING:
    import torch

ENV_SHOWN = ("python", "torch", "numpy", "cuda", "host", "world_size")


def tensor_entries(storage: Any, name: str, manifest: Manifest) -> list[dict[str, Any]]:
    """Every tensor of every ``.safetensors`` file: ``{file, name, dtype, shape}`` from the headers
    (data not verified), or ``{file, error}`` for a file whose header does not parse. In an
    incremental checkpoint, a tensor file's entries come from its chunk map (with ``chunk``)."""
    from ..format import chunkmap  # the header parsers share torch's dtype tables
    from ..format.tensorfile import DTYPE_TO_ST, parse_header

    entries: list[dict[str, Any]] = []
    for fname, entry in sorted(manifest.files.items()):
        if fname.endswith(chunkmap.SUFFIX):
            tfile = chunkmap.tensor_file_of(fname)
            try:
                table = chunkmap.decode(storage.read(name, fname, entry.size), fname, manifest.files)
            except (UnbrokenError, OSError) as e:
                entries.append({"file": tfile, "error": str(e)})
                continue
            entries += [{"file": tfile, "name": key, "dtype": DTYPE_TO_ST[dtype], "shape": list(shape), "chunk": cid}
                        for key, (dtype, shape, cid) in table.items()]
            continue
        if not fname.endswith(".safetensors"):
            continue
        try:
            header, _ = parse_header(memoryview(storage.read(name, fname, entry.size)), fname)
        except (UnbrokenError, OSError) as e:
            entries.append({"file": fname, "error": str(e)})
            continue
        entries += [{"file": fname, "name": key, "dtype": info["dtype"], "shape": list(info["shape"])}
                    for key, info in header.items()]
    return entries


_SKIPPED = {"tensor", "ndarray", "dtensor", "torch_generator", "np_generator", "np_randomstate", "py_random"}
"""Tagged nodes :func:`state_values` leaves out: tensors (listed by :func:`tensor_entries`) and RNG states."""


def state_values(storage: Any, name: str, manifest: Manifest) -> dict[str, str]:
    """The non-tensor values of the state shared by all ranks (``state.json``: counters, hyperparameters,
    loop variables, data positions), path -> shown value, in the state's order; tensors and RNG states
    are left out. ``{"": "<error>"}`` if the file does not verify or parse."""
    from ..checkpoint.reader import CheckpointFiles  # torch

    if "state.json" not in manifest.files:
        return {}
    try:
        tree = CheckpointFiles(storage, name, manifest).json("state.json")  # its checksum verified first
    except (UnbrokenError, OSError, ValueError) as e:
        return {"": f"state.json: {e}"}
    out: dict[str, str] = {}
    _walk(tree.get("state", {}) if isinstance(tree, dict) else {}, "", out)
    return out


def _shown(node: Any) -> str | None:
    """A leaf as it is shown, or ``None`` for a node to walk into (or leave out)."""
    if node is None or isinstance(node, (bool, int, float, str)):
        return repr(node)
    if isinstance(node, list) and all(n is None or isinstance(n, (bool, int, float, str)) for n in node):
        text = repr(node)
        return text if len(text) <= 80 else f"[{len(node)} values: {text[1:60]}, ...]"
    if not isinstance(node, dict):
        return None
    tag = node.get("@")
    if tag in ("float", "dtype", "device", "path", "size"):
        return str(node.get("v"))
    if tag == "int":
        return f"<an integer of {len(str(node.get('hex', ''))) * 4} bits>"
    if tag in ("bytes", "bytearray"):
        return f"<{tag}, {len(str(node.get('b64', ''))) * 3 // 4} bytes>"
    if tag == "np_scalar":
        return f"<numpy {node.get('dtype')} 0x{node.get('hex')}>"
    return None


def _walk(node: Any, path: str, out: dict[str, str]) -> None:
    shown = _shown(node)
    if shown is not None:
        out[path] = shown
        return
    if isinstance(node, list):
        for i, n in enumerate(node):
            _walk(n, f"{path}/{i}" if path else str(i), out)
        return
    if not isinstance(node, dict):
        return
    tag = node.get("@")
    if tag in _SKIPPED:
        return
    if tag == "stateful":
        _walk(node.get("v"), path, out)
    elif tag in ("tuple", "set", "frozenset"):
        _walk(node.get("v"), path, out)
    elif tag == "dict" and isinstance(node.get("v"), dict):
        for k, v in node["v"].items():
            _walk(v, f"{path}/{k}" if path else k, out)
    elif tag == "dict" and isinstance(node.get("items"), list):
        for pair in node["items"]:
            if isinstance(pair, list) and len(pair) == 2:
                _walk(pair[1], f"{path}/{_shown(pair[0]) or '?'}", out)
    elif tag is None:  # the document's state object
        for k, v in node.items():
            _walk(v, f"{path}/{k}" if path else k, out)


def tensor_stats(t: torch.Tensor) -> dict[str, Any]:
    """dtype, shape, element count, min, max, mean, L2 norm and the count of non-finite values
    (computed in float64; min/max/mean are ``None`` for an empty tensor)."""
    import torch

    x = t.detach().to(torch.float64).reshape(-1)
    empty = x.numel() == 0
    return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "numel": x.numel(),
            "min": None if empty else x.min().item(), "max": None if empty else x.max().item(),
            "mean": None if empty else x.mean().item(), "l2_norm": torch.linalg.vector_norm(x).item(),
            "non_finite": int((~x.isfinite()).sum().item())}


def _summary(path: str, m: Manifest) -> dict[str, Any]:
    return {"path": path, "step": m.step, "seq": m.seq, "format_version": m.format_version, "kind": m.kind,
            "created": m.created, "size_bytes": m.total_bytes, "world_size": m.world_size, "tags": m.tags,
            "metrics": m.metrics, "progress": m.progress, "environment": m.environment,
            "files": {f: {"size": e.size, "xxh3_128": e.xxh3_128} for f, e in sorted(m.files.items())
                      if not is_chunk(f)},
            "chunks": {c: {"size": e.size, "xxh3_128": e.xxh3_128} for c, e in sorted(m.chunks.items())}}


def _one_tensor(storage: Any, name: str, m: Manifest, path: str, wanted: str, json_: bool) -> None:
    entries = tensor_entries(storage, name, m)
    found = [e for e in entries if e.get("name") == wanted]
    if not found:
        names = [e["name"] for e in entries if "name" in e]
        close = difflib.get_close_matches(wanted, names, n=5, cutoff=0.4)
        hint = f"close names: {', '.join(close)}" if close else \
            f"it has {len(names)} tensors; `unbroken inspect {path}` lists them"
        fail(escape(f"no tensor {wanted!r} in {path}; {hint}"))
    fname = found[0]["file"]
    from ..checkpoint.reader import CheckpointFiles  # torch

    t = CheckpointFiles(storage, name, m).tensors(fname)[wanted]  # the file is verified (checksum) first
    stats = {"name": wanted, "file": fname, "verified": True, **tensor_stats(t)}
    if json_:
        emit_json({**_summary(path, m), "tensor": stats})
        return
    con = out()
    con.print(f"[bold]{escape(wanted)}[/] in {escape(fname)} [green](file checksum verified)[/]")
    con.print(f"dtype {stats['dtype']}, shape {stats['shape']}, {stats['numel']} elements"
              + (f", [red]{stats['non_finite']} non-finite[/]" if stats["non_finite"] else ""))
    con.print("  ".join(f"{label} {'-' if stats[key] is None else number(stats[key])}"
                        for label, key in (("min", "min"), ("max", "max"), ("mean", "mean"), ("L2 norm", "l2_norm"))))


@app.command()
def inspect(path: str = typer.Argument(..., metavar="CHECKPOINT", help="A checkpoint (folder or URL)."),
            tensor: str | None = typer.Option(None, "--tensor", metavar="NAME",
                                              help="Load and verify this tensor (e.g. model/weight) and show its "
                                                   "dtype, shape, min, max, mean and L2 norm."),
            json_: bool = JSON_OPTION) -> None:
    """Show a checkpoint's manifest, every tensor (file, name, dtype, shape) without loading data, and the
    non-tensor values of its state (counters, hyperparameters, loop variables, data positions)."""
    storage, name = open_checkpoint(path)
    m = read_manifest(storage, name)
    if tensor is not None:
        _one_tensor(storage, name, m, path, tensor, json_)
        return
    entries = tensor_entries(storage, name, m)
    values = state_values(storage, name, m)
    if json_:
        emit_json({**_summary(path, m), "tensors": entries, "values": values})
        return
    con = out()
    con.print(f"[bold]{escape(path)}[/]: step {m.step}, seq {m.seq}, {m.kind}, format v{m.format_version}, "
              f"{size(m.total_bytes)}, saved {when(m.created)}, world size {m.world_size}")
    if m.chunks:
        con.print(f"incremental: {len(m.chunks)} chunks ({size(sum(e.size for e in m.chunks.values()))}) in the "
                  "run's chunks/, shared with its other checkpoints")
    con.print(escape(f"metrics: {metrics_text(m.metrics) or '-'}   progress: {metrics_text(m.progress) or '-'}"
                     + (f"   tags: {', '.join(m.tags)}" if m.tags else "")))
    env = m.environment
    git: dict[str, Any] = env["git"] if isinstance(env.get("git"), dict) else {}
    shown = [f"{k} {env[k]}" for k in ENV_SHOWN if env.get(k) is not None]
    if git.get("commit"):
        shown.append(f"git {str(git['commit'])[:12]}" + (" (dirty)" if git.get("dirty") else ""))
    con.print(escape("environment: " + (", ".join(shown) or "-")))
    table = Table()
    for col in ("file", "tensor", "dtype", "shape"):
        table.add_column(col)
    for e in entries:
        if "error" in e:
            table.add_row(escape(e["file"]), f"[red]{escape(e['error'])}[/]", "", "")
        else:
            table.add_row(escape(e["file"]), escape(e["name"]), e["dtype"], escape(str(e["shape"])))
    con.print(table)
    if values:
        rows = Table()
        rows.add_column("value (state.json)")
        rows.add_column("")
        for key, text in values.items():
            rows.add_row(escape(key), escape(text) if key else f"[red]{escape(text)}[/]")
        con.print(rows)
