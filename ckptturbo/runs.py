"""Runs and checkpoints in storage: a run's chunk store with its control paths
(``RunStore``), and where one checkpoint's manifest and chunks are (``Location``), with the
reading and writing of its manifest. The one module of the format that does I/O: it joins
``paths``' names onto a ``ChunkStore`` and moves ``manifest_codec``'s bytes. It opens no
store itself: it asks the opener it is handed (a runtime), else the default runtime.
"""
from __future__ import annotations

import logging
import posixpath
from typing import Any

from .chunk_store import ChunkStore, StoreOpener, default_opener
from .errors import CheckpointExists, CheckpointNotFound, FormatError
from .manifest import Manifest
from .paths import (
    CHUNKS_DIR,
    CONTROL_DIR,
    GC_GENERATION,
    GC_LOCK,
    MANIFEST_NAME,
    OWN_STORE,
    PENDING_DIR,
    READS_OF_A_DAMAGED_OBJECT,
    RUN_STORE,
    chunk_relpath,
)
from .urls import options_key

MAX_MANIFEST_BYTES = 1 << 30  # a larger manifest is refused unread
log = logging.getLogger(__name__)


class RunStore:
    """A run's chunk store and its control files: the paths a save and a gc share.

    ``own``: the store of one self-contained checkpoint (``OWN_STORE``), which a delete
    removes whole, control files included (``catalog``). ``owner``: what opened ``store``
    (the runtime that keeps the run's chunk index and heartbeats)."""

    def __init__(self, store: ChunkStore, root: str, *, owner: StoreOpener,
                 own: bool = False) -> None:
        self.store = store
        self.owner = owner
        self.root = root.rstrip("/") or "/"
        self.own = own
        self.control_dir = store.join(self.root, CONTROL_DIR)
        self.chunks_root = store.join(self.root, CHUNKS_DIR)
        self.pending_dir = store.join(self.root, PENDING_DIR)
        self.gc_lock = store.join(self.root, GC_LOCK)
        self.gc_generation = store.join(self.root, GC_GENERATION)

    @classmethod
    def for_run(cls, run_url: str, storage_options: dict[str, Any] | None = None, *,
                session: StoreOpener | None = None) -> RunStore:
        """The chunk store of the run at ``run_url`` (the parent of its checkpoints), opened
        by ``session`` (default: the default runtime)."""
        owner = session if session is not None else default_opener(run_url)
        store = owner.open_store(run_url, storage_options)
        return cls(store, store.root, owner=owner)

    @property
    def key(self) -> tuple[str, str]:
        """Names this store across writers: its URL and the options that reach it."""
        return (self.store.url_of(self.chunks_root), options_key(self.store.storage_options))

    def chunk_path(self, cid: str) -> str:
        return self.store.join(self.chunks_root, chunk_relpath(cid))

    def chunk_ids(self) -> set[str]:
        """The ids of the chunks the store holds (one listing)."""
        return {info.path.rsplit("/", 1)[-1] for info in self.store.list_files(self.chunks_root)}

    def pending_path(self, save_id: str, rank: int) -> str:
        return self.store.join(self.pending_dir, f"{save_id}.{rank}")


class Location:
    """Where one checkpoint's manifest and its chunk store are.

    ``store_url``: None or ``RUN_STORE`` for the run's store (the checkpoint's parent),
    ``OWN_STORE`` for a store inside the checkpoint's directory, else the store's URL.
    ``session`` opens its stores (default: the default runtime)."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None,
                 store_url: str | None = None, *, session: StoreOpener | None = None) -> None:
        self.url = str(url)
        self.storage_options = storage_options
        owner = session if session is not None else default_opener(self.url)
        self.store = owner.open_store(self.url, storage_options)
        self.path = self.store.root
        parent = posixpath.dirname(self.path)
        if not parent or parent == self.path:
            raise FormatError(f"checkpoint URL {self.url!r} needs a parent directory or bucket "
                              "prefix to hold the chunk store, e.g. s3://bucket/run/step-100")
        self.manifest_path = self.store.join(self.path, MANIFEST_NAME)
        if store_url is None or store_url == RUN_STORE:
            self.run = RunStore(self.store, parent, owner=owner)
            self.chunk_store_ref = RUN_STORE
        elif store_url == OWN_STORE:
            self.run = RunStore(self.store, self.path, owner=owner, own=True)
            self.chunk_store_ref = OWN_STORE
        else:
            self.run = RunStore.for_run(store_url, storage_options, session=owner)
            self.chunk_store_ref = str(store_url)
        self.chunk_store = self.run.store
        self.chunks_root = self.run.chunks_root

    @classmethod
    def for_manifest(cls, url: str, storage_options: dict[str, Any] | None,
                     manifest: Manifest, *, session: StoreOpener | None = None) -> Location:
        """The location a committed manifest points at (its chunk store may be elsewhere)."""
        return cls(url, storage_options, manifest.chunk_store, session=session)

    @property
    def self_contained(self) -> bool:
        """Whether the checkpoint's directory holds its chunks (``OWN_STORE``)."""
        return self.run.own

    def chunk_path(self, cid: str) -> str:
        return self.run.chunk_path(cid)

    def refuse_committed(self) -> None:
        """overwrite=False: raise CheckpointExists when a committed checkpoint is here."""
        if self.store.exists(self.manifest_path):
            raise CheckpointExists(f"Checkpoint already exists at {self.url!r} and overwrite=False "
                                   "(a committed ckptturbo checkpoint); it was left untouched")

    def read_manifest(self) -> Manifest:
        where = f"{self.url}/{MANIFEST_NAME}"
        rereads = 0 if self.store.is_local else READS_OF_A_DAMAGED_OBJECT - 1  # no transit locally
        for _ in range(rereads):
            try:
                return Manifest.from_bytes(self._manifest_bytes(), where)
            except FormatError as exc:
                log.warning("%s: %s; reading it again in case it was damaged in transit",
                            where, exc)
        return Manifest.from_bytes(self._manifest_bytes(), where)

    def _manifest_bytes(self) -> bytes:
        """The manifest in one request, no HEAD first (a round trip per rank and load): a
        read of one byte more than the largest manifest trusted tells a larger one apart."""
        try:
            data = self.store.get(self.manifest_path, 0, MAX_MANIFEST_BYTES + 1)
        except CheckpointNotFound as exc:
            raise CheckpointNotFound(
                f"no committed checkpoint at {self.url!r}: {MANIFEST_NAME} is missing "
                "(the save never finished, or the URL is wrong)") from exc
        if len(data) > MAX_MANIFEST_BYTES:
            raise FormatError(f"{self.url}/{MANIFEST_NAME} is over {MAX_MANIFEST_BYTES} bytes; "
                              "refusing to read it")
        return data

    def write_manifest(self, manifest: Manifest) -> None:
        self.store.put(self.manifest_path, manifest.to_bytes())
