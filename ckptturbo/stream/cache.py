"""Optional local-disk cache tier for bytes read from an object store.

Loading the same model again on the same machine (a restarted server, a second replica)
should cost a local disk read, not another trip through the network and the object
store. Entries are keyed by what identifies the bytes: the endpoint, the object's path,
its size and version (mtime / ETag), and the byte range, so a changed object can never
be served from an old entry (its new version makes a new key).

Every entry stores the BLAKE3 digest of its bytes and is checked on every read: an entry
that was truncated, bit-flipped or half-written is deleted and reported as a miss, so the
caller refetches it from the store; a cache can make loading faster, never wrong.
Entries are written to a temporary name and renamed into place, so a crash or a
concurrent writer leaves either the old entry or the new one. Nothing is fsynced: a
power loss may lose entries, and the checksum catches any that came back damaged.

Size is bounded by ``max_bytes`` with least-recently-used eviction (a hit refreshes the
entry's mtime). Several processes may share one directory; each evicts by the mtimes it
sees on disk, so the bound holds up to the entries written concurrently by others.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import uuid
from collections import OrderedDict
from pathlib import Path
from typing import Any

import blake3

log = logging.getLogger(__name__)

_MAGIC = b"CTCACHE1"
_HEAD = len(_MAGIC) + 32  # magic + BLAKE3 digest of the payload
DEFAULT_MAX_BYTES = 64 << 30


def cache_key(*parts: Any) -> str:
    """A fixed-length, path-safe key for any JSON-serialisable identity."""
    text = json.dumps(parts, sort_keys=True, separators=(",", ":"), default=str)
    return blake3.blake3(text.encode()).hexdigest()


class DiskCache:
    """Checksummed, size-bounded LRU store of byte strings in a local directory."""

    def __init__(self, directory: str | os.PathLike[str], max_bytes: int | None = None) -> None:
        self.directory = Path(directory).expanduser()
        self.max_bytes = DEFAULT_MAX_BYTES if max_bytes is None else int(max_bytes)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, int] = OrderedDict()  # key -> bytes on disk, LRU first
        self._total = 0
        self.stats = dict.fromkeys(("hits", "misses", "corrupt", "writes", "evictions",
                                    "bytes_read", "bytes_written"), 0)
        self._scan()

    def _path(self, key: str) -> Path:
        return self.directory / key[:2] / key

    def _scan(self) -> None:
        """Rebuild the LRU order from the files on disk (oldest mtime first)."""
        found = []
        for sub in self.directory.iterdir():
            if not sub.is_dir() or len(sub.name) != 2:
                continue
            for entry in sub.iterdir():
                if entry.name.startswith(".tmp-"):
                    continue
                try:
                    st = entry.stat()
                except FileNotFoundError:
                    continue
                found.append((st.st_mtime, entry.name, st.st_size))
        found.sort()
        with self._lock:
            self._entries = OrderedDict((name, size) for _, name, size in found)
            self._total = sum(self._entries.values())

    def get(self, key: str) -> bytes | None:
        """The cached bytes, or None when absent or damaged (a damaged entry is deleted)."""
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            self._count("misses")
            return None
        digest = raw[len(_MAGIC):_HEAD]
        if raw[:len(_MAGIC)] != _MAGIC or blake3.blake3(raw[_HEAD:]).digest() != digest:
            log.warning("cache entry %s is corrupt; dropping it", path)
            self._count("corrupt")
            self._count("misses")
            self._drop(key)
            return None
        try:
            os.utime(path)
        except FileNotFoundError:
            pass  # evicted by another process meanwhile; the bytes we read are verified
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
            self.stats["hits"] += 1
            self.stats["bytes_read"] += len(raw) - _HEAD
        return raw[_HEAD:]

    def put(self, key: str, data: bytes | bytearray | memoryview) -> None:
        """Store ``data`` atomically; entries larger than the whole cache are skipped."""
        size = _HEAD + len(data)
        if size > self.max_bytes:
            return
        path = self._path(key)
        path.parent.mkdir(exist_ok=True)
        tmp = path.parent / f".tmp-{uuid.uuid4().hex}"
        try:
            with open(tmp, "wb") as f:
                f.write(_MAGIC)
                f.write(blake3.blake3(data).digest())
                f.write(data)
            os.replace(tmp, path)
        except OSError as exc:  # a full or read-only disk must not fail the load
            log.warning("cannot write cache entry %s: %s", path, exc)
            tmp.unlink(missing_ok=True)
            return
        with self._lock:
            self._total += size - self._entries.pop(key, 0)
            self._entries[key] = size
            self.stats["writes"] += 1
            self.stats["bytes_written"] += len(data)
            over = self._total > self.max_bytes
        if over:
            self._evict()

    def get_json(self, key: str) -> Any | None:
        raw = self.get(key)
        if raw is None:
            return None
        try:
            return json.loads(raw)
        except ValueError:
            self._drop(key)
            return None

    def put_json(self, key: str, value: Any) -> None:
        self.put(key, json.dumps(value, separators=(",", ":")).encode())

    def _evict(self) -> None:
        self._scan()  # include entries other processes wrote; order by on-disk mtime
        while True:
            with self._lock:
                if self._total <= self.max_bytes or not self._entries:
                    return
                key = next(iter(self._entries))
            self._drop(key)
            self._count("evictions")

    def _drop(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)
        with self._lock:
            self._total -= self._entries.pop(key, 0)

    def _count(self, what: str) -> None:
        with self._lock:
            self.stats[what] += 1

    @property
    def total_bytes(self) -> int:
        return self._total
