"""Chunking and BLAKE3 content ids.

A chunk is an immutable object named by the BLAKE3 hash of its bytes, so identical bytes
(replicas, tied weights, unchanged tensors of an earlier save) are stored once. Large
shards are cut at multiples of ``chunk_size`` from the shard's start, so whoever writes a
range of a replicated tensor produces exactly the chunks anyone else would have. Small
pieces are packed together into one chunk, because an object store charges a round trip
per object and a model has thousands of small tensors. Where chunks live in storage (the
fan-out) and how manifests name their bytes is the storage contract, in ``paths`` and
``manifest``.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import blake3

from .errors import FormatError

T = TypeVar("T")

CHUNK_ID_RE = re.compile(r"^[0-9a-f]{64}$")
DEFAULT_CHUNK_SIZE = 64 << 20
DEFAULT_PACK_THRESHOLD = 1 << 20


def chunk_id(data: bytes | bytearray | memoryview) -> str:
    """BLAKE3 hex digest; multi-threaded for big buffers (the GIL is released)."""
    threads = blake3.blake3.AUTO if len(data) >= (8 << 20) else 1
    return blake3.blake3(data, max_threads=threads).hexdigest()


def validate_chunk_id(value: str) -> str:
    """Chunk names come from manifests that may be hostile: hex only, fixed length."""
    if not isinstance(value, str) or not CHUNK_ID_RE.match(value):
        raise FormatError(f"invalid chunk id {value!r}: expected 64 lowercase hex digits")
    return value


def cut(start: int, end: int, chunk_size: int) -> list[tuple[int, int]]:
    """Split [start, end) at multiples of chunk_size counted from 0 (the shard start)."""
    if chunk_size <= 0:
        raise ValueError("chunk_size must be positive")
    bounds = []
    pos = start
    while pos < end:
        stop = min(end, (pos // chunk_size + 1) * chunk_size)
        bounds.append((pos, stop))
        pos = stop
    return bounds


@dataclass(frozen=True)
class Piece:
    """Bytes [start, end) of one shard, to be stored somewhere in one chunk."""

    key: int          # index of the shard in the writer's item list
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class ChunkLayout:
    """One chunk to write: the pieces it holds, back to back, in order."""

    pieces: tuple[Piece, ...]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.pieces)


def layout_chunks(ranges: Iterable[tuple[int, int, int]], chunk_size: int,
                  pack_threshold: int = DEFAULT_PACK_THRESHOLD) -> list[ChunkLayout]:
    """Turn (key, start, end) ranges into the chunks that store them.

    Ranges of at least ``pack_threshold`` bytes are cut at chunk_size boundaries and each
    piece gets a chunk of its own (stable ids across saves and ranks). Smaller ranges are
    packed back to back into chunks of up to ``pack_size`` bytes, in the given order.
    """
    pack_size = min(chunk_size, 16 << 20)
    out: list[ChunkLayout] = []
    pack: list[Piece] = []
    pack_bytes = 0
    for key, start, end in ranges:
        if end - start >= pack_threshold:
            out.extend(ChunkLayout((Piece(key, s, e),)) for s, e in cut(start, end, chunk_size))
            continue
        if pack and pack_bytes + (end - start) > pack_size:
            out.append(ChunkLayout(tuple(pack)))
            pack, pack_bytes = [], 0
        pack.append(Piece(key, start, end))
        pack_bytes += end - start
    if pack:
        out.append(ChunkLayout(tuple(pack)))
    return out


def batched(items: Iterable[T], nbytes: Callable[[T], int], limit: int) -> Iterator[list[T]]:
    """``items`` in order, cut into consecutive batches of at most ``limit`` bytes (an item
    larger than ``limit`` alone): the one way memory-bounded loops cut their work."""
    batch: list[T] = []
    held = 0
    for item in items:
        size = nbytes(item)
        if batch and held + size > limit:
            yield batch
            batch, held = [], 0
        batch.append(item)
        held += size
    if batch:
        yield batch
