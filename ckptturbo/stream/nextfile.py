"""The next shard of a ``safe_open`` loop, opened and read ahead before the caller opens it.

``for url in shards: with safe_open(url) as f: for k in f.keys(): f.get_tensor(k)`` reads
one file after another: at each file's end its read-ahead drains, then the next file's
HEAD and header GET and its first ranges each wait a round trip before data flows again,
where the stream keeps its requests in flight across files. Sharded checkpoints are named
``NAME-00001-of-00004.safetensors`` and read in that order, so once a handle's read-ahead
has issued its last range, :func:`start_next` opens the next shard in the background and
reads it ahead in the order the handle's calls followed (``keys()`` or the offset order).
Once its own reads are out it opens the shard after it in turn, so requests stay in
flight across files as the stream's do. Its reads count in a :class:`LinkedBudget`: the
bytes of the reading handle and of every shard opened ahead after it together stay
within that handle's ``memory_limit``. ``safe_open`` of that URL with the same settings
adopts it (:func:`claim`); one that nobody opens within PARK_SECONDS of its parent's
close is dropped, with its bytes (and those of the shards after it). Nothing of it is
visible to the caller: a failure (no such shard, a bad header) only means the next
handle opens the usual way. Its HEAD and bytes are those of the object when it was read
ahead, moments before the caller's open: an object replaced in between is read as it was.
"""
from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple

from ..prefetch import MemoryBudget
from ..runtime import default_runtime
from .format import Header
from .headers import StreamFile, open_file
from .readahead import ReadAhead, start_read_ahead
from .source import ByteSource, open_store

log = logging.getLogger(__name__)
PARK_SECONDS = 2.0  # how long a next shard waits to be opened once its parent has closed
SHARD = re.compile(
    r"^(?P<head>.*-)(?P<index>\d+)(?P<of>-of-)(?P<count>\d+)(?P<tail>\.safetensors)$")



class HandleSettings(NamedTuple):
    """What a ``safe_open`` handle reads with: a shard opened ahead with other settings is
    not adopted (``pinned``: its tensors land in pinned memory, for a GPU)."""

    chunk_size: int
    streams: int
    max_header_size: int
    memory_limit: int
    pinned: bool


class LinkedBudget(MemoryBudget):
    """A next file's budget: while ``parent`` (the budget of the handle or next file
    before it) is linked, the bytes held under the whole chain stay within ``limit``.
    A parent has issued all its reads when its next file starts, so it only releases
    from then on: it never waits on this one."""

    def __init__(self, limit: int, parent: MemoryBudget) -> None:
        super().__init__(limit)
        self._parent: MemoryBudget | None = parent

    def chain_held(self) -> int:
        """Bytes held under this budget and those it is linked to."""
        return self.held + _held(self._parent)

    def try_acquire(self, nbytes: int, *, alone: bool = False) -> bool:
        if self._parent is not None and self.chain_held() + nbytes > self.limit:
            return False
        return super().try_acquire(nbytes, alone=alone)

    def unlink(self) -> None:
        """The parent closed, or this file was adopted by a handle: its own limit alone."""
        self._parent = None


def _held(budget: MemoryBudget | None) -> int:
    if budget is None:
        return 0
    return budget.chain_held() if isinstance(budget, LinkedBudget) else budget.held


def next_shard(url: str) -> str | None:
    """``...-00002-of-00004.safetensors`` for ``...-00001-of-00004.safetensors``; None
    for the last shard or a name that is not a shard's."""
    m = SHARD.match(url)
    if m is None or int(m["index"]) >= int(m["count"]):
        return None
    index = str(int(m["index"]) + 1).zfill(len(m["index"]))
    return f"{m['head']}{index}{m['of']}{m['count']}{m['tail']}"


def shard_count(url: str) -> int:
    """How many shards the model of ``url`` has, by its name (1 if not a shard's)."""
    m = SHARD.match(url)
    return 1 if m is None else max(1, int(m["count"]))


class NextFile:
    """A shard opened in the background: its source, header and read-ahead once ready;
    once all its reads have gone out it opens the shard after it in turn (``next``), so
    requests stay in flight across files while the budget allows."""

    def __init__(self, url: str, settings: HandleSettings, storage_options: dict[str, Any] | None,
                 budget: LinkedBudget, order_of: Callable[[Header], list[str]]) -> None:
        self.url = url
        self.settings = settings  # what a handle must be opened with to adopt it
        self.storage_options = storage_options
        self.budget = budget
        self.order_of = order_of
        self.file: StreamFile | None = None
        self.order: list[str] = []
        self.ahead: ReadAhead | None = None
        self.next: NextFile | None = None
        self.next_tried = False
        self.adopted = False  # then its handle reads it and opens the next shard
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None
        self.source = ByteSource(open_store(url, storage_options, settings.streams), None,
                                 part_helpers=settings.streams)
        # threads of its own for the HEAD and header GET: the store's are busy with the
        # reads before it, and the point is to have its reads queued behind them already
        self._opener = ThreadPoolExecutor(2, thread_name_prefix="ckptturbo-next")
        self._ready: Future[None] = self._opener.submit(self._open)

    def _open(self) -> None:
        settings = self.settings
        try:
            file = open_file(self.source, settings.max_header_size, self._opener.submit)
        finally:
            self._opener.shutdown(wait=False)
        self.order = self.order_of(file.header)
        self.ahead = start_read_ahead(file, self.order, self.source, self.budget,
                                      settings.chunk_size, settings.streams,
                                      shard_count(self.url), pinned=settings.pinned)
        self.file = file
        self._pump()  # its reads may all be out already: open the next shard now

    def pump(self) -> None:
        """Bytes were released before it: issue the reads that fit now, and open the
        next shard once all of its own have gone out."""
        if self._ready.done() and self._ready.exception() is None:
            self._pump()

    def _pump(self) -> None:
        if self.adopted or self.ahead is None:
            return
        self.ahead.pump()
        with self._lock:
            if not self.next_tried and self.ahead.issued_all:
                self.next_tried = True
                self.next = start_next(self.url, self.settings, self.storage_options, self.budget,
                                       self.order_of)
            nxt = self.next
        if nxt is not None:
            nxt.pump()

    def orphan(self) -> None:
        """The parent closed: read on within the whole limit, and drop the file unless a
        handle adopts it within PARK_SECONDS."""
        if self.adopted:
            return
        self.budget.unlink()
        self.pump()
        self._timer = threading.Timer(PARK_SECONDS, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def _expire(self) -> None:
        if _unregister(self):
            log.debug("%s: read ahead but not opened within %.1f s: dropped", self.url,
                      PARK_SECONDS)
            self.close()

    def adopt(self) -> NextFile | None:
        """Hand the file over to the handle that opens it: ready, under its own limit (None
        if opening it failed: the handle opens it itself and raises what there is to raise)."""
        if self._timer is not None:
            self._timer.cancel()
        self.budget.unlink()
        try:
            self._ready.result()
        except Exception as exc:  # noqa: BLE001 - the handle's own open reports it
            log.debug("%s: opening it ahead failed (%s): opening it again", self.url, exc)
            self.close()
            return None
        self.pump()
        with self._lock:
            self.adopted = True
        return self

    def close(self) -> None:
        """Stop reading ahead and let go of everything held, the shards after it included."""
        if self._timer is not None:
            self._timer.cancel()
        self._ready.exception()  # wait: what it would start must be stopped too
        with self._lock:
            self.next_tried, nxt, self.next = True, self.next, None
        if nxt is not None and _unregister(nxt):
            nxt.close()
        if self.ahead is not None:
            self.ahead.close()
        self.source.close()


def _unregister(found: NextFile) -> bool:
    """Take ``found`` out of the pending files (False if it was claimed or dropped already)."""
    return default_runtime().unpark(found.url, found)


def start_next(url: str, settings: HandleSettings, storage_options: dict[str, Any] | None,
               parent: MemoryBudget, order_of: Callable[[Header], list[str]]) -> NextFile | None:
    """Open the shard after ``url`` in the background (None: no next shard, or one is
    being opened already)."""
    nxt = next_shard(url)
    if nxt is None:
        return None
    try:  # at most one per URL, parked in the runtime until claimed or dropped
        found = default_runtime().park(nxt, lambda: NextFile(
            nxt, settings, storage_options, LinkedBudget(parent.limit, parent), order_of))
    except Exception as exc:  # noqa: BLE001 - reading ahead is optional
        log.debug("%s: cannot open it ahead: %s", nxt, exc)
        return None
    if found is None:
        return None
    log.debug("%s: opening it ahead of the caller", nxt)
    return found


def claim(url: str, settings: HandleSettings,
          storage_options: dict[str, Any] | None) -> NextFile | None:
    """The file opened ahead for ``url`` with these settings, if any (one opened with
    others is dropped: a handle reads with its own)."""
    found = default_runtime().claim(url)
    if found is None:
        return None
    if found.settings != settings or found.storage_options != storage_options:
        found.close()
        return None
    return found.adopt()
