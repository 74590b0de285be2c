"""The checkpoints of a run: listing, deleting, and collecting unreferenced chunks safely.

Why a save and a gc can run at the same time without losing data (the rule, also in
docs/format.md): both announce themselves before they look at the other, and a save makes
no dedup decision before it has announced itself.

* Each rank of a save first stages its bytes into host memory (no storage request), then
  writes ``pending/<save id>.<rank>`` and *then* waits while a fresh ``gc.lock`` exists;
  it reads ``gc.generation`` and relists the chunk store when the generation differs
  from the one its chunk index was listed at. Only then does it decide which chunks
  already exist (and skip their upload). The coordinator removes every rank's marker
  after the manifest is written.
* A gc writes ``gc.lock`` and *then* refuses to run while a fresh pending marker exists;
  it bumps ``gc.generation`` before deleting anything.

With a strongly consistent store (local disks, S3 since 2020) at least one of the two sees
the other's marker: either the gc sees a rank's marker and stops, or the gc's lock was
written before that marker, the rank waits until the gc is done, and the bumped
generation makes it relist. Either way no chunk a save relies on is deleted while its
marker stands, and once the marker goes the manifest names those chunks. Staging before
the marker is safe because copying into host memory decides nothing about storage. Stale
markers (a crashed save, a killed gc) expire after ``MARKER_TTL`` seconds.
"""
from __future__ import annotations

import logging
import posixpath
import time
import uuid
from dataclasses import dataclass
from typing import Any, Iterator

from .errors import CheckpointNotFound, CkptTurboError, SaveInProgress
from .layout import CONTROL_DIR, MARKER_TTL, Location, Manifest, RunStore, marker_is_fresh, marker_record
from .store import Store

log = logging.getLogger(__name__)

LOCK_WAIT = 600.0
LOCK_POLL = 0.5


def _fresh(store: Store, path: str, now: float) -> bool:
    try:
        return marker_is_fresh(store.get(path), now)
    except CheckpointNotFound:
        return False


def begin_save(run: RunStore, save_id: str, rank: int, wait: float = LOCK_WAIT) -> str:
    """Announce one rank of a save, wait out a running gc, and return the gc generation.

    Called after staging and before the first dedup decision (see the module docstring).
    """
    store = run.store
    store.put(run.pending_path(save_id, rank), marker_record(rank=rank), durable=False)
    deadline = time.monotonic() + wait
    while _fresh(store, run.gc_lock, time.time()):
        if time.monotonic() > deadline:
            end_save(run, save_id, [rank])
            raise SaveInProgress(f"a gc of {store.url_of(run.chunks_root)} held its lock for {wait}s")
        time.sleep(LOCK_POLL)
    return generation(run)


def end_save(run: RunStore, save_id: str, ranks: list[int] | range) -> None:
    """Remove the pending markers of these ranks of a save (absent ones are fine); a
    failure is only logged: it must not fail a committed save."""
    try:  # in parallel; every delete is attempted before the first failure is reported
        run.store.delete([run.pending_path(save_id, rank) for rank in ranks])
    except CheckpointNotFound:
        pass
    except CkptTurboError as exc:  # advisory: the save itself stands, the markers expire
        log.warning("could not remove the pending markers of save %s (%s); gc of %s waits "
                    "until they expire after %ss", save_id, exc, run.store.url_of(run.root), MARKER_TTL)


def generation(run: RunStore) -> str:
    """Changes whenever a gc may have deleted chunks ("0": no gc ever ran)."""
    try:
        return run.store.get(run.gc_generation).decode()
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


def _committed(run_url: str, storage_options: dict[str, Any] | None) -> Iterator[tuple[str, Manifest]]:
    """(url, manifest) of every committed checkpoint directly under a run, each read once."""
    store = Store(run_url, storage_options)
    for path in store.list_dirs(store.root):
        name = posixpath.basename(path)
        if name == CONTROL_DIR:
            continue
        url = f"{run_url.rstrip('/')}/{name}"
        try:
            yield url, Location(url, storage_options).read_manifest()
        except CheckpointNotFound:
            continue


def list_checkpoints(run_url: str, storage_options: dict[str, Any] | None = None) -> list[CheckpointInfo]:
    """Committed checkpoints directly under a run, oldest first; uncommitted ones are absent."""
    found = [CheckpointInfo(posixpath.basename(url), url, m.created, m.total_bytes, m.unique_bytes,
                            len(m.items)) for url, m in _committed(run_url, storage_options)]
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
    run = RunStore.for_run(run_url, storage_options)
    store = run.store
    now = time.time()
    if not dry_run:
        store.put(run.gc_lock, marker_record(id=uuid.uuid4().hex))
    try:
        live = [p.path for p in store.list_files(run.pending_dir) if _fresh(store, p.path, now)]
        if live and not dry_run:
            raise SaveInProgress(f"{len(live)} save(s) in progress under {run_url}; "
                                 "run gc again when they are committed")
        if not dry_run:
            store.put(run.gc_generation, uuid.uuid4().hex.encode())
        referenced: set[str] = set()
        for _, manifest in _committed(run_url, storage_options):
            referenced.update(manifest.chunks)
        doomed, kept_recent, doomed_bytes = [], 0, 0
        for info in store.list_files(run.chunks_root):
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
                store.delete([run.gc_lock])
            except CkptTurboError:
                log.warning("could not remove %s; it expires after %ss", run.gc_lock, MARKER_TTL)
