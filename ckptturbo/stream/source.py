"""Where the streamer's files and bytes come from: listing, index, cache, then the store.

Kept apart from the streaming logic so the rules for what a model location means live in
one place: a ``.safetensors`` file; a directory/prefix whose
``model.safetensors.index.json`` (Hugging Face's ``{"weight_map": {tensor: file}}``)
names the shards, or else whose ``*.safetensors`` files are the shards; or an explicit
list of file URLs. Pickle checkpoints are refused by name and by content.

With a :class:`~ckptturbo.stream.cache.DiskCache` the listing (with each file's size and
mtime), every header and every range are served from local disk on a later load, so the
object store sees no request at all. Staleness rule: a cached listing is trusted until
it is evicted or the load passes ``cache_validate=True``, which lists the files again
(one LIST, or one HEAD per file given by URL); ranges and headers are keyed by the
object's size and mtime, so an object that changed is never served from old entries.
"""
from __future__ import annotations

import json
import logging
import threading
from dataclasses import asdict, dataclass
from typing import Any, Callable, Sequence

import fsspec

from ..errors import CheckpointKindError, CheckpointNotFound, FormatError
from ..layout import MANIFEST_NAME
from ..prefetch import Read
from ..store import ObjectInfo, Store
from .cache import DiskCache, cache_key
from .format import DEFAULT_MAX_HEADER_SIZE, PICKLE_SUFFIXES, refuse_pickle_name
from .profiles import endpoint_key

log = logging.getLogger(__name__)
INDEX_NAME = "model.safetensors.index.json"
MAX_INDEX_SIZE = DEFAULT_MAX_HEADER_SIZE  # an index is fetched whole: bound it like a header


@dataclass(frozen=True)
class FileEntry:
    """One file of a model: full store path, size and version (mtime) at listing time."""

    path: str
    size: int
    mtime: float | None


def open_store(url: str, storage_options: dict[str, Any] | None, streams: int) -> Store:
    """A Store whose pool and HTTP connection pool both allow ``streams`` requests at once."""
    options = dict(storage_options or {})
    if fsspec.utils.get_protocol(url) in ("s3", "s3a"):
        config = dict(options.get("config_kwargs") or {})
        config.setdefault("max_pool_connections", max(10, 2 * streams))
        options["config_kwargs"] = config
    return Store(url, options, max_workers=max(2, streams))


class ByteSource:
    """Reads byte ranges of listed files through the cache, then the store; counts both."""

    def __init__(self, store: Store, cache: DiskCache | None) -> None:
        self.store = store
        self.cache = cache
        self.endpoint = endpoint_key(store)
        self.entries: dict[str, FileEntry] = {}
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(("requests", "bytes_fetched", "cache_hits", "cache_bytes"), 0)

    def url_of(self, entry: FileEntry) -> str:
        return self.store.url_of(entry.path)

    def register(self, entries: Sequence[FileEntry]) -> None:
        self.entries.update((e.path, e) for e in entries)

    def _key(self, kind: str, entry: FileEntry, *rest: Any) -> str:
        return cache_key(kind, self.endpoint, entry.path, entry.size, entry.mtime, *rest)

    def get(self, entry: FileEntry, start: int, end: int, *, cacheable: bool = True) -> bytes:
        key = self._key("range", entry, start, end) if cacheable and self.cache else None
        if key is not None:
            data = self.cache.get(key)
            if data is not None and len(data) == end - start:
                self._count(cache_hits=1, cache_bytes=len(data))
                return data
        data = self.store.get(entry.path, start, end)
        self._count(requests=1, bytes_fetched=len(data))
        if key is not None and len(data) == end - start:
            self.cache.put(key, data)
        return data

    def remember_range(self, entry: FileEntry, start: int, data: bytes) -> None:
        """Cache bytes that arrived another way (inside a header GET) under their range key."""
        if self.cache is not None:
            self.cache.put(self._key("range", entry, start, start + len(data)), data)

    def fetch(self, read: Read) -> bytes:
        return self.get(self.entries[read.path], read.start, read.end)

    def cached_header(self, entry: FileEntry) -> bytes | None:
        if self.cache is None:
            return None
        data = self.cache.get(self._key("header", entry))
        if data is not None:
            self._count(cache_hits=1, cache_bytes=len(data))
        return data

    def remember_header(self, entry: FileEntry, raw: bytes) -> None:
        if self.cache is not None:
            self.cache.put(self._key("header", entry), raw)

    def _count(self, **amounts: int) -> None:
        with self._lock:
            for k, v in amounts.items():
                self._counts[k] += v

    def counters(self) -> dict[str, int]:
        with self._lock:
            out = dict(self._counts)
        if self.cache is not None:
            out["cache_corrupt"] = self.cache.stats["corrupt"]
        return out


def list_files(source: ByteSource, spec: str | Sequence[str], validate: bool = False,
               early: Callable[[list[FileEntry]], None] | None = None,
               ) -> tuple[list[FileEntry], dict[str, str] | None]:
    """The model's files in stream order, and its index's weight map if it has one.

    ``early`` is called with the directory's ``.safetensors`` files before its index is
    read, so the caller can start work on them (their header GETs) during that round
    trip; the index may then select only some of them."""
    key = cache_key("listing", source.endpoint, spec if isinstance(spec, str) else list(spec))
    if source.cache is not None and not validate:
        hit = source.cache.get_json(key)
        if hit is not None:
            entries = [FileEntry(**e) for e in hit["files"]]
            log.debug("listing of %s served from the cache (%d files)", spec, len(entries))
            source.register(entries)
            source._count(cache_hits=1)
            return entries, hit["weight_map"]
    if isinstance(spec, str):
        entries, weight_map = _list_location(source.store, spec, early)
    else:
        entries, weight_map = _list_urls(source.store, list(spec)), None
    if source.cache is not None:
        source.cache.put_json(key, {"files": [asdict(e) for e in entries], "weight_map": weight_map})
    source.register(entries)
    return entries, weight_map


def _entry(info: ObjectInfo) -> FileEntry:
    return FileEntry(info.path, info.size, info.mtime)


def _list_urls(store: Store, urls: list[str]) -> list[FileEntry]:
    paths = []
    for url in urls:
        refuse_pickle_name(url)
        if fsspec.utils.get_protocol(url) != store.protocol:
            raise FormatError(f"{url}: all URLs of one model must use the same storage "
                              f"({store.protocol}://)")
        paths.append(fsspec.core.strip_protocol(url))
    return [_entry(i) for i in store.map(store.info, paths)]


def _list_location(store: Store, url: str, early: Callable[[list[FileEntry]], None] | None = None,
                   ) -> tuple[list[FileEntry], dict[str, str] | None]:
    refuse_pickle_name(url)
    if url.rstrip("/").endswith(".safetensors"):
        return [_entry(store.info(store.root))], None
    listing = store.list_files(store.root)
    if not listing or (len(listing) == 1 and listing[0].path == store.root):
        return [_entry(store.info(store.root))], None  # a file without the suffix
    direct = {f.path.rsplit("/", 1)[-1]: f for f in listing
              if f.path.rsplit("/", 1)[0] == store.root.rstrip("/")}
    index_name = INDEX_NAME if INDEX_NAME in direct else next(
        (n for n in sorted(direct) if n.endswith(".safetensors.index.json")), None)
    if index_name is not None:
        if direct[index_name].size > MAX_INDEX_SIZE:
            raise FormatError(f"{store.url_of(direct[index_name].path)}: {direct[index_name].size} "
                              f"bytes is too large for an index (limit {MAX_INDEX_SIZE})")
        if early is not None:
            early([_entry(direct[n]) for n in sorted(direct) if n.endswith(".safetensors")])
        weight_map = _read_index(store, direct[index_name].path)
        names = sorted(set(weight_map.values()))
        missing = [n for n in names if n not in direct]
        if missing:
            raise CheckpointNotFound(f"{store.url}: {index_name} names files that do not "
                                     f"exist: {missing}")
        return [_entry(direct[n]) for n in names], weight_map
    names = sorted(n for n in direct if n.endswith(".safetensors"))
    if names:
        return [_entry(direct[n]) for n in names], None
    if MANIFEST_NAME in direct:
        raise CheckpointKindError(f"{store.url}: holds a ckptturbo checkpoint ({MANIFEST_NAME}), "
                                  "not safetensors: load it with ct.load or ct.load_state_dict")
    pickles = sorted(n for n in direct if n.lower().endswith(PICKLE_SUFFIXES))
    if pickles:
        raise FormatError(f"{store.url}: holds only pickle checkpoints ({', '.join(pickles[:5])}); "
                          "they are refused because loading them can run arbitrary code; "
                          "convert them to safetensors")
    raise CheckpointNotFound(f"{store.url}: no .safetensors files found")


def _read_index(store: Store, path: str) -> dict[str, str]:
    where = store.url_of(path)
    try:
        doc = json.loads(store.get(path))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise FormatError(f"{where}: not valid JSON: {exc}") from None
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise FormatError(f"{where}: needs a non-empty \"weight_map\" object")
    for name, file in weight_map.items():
        if not isinstance(file, str) or not file.endswith(".safetensors") or "/" in file \
                or file.startswith("."):
            raise FormatError(f"{where}: tensor {name!r} maps to {file!r}, which is not a "
                              ".safetensors file in the same directory")
    return weight_map
