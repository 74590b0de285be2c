"""Chunks as a load gets them from storage: read (into their destination when it is host
memory), verified against their BLAKE3 names, read again when damaged in transit.

One checkpoint's chunk store, one verification setting, and the two counts a load reports
(bytes read from storage, chunks verified), which is how the tests and benchmarks show
that a grouped load reads each chunk once and hashes it once.
"""
from __future__ import annotations

import logging
import threading

import torch

from .errors import CheckpointNotFound, IntegrityError, ShortReadError
from .integrity import damaged_chunk, verify_chunk
from .manifest import Manifest
from .paths import READS_OF_A_DAMAGED_OBJECT
from .runs import Location

log = logging.getLogger(__name__)


class ChunkSource:
    """Verified chunk reads of one checkpoint; ``verify`` is "storage", "all" or "off"
    (see TurboReader: here it only matters whether chunks are hashed at all)."""

    def __init__(self, location: Location, manifest: Manifest, url: str, verify: str) -> None:
        self.location = location
        self.manifest = manifest
        self.url = url
        self.verify = verify
        self.bytes_from_storage = 0
        self.chunks_verified = 0
        self._lock = threading.Lock()

    def fetch(self, cid: str, out: memoryview | None = None) -> memoryview:
        """A chunk read from storage and verified. From an object store, a damaged one is
        read again (up to READS_OF_A_DAMAGED_OBJECT reads) before it is reported: a body
        corrupted in transit reads right a later time, a chunk corrupted, truncated or
        deleted at rest does not. A local file, or a chunk that is missing, has no transit
        to blame: its first error is the report."""
        view = memoryview(bytearray(self.manifest.chunks[cid])) if out is None else out
        rereads = 0 if self.holder(cid).chunk_store.is_local else READS_OF_A_DAMAGED_OBJECT - 1
        for _ in range(rereads):
            try:
                self._read_checked(cid, view)
                return view
            except IntegrityError as exc:
                if isinstance(exc.__cause__, CheckpointNotFound):
                    raise
                log.warning("%s; reading it again in case it was damaged in transit", exc)
        self._read_checked(cid, view)  # the last read's error is the report
        return view

    def holder(self, cid: str) -> Location:
        """Where chunk ``cid`` is read from: the checkpoint's chunk store (a tiered load
        picks the nearest tier that holds it)."""
        return self.location

    def fetch_into(self, cid: str, into: dict[str, torch.Tensor]) -> memoryview:
        """A verified chunk, read straight into its destination when that is host memory."""
        target = into.get(cid)
        if target is None or target.is_cuda:
            return self.fetch(cid)
        return self.fetch(cid, target.numpy().data)

    def check(self, cid: str, data: memoryview) -> None:
        """Raise IntegrityError naming the chunk and its tensors unless ``data`` is chunk
        ``cid`` (nothing when verification is off)."""
        if self.verify != "off":
            verify_chunk(self.location, self.manifest, self.url, cid, data)
            with self._lock:
                self.chunks_verified += 1

    def _read_checked(self, cid: str, view: memoryview) -> None:
        location = self.holder(cid)
        try:
            if len(view):
                location.chunk_store.get_into(location.chunk_path(cid), view)
        except (ShortReadError, CheckpointNotFound) as exc:
            problem = "missing" if isinstance(exc, CheckpointNotFound) else f"truncated ({exc})"
            raise damaged_chunk(location, self.manifest, self.url, cid, problem) from exc
        with self._lock:
            self.bytes_from_storage += len(view)
        self.check(cid, view)
