"""A rank's local save and load plans as DCP's default planners make them, built faster.

At thousands of ranks each rank's own planning is most of a save's or load's CPU: DCP's
default planners build every item through helpers that handle every kind of tensor
(DTensor, ShardedTensor, resharding between chunk lists), about 30 us an item, and a load
into a state dict on the meta device materialises each tensor through ``empty_like``'s
Python reference (about 100 us). A plain tensor, saved whole and loaded whole, needs none
of that: these functions build its items directly, and hand every other value to DCP's own
functions, item by item. The plans are equal to DCP's, item for item (the tests compare
them). No I/O, no collectives.
"""
from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import (
    create_default_local_load_plan,
    create_default_local_save_plan,
)
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

_PLAIN = (torch.Tensor, torch.nn.Parameter)  # exactly these types; subclasses go to DCP
_META = torch.device("meta")


def local_save_plan(state_dict: dict[str, Any], is_coordinator: bool) -> SavePlan:
    """``create_default_local_save_plan`` of a flattened state dict: a plain tensor's write
    item made here, every other value's by DCP."""
    items: list[WriteItem] = []
    for fqn, obj in state_dict.items():
        if type(obj) in _PLAIN:
            items.append(_whole_write(fqn, obj))
        else:
            items += create_default_local_save_plan({fqn: obj}, is_coordinator).items
    return SavePlan(items)


def _whole_write(fqn: str, tensor: torch.Tensor) -> WriteItem:
    """DCP's write item of a whole plain tensor (``_create_write_item_for_tensor``)."""
    size = tensor.size()
    offsets = torch.Size((0,) * len(size))
    properties = TensorProperties(dtype=tensor.dtype, layout=tensor.layout,
                                  requires_grad=tensor.requires_grad,
                                  memory_format=torch.contiguous_format,
                                  pin_memory=tensor.is_pinned())
    return WriteItem(index=MetadataIndex(fqn, offsets), type=WriteItemType.TENSOR,
                     tensor_data=TensorWriteData(
                         chunk=ChunkStorageMetadata(offsets=offsets, sizes=size),
                         properties=properties, size=size))


def local_load_plan(state_dict: dict[str, Any], metadata: Metadata, strict: bool) -> LoadPlan:
    """``create_default_local_load_plan``: a plain tensor stored as one whole chunk gets its
    read item here, every other value (and every error: a missing key, another size) from
    DCP."""
    items: list[ReadItem] = []
    stored = metadata.state_dict_metadata
    for fqn, obj in state_dict.items():
        item = _whole_read(fqn, stored.get(fqn), obj)
        if item is not None:
            items.append(item)
        else:
            items += create_default_local_load_plan({fqn: obj}, metadata, strict).items
    return LoadPlan(items)


def _whole_read(fqn: str, md: Any, obj: Any) -> ReadItem | None:
    """The one read item of a plain tensor that the checkpoint holds as one whole chunk of
    its size, as DCP's resharding makes it; None for anything else."""
    if type(obj) not in _PLAIN or not isinstance(md, TensorStorageMetadata) or \
            len(md.chunks) != 1:
        return None
    size = obj.size()
    chunk = md.chunks[0]
    if md.size != size or chunk.sizes != size or any(chunk.offsets) or 0 in size:
        return None
    zeros = torch.Size((0,) * len(size))
    return ReadItem(type=LoadItemType.TENSOR, dest_index=MetadataIndex(fqn, zeros, 0),
                    dest_offsets=zeros, storage_index=MetadataIndex(fqn, chunk.offsets, 0),
                    storage_offsets=zeros, lengths=torch.Size(size))


def materialise_meta(state_dict: dict[str, Any], like: Any) -> None:
    """Give each plain contiguous tensor on the meta device in ``state_dict``'s dicts a
    fresh tensor of its shape and dtype, as DCP's load planner does before it plans
    (``_init_state_dict``, through ``empty_like``), on the device ``like(tensor)`` chooses
    for the first one (DCP's own choice, asked once). Lists, DTensors and every other
    value are left to DCP."""
    device = None
    stack = [state_dict]
    while stack:
        current = stack.pop()
        for key, value in current.items():
            if isinstance(value, dict):
                stack.append(value)
            elif type(value) in _PLAIN and value.device == _META and value.is_contiguous():
                if device is None:
                    current[key] = made = like(value)
                    device = made.device
                else:
                    current[key] = torch.empty(value.size(), dtype=value.dtype, device=device)
