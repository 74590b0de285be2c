"""Byte-span maths of a load: which bytes of a stored box a read needs, and which chunks.

A stored shard is a row-major box whose bytes are cut into pieces, each a slice of one
content-addressed chunk. A read asks for a sub-box; everything a loader plans (which
chunks to fetch, which ranks need a chunk, what to copy where) follows from the byte
range that sub-box spans within the shard. Pure: sizes in, ranges out.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol, TypeVar


class Piece(Protocol):
    """What span maths needs of a stored piece (``manifest_records.StoredPiece`` is one)."""

    @property
    def chunk(self) -> str: ...
    @property
    def start(self) -> int: ...
    @property
    def length(self) -> int: ...


P = TypeVar("P", bound=Piece)


def numel(sizes: Sequence[int]) -> int:
    """Elements in a box of ``sizes`` (1 for a scalar)."""
    n = 1
    for s in sizes:
        n *= s
    return n


def row_major_strides(sizes: Sequence[int]) -> tuple[int, ...]:
    """Element strides of a contiguous row-major box (zero-sized dims count as 1)."""
    strides, acc = [], 1
    for s in reversed(sizes):
        strides.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(strides))


def box_span(sizes: Sequence[int], nbytes: int, offsets: Sequence[int],
             lengths: Sequence[int]) -> tuple[int, int]:
    """The byte range [start, end) of a stored box of ``sizes`` (``nbytes`` in all) that
    holds the sub-box at ``offsets`` of ``lengths``: from its first element to its last,
    so a strided sub-box spans the rows between too. An empty sub-box spans nothing."""
    if any(n == 0 for n in lengths):
        return 0, 0
    if tuple(lengths) == tuple(sizes) and not any(offsets):  # the whole box: most reads
        return 0, nbytes
    strides = row_major_strides(sizes)
    first = sum(o * s for o, s in zip(offsets, strides, strict=True))
    last = sum((o + n - 1) * s for o, n, s in zip(offsets, lengths, strides, strict=True))
    itemsize = nbytes // max(1, numel(sizes))
    return first * itemsize, (last + 1) * itemsize


def overlapping(pieces: Iterable[P], start: int, end: int) -> list[P]:
    """The pieces with bytes in [start, end) of their shard."""
    return [p for p in pieces if p.start < end and p.start + p.length > start]


def chunks_touched(spans: Iterable[tuple[Iterable[Piece], int, int]]) -> list[str]:
    """Chunk ids that (pieces, start, end) spans touch, each once, in first-use order."""
    seen: dict[str, None] = {}
    for pieces, start, end in spans:
        for p in overlapping(pieces, start, end):
            seen.setdefault(p.chunk, None)
    return list(seen)
