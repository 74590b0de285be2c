"""The next shard of a ``safe_open`` loop, opened and read ahead before the caller opens it.

``for url in shards: with safe_open(url) as f: for k in f.keys(): f.get_tensor(k)`` reads
one file after another: at each file's end its read-ahead drains, then the next file's
HEAD and header GET and its first ranges each wait a round trip before data flows again,
where the stream keeps its requests in flight across files. Sharded checkpoints are named
``NAME-00001-of-00004.safetensors`` and read in that order, so once a handle's read-ahead
has issued its last range, :func:`start_next` opens the next shard in the background and
reads it ahead in the order the handle's calls followed (``keys()`` or the offset order).
Its reads count in a :class:`LinkedBudget`: while the parent handle reads, the two files'
bytes together stay within the parent's ``memory_limit``. ``safe_open`` of that URL with
the same settings adopts it (:func:`claim`); one that nobody opens within PARK_SECONDS of
its parent's close is dropped, with its bytes. Nothing of it is visible to the caller:
a failure (no such shard, a bad header) only means the next handle opens the usual way.
"""
from __future__ import annotations

import logging
import re
import threading
from concurrent.futures import Future
from typing import Any, Callable

from ..prefetch import MemoryBudget
from .format import Header
from .headers import StreamFile, open_file
from .readahead import ReadAhead, plan_reads
from .source import ByteSource, open_store

log = logging.getLogger(__name__)
PARK_SECONDS = 2.0  # how long a next shard waits to be opened once its parent has closed
SHARD = re.compile(r"^(?P<head>.*-)(?P<index>\d+)(?P<of>-of-)(?P<count>\d+)(?P<tail>\.safetensors)$")

_lock = threading.Lock()
_pending: dict[str, NextFile] = {}  # by URL: at most one per URL, claimed or dropped


class LinkedBudget(MemoryBudget):
    """A next file's budget: while ``parent`` (the reading handle's) is linked, the bytes
    held under both stay within ``limit``. The parent has issued all its reads when the
    next file starts, so it only releases from then on; it never waits on this one."""

    def __init__(self, limit: int, parent: MemoryBudget) -> None:
        super().__init__(limit)
        self._parent: MemoryBudget | None = parent

    def try_acquire(self, nbytes: int, *, alone: bool = False) -> bool:
        parent = self._parent
        if parent is not None and parent.held + self.held + nbytes > self.limit:
            return False
        return super().try_acquire(nbytes, alone=alone)

    def unlink(self) -> None:
        """The parent closed, or this file was adopted by a handle: its own limit alone."""
        self._parent = None


def next_shard(url: str) -> str | None:
    """``...-00002-of-00004.safetensors`` for ``...-00001-of-00004.safetensors``; None
    for the last shard or a name that is not a shard's."""
    m = SHARD.match(url)
    if m is None or int(m["index"]) >= int(m["count"]):
        return None
    index = str(int(m["index"]) + 1).zfill(len(m["index"]))
    return f"{m['head']}{index}{m['of']}{m['count']}{m['tail']}"


class NextFile:
    """A shard opened in the background: its source, header and read-ahead, once ready."""

    def __init__(self, url: str, settings: tuple[Any, ...], storage_options: dict[str, Any] | None,
                 budget: LinkedBudget, order_of: Callable[[Header], list[str]]) -> None:
        self.url = url
        self.settings = settings  # what a handle must be opened with to adopt it
        self.storage_options = storage_options
        self.budget = budget
        chunk_size, streams, max_header_size = settings[:3]
        self.source = ByteSource(open_store(url, storage_options, streams), None, part_helpers=streams)
        self._timer: threading.Timer | None = None
        self._ready: Future[tuple[StreamFile, list[str], ReadAhead | None]] = self.source.store.submit(
            self._open, chunk_size, streams, max_header_size, order_of)

    def _open(self, chunk_size: int, streams: int, max_header_size: int,
              order_of: Callable[[Header], list[str]]) -> tuple[StreamFile, list[str], ReadAhead | None]:
        file = open_file(self.source, max_header_size)
        order = order_of(file.header)
        by_name = file.header.by_name
        tensors = [by_name[n] for n in order
                   if by_name[n].nbytes and not by_name[n].end <= file.probe_end]
        piece = max(1, min(chunk_size, self.budget.limit // 4))
        plan = plan_reads(tensors, file.entry.path, piece, streams, self.budget.limit)
        ahead = None if not plan else ReadAhead(plan, self.source.fetch_parts, self.source.store.submit,
                                                self.budget, streams)
        return file, order, ahead

    def pump(self) -> None:
        """The parent released bytes: issue the reads that fit now."""
        if self._ready.done() and self._ready.exception() is None:
            ahead = self._ready.result()[2]
            if ahead is not None:
                ahead.pump()

    def orphan(self) -> None:
        """The parent closed: read on within the whole limit, and drop the file unless a
        handle adopts it within PARK_SECONDS."""
        self.budget.unlink()
        self.pump()
        self._timer = threading.Timer(PARK_SECONDS, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def _expire(self) -> None:
        with _lock:
            if _pending.get(self.url) is not self:
                return
            del _pending[self.url]
        log.debug("%s: read ahead but not opened within %.1f s: dropped", self.url, PARK_SECONDS)
        self.close()

    def adopt(self) -> tuple[ByteSource, StreamFile, list[str], ReadAhead | None] | None:
        """Hand the file over to the handle that opens it (None if opening it failed: the
        handle opens it itself and raises what there is to raise)."""
        if self._timer is not None:
            self._timer.cancel()
        self.budget.unlink()
        try:
            file, order, ahead = self._ready.result()
        except Exception as exc:  # noqa: BLE001 - the handle's own open reports it
            log.debug("%s: opening it ahead failed (%s): opening it again", self.url, exc)
            self.source.close()
            return None
        if ahead is not None:
            ahead.pump()
        return self.source, file, order, ahead

    def close(self) -> None:
        """Stop reading ahead and let go of everything held."""
        if self._timer is not None:
            self._timer.cancel()
        try:
            ahead = self._ready.result()[2]
        except Exception:  # noqa: BLE001 - nothing was started
            ahead = None
        if ahead is not None:
            ahead.close()
        self.source.close()


def start_next(url: str, settings: tuple[Any, ...], storage_options: dict[str, Any] | None,
               parent: MemoryBudget, order_of: Callable[[Header], list[str]]) -> NextFile | None:
    """Open the shard after ``url`` in the background (None: no next shard, or one is
    being opened already)."""
    nxt = next_shard(url)
    if nxt is None:
        return None
    with _lock:
        if nxt in _pending:
            return None
        try:
            found = _pending[nxt] = NextFile(nxt, settings, storage_options,
                                             LinkedBudget(parent.limit, parent), order_of)
        except Exception as exc:  # noqa: BLE001 - reading ahead is optional
            log.debug("%s: cannot open it ahead: %s", nxt, exc)
            return None
    log.debug("%s: opening it ahead of the caller", nxt)
    return found


def claim(url: str, settings: tuple[Any, ...],
          storage_options: dict[str, Any] | None) -> tuple[ByteSource, StreamFile, list[str], ReadAhead | None] | None:
    """The file opened ahead for ``url`` with these settings, if any (one opened with
    others is dropped: a handle reads with its own)."""
    with _lock:
        found = _pending.pop(url, None)
    if found is None:
        return None
    if found.settings != settings or found.storage_options != storage_options:
        found.close()
        return None
    return found.adopt()
