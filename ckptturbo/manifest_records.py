"""The records a manifest is made of: one per state-dict entry (``ItemRecord``), its
shards (``ShardRecord``) and where their bytes are (``StoredPiece``), and the dtypes they
name. Pure: no I/O, and torch only where tensors or DCP's metadata are made, so that
``ckptturbo ls`` and ``inspect`` need none. ``manifest_codec`` reads and writes them.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import TYPE_CHECKING, Any, NamedTuple

from .errors import FormatError

if TYPE_CHECKING:  # torch is imported where tensors are made: `ls` and `inspect` need none
    import torch

# Bytes per element of every dtype torch names, so a manifest is validated without importing
# torch (tests/test_cli_messages.py checks this table against torch's own dtypes).
DTYPE_ITEMSIZES = {
    "bool": 1, "uint8": 1, "int8": 1, "int16": 2, "int32": 4, "int64": 8, "uint16": 2,
    "uint32": 4, "uint64": 8, "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8,
    "complex32": 4, "complex64": 8, "complex128": 16, "qint8": 1, "quint8": 1, "qint32": 4,
    "quint4x2": 1, "quint2x4": 1, "bits1x8": 1, "bits2x4": 1, "bits4x2": 1, "bits8": 1,
    "bits16": 2, "float8_e5m2": 1, "float8_e4m3fn": 1, "float8_e5m2fnuz": 1,
    "float8_e4m3fnuz": 1, "float8_e8m0fnu": 1, "float4_e2m1fn_x2": 1,
    "bcomplex32": 4,  # torch 2.14
    **{f"{kind}{bits}": 1 for kind in ("uint", "int") for bits in range(1, 8)},
}



def nonnegative_ints(values: Any, where: str) -> list[int]:
    """``values`` as a list, refused unless it is a list of non-negative integers."""
    if not isinstance(values, (list, tuple)):
        raise FormatError(f"{where}: expected a list of integers, got {type(values).__name__}")
    for v in values:
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise FormatError(f"{where}: expected non-negative integers, got {v!r}")
    return list(values)


class StoredPiece(NamedTuple):
    """Where bytes [start, start+length) of a shard live: a chunk and an offset in it (a
    tuple: a loading rank makes thousands of them from the manifest's piece lists)."""

    start: int
    length: int
    chunk: str
    offset: int


def dtype_name(dtype: torch.dtype | str) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: Any) -> torch.dtype:
    """The torch.dtype a manifest names (this imports torch)."""
    import torch

    if isinstance(name, str) and name in _TORCH_DTYPES:
        return _TORCH_DTYPES[name]
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype) or dtype_name(dtype) != name:
        raise FormatError(f"unknown dtype {name!r} in manifest")
    _TORCH_DTYPES[str(name)] = dtype
    return dtype


_TORCH_DTYPES: dict[str, Any] = {}  # parse_dtype's answers: a manifest names a few dtypes often


class DtypeName(str):
    """A dtype as a manifest names it, with its item size: enough to validate a manifest
    and to show it, without torch. ``ItemRecord.dtype`` turns it into a torch.dtype."""

    itemsize: int

    @classmethod
    def parse(cls, name: Any) -> DtypeName:
        if not isinstance(name, str):
            raise FormatError(f"unknown dtype {name!r} in manifest")
        itemsize = DTYPE_ITEMSIZES.get(name)
        if itemsize is None:  # a dtype newer than this table: ask torch itself
            itemsize = parse_dtype(name).itemsize
        out = cls(name)
        out.itemsize = itemsize
        return out


@dataclass
class ShardRecord:
    """One stored box of a tensor (or the whole of a bytes object), and where its bytes are.

    A delta shard (a tensor saved with ``delta_from``, docs/format.md) is its base value's
    bytes followed by payloads, each the changes from the value before it
    (``delta_codec``): ``deltas`` holds the payloads' lengths, oldest first, and the
    pieces tile ``nbytes`` plus those. ``nbytes`` is always the value's own bytes."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    nbytes: int
    pieces: list[StoredPiece]
    deltas: tuple[int, ...] = ()

    @property
    def stored_bytes(self) -> int:
        """The bytes its pieces hold: the value's, or a delta's base and payloads."""
        return self.nbytes + sum(self.deltas)

    def check(self, where: str) -> None:
        """Pieces must tile [0, stored_bytes) exactly, in order: no gaps, no overlaps."""
        pos = 0
        for p in self.pieces:
            if p.start != pos:
                raise FormatError(f"{where}: pieces do not tile the shard "
                                  f"(gap or overlap at byte {pos})")
            pos += p.length
        if pos != self.stored_bytes:
            raise FormatError(f"{where}: pieces cover {pos} of {self.stored_bytes} bytes")


class Boxes:
    """The shard boxes of the tensor records of one shape, dtype and ``boxes`` list, parsed
    once: a model's tensors share a few shapes and one sharding (the 186K shards of a 72B
    HSDP manifest have a few dozen distinct lists), and so do DCP's chunk metadata."""

    def __init__(self, ndim: int, flat: tuple[int, ...], where: str) -> None:
        nonnegative_ints(flat, where)
        step = 2 * ndim
        if (step == 0 and flat) or (step and len(flat) % step):
            raise FormatError(f"{where!r}: {len(flat)} box values do not make boxes of rank {ndim}")
        starts = range(0, len(flat), step) if step else range(1)
        self.offsets = [flat[i:i + ndim] for i in starts]
        self.sizes = [flat[i + ndim:i + step] for i in starts]
        self._position: dict[tuple[int, ...], int] | None = None
        self._chunk_metas: list[Any] | None = None

    def check_fits(self, size: tuple[int, ...], where: str) -> None:
        """Every box lies inside a tensor of ``size``."""
        # the boxes were cut from ``flat`` in steps of twice ``ndim`` = len(size)
        for offsets, sizes in zip(self.offsets, self.sizes, strict=True):
            if any(o + n > d for o, n, d in zip(offsets, sizes, size, strict=True)):
                raise FormatError(f"{where!r}: shard {offsets}+{sizes} exceeds size {size}")

    def nbytes(self, itemsize: int) -> list[int]:
        """The bytes each box holds of a dtype of ``itemsize``."""
        return [math.prod(s) * itemsize for s in self.sizes]

    def position(self, offsets: Sequence[int]) -> int | None:
        """Which box starts at ``offsets`` (None: none)."""
        if self._position is None:
            self._position = {o: j for j, o in enumerate(self.offsets)}
        return self._position.get(tuple(offsets))

    def chunk_metas(self) -> list[Any]:
        """DCP's ChunkStorageMetadata of the boxes, made once (DCP only reads them)."""
        if self._chunk_metas is None:
            import torch
            from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

            self._chunk_metas = [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s))
                                 for o, s in zip(self.offsets, self.sizes, strict=True)]
        return self._chunk_metas


OBJECT_BOX = Boxes(0, (), "an object")  # an object's one shard has no box


class ItemRecord:
    """One state-dict entry: a tensor (possibly in several shards) or a serialized object.

    A record read from a manifest keeps its pieces as the manifest lists them (the piece
    count of each shard, then (length, chunk ordinal, offset) per piece), builds its
    ``shards`` when they are first read, and ``shard_at`` builds only the one asked for:
    a loading rank of an HSDP job uses one shard in 64."""

    __slots__ = ("kind", "size", "requires_grad", "_dtype", "_shards", "_boxes", "_pieces",
                 "_ids", "_first", "_position", "_deltas")

    def __init__(self, kind: str, shards: list[ShardRecord] | None, dtype: Any = None,
                 size: tuple[int, ...] | None = None, requires_grad: bool = False) -> None:
        self.kind = kind
        self.size = size
        self.requires_grad = requires_grad
        self._dtype = dtype  # a torch.dtype, or its name until first read
        self._shards = shards
        self._boxes: Boxes | None = None
        self._pieces: list[int] = []
        self._ids: list[str] = []
        self._first: list[int] | None = None
        self._position: dict[tuple[int, ...], int] | None = None
        self._deltas: tuple[int, ...] = ()  # a stored delta record's payload lengths

    @classmethod
    def stored(cls, kind: str, dtype: Any, size: tuple[int, ...] | None, requires_grad: bool,
                boxes: Boxes, pieces: list[int], ids: list[str],
                deltas: tuple[int, ...] = ()) -> ItemRecord:
        """A record as a version 3 or 4 manifest holds it (checked by the caller);
        ``deltas``: a delta record's payload lengths (its one shard's)."""
        item = cls(kind, None, dtype, size, requires_grad)
        item._boxes, item._pieces, item._ids, item._deltas = boxes, pieces, ids, deltas
        return item

    @property
    def dtype(self) -> torch.dtype | None:
        if isinstance(self._dtype, str):
            self._dtype = parse_dtype(str(self._dtype))
        return self._dtype

    @property
    def dtype_name(self) -> str | None:
        """The dtype's name ("bfloat16"), read without importing torch."""
        return None if self._dtype is None else dtype_name(self._dtype)

    @property
    def shards(self) -> list[ShardRecord]:
        if self._shards is None:
            self._shards = [self._shard(j) for j in range(len(self._stored_boxes().offsets))]
        return self._shards

    def shard_at(self, offsets: Sequence[int] | None) -> ShardRecord | None:
        """The shard a DCP ``MetadataIndex`` names (an object's by no offsets, a tensor's
        by its offsets), or None."""
        if (self.kind == "bytes") != (offsets is None):
            return None
        if self._shards is None:
            j = self._stored_boxes().position(offsets or ())
            return None if j is None else self._shard(j)
        if self._position is None:
            self._position = {tuple(s.offsets): j for j, s in enumerate(self._shards)}
        j = self._position.get(tuple(offsets or ()))
        return None if j is None else self._shards[j]

    def _stored_boxes(self) -> Boxes:
        """The boxes of a record without built shards: only ``stored`` makes one."""
        assert self._boxes is not None, "a record without shards is made by ItemRecord.stored"
        return self._boxes

    def _shard(self, j: int) -> ShardRecord:
        """Shard ``j`` of a stored record; a piece starts where the one before it ended."""
        boxes = self._stored_boxes()
        raw, ids, count = self._pieces, self._ids, len(boxes.offsets)
        if self._first is None:
            self._first = list(accumulate(raw[:count], initial=0))
        at = count + 3 * self._first[j]
        out, pos = [], 0
        for i in range(at, at + 3 * raw[j], 3):
            out.append(StoredPiece(pos, raw[i], ids[raw[i + 1]], raw[i + 2]))
            pos += raw[i]
        return ShardRecord(boxes.offsets[j], boxes.sizes[j], pos - sum(self._deltas), out,
                           self._deltas)

    def offsets(self) -> list[tuple[int, ...]]:
        """The offsets of the shards, without building them."""
        if self._shards is None:
            return self._stored_boxes().offsets
        return [tuple(s.offsets) for s in self._shards]

    def chunk_metas(self) -> list[Any]:
        """DCP's ChunkStorageMetadata of each shard."""
        if self._shards is None:
            return list(self._stored_boxes().chunk_metas())
        import torch
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [ChunkStorageMetadata(offsets=torch.Size(s.offsets), sizes=torch.Size(s.sizes))
                for s in self._shards]

    def to_record(self, fqn: str, ordinal: dict[str, int]) -> list[Any]:
        """The item as a version 3 manifest spells it, or a delta record as version 4 does
        (docs/format.md)."""
        counts: list[int] = []
        triples: list[int] = []
        boxes: list[int] = []
        deltas: list[int] = []
        for s in self.shards:
            deltas += s.deltas
            s.check(fqn)  # the record leaves piece starts out: they follow from the lengths
            counts.append(len(s.pieces))
            for p in s.pieces:
                triples += (p.length, ordinal[p.chunk], p.offset)
            boxes += s.offsets
            boxes += s.sizes
        if self.kind == "bytes":
            return ["bytes", counts + triples]
        assert self.size is not None, "a tensor record is made with its size"
        record = ["tensor", self.dtype_name, list(self.size), bool(self.requires_grad), boxes,
                  counts + triples]
        if deltas:
            if len(self.shards) != 1:
                raise FormatError(f"{fqn!r}: a delta record has exactly one shard")
            record[0] = "delta"
            record.append(deltas)
        return record

