"""Bounds on what ``unbroken import`` builds from a source it does not trust.

A source is a pickle or JSON written by someone else; unbroken stores a state as a *tree*. Two
cheap inputs would otherwise cost minutes or crash deep in the codec:

- **shared references**: a 2 KB pickle can hold a list whose two items are the same list, 30
  levels deep: 2**30 values once written out as a tree. :func:`check_tree` walks every distinct
  container once (memoized by identity), computes how many values and how many levels the tree
  would have, and refuses it over :data:`MAX_VALUES` or :data:`MAX_DEPTH` (a cycle is refused too),
  before anything walks it value by value;
- **sizes declared by metadata**: an HF ``config.json`` claiming 200,000 layers makes
  ``transformers`` build 200,000 modules. :func:`check_config` bounds every layer, block or expert
  count by the number of weight tensors the checkpoint really has (each one needs at least one),
  before any model is built.

Every refusal is an :class:`~unbroken.errors.UnbrokenError` that names the source and what to do;
nothing was written.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from ..errors import UnbrokenError

MAX_VALUES = 2_000_000
"""Values (containers and leaves) an imported state may have once written out as a tree."""
MAX_DEPTH = 100
"""Levels of nesting an imported state may have (real checkpoints have fewer than ten)."""
MAX_JSON_BYTES = 64 * 1024 * 1024
"""Largest JSON metadata file read (trainer state, model config, weight index)."""
_CONTAINERS = (dict, list, tuple, set, frozenset)
_COUNTS = re.compile(r"(layers?|blocks?|experts?)$")


class SourceTooLargeError(UnbrokenError):
    """An import source would expand beyond the bounds of :mod:`unbroken.convert.bounds`."""


def _children(node: Any) -> list[Any]:
    if isinstance(node, dict):
        return [*node.keys(), *node.values()]
    return list(node)


def check_tree(root: Any, source: str) -> None:
    """Refuse ``root`` if, written out as a tree, it has more than :data:`MAX_VALUES` values or more
    than :data:`MAX_DEPTH` levels, or a cycle. Each distinct container is visited once."""
    if not isinstance(root, _CONTAINERS):
        return
    done: dict[int, tuple[int, int]] = {}  # id -> (values, levels) of a finished container
    on_path: set[int] = set()
    frames: list[list[Any]] = [[root, iter(_children(root)), 1, 0]]  # node, children left, values, deepest child
    on_path.add(id(root))
    while frames:
        frame = frames[-1]
        child = next(frame[1], frames)  # ``frames`` marks the end
        if child is frames:
            frames.pop()
            on_path.discard(id(frame[0]))
            values, levels = frame[2], frame[3] + 1
            done[id(frame[0])] = (values, levels)
            if frames:
                frames[-1][2] += values
                frames[-1][3] = max(frames[-1][3], levels)
                if frames[-1][2] > MAX_VALUES:
                    raise _too_many(source, frames[-1][2])
            continue
        if not isinstance(child, _CONTAINERS):
            frame[2] += 1
            frame[3] = max(frame[3], 1)
        elif id(child) in done:
            values, levels = done[id(child)]
            frame[2] += values
            frame[3] = max(frame[3], levels)
        elif id(child) in on_path:
            raise SourceTooLargeError(f"{source} holds a container that contains itself (a cycle): a checkpoint "
                                      "is a tree, so it cannot be imported; it was not written anywhere")
        elif len(frames) >= MAX_DEPTH:
            raise SourceTooLargeError(f"{source} nests containers more than {MAX_DEPTH} levels deep; a training "
                                      "state has a few levels, so this is not one: it was not imported")
        else:
            on_path.add(id(child))
            frames.append([child, iter(_children(child)), 1, 0])
            continue
        if frame[2] > MAX_VALUES:
            raise _too_many(source, frame[2])


def _too_many(source: str, values: int) -> SourceTooLargeError:
    return SourceTooLargeError(
        f"{source} would hold more than {MAX_VALUES:,} values once written out ({values:,} counted so far): "
        "it shares the same containers many times over (a checkpoint stores a tree, so each reference "
        "becomes a copy). A training state is not built like this; it was not imported")


def read_json(path: Path, what: str) -> dict[str, Any]:
    """The JSON object in ``path`` (an HF metadata file), or a clear error for a file that is too large,
    not JSON, nested too deep, or not an object."""
    size = path.stat().st_size
    if size > MAX_JSON_BYTES:
        raise SourceTooLargeError(f"{path} ({what}) has {size:,} bytes, more than the {MAX_JSON_BYTES:,} "
                                  "metadata files have: not imported")
    try:
        value = json.loads(path.read_bytes())
    except (ValueError, RecursionError) as e:
        raise UnbrokenError(f"{path} ({what}) is not valid JSON ({type(e).__name__}: {e}); fix or remove "
                            "it") from None
    if not isinstance(value, dict):
        raise UnbrokenError(f"{path} ({what}) holds a JSON {type(value).__name__}, not an object; fix or "
                            "remove it")
    check_tree(value, str(path))
    return value


def check_config(config: dict[str, Any], tensors: int, path: Path) -> None:
    """Refuse an HF model config (already through :func:`read_json`) that declares more layers, blocks
    or experts (any integer under a key ending so, at any level) than the weights have tensors, before
    a model is built from it."""
    todo: list[Any] = [config]
    while todo:
        node = todo.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for key, value in items:
            if isinstance(value, (dict, list)):
                todo.append(value)
            elif (isinstance(key, str) and _COUNTS.search(key) and isinstance(value, int)
                  and not isinstance(value, bool) and not 0 <= value <= tensors):
                raise SourceTooLargeError(
                    f"{path} declares {key} = {value}, but the checkpoint's weights have {tensors} tensors (each "
                    "layer, block or expert has at least one): the config does not describe these weights, so "
                    "no model was built from it. Fix or remove config.json")


MAX_COUNT = 2**53
"""The largest step, epoch or sample count an import accepts (a float64 holds every integer below it)."""
MAX_AMPLIFIED_BYTES = 1 << 20
"""Bytes an imported state's tensors may hold beyond the storage behind them (expanded views: a
broadcast row, HF's ``position_ids``); past it the source is refused, not written out at full size."""


def check_count(value: Any, what: str, source: str, integral: bool = True) -> int:
    """A step, epoch or sample count from ``source``: missing (``None``) is 0; otherwise a number from 0
    to :data:`MAX_COUNT` (``integral``: a whole one; else its whole part, as an HF epoch of 2.57),
    refused with a clear error otherwise (infinite, NaN, negative, a string), never committed as is."""
    if value is None:
        return 0
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not number or value != value or not 0 <= value < MAX_COUNT or (integral and value != int(value)):
        raise UnbrokenError(f"{source}: its {what} is {value!r}, not a count from 0 to {MAX_COUNT:,}; the "
                            "checkpoint was not imported (fix the source's metadata, or import a plain state)")
    return int(value)


def check_tensors(root: Any, source: str) -> None:
    """Refuse ``root`` (already through :func:`check_tree`) if its tensors would be written out with
    more than :data:`MAX_AMPLIFIED_BYTES` beyond the bytes that back them: a 1.5 KB pickle of one
    element expanded to 10**8 would otherwise become a checkpoint of 400 MB."""
    import torch

    extra, seen, todo = 0, set(), [root]
    while todo:
        node = todo.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, torch.Tensor):
            if node.layout != torch.strided or node.is_meta:
                continue
            logical = node.numel() * node.element_size()
            extra += max(0, logical - node.untyped_storage().nbytes())
            if extra > MAX_AMPLIFIED_BYTES:
                raise SourceTooLargeError(
                    f"{source} holds tensors that are views expanded beyond the bytes behind them (one of shape "
                    f"{tuple(node.shape)} has {logical:,} bytes over a storage of "
                    f"{node.untyped_storage().nbytes():,}): written out they would take more than "
                    f"{MAX_AMPLIFIED_BYTES:,} bytes the source does not hold; it was not imported")
        elif isinstance(node, _CONTAINERS):
            todo.extend(_children(node))
