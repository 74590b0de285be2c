"""The chunk-store seam: what any place that holds chunks and manifests must do.

A chunk has one BLAKE3 name whatever holds it, and a manifest names chunks, not places,
so a tier (the durable object store, a node's host memory, later a peer node's memory) is
just another place that answers these calls. Everything above the seam (runs and their
manifests, saves, loads, the catalog and gc, eviction, recovery, persisting from one tier
to another) speaks only :class:`ChunkStore`, so verification, retries and deadlines
(which :class:`~ckptturbo.store.Store`, the fsspec implementation, applies to every
request) are the same in every tier.

Stores are opened in one place, :meth:`ckptturbo.runtime.Runtime.open_store` (a
:class:`StoreOpener`), keyed by URL and options and cached there; the run code below the
runtime is handed an opener and never builds a store itself.

The order of calls, as a save, a load and a gc make them (each call is independent: a
store keeps no per-checkpoint state between them)::

    opener.open_store(url, options) -> store          once per URL and options
    store.join(store.root, ...)                        paths of the run, the manifest
    save:  store.exists / list_files(chunks root)      which chunks are there (dedup)
           store.submit(put chunk) ... put(manifest)   chunks first, the manifest last
    load:  store.get(manifest) -> get / get_into(chunk, range) on store.submit
    gc:    list_dirs(root), list_files(chunks root) -> delete(unnamed chunks)
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, runtime_checkable

from .errors import StorageError

T = TypeVar("T")


@dataclass(frozen=True)
class ObjectInfo:
    """One object a chunk store holds, as a listing reports it."""

    path: str
    size: int
    mtime: float | None


@runtime_checkable
class ChunkStore(Protocol):
    """A place that holds chunks and manifests, addressed by full paths of the place.

    Naming: ``url`` and ``storage_options`` opened it, ``root`` is its path, ``join``
    extends a path, ``url_of`` spells one for messages. Objects: ``put``, ``get``,
    ``get_into``, ``exists``, ``list_files``, ``list_dirs``, ``delete``. Parallelism: its
    requests run on ``max_workers`` I/O threads (``submit``, ``map``)."""

    url: str
    root: str
    storage_options: dict[str, Any]
    is_local: bool  # a local file system: no transit to damage bytes, directories to remove
    max_workers: int

    def join(self, base: str, *parts: str) -> str:
        """``base`` (a full path of this store) extended by relative, '..'-free names."""

    def url_of(self, path: str) -> str:
        """A URL a user can paste, for error messages and listings."""

    def put(self, path: str, data: bytes | bytearray | memoryview, *, durable: bool = True) -> None:
        """Write an object whole: a reader sees the old object or the new one, never a part."""

    def get(self, path: str, start: int | None = None, end: int | None = None) -> bytes:
        """Bytes [start, end) of an object; CheckpointNotFound when it is absent."""

    def get_into(self, path: str, out: memoryview, start: int = 0) -> None:
        """Fill ``out`` with the object's bytes from ``start`` (ShortReadError if it ends)."""

    def exists(self, path: str) -> bool:
        """Whether the object is held (the "has" of the seam)."""

    def list_files(self, prefix: str) -> list[ObjectInfo]:
        """Every object under ``prefix`` (recursive); an absent prefix lists as empty."""

    def list_dirs(self, prefix: str) -> list[str]:
        """The immediate children of ``prefix`` that hold objects (a run's checkpoints)."""

    def delete(self, paths: Iterable[str]) -> None:
        """Remove objects; every delete is attempted before the first failure is raised."""

    def check_reachable(self) -> None:
        """Fail fast, with a clear error, when the place itself (a bucket) is unusable."""

    def submit(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> Future[T]:
        """Run ``fn`` on this store's I/O threads."""

    def map(self, fn: Callable[[Any], T], items: Iterable[Any]) -> list[T]:
        """``fn`` over ``items`` on the I/O threads; the first failure is raised after all
        have finished."""


class StoreOpener(Protocol):
    """What opens stores (``ckptturbo.runtime.Runtime``): the code below the runtime is
    handed one and asks it, so that a store of one URL and options is opened once."""

    def open_store(self, url: Any, storage_options: dict[str, Any] | None = None,
                   **settings: Any) -> ChunkStore:
        """The store at ``url`` reached with ``storage_options`` (``settings``: the
        implementation's retry, timeout and width settings)."""


_default_opener: Callable[[], StoreOpener] | None = None


def use_default_opener(find: Callable[[], StoreOpener]) -> None:
    """Hand this layer the process's default runtime (``ckptturbo.runtime`` does, once, at
    its import): what opens the stores of a caller that names no runtime (a ``Location``
    of the command line or a test) and runs the I/O of a store unpickled. The storage
    layer never looks a runtime up itself: the runtime sits above it."""
    global _default_opener
    _default_opener = find


def default_opener(what: str) -> StoreOpener:
    """The opener handed to :func:`use_default_opener`; ``what`` names the store for the
    error raised when none was."""
    if _default_opener is None:
        raise StorageError(f"no runtime opens the store of {what!r} (import ckptturbo.runtime, "
                           "or open it with Runtime.open_store)")
    return _default_opener()
