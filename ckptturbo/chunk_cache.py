"""A node's cache tier for checkpoint chunks: one read from storage per node, not per process.

Several processes on one node often load the same checkpoint: the engines of a serving
fleet taking a weight update, a restarted trainer, a second replica. With ``cache_dir``
they share a local directory (an NVMe disk, or /dev/shm): a chunk is read from storage by
the first process that needs it and the others copy it from the directory. While one
process reads a chunk, the others that want it wait on a lock file of that chunk (a
bounded wait: past ``timeout`` each reads it from storage itself), so two engines updating
at once still send one request per chunk. Entries are the stream's checksummed, atomically
renamed, LRU-bounded :class:`~ckptturbo.stream.cache.DiskCache` entries keyed by the chunk's
BLAKE3 name: a chunk's bytes never change, and a damaged entry is dropped and read again.
"""
from __future__ import annotations

import fcntl
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

from .chunk_source import ChunkSource
from .manifest import Manifest
from .runs import Location
from .stream.cache import DiskCache, cache_key

log = logging.getLogger(__name__)

LOCK_POLL_S = 0.01


class CachedChunkSource(ChunkSource):
    """A :class:`ChunkSource` that looks in the node's cache directory first and leaves
    what it read from storage there."""

    def __init__(self, location: Location, manifest: Manifest, url: str, verify: str,
                 cache: DiskCache, timeout: float) -> None:
        super().__init__(location, manifest, url, verify)
        self.cache = cache
        self.timeout = timeout
        self.bytes_from_cache = 0

    def fetch(self, cid: str, out: memoryview | None = None) -> memoryview:
        key = cache_key("chunk", cid)
        with self._turn(key):
            cached = self.cache.get(key)
            if cached is not None and len(cached) == self.manifest.chunks[cid]:
                view = memoryview(bytearray(cached)) if out is None else out
                view[:] = cached
                with self._lock:
                    self.bytes_from_cache += len(cached)
                return view
            view = super().fetch(cid, out)
            self.cache.put(key, view)
            return view

    @contextmanager
    def _turn(self, key: str) -> Iterator[None]:
        """Hold the chunk's lock file: the processes of a node read a chunk in turn, so
        only the first goes to storage. Past ``timeout`` a waiter goes ahead alone."""
        path = self.cache.directory / ".locks" / key  # not an entry: no two-letter folder
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a+b") as lock:
            deadline = time.monotonic() + self.timeout
            while True:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        log.warning("chunk %s: another process has read it for %.0fs; "
                                    "reading it from storage here", key, self.timeout)
                        yield
                        return
                    time.sleep(LOCK_POLL_S)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
