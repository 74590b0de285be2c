"""A rank's local save and load plans as DCP's default planners make them, built faster.

At thousands of ranks each rank's own planning is most of a save's or load's CPU: DCP's
default planners build every item through helpers that handle every kind of tensor
(DTensor, ShardedTensor, resharding between chunk lists), about 30 us an item, and a load
into a state dict on the meta device materialises each tensor through ``empty_like``'s
Python reference (about 100 us). A plain tensor, saved whole and loaded whole, needs none
of that: these functions build its items directly, and hand every other value to DCP's own
functions, item by item. A DTensor's shard (its size and offset) is computed once per
shape and placement, not once per item. The plans are equal to DCP's, item for item (the
tests compare them). No I/O, no collectives.
"""
from __future__ import annotations

from collections.abc import Callable
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
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

_PLAIN = (torch.Tensor, torch.nn.Parameter)  # exactly these types; subclasses go to DCP
_META = torch.device("meta")


def local_save_plan(state_dict: dict[str, Any], is_coordinator: bool) -> SavePlan:
    """``create_default_local_save_plan`` of a flattened state dict: the write item of a
    plain tensor or of a DTensor over one made here, every other value's by DCP."""
    items: list[WriteItem] = []
    shards = _Shards()
    for fqn, obj in state_dict.items():
        if type(obj) in _PLAIN:
            items.append(_whole_write(fqn, obj))
            continue
        shard = shards.of(obj)
        if shard is not None:
            items.append(_shard_write(fqn, obj, *shard))
        else:
            items += create_default_local_save_plan({fqn: obj}, is_coordinator).items
    return SavePlan(items)


def _whole_write(fqn: str, tensor: torch.Tensor) -> WriteItem:
    """DCP's write item of a whole plain tensor (``_create_write_item_for_tensor``)."""
    size = tensor.size()
    offsets = _zeros(len(size))
    properties = TensorProperties(dtype=tensor.dtype, layout=tensor.layout,
                                  requires_grad=tensor.requires_grad,
                                  memory_format=torch.contiguous_format,
                                  pin_memory=tensor.is_pinned())
    return WriteItem(index=MetadataIndex(fqn, offsets), type=WriteItemType.TENSOR,
                     tensor_data=TensorWriteData(
                         chunk=ChunkStorageMetadata(offsets=offsets, sizes=size),
                         properties=properties, size=size))


class _Shards:
    """This rank's shard of DTensors, ``(sizes, offsets)`` as DCP computes them
    (``compute_local_shape_and_global_offset``), once per shape, mesh and placements:
    the layers of a model repeat a handful of shapes."""

    def __init__(self) -> None:
        self._of: dict[tuple, tuple[torch.Size, torch.Size] | None] = {}

    def of(self, obj: Any) -> tuple[torch.Size, torch.Size] | None:
        """None where DCP's own path must decide: not a DTensor over a plain tensor, a
        partial placement (DCP raises), a rank outside the mesh (DCP skips the item)."""
        if type(obj) is not DTensor or type(obj._local_tensor) not in _PLAIN:
            return None
        mesh, placements = obj.device_mesh, obj.placements
        key = (obj.shape, id(mesh), placements)
        if key not in self._of:
            shard = None
            if not any(p.is_partial() for p in placements) and \
                    mesh.get_coordinate() is not None:
                sizes, offsets = compute_local_shape_and_global_offset(obj.shape, mesh,
                                                                       placements)
                shard = (torch.Size(sizes), torch.Size(offsets))
            self._of[key] = shard
        return self._of[key]


def _shard_write(fqn: str, obj: DTensor, sizes: torch.Size, offsets: torch.Size) -> WriteItem:
    """DCP's write item of a DTensor's shard (``_create_write_items_for_dtensor``; its
    properties those of ``to_local()``, whose result needs grad only where grad is on)."""
    local = obj._local_tensor
    properties = TensorProperties(dtype=local.dtype, layout=local.layout,
                                  requires_grad=obj.requires_grad and torch.is_grad_enabled(),
                                  memory_format=torch.contiguous_format,
                                  pin_memory=local.is_pinned())
    return WriteItem(index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                     tensor_data=TensorWriteData(
                         chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
                         properties=properties, size=obj.size()))


def local_load_plan(state_dict: dict[str, Any], metadata: Metadata, strict: bool) -> LoadPlan:
    """``create_default_local_load_plan``: a plain tensor or a DTensor's shard that the
    checkpoint holds as one chunk of exactly its box gets its read item here, every other
    value (and every error: a missing key, another size) from DCP."""
    items: list[ReadItem] = []
    stored = metadata.state_dict_metadata
    shards = _Shards()
    for fqn, obj in state_dict.items():
        item = _whole_read(fqn, stored.get(fqn), obj, shards)
        if item is not None:
            items.append(item)
        else:
            items += create_default_local_load_plan({fqn: obj}, metadata, strict).items
    return LoadPlan(items)


def _whole_read(fqn: str, md: Any, obj: Any, shards: _Shards) -> ReadItem | None:
    """The one read item of a plain tensor, or of a DTensor's shard, that the checkpoint
    holds as one chunk of exactly its box, as DCP's resharding makes it (saved chunks do
    not overlap: DCP validates that on save); None for anything else."""
    if not isinstance(md, TensorStorageMetadata):
        return None
    size = obj.size()
    if md.size != size:
        return None
    if type(obj) in _PLAIN:
        sizes, offsets = size, _zeros(len(size))
    else:
        shard = shards.of(obj)
        if shard is None:
            return None
        sizes, offsets = shard
    if 0 in sizes:
        return None
    chunks = md.chunks
    if len(chunks) == 1 and chunks[0].offsets == offsets and chunks[0].sizes == sizes:
        at: int | None = 0
    else:
        at = next((i for i, c in enumerate(chunks) if c.offsets == offsets and c.sizes == sizes),
                  None)
    if at is None:
        return None
    zeros = _zeros(len(sizes))
    dest = MetadataIndex(fqn, offsets, 0)
    # the chunk at position 0 of exactly this box is named as the destination is (an index
    # cannot change: the item holds it twice)
    stored = dest if at == 0 else MetadataIndex(fqn, chunks[at].offsets, at)
    return ReadItem(type=LoadItemType.TENSOR, dest_index=dest, dest_offsets=zeros,
                    storage_index=stored, storage_offsets=zeros,
                    lengths=sizes if type(sizes) is torch.Size else torch.Size(sizes))


_ZEROS: dict[int, torch.Size] = {}


def _zeros(ndim: int) -> torch.Size:
    """The offsets of a box's origin, one per rank of tensor (a torch.Size cannot change:
    items share it)."""
    if ndim not in _ZEROS:
        _ZEROS[ndim] = torch.Size((0,) * ndim)
    return _ZEROS[ndim]


def materialise_meta(state_dict: dict[str, Any],
                     like: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Give each tensor on the meta device in ``state_dict`` a fresh one, as DCP's load
    planner does before it plans (``_init_state_dict``, through ``empty_like`` and, for a
    DTensor, ``DTensor.from_local``: about 0.1 and 0.6 ms each): a plain contiguous tensor,
    or a DTensor with one as its local tensor, gets ``torch.empty`` on the device ``like``
    picked for the first meta tensor (DCP's choice, asked once) and a DTensor its own
    spec; any other ``like``'s own. Walks dicts (in place), lists and tuples (new ones
    where something changed) as DCP does; DCP's own walk then finds nothing left to do."""
    device: list[torch.device] = []

    def fresh(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            if obj.device != _META:
                return obj
            if device and type(obj) in _PLAIN and obj.is_contiguous():
                return torch.empty(obj.size(), dtype=obj.dtype, device=device[0])
            if device and type(obj) is DTensor:
                local = obj._local_tensor
                if type(local) in _PLAIN and local.is_contiguous():
                    empty = torch.empty(local.size(), dtype=local.dtype, device=device[0])
                    return DTensor(empty, obj._spec, requires_grad=False)
            made = like(obj)
            device[:1] = [made.device]
            return made
        if isinstance(obj, dict):
            for key, value in obj.items():
                obj[key] = fresh(value)
            return obj
        if isinstance(obj, (list, tuple)):
            out = [fresh(v) for v in obj]
            if all(a is b for a, b in zip(out, obj, strict=True)):
                return obj
            return tuple(out) if isinstance(obj, tuple) else out
        return obj

    fresh(state_dict)
