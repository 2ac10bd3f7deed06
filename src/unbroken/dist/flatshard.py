"""One rank's contiguous piece of a tensor flattened to one dimension, for DCP.

ZeRO (DeepSpeed) partitions a model's fp32 master weights and optimizer moments as slices
of flattened parameters: on rank ``r``, elements ``[offset, offset + n)`` of
``param.flatten()``. Such a slice is not a rectangle of the parameter's shape, so it is
saved as a piece of a one-dimensional tensor of ``numel`` elements. :class:`FlatShard`
speaks DCP's checkpointable protocol (``__create_write_items__``,
``__create_chunk_list__``, ``__get_tensor_shard__``), like a DTensor does: DCP's planners
then write each rank's pieces once and, at load, give every rank exactly the elements of
*its* slices, whatever slices they were saved as. That is what lets a checkpoint written
by 2 ranks resume on 1 or 4, with no offline conversion.

The local tensor may be a view into the live state (a ZeRO partition): DCP then loads
into it in place.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType


class FlatShard:
    """Elements ``[offset, offset + local.numel())`` of a flat tensor of ``numel`` elements."""

    def __init__(self, local: torch.Tensor, offset: int, numel: int) -> None:
        if local.dim() != 1:
            raise ValueError(f"a FlatShard holds a 1-D piece, not a tensor of shape {tuple(local.shape)}")
        if not 0 <= offset <= numel or offset + local.numel() > numel:
            raise ValueError(f"piece [{offset}, {offset + local.numel()}) is outside a tensor of {numel} elements")
        self.local, self.offset, self.numel = local, int(offset), int(numel)

    # what the codec records for the reference
    @property
    def shape(self) -> torch.Size:
        return torch.Size([self.numel])

    @property
    def dtype(self) -> torch.dtype:
        return self.local.dtype

    def size(self) -> torch.Size:
        return self.shape

    def detach(self) -> "FlatShard":
        return self

    def __repr__(self) -> str:
        return f"FlatShard([{self.offset}, {self.offset + self.local.numel()}) of {self.numel}, {self.dtype})"

    # DCP's checkpointable protocol
    def _chunk(self) -> ChunkStorageMetadata:
        return ChunkStorageMetadata(offsets=torch.Size([self.offset]), sizes=torch.Size([self.local.numel()]))

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        if not self.local.numel():
            return []
        return [WriteItem(index=MetadataIndex(fqn, torch.Size([self.offset])), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=self._chunk(),
                                                      properties=TensorProperties.create_from_tensor(self.local),
                                                      size=self.shape))]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [self._chunk()] if self.local.numel() else []

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        if index.offset is not None and tuple(index.offset) != (self.offset,):
            raise ValueError(f"no piece of {index.fqn} at {list(index.offset)} here (this rank has {self.offset})")
        return self.local


class SavePlanner(DefaultSavePlanner):
    """DCP's default planner, which finds a piece by offset only in tensors: also in FlatShards."""

    def lookup_object(self, index: MetadataIndex) -> Any:
        obj = self.state_dict.get(index.fqn)
        return obj.__get_tensor_shard__(index) if isinstance(obj, FlatShard) else super().lookup_object(index)


class LoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, which finds a piece by offset only in tensors (also in FlatShards) and
    replaces what is neither a tensor nor a container by ``None`` as it sets up (not FlatShards)."""

    def set_up_planner(self, state_dict: dict[str, Any], metadata: Any = None, is_coordinator: bool = False) -> None:
        pieces = {k: state_dict.pop(k) for k in [k for k, v in state_dict.items() if isinstance(v, FlatShard)]}
        try:
            super().set_up_planner(state_dict, metadata, is_coordinator)
        finally:
            state_dict.update(pieces)
        self.state_dict.update(pieces)
        self.mappings.update({k: (k,) for k in pieces})

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        obj = self.state_dict.get(index.fqn)
        return obj.__get_tensor_shard__(index) if isinstance(obj, FlatShard) else super().lookup_tensor(index)
