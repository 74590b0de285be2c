"""A rank's local save and load plans as DCP's default planners make them, built faster.

At thousands of ranks each rank's own planning is most of a save's or load's CPU: DCP's
default planners build every item through helpers that handle every kind of tensor
(DTensor, ShardedTensor, resharding between chunk lists), about 30 us an item, and a load
into a state dict on the meta device materialises each tensor through ``empty_like``'s
Python reference (about 100 us). A plain tensor, saved whole and loaded whole, needs none
of that: these functions build its items directly, and hand every other value to DCP's own
functions, item by item; and a state dict of nested dicts is flattened (and on a load
materialised) in one walk instead of DCP's three. The plans are equal to DCP's, item for
item (the tests compare them). No I/O, no collectives.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.distributed.checkpoint import _version
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
from torch.distributed.tensor import DTensor

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


class _NotPlain(Exception):
    """A value ``plain_state`` leaves to DCP's own set-up."""


def plain_state(state_dict: dict[str, Any], flatten: bool,
                like: Callable[[torch.Tensor], torch.Tensor] | None
                ) -> tuple[dict[str, Any], dict[str, tuple[str, ...]]] | None:
    """DCP's set-up of a state dict in one walk: ``(flat, mappings)`` as DCP's
    ``flatten_state_dict`` makes them (``flatten``; else the state dict itself and no
    mappings), for nested dicts whose values are tensors of plain types or DTensors, or
    neither lists, tuples nor tensors; None for anything else (DCP's own path then).

    ``like``: a load, where DCP's planner first materialises each tensor on the meta
    device (``_init_state_dict``): here a plain contiguous one gets ``torch.empty`` on the
    device ``like`` picked for the first (DCP's choice, asked once), any other ``like``'s
    own. Tensors already materialised when None is returned stay so (DCP skips them)."""
    if _version._derived_version is not None:  # DCP's pre-2.4 key format: its own path
        return None
    flat: dict[str, Any] = {}
    mappings: dict[str, tuple[str, ...]] = {}
    device: list[torch.device] = []

    def fresh(value: torch.Tensor) -> torch.Tensor:
        if like is None or value.device != _META:
            return value
        if device and type(value) in _PLAIN and value.is_contiguous():
            return torch.empty(value.size(), dtype=value.dtype, device=device[0])
        made = like(value)
        device[:1] = [made.device]
        return made

    def walk(container: dict[str, Any], path: tuple[str, ...]) -> None:
        for key, value in container.items():
            here = (*path, str(key))
            if type(value) is dict:
                walk(value, here)
                continue
            if isinstance(value, (Mapping, list, tuple)):
                raise _NotPlain
            if isinstance(value, torch.Tensor):
                if type(value) not in _PLAIN and not isinstance(value, DTensor):
                    raise _NotPlain  # ShardedTensor, other subclasses
                value = container[key] = fresh(value)
            if flatten:
                fqn = ".".join(here)
                if fqn in flat:
                    raise _NotPlain  # DCP names the duplicate
                flat[fqn] = value
                mappings[fqn] = here

    try:
        walk(state_dict, ())
    except _NotPlain:
        return None
    return (flat, mappings) if flatten else (state_dict, {})
