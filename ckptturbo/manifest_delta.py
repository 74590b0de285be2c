"""Delta records in a manifest, and the versions of its tensors. Pure: records in,
records out, no I/O.

A delta record (docs/format.md) is its base tensor's own stored pieces followed by
payloads (``delta_codec``), so it needs no other manifest to be read, verified or kept by
gc, and a delta of a delta is the base's record with one payload more. ``delta_record``
makes one, ``delta_room`` says how many payload bytes a tensor may still take before it
is stored in full again (the rebase rule), and ``tensor_versions`` gives every tensor's
content key and the keys of the versions it was built from, from the manifest alone.
"""
from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .chunks import chunk_id
from .manifest import Manifest
from .manifest_records import ItemRecord, ShardRecord, StoredPiece

if TYPE_CHECKING:  # torch is imported where a dtype is parsed: `ls` and `inspect` need none
    import torch

# The rebase rule: a tensor is stored in full again once it has this many payloads, or
# when its payloads would hold more bytes than the tensor itself (``delta_room``).
MAX_CHAIN = 8


@dataclass(frozen=True)
class TensorVersion:
    """A tensor of a checkpoint, by content, from its manifest alone.

    ``key`` names its value as stored (equal keys: equal values; the same value stored
    differently, e.g. in full after a rebase, may get another key); ``chain`` the keys
    of the versions a delta record was built from, oldest first (empty for a tensor
    stored in full); ``nbytes`` its bytes in full."""

    key: str
    chain: tuple[str, ...]
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int


def span_pieces(shard: ShardRecord, spans: Iterable[tuple[int, int]]) -> list[StoredPiece]:
    """Where the bytes of ``spans`` ([start, end) of ``shard``) are, as the pieces of a
    shard that holds them back to back (a delta record's base, or payloads read alone)."""
    out, pos = [], 0
    for start, end in spans:
        for p in shard.pieces:
            lo, hi = max(start, p.start), min(end, p.start + p.length)
            if lo < hi:
                out.append(StoredPiece(pos, hi - lo, p.chunk, p.offset + lo - p.start))
                pos += hi - lo
    return out


def _clip(shard: ShardRecord, start: int, end: int) -> list[list[Any]]:
    """[chunk, offset, length] of the bytes [start, end) of a shard: what a key names."""
    return [[p.chunk, p.offset, p.length] for p in span_pieces(shard, [(start, end)])]


def _key(*parts: Any) -> str:
    return chunk_id(json.dumps(parts, separators=(",", ":")).encode())


def versions_of(item: ItemRecord) -> tuple[str, tuple[str, ...]]:
    """A tensor record's content key and chain (``TensorVersion``): the key of its stored
    value's bytes (for a delta record, its base's), then one key per payload, each made
    of the key before it and where the payload is."""
    shards = item.shards
    key = _key(item.dtype_name, list(item.size or ()),
               [[list(s.offsets), list(s.sizes), _clip(s, 0, s.nbytes)] for s in shards])
    chain: list[str] = []
    for s in shards:
        pos = s.nbytes
        for length in s.deltas:
            chain.append(key)
            key = _key(key, _clip(s, pos, pos + length))
            pos += length
    return key, tuple(chain)


def tensor_versions(manifest: Manifest) -> dict[str, TensorVersion]:
    """Every tensor's ``TensorVersion`` (objects are left out)."""
    out = {}
    for fqn, item in manifest.items.items():
        if item.kind != "tensor":
            continue
        key, chain = versions_of(item)
        assert item.dtype is not None, "a tensor record has a dtype"
        out[fqn] = TensorVersion(key, chain, item.dtype, tuple(item.size or ()),
                                 sum(s.nbytes for s in item.shards))
    return out


def payload_spans(item: ItemRecord) -> list[tuple[int, int]]:
    """The byte spans [start, end) of a delta record's payloads in its shard, oldest first
    (empty for a record stored in full)."""
    shard = item.shards[0]
    spans, pos = [], shard.nbytes
    for length in shard.deltas:
        spans.append((pos, pos + length))
        pos += length
    return spans


def whole_shard(item: ItemRecord) -> ShardRecord | None:
    """The one shard of a tensor stored whole (in full or as a delta record): what a delta
    can be taken from; None for objects and tensors stored in several shards."""
    if item.kind != "tensor" or len(item.offsets()) != 1:
        return None
    shard = item.shards[0]
    return shard if tuple(shard.sizes) == tuple(item.size or ()) else None


def delta_room(base: ItemRecord) -> int:
    """How many bytes a new payload over ``base`` may have (0: none; store the tensor in
    full). A payload must be smaller than this: the tensor's bytes less its payloads so far,
    and no more than ``MAX_CHAIN`` payloads in all."""
    shard = whole_shard(base)
    if shard is None or len(shard.deltas) >= MAX_CHAIN:
        return 0
    return shard.nbytes - sum(shard.deltas)


def delta_record(base: ItemRecord, payload: ShardRecord | None,
                 requires_grad: bool) -> ItemRecord:
    """The record of a tensor saved as ``payload`` (a stored uint8 shard) over ``base``,
    or, with no payload (nothing changed), the base's own value."""
    shard = whole_shard(base)
    assert shard is not None, "a delta is taken only over a tensor stored whole (delta_room)"
    if payload is None or payload.nbytes == 0:
        pieces, deltas = list(shard.pieces), shard.deltas
    else:
        shift = shard.stored_bytes
        pieces = shard.pieces + [StoredPiece(p.start + shift, p.length, p.chunk, p.offset)
                                 for p in payload.pieces]
        deltas = (*shard.deltas, payload.nbytes)
    record = ShardRecord(shard.offsets, shard.sizes, shard.nbytes, pieces, deltas)
    return ItemRecord("tensor", [record], base.dtype, base.size, requires_grad)


@dataclass(frozen=True)
class DeltaBase:
    """What a save stores of one tensor over a base: the base's record, and whether the
    stored item is a payload over it (False: the tensor is unchanged; the save stored an
    empty placeholder and the base's record is used as it is)."""

    record: ItemRecord
    payload: bool
    requires_grad: bool


def with_deltas(manifest: Manifest, bases: Mapping[str, DeltaBase],
                base_chunks: Mapping[str, int]) -> Manifest:
    """The manifest of a delta save: each item of ``bases`` (stored as its payload, a uint8
    tensor) becomes its delta record, and the base chunks those name join the chunk table,
    so the checkpoint is read, verified and kept by gc without its base's manifest."""
    items = dict(manifest.items)
    chunks = dict(manifest.chunks)
    for fqn, base in bases.items():
        stored = items[fqn].shards[0] if base.payload else None
        items[fqn] = record = delta_record(base.record, stored, base.requires_grad)
        for p in record.shards[0].pieces:
            if p.chunk not in chunks:
                chunks[p.chunk] = base_chunks[p.chunk]
    manifest.items, manifest.chunks = items, chunks
    return manifest
