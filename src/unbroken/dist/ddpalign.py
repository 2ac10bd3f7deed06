"""DDP's first step after a resume, summed as the run that never stopped sums it.

``DistributedDataParallel`` reduces gradients in flat buckets. For its first iteration it lays
them out in an order fixed at construction; after that iteration it rebuilds them in the order
the gradients became ready. A resumed process's first step is a first iteration, so each
gradient sits elsewhere in the flat buffer than in the same step of the uninterrupted run, and
with more than two ranks the all-reduce then adds the ranks' values in another order (gloo and
NCCL split a buffer into chunks by position): last-bit differences, which grow from there.

:func:`align_after_restore` (called by :meth:`unbroken.Checkpointer.restore` after a checkpoint
was loaded) registers a communication hook on every such DDP module that does, for the first
iteration only, what the rebuilt buckets would do: it records the order in which the gradients
become ready (a post-accumulate hook per parameter, the moment DDP's own hook records it),
computes the buckets DDP is about to rebuild from that order (``_compute_bucket_assignment_by_size``
with DDP's own limits), and all-reduces one flat tensor per such bucket, laid out as DDP will lay
it out, then copies the sums back. Every later iteration (DDP has rebuilt by then) is DDP's own
default, reproduced exactly: the bucket multiplied by ``1 / world`` (as DDP does while copying the
gradients in, which it skips once a hook is registered), then all-reduced.

Only where it is needed and safe: more than two ranks (a sum of two is the same in any order), a
DDP that has not rebuilt its buckets, with no communication hook of its own, no static graph, no
search for unused parameters, no mixed precision and no sparse gradients (their first iterations
follow other paths); anything else is left as it is. A hook can be registered once: register your
own before ``restore()`` (then this one steps aside), or set ``UNBROKEN_DDP_ALIGN=0`` to leave
DDP as it is (exact on two ranks; last bits on more).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import torch

from ..state.walk import instances

log = logging.getLogger("unbroken")


def align_after_restore(state: Mapping[str, Any]) -> int:
    """Align the first step of every DDP module in ``state`` with the uninterrupted run's (see
    the module docstring); how many were. Call it after a checkpoint was loaded, before training."""
    aligned = 0
    if os.environ.get("UNBROKEN_DDP_ALIGN") == "0":
        return 0
    for ddp in instances(dict(state.items()), torch.nn.parallel.DistributedDataParallel, depth=3):
        why = _why_not(ddp)
        if why and why in QUIET:
            log.debug("DDP's first step after the resume is left as it is: %s", why)
            continue
        if why:  # an option whose first iteration follows another path: said, once per restore
            log.warning("DDP's first step after the resume is not aligned with the uninterrupted run's (%s): with "
                        "more than two ranks its gradients may differ in the last bits, and so may every later "
                        "step (docs/distributed.md lists the options; UNBROKEN_DDP_ALIGN=0 silences this)", why)
            continue
        try:
            hook = _FirstStep(ddp)
            ddp.register_comm_hook(None, hook.run)
        except Exception as e:  # noqa: BLE001 - another torch's internals: exact elsewhere, last bits here
            log.warning("could not align DDP's first step after the resume with the uninterrupted run's (%s: %s); "
                        "with more than two ranks it may differ in the last bits", type(e).__name__, e)
            continue
        aligned += 1
    return aligned


TWO_OR_FEWER = "two ranks or fewer"
REBUILT = "its buckets were rebuilt already"
NEVER_REBUILDS = "find_unused_parameters=True: DDP never rebuilds its buckets, every iteration sums in one order"
QUIET = (TWO_OR_FEWER, REBUILT, NEVER_REBUILDS)
"""Reasons that need no warning: nothing to align (a sum of two is the same in any order; a DDP
module that has rebuilt its buckets already, or never rebuilds them, sums as the uninterrupted run:
HF's default ``ddp_find_unused_parameters=True`` was found bitwise without alignment)."""


def _why_not(ddp: Any) -> str:
    """Why the first step of ``ddp`` is not aligned ("" if it is to be): the constructor options that
    change how the first iteration buckets or reduces (docs/distributed.md), by name."""
    dist = torch.distributed
    group = getattr(ddp, "process_group", None)
    if not dist.is_initialized() or group is None or dist.get_world_size(group) <= 2:
        return TWO_OR_FEWER
    options = [name for name, on in (
        ("static_graph=True", ddp.static_graph),
        ("mixed_precision", getattr(ddp, "mixed_precision", None) is not None),
        ("bucket_cap_mb_list", bool(getattr(getattr(ddp, "_bucket_config", None), "per_bucket_bytes_caps", ()))),
        ("batched_grad_copy=True", getattr(ddp, "batched_grad_copy", False)),
        ("delay_all_reduce_named_params", getattr(ddp, "_delay_all_reduce_all_params", False)
         or bool(getattr(ddp, "_delay_all_reduce_params", None))),
        ("a communication hook of its own", bool(getattr(ddp, "_comm_hooks", None))),
    ) if on]
    if options:
        return ", ".join(options)
    if ddp.find_unused_parameters:
        return NEVER_REBUILDS
    if not hasattr(ddp, "_bucket_config") or not hasattr(dist, "_compute_bucket_assignment_by_size"):
        return "this torch's DDP has no bucket configuration to follow"
    if int(ddp._get_ddp_logging_data().get("has_rebuilt_buckets", 0)):
        return REBUILT
    return ""


class _FirstStep:
    """The communication hook of :func:`align_after_restore`."""

    def __init__(self, ddp: Any) -> None:
        self.ddp = ddp
        self.group = ddp.process_group
        self.world = torch.distributed.get_world_size(self.group)
        self.params, sparse = ddp._build_params_for_reducer()
        if any(sparse):
            raise ValueError("sparse gradients")
        self.index = {id(p): i for i, p in enumerate(self.params)}
        self.order: list[int] = []
        self.first = True
        self.handles = [p.register_post_accumulate_grad_hook(self._ready) for p in self.params]

    def _ready(self, p: torch.Tensor) -> None:
        if self.first:
            self.order.append(self.index[id(p)])

    def _drop_handles(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def run(self, _state, bucket):  # type: ignore[no-untyped-def]  # DDP checks annotations: none here
        """The hook: a future of ``bucket``'s reduced buffer."""
        buf = bucket.buffer()
        buf.mul_(1.0 / self.world)  # what DDP does while copying gradients in, without a hook
        if self.first:
            self.first = False
            self._drop_handles()
            if self._as_rebuilt(bucket):
                done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
                done.set_result(buf)
                return done
        work = torch.distributed.all_reduce(buf, group=self.group, async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0])

    def _as_rebuilt(self, bucket: Any) -> bool:
        """All-reduce the first iteration's one bucket as the buckets DDP rebuilds from this
        iteration's ready order; False (nothing done) if the bucket is not that one bucket."""
        params = bucket.parameters()
        if len(params) != len(self.params) or sorted(self.order) != list(range(len(self.params))):
            log.warning("DDP's first step after the resume could not be aligned (%d of %d parameters in the first "
                        "bucket, %d ready): with more than two ranks it may differ in the last bits", len(params),
                        len(self.params), len(self.order))
            return False
        views = {id(p): g for p, g in zip(params, bucket.gradients())}
        cfg = self.ddp._bucket_config
        ordered = [self.params[i] for i in self.order]
        groups, _ = torch.distributed._compute_bucket_assignment_by_size(
            ordered, [cfg.first_bucket_bytes_cap, cfg.bucket_bytes_cap], [False] * len(ordered), self.order)
        for group in groups:
            flat = torch.cat([views[id(self.params[i])].reshape(-1) for i in group])
            torch.distributed.all_reduce(flat, group=self.group)
            offset = 0
            for i in group:
                view = views[id(self.params[i])]
                view.copy_(flat[offset:offset + view.numel()].view_as(view))
                offset += view.numel()
        return True
