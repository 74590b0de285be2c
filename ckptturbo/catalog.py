"""The checkpoints of a run: listing, deleting, and collecting unreferenced chunks safely.

Why a save and a gc can run at the same time without losing data (the rule, also in
docs/format.md): both announce themselves before they look at the other.

* A save writes ``.ckptturbo/pending/<save_id>`` and *then* waits while a fresh
  ``.ckptturbo/gc.lock`` exists; it reads ``gc.generation`` and relists the chunk store
  when the generation changed since its last save, so it never skips the upload of a
  chunk a gc may have removed.
* A gc writes ``gc.lock`` and *then* refuses to run while a fresh pending marker exists;
  it bumps ``gc.generation`` before deleting anything.

With a strongly consistent store (local disks, S3 since 2020) at least one of the two sees
the other's marker, so a chunk is never deleted while a save may still rely on it. Stale
markers (a crashed save, a killed gc) expire after ``MARKER_TTL`` seconds.
"""
from __future__ import annotations

import json
import logging
import posixpath
import time
import uuid
from dataclasses import dataclass
from typing import Any

from .errors import CheckpointNotFound, CkptTurboError, SaveInProgress
from .layout import CONTROL_DIR, Location
from .store import Store

log = logging.getLogger(__name__)

MARKER_TTL = 6 * 3600.0
LOCK_WAIT = 600.0


def _control(location: Location, *parts: str) -> str:
    return location.chunk_store.join(posixpath.dirname(location.chunks_root), *parts)


def _fresh(store: Store, path: str, now: float) -> bool:
    try:
        doc = json.loads(store.get(path))
        return now - float(doc.get("time", 0)) < MARKER_TTL
    except (CheckpointNotFound, ValueError, TypeError):
        return False


def begin_save(location: Location, save_id: str, wait: float = LOCK_WAIT) -> str:
    """Announce a save, wait out a running gc, and return the store's gc generation."""
    store = location.chunk_store
    store.put(_control(location, "pending", save_id), json.dumps({"time": time.time()}).encode(),
              durable=False)
    lock = _control(location, "gc.lock")
    deadline = time.monotonic() + wait
    while store.exists(lock) and _fresh(store, lock, time.time()):
        if time.monotonic() > deadline:
            end_save(location, save_id)
            raise SaveInProgress(f"a gc of {location.chunks_root} held its lock for {wait}s")
        time.sleep(0.5)
    return _generation(location)


def end_save(location: Location, save_id: str) -> None:
    try:
        location.chunk_store.delete([_control(location, "pending", save_id)])
    except CheckpointNotFound:
        pass


def _generation(location: Location) -> str:
    try:
        return location.chunk_store.get(_control(location, "gc.generation")).decode()
    except CheckpointNotFound:
        return "0"


@dataclass
class CheckpointInfo:
    name: str
    url: str
    created: float
    total_bytes: int
    unique_bytes: int
    items: int


def _run_store(run_url: str, storage_options: dict[str, Any] | None) -> Store:
    return Store(run_url, storage_options)


def list_checkpoints(run_url: str, storage_options: dict[str, Any] | None = None) -> list[CheckpointInfo]:
    """Committed checkpoints directly under a run, oldest first; uncommitted ones are absent."""
    store = _run_store(run_url, storage_options)
    found = []
    for path in store.list_dirs(store.root):
        name = posixpath.basename(path)
        if name == CONTROL_DIR:
            continue
        url = f"{run_url.rstrip('/')}/{name}"
        try:
            manifest = Location(url, storage_options).read_manifest()
        except CheckpointNotFound:
            continue
        found.append(CheckpointInfo(name, url, manifest.created, manifest.total_bytes,
                                    manifest.unique_bytes, len(manifest.items)))
    return sorted(found, key=lambda c: (c.created, c.name))


def delete_checkpoint(url: str, storage_options: dict[str, Any] | None = None) -> None:
    """Remove the manifest (which makes the checkpoint cease to exist); chunks stay for gc."""
    location = Location(url, storage_options)
    location.read_manifest()
    location.store.delete([location.manifest_path])


@dataclass
class GcReport:
    referenced: int
    deleted: int
    deleted_bytes: int
    kept_recent: int
    dry_run: bool


def collect_garbage(run_url: str, storage_options: dict[str, Any] | None = None, *,
                    dry_run: bool = False, grace_seconds: float = 0.0) -> GcReport:
    """Delete chunks of the run's store that no committed checkpoint of the run names."""
    probe = Location(f"{run_url.rstrip('/')}/{CONTROL_DIR}-gc", storage_options)
    store = probe.chunk_store
    lock = _control(probe, "gc.lock")
    now = time.time()
    if not dry_run:
        store.put(lock, json.dumps({"time": now, "id": uuid.uuid4().hex}).encode())
    try:
        pending = store.list_files(_control(probe, "pending"))
        live = [p.path for p in pending if _fresh(store, p.path, now)]
        if live and not dry_run:
            raise SaveInProgress(f"{len(live)} save(s) in progress under {run_url}; "
                                 "run gc again when they are committed")
        if not dry_run:
            store.put(_control(probe, "gc.generation"), uuid.uuid4().hex.encode())
        referenced: set[str] = set()
        for ckpt in list_checkpoints(run_url, storage_options):
            referenced.update(Location(ckpt.url, storage_options).read_manifest().chunks)
        doomed, kept_recent, doomed_bytes = [], 0, 0
        for info in store.list_files(probe.chunks_root):
            cid = info.path.rsplit("/", 1)[-1]
            if cid in referenced:
                continue
            if info.mtime is not None and now - info.mtime < grace_seconds:
                kept_recent += 1
                continue
            doomed.append(info.path)
            doomed_bytes += info.size
        if not dry_run:
            store.delete(doomed)
        log.info("gc %s: %d referenced, %d unreferenced chunks (%d bytes)%s", run_url,
                 len(referenced), len(doomed), doomed_bytes, " [dry run]" if dry_run else "")
        return GcReport(len(referenced), len(doomed), doomed_bytes, kept_recent, dry_run)
    finally:
        if not dry_run:
            try:
                store.delete([lock])
            except CkptTurboError:
                log.warning("could not remove %s; it expires after %ss", lock, MARKER_TTL)

