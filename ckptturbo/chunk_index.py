"""Which chunks a run's store already holds, kept by the runtime across writers.

The documented pattern builds a fresh ``TurboWriter`` for every ``dcp.save``; listing a
large store for each of them would cost more than the save. So the runtime keeps one
index per chunk store (keyed by its URL and options), relisted only when the store's gc
generation changes (a gc may have deleted chunks; see ``catalog``). Chunks this process
uploads are added as they land. The runtime's registry is bounded: the least recently
used index is dropped (it is only a cache: a dropped index is relisted when needed).
"""
from __future__ import annotations

import logging
import threading

from .runs import RunStore

log = logging.getLogger(__name__)


class ChunkIndex:
    """The chunk ids of one store, as listed at ``generation`` plus what was added since."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._known: set[str] = set()
        self.generation: str | None = None
        self.listings = 0  # how many times the store was listed (observable in tests)

    def sync(self, run: RunStore, generation: str, listed: set[str] | None = None) -> None:
        """Relist the store unless the index was listed at this gc generation already;
        ``listed``: a listing already taken at that generation (``catalog.begin_save``)."""
        with self._lock:
            if generation == self.generation:
                return
            self._known = listed if listed is not None else run.chunk_ids()
            self.generation = generation
            self.listings += 1
            log.debug("listed %d chunks of %s at gc generation %s", len(self._known),
                      run.store.url_of(run.chunks_root), generation)

    @property
    def listed(self) -> bool:
        return self.generation is not None

    def __contains__(self, cid: str) -> bool:
        with self._lock:
            return cid in self._known

    def add(self, cid: str) -> None:
        with self._lock:
            self._known.add(cid)

