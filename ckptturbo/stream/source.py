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
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from itertools import pairwise
from typing import Any

import fsspec
import torch

from ..errors import CheckpointKindError, CheckpointNotFound, FormatError
from ..paths import MANIFEST_NAME
from ..prefetch import Read
from ..runtime import default_runtime
from ..store import ObjectInfo, Store, all_results
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
    return default_runtime().open_store(url, options, max_workers=max(2, streams))


class Parts:
    """A range's bytes as the bodies of its part GETs, in order, not joined: the consumer
    (:class:`~.device.Scatter`) copies each body into its destinations, and joining them
    first would copy every byte once more."""

    def __init__(self, bodies: list[bytes]) -> None:
        self.bodies = bodies
        self._size = sum(len(b) for b in bodies)

    def __len__(self) -> int:
        return self._size


class ByteSource:
    """Reads byte ranges of listed files through the cache, then the store; counts both.

    :meth:`fetch_parts` reads a range of about two ``read_part_size`` parts or more from an
    object store as concurrent part GETs, as :meth:`Store.get_into` and AWS's CRT client
    do: each connection to an object store is capped (tens of MB/s on S3), so a 16 MiB
    range on one connection takes twice as long as on two. The parts after the first go
    to helper threads of this source (the I/O thread fetches the first itself and waits
    for the rest; the helpers wait on nothing, so this cannot deadlock).
    """

    def __init__(self, store: Store, cache: DiskCache | None, part_helpers: int = 0) -> None:
        self.store = store
        self.cache = cache
        self.endpoint = endpoint_key(store)
        self.entries: dict[str, FileEntry] = {}
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(("requests", "bytes_fetched", "cache_hits", "cache_bytes"), 0)
        self._helpers = (ThreadPoolExecutor(part_helpers, thread_name_prefix="ckptturbo-part")
                         if part_helpers and not store.is_local else None)

    def url_of(self, entry: FileEntry) -> str:
        return self.store.url_of(entry.path)

    def register(self, entries: Sequence[FileEntry]) -> None:
        self.entries.update((e.path, e) for e in entries)

    def _key(self, kind: str, entry: FileEntry, *rest: Any) -> str:
        return cache_key(kind, self.endpoint, entry.path, entry.size, entry.mtime, *rest)

    def get(self, entry: FileEntry, start: int, end: int, *, cacheable: bool = True) -> bytes:
        cache = self.cache if cacheable and self.cache else None
        key = self._key("range", entry, start, end) if cache is not None else None
        if cache is not None and key is not None:
            data = cache.get(key)
            if data is not None and len(data) == end - start:
                self._count(cache_hits=1, cache_bytes=len(data))
                return data
        data = self.store.get(entry.path, start, end)
        self._count(requests=1, bytes_fetched=len(data))
        if cache is not None and key is not None and len(data) == end - start:
            cache.put(key, data)
        return data

    def remember_range(self, entry: FileEntry, start: int, data: bytes) -> None:
        """Cache bytes that arrived another way (inside a header GET) under their range key."""
        if self.cache is not None:
            self.cache.put(self._key("range", entry, start, start + len(data)), data)

    def fetch(self, read: Read) -> bytes:
        return self.get(self.entries[read.path], read.start, read.end)

    def fetch_writable(self, read: Read) -> bytes | torch.Tensor:
        """``read``'s bytes in memory of their own that tensors may view (``views=True``):
        torch views of immutable ``bytes`` are read-only, which torch warns about. The bytes
        go straight into a fresh tensor (:meth:`Store.get_into`: no copy more than
        :meth:`get` makes, none on local disk); through the cache, as the cached ``bytes``,
        which the iterator copies out of."""
        if self.cache is not None:
            return self.fetch(read)
        out = torch.empty(read.size, dtype=torch.uint8)
        self.store.get_into(self.entries[read.path].path, out.numpy().data, read.start)
        # an object store's read goes out as ranged GETs of read_part_size (see Store)
        gets = 1 if self.store.is_local else -(-read.size // self.store.read_part_size)
        self._count(requests=max(1, gets), bytes_fetched=read.size)
        return out

    def fetch_parts(self, read: Read) -> bytes | Parts:
        """``read``'s bytes, as concurrent part GETs when it holds two parts or more (and
        is not cached: the cache stores whole ranges)."""
        count = round(read.size / self.store.read_part_size)  # parts within 2/3-4/3 of that size
        if self._helpers is None or self.cache is not None or count < 2:
            return self.fetch(read)
        entry = self.entries[read.path]
        part = -(-read.size // count)
        cuts = [*range(read.start, read.end, part), read.end]
        rest = [self._helpers.submit(self.get, entry, lo, hi) for lo, hi in pairwise(cuts[1:])]
        first: Future[bytes] = Future()  # read on this thread meanwhile
        try:
            first.set_result(self.get(entry, cuts[0], cuts[1]))
        except BaseException as exc:  # noqa: BLE001 - raised once the other parts are done
            first.set_exception(exc)
        return Parts(all_results([first, *rest]))

    def close(self) -> None:
        """Stop the part helpers (after the part GETs in flight)."""
        if self._helpers is not None:
            self._helpers.shutdown(wait=True)

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
        source.cache.put_json(key, {"files": [asdict(e) for e in entries],
                                    "weight_map": weight_map})
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
