"""Which DDP constructor options the first-step alignment after a resume covers (issue 33 §6), in one
process: a 4-rank process group of torch's ``fake`` backend (no communication) is enough to build
``DistributedDataParallel`` with each option and ask :func:`unbroken.dist.ddpalign.align_after_restore`
what it does. The bitwise checks at 3-4 real ranks are in tests/test_ddp_align.py."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist

from unbroken.dist.ddpalign import align_after_restore


@pytest.fixture(scope="module")
def four_fake_ranks():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    yield
    dist.destroy_process_group()


def _ddp(**options) -> torch.nn.parallel.DistributedDataParallel:
    torch.manual_seed(0)
    return torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)),
                                                     **options)


@pytest.mark.parametrize("options", [{}, {"gradient_as_bucket_view": True}, {"bucket_cap_mb": 1},
                                     {"forward_sync_buffers": False}])
def test_options_that_keep_ddps_bucketing_are_aligned_silently(four_fake_ranks, options, caplog) -> None:
    caplog.set_level(logging.DEBUG, logger="unbroken")
    assert align_after_restore({"model": _ddp(**options)}) == 1
    assert "not aligned" not in caplog.text


def test_find_unused_parameters_needs_no_alignment_and_gets_no_warning(four_fake_ranks, caplog) -> None:
    """With ``find_unused_parameters=True`` (HF's default) DDP never rebuilds its buckets: every iteration,
    the first after a resume too, sums in one order (found bitwise at 4 ranks: docs/distributed.md)."""
    assert align_after_restore({"model": _ddp(find_unused_parameters=True)}) == 0
    assert "not aligned" not in caplog.text


@pytest.mark.parametrize("options,named", [
    ({"static_graph": True}, "static_graph=True"),
    ({"bucket_cap_mb_list": [1, 2]}, "bucket_cap_mb_list"),
    ({"batched_grad_copy": True}, "batched_grad_copy=True"),
])
def test_options_whose_first_iteration_differs_are_left_with_a_warning(four_fake_ranks, options, named,
                                                                       caplog) -> None:
    """Before, these stepped aside with a debug line only: on more than two ranks the resume differed in
    the last bits and nothing said so."""
    assert align_after_restore({"model": _ddp(**options)}) == 0
    [record] = [r for r in caplog.records if "not aligned" in r.getMessage()]
    assert record.levelno == logging.WARNING and named in record.getMessage()
    assert "docs/distributed.md" in record.getMessage()


def test_a_communication_hook_of_the_users_is_left_with_a_warning(four_fake_ranks, caplog) -> None:
    ddp = _ddp()
    ddp.register_comm_hook(None, lambda state, bucket: torch.futures.Future())
    assert align_after_restore({"model": ddp}) == 0
    assert "a communication hook of its own" in caplog.text


def test_unbroken_ddp_align_0_leaves_every_ddp_silently(four_fake_ranks, caplog, monkeypatch) -> None:
    monkeypatch.setenv("UNBROKEN_DDP_ALIGN", "0")
    assert align_after_restore({"model": _ddp(static_graph=True)}) == 0
    assert "not aligned" not in caplog.text
