"""Safetensors headers of a stream's files: one ranged GET each, whose data tail is kept.

The first GET of a file asks for ``HEADER_PROBE`` bytes (``GROUP_HEADER_PROBE`` when one
rank describes the model for a process group), which hold the whole header of almost every
model; a second GET is needed only for a longer header. The rest of the first
GET is already data: it is kept (within a quarter of the memory budget) and serves the
reads it covers, so no byte is fetched twice.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from ..prefetch import MemoryBudget, Read
from .format import Header, header_length, parse_header
from .source import ByteSource, FileEntry

MiB = 1 << 20
HEADER_PROBE = 1 * MiB  # first GET per file: holds the whole header of almost every model
# With a process group each rank fetches the headers of its share of the files, and no
# rank reads data until every header is known: a probe's data tail is bytes a few nodes
# read while the others wait, so the probe is no larger than a large header (a few
# thousand tensors' entries).
GROUP_HEADER_PROBE = 256 << 10


@dataclass
class StreamFile:
    """A file of the stream with its parsed header and, when kept, its first GET's data tail."""

    entry: FileEntry
    header: Header
    raw: bytes  # the header's JSON bytes, as stored (sent to the other ranks)
    tail: bytes | None = None  # bytes [data_start, probe_end) from the header GET
    # read once across ranks: the rank that made this file's header GET and the end of the
    # data tail it kept (None: none kept); that rank heads the reads inside the tail
    held: tuple[int, int] | None = None

    @property
    def probe_end(self) -> int:
        return self.header.data_start + len(self.tail or b"")

    def in_tail(self, end: int) -> bool:
        """Whether data up to ``end`` came with the header GET (is in the kept tail)."""
        return self.tail is not None and end <= self.probe_end


def fetch_header(source: ByteSource, entry: FileEntry, probe: int, max_header_size: int,
                 budget: MemoryBudget | None = None, head: bytes | None = None) -> StreamFile:
    """One ranged GET of the first ``probe`` bytes; a second only if the header is longer.

    Headers are cached (keyed by the object's identity) when the source has a cache, so a
    second load parses them without any request. With a ``budget``, a kept tail stays
    reserved in it: the caller serves reads from it and releases what it does not use.
    ``head``: the first GET's bytes when the caller made it already (``safe_open`` makes it
    alongside the HEAD that gives ``entry``, to save a round trip).
    """
    cached = source.cached_header(entry)
    if cached is not None:
        return StreamFile(entry, parse_header(cached, source.url_of(entry), file_size=entry.size),
                          cached)
    first = min(probe, entry.size)
    if budget is not None:
        budget.acquire(first)
    try:
        if head is None:
            head = source.get(entry, 0, first, cacheable=False)
        n = header_length(head[:8], source.url_of(entry), file_size=entry.size,
                          max_header_size=max_header_size)
        if 8 + n <= len(head):
            raw, tail = head[8:8 + n], head[8 + n:]
        else:
            raw, tail = head[8:] + source.get(entry, len(head), 8 + n, cacheable=False), b""
        header = parse_header(bytes(raw), source.url_of(entry), file_size=entry.size)
    finally:
        if budget is not None:
            budget.release(first)
    source.remember_header(entry, bytes(raw))
    # Keep the data tail only while all kept tails fit in a quarter of the budget (reserved
    # now, so they count like any other bytes held); otherwise drop it and read it again.
    if tail and budget is not None and (budget.held + len(tail) > budget.limit // 4
                                        or not budget.try_acquire(len(tail))):
        tail = b""
    return StreamFile(entry, header, bytes(raw), bytes(tail) if tail else None)


def tail_slices(f: StreamFile, reads: Sequence[Read], source: ByteSource,
                budget: MemoryBudget) -> list[tuple[Read, bytes]]:
    """The leading reads of ``f`` that its header GET already holds, with their bytes.

    Those ranges go to the cache, the tail's budget reservation shrinks to what they
    use (each returned read keeps its share until it is released), and the file lets
    go of its tail.
    """
    if f.tail is None:
        return []
    served = []
    for r in leading_reads(reads, f.probe_end):
        lo = r.start - f.header.data_start
        served.append((r, f.tail[lo:lo + r.size]))
        source.remember_range(f.entry, r.start, served[-1][1])
    budget.release(len(f.tail) - sum(r.size for r, _ in served))
    f.tail = None
    return served


def leading_reads(reads: Sequence[Read], end: int) -> list[Read]:
    """The leading reads of a file's ``reads`` that end by ``end`` (a kept tail's end)."""
    out = []
    for r in reads:
        if r.end > end:
            break
        out.append(r)
    return out


def tail_heads(files: Sequence[StreamFile], reads: Sequence[Sequence[Read]]) -> dict[int, int]:
    """Read index -> the rank that serves it from its header GET's kept tail, over every
    file of a stream read once across ranks (``held``, from the headers' exchange): the
    same on every rank, with no collective of its own."""
    return {r.index: f.held[0] for f, file_reads in zip(files, reads, strict=True)
            if f.held is not None for r in leading_reads(file_reads, f.held[1])}


def open_file(source: ByteSource, max_header_size: int,
              submit: Callable[..., Future[Any]] | None = None) -> StreamFile:
    """The store's root object with its header: the HEAD (its size, for the header's
    checks) and the first GET at once, one round trip instead of two; the HEAD goes to
    ``submit`` (the store's I/O threads by default). The entry is registered with ``source``."""
    store = source.store
    info = (submit or store.submit)(store.info, store.root)
    try:
        head = source.get(FileEntry(store.root, 0, None), 0, HEADER_PROBE, cacheable=False)
    finally:
        stat = info.result()  # a missing object: its error, the one callers expect
    entry = FileEntry(stat.path, stat.size, stat.mtime)
    source.register([entry])
    return fetch_header(source, entry, HEADER_PROBE, max_header_size, head=head)
