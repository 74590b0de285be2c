"""The payload of a delta record: which elements of a tensor changed from the value before,
and their new values. Pure: tensors in, tensors out, no I/O (``delta_save`` makes
payloads, ``assemble`` and ``changes`` apply them; docs/format.md spells the bytes out).

A payload is a bitmask of ``ceil(numel / 8)`` bytes (element ``i`` is bit ``i % 8`` of
byte ``i // 8``: numpy's ``packbits(bitorder="little")``), then the changed elements'
values in row-major order, in the tensor's dtype, back to back. Elements are compared by
their bits, not their values, so a NaN that stays the same bits is unchanged and a
``-0.0`` that becomes ``0.0`` is a change: what is loaded is bit for bit what was saved.
"""
from __future__ import annotations

import numpy as np
import torch

from .errors import FormatError

# An element of each width compared and moved as one integer; wider ones as rows of bytes.
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def mask_bytes(numel: int) -> int:
    """The bytes of a payload's bitmask for a tensor of ``numel`` elements."""
    return (numel + 7) // 8


def _rows(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's elements as integers of their width, a view of its memory
    (elements wider than 8 bytes: one row of bytes each), so that comparing and copying
    them works on bits."""
    flat = t.reshape(-1)
    as_int = _INT_OF_SIZE.get(t.element_size())
    if as_int is not None:
        return flat.view(as_int)
    return flat.view(torch.uint8).reshape(-1, t.element_size())


def _from_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Elements taken out of ``_rows`` as a 1-D tensor of ``dtype`` again."""
    return rows.reshape(-1).view(dtype) if rows.dim() == 2 else rows.view(dtype)


def changed(base: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """The elements whose bits differ, as a flat bool mask (same shape and dtype given)."""
    diff = _rows(base.contiguous()) != _rows(new.contiguous())
    return diff if diff.dim() == 1 else diff.any(dim=1)


def encode(mask: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """The payload that turns the value before into ``new``: ``mask`` of the changed
    elements (``changed``), then their new values (a uint8 tensor on the CPU)."""
    bits = torch.from_numpy(np.packbits(mask.cpu().numpy(), bitorder="little"))
    values = _rows(new.contiguous().cpu())[mask.cpu()]
    return torch.cat([bits, values.reshape(-1).view(torch.uint8)])


def count(mask: torch.Tensor) -> int:
    """The changed elements of a bool mask (numpy's count: a torch sum of a bool tensor
    of millions of elements is ~100x slower, and every delta is counted on save and load)."""
    return int(np.count_nonzero(mask.cpu().numpy()))


def payload_bytes(mask: torch.Tensor, itemsize: int) -> int:
    """How many bytes ``encode`` makes of ``mask`` for elements of ``itemsize`` bytes."""
    return mask_bytes(mask.numel()) + count(mask) * itemsize


def split(payload: torch.Tensor, numel: int, dtype: torch.dtype,
          where: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A payload's mask (bool, ``numel`` elements) and new values (1-D, ``dtype``);
    refused with FormatError, naming ``where``, when its parts do not fit together."""
    head = mask_bytes(numel)
    data = payload.cpu().contiguous()
    if data.numel() < head:
        raise FormatError(f"{where}: a delta payload of {data.numel()} bytes is shorter than "
                          f"its mask of {head}")
    bits = np.unpackbits(data[:head].numpy(), count=numel, bitorder="little")
    mask = torch.from_numpy(bits.view(bool))
    changed_count = int(np.count_nonzero(bits))
    itemsize = torch.empty(0, dtype=dtype).element_size()
    if data.numel() - head != changed_count * itemsize:
        raise FormatError(f"{where}: a delta payload holds {data.numel() - head} bytes of "
                          f"values for {changed_count} changed elements of {itemsize} bytes")
    return mask, data[head:].clone().view(dtype)


def apply(value: torch.Tensor, mask: torch.Tensor, values: torch.Tensor) -> None:
    """Write ``values`` into the masked elements of ``value`` (contiguous), in place
    (``masked_scatter_``: the same elements in the same order as boolean indexing, 2-3x
    faster on the CPU)."""
    rows = _rows(value)
    mask = mask.to(value.device).reshape(-1)
    src = _rows(values.to(value.device))
    if rows.dim() == 1:
        rows.masked_scatter_(mask, src)
    else:
        rows[mask] = src


def compose(parts: list[tuple[torch.Tensor, torch.Tensor]], numel: int,
            dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """One (mask, values) with the effect of applying ``parts`` in order: an element
    changed by several takes the last one's value."""
    if len(parts) == 1:
        return parts[0]
    mask = torch.zeros(numel, dtype=torch.bool)
    acc = torch.empty(numel, dtype=dtype)
    for m, v in parts:
        apply(acc, m, v)
        mask |= m
    return mask, _from_rows(_rows(acc)[mask], dtype)
