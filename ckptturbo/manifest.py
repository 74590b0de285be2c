"""The manifest of a checkpoint: its items, its chunks and where they are, and DCP's view.

The manifest carries everything DCP's ``Metadata`` carries (tensor shapes, dtypes, shard
boxes, planner data), so the reader rebuilds Metadata from JSON and nothing from storage
is ever unpickled. ``build_manifest`` (pure) turns DCP's Metadata and the ranks' write
results into a manifest; ``manifest_codec`` turns it into bytes and back, validating every
field; ``runs`` reads and writes it. No I/O here.
"""
from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .errors import StorageError
from .manifest_codec import decode, encode
from .manifest_records import ItemRecord, ShardRecord, StoredPiece
from .paths import RUN_STORE

if TYPE_CHECKING:  # torch is imported where DCP's metadata is made: `ls` and `inspect` need none
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex


class _ShardIndex(Mapping):
    """DCP's ``Metadata.storage_data`` of a manifest: MetadataIndex -> ShardRecord, looked
    up in the items instead of copied into a dict of every shard (a rank reads a few)."""

    def __init__(self, items: dict[str, ItemRecord]) -> None:
        self._items = items

    def __getitem__(self, index: Any) -> ShardRecord:
        fqn = getattr(index, "fqn", None)
        item = self._items.get(fqn) if isinstance(fqn, str) else None
        shard = item.shard_at(index.offset) if item is not None else None
        if shard is None:
            raise KeyError(index)
        return shard

    def __iter__(self) -> Iterator[Any]:
        from torch.distributed.checkpoint.metadata import MetadataIndex

        for fqn, item in self._items.items():
            if item.kind == "bytes":
                yield MetadataIndex(fqn)
            else:
                for offsets in item.offsets():
                    yield MetadataIndex(fqn, offsets)

    def __len__(self) -> int:
        return sum(len(item.offsets()) for item in self._items.values())

    def __reduce__(self) -> tuple[Any, ...]:
        return dict, (list(self.items()),)  # pickled as the plain dict it stands for


@dataclass
class Manifest:
    """A checkpoint's manifest: its items (what DCP saved), its chunks (id -> size) and
    which store holds them (``chunk_store``), and what DCP's Metadata needs besides."""

    items: dict[str, ItemRecord]
    chunks: dict[str, int]
    planner_data: Any = None
    storage_meta: dict[str, Any] = field(default_factory=dict)
    created: float = field(default_factory=time.time)
    stats: dict[str, Any] = field(default_factory=dict)
    chunk_store: str = RUN_STORE
    dcp_version: str | None = None

    # --- serialisation
    def to_bytes(self) -> bytes:
        """The manifest in the current version's form, with its checksum."""
        return encode(items=self.items, chunks=self.chunks, planner_data=self.planner_data,
                      storage_meta=self.storage_meta, created=self.created, stats=self.stats,
                      chunk_store=self.chunk_store, dcp_version=self.dcp_version)

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> Manifest:
        """The manifest ``data`` holds, of any readable version, every field checked."""
        return cls(**decode(data, where))

    # --- DCP view
    def to_metadata(self) -> Metadata:
        """DCP's Metadata; its ``storage_data`` looks shards up in the items when asked."""
        import torch
        from torch.distributed.checkpoint.metadata import (
            BytesStorageMetadata,
            Metadata,
            StorageMeta,
            TensorProperties,
            TensorStorageMetadata,
        )

        sd_meta: dict[str, Any] = {}
        props: dict[tuple[Any, bool], TensorProperties] = {}  # shared: DCP only reads them
        for fqn, item in self.items.items():
            if item.kind == "bytes":
                sd_meta[fqn] = BytesStorageMetadata()
                continue
            dtype, size = item.dtype, item.size
            assert dtype is not None and size is not None, "a tensor record has dtype and size"
            key = (dtype, item.requires_grad)
            if key not in props:
                props[key] = TensorProperties(dtype=dtype, requires_grad=item.requires_grad)
            sd_meta[fqn] = TensorStorageMetadata(props[key], torch.Size(size),
                                                 item.chunk_metas())
        meta = StorageMeta(checkpoint_id=self.storage_meta.get("checkpoint_id"),
                           save_id=self.storage_meta.get("save_id"))
        return Metadata(state_dict_metadata=sd_meta, planner_data=self.planner_data,
                        storage_data=_ShardIndex(self.items), storage_meta=meta,
                        version=self.dcp_version)

    @property
    def total_bytes(self) -> int:
        return sum(s.nbytes for item in self.items.values() for s in item.shards)

    @property
    def unique_bytes(self) -> int:
        return sum(self.chunks.values())



@dataclass
class ShardPart:
    """What one rank stored of one shard: a DCP WriteResult's ``storage_data``."""

    kind: str
    nbytes: int
    pieces: list[StoredPiece]
    chunk_sizes: dict[str, int]
    written: int = 0
    reused: int = 0


def build_manifest(metadata: Metadata, parts: dict[MetadataIndex, list[ShardPart]], *,
                   url: str, save_id: str, chunk_store_ref: str, world_size: int) -> Manifest:
    """The manifest of a save, from DCP's Metadata and what every rank stored (pure)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    chunks: dict[str, int] = {}
    items: dict[str, ItemRecord] = {}
    written = reused = 0
    for fqn, md in metadata.state_dict_metadata.items():
        is_bytes = isinstance(md, BytesStorageMetadata)
        boxes = ([((), ())] if isinstance(md, BytesStorageMetadata)
                 else [(tuple(c.offsets), tuple(c.sizes)) for c in md.chunks])
        shards = []
        for offsets, sizes in boxes:
            index = MetadataIndex(fqn) if is_bytes else MetadataIndex(fqn, offsets)
            shard, w, r = _merge(parts.get(index, []), fqn, offsets, sizes, chunks)
            shards.append(shard)
            written, reused = written + w, reused + r
        items[fqn] = ItemRecord("bytes", shards) if isinstance(md, BytesStorageMetadata) else (
            ItemRecord("tensor", shards, md.properties.dtype, tuple(md.size),
                       bool(md.properties.requires_grad)))
    return Manifest(
        items=items, chunks=chunks, planner_data=metadata.planner_data,
        storage_meta={"checkpoint_id": url, "save_id": save_id},
        stats={"bytes_written": written, "bytes_reused": reused, "world_size": world_size},
        chunk_store=chunk_store_ref, dcp_version=metadata.version)


def _merge(plist: list[ShardPart], fqn: str, offsets: tuple, sizes: tuple,
           chunks: dict[str, int]) -> tuple[ShardRecord, int, int]:
    """One shard from the parts its writers stored; the pieces must tile it exactly."""
    if not plist:
        raise StorageError(f"no rank wrote {fqn!r} at offset {offsets}: the save is incomplete")
    pieces = sorted((piece for p in plist for piece in p.pieces), key=lambda p: p.start)
    for p in plist:
        chunks.update(p.chunk_sizes)
    record = ShardRecord(offsets, sizes, plist[0].nbytes, pieces)
    record.check(fqn)
    return record, sum(p.written for p in plist), sum(p.reused for p in plist)
