"""The chunk-store seam: what any place that holds chunks and manifests must do.

A chunk has one BLAKE3 name whatever holds it, and a manifest names chunks, not places,
so a tier (the durable object store, a node's host memory, later a peer node's memory) is
just another place that answers these five calls. Everything above the seam (saves, loads,
gc, eviction, persisting from one tier to another) speaks only them, so verification,
retries and deadlines (which :class:`~ckptturbo.store.Store` applies to every request) are
the same in every tier. ``Store`` satisfies the protocol as it is; a peer tier reached
over the network implements the same five calls.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Protocol, runtime_checkable


@dataclass(frozen=True)
class ObjectInfo:
    """One object a chunk store holds, as a listing reports it."""

    path: str
    size: int
    mtime: float | None


@runtime_checkable
class ChunkStore(Protocol):
    """A place that holds chunks and manifests, addressed by full paths of the place."""

    def put(self, path: str, data: bytes | bytearray | memoryview, *, durable: bool = True) -> None:
        """Write an object whole: a reader sees the old object or the new one, never a part."""

    def get(self, path: str, start: int | None = None, end: int | None = None) -> bytes:
        """Bytes [start, end) of an object; CheckpointNotFound when it is absent."""

    def exists(self, path: str) -> bool:
        """Whether the object is held (the "has" of the seam)."""

    def list_files(self, prefix: str) -> list[ObjectInfo]:
        """Every object under ``prefix`` (recursive); an absent prefix lists as empty."""

    def delete(self, paths: Iterable[str]) -> None:
        """Remove objects; every delete is attempted before the first failure is raised."""
