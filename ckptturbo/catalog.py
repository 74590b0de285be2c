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
the marker is safe because copying into host memory decides nothing about storage.

Markers and the lock are leases (``lease``): a heartbeat rewrites them every third of
``$CKPTTURBO_PENDING_LEASE`` while their writer works, so a crashed save or a killed gc
holds the run for one lease, not for hours. A rank's heartbeat stops when its uploads are
done, after one last renewal unless the last was within a sixth of the lease; the
coordinator must commit within five sixths of a lease of that.

A manifest gc cannot read (truncated, corrupted, hostile) might name any chunk, so gc
deletes nothing while one exists and names it; ``ls`` lists the others and marks it.

The lock file tells saves that a gc runs; it does not keep two gcs apart (a second gc
overwrites a dead one's lock rather than wait out its lease). Within a process, where a
memory tier's evictions after two saves run on two threads, the gcs of one store take
turns: side by side, the first to finish would remove the lock while the other still
deletes, and both would delete the same chunks.

A self-contained checkpoint (manifest ``chunk_store`` ".") has a store of its own inside
its directory, under the same rules: its pending markers and gc lock live there, gc of
the run sweeps it against its one manifest, a save that replaces it sweeps it after the
commit, and a delete removes it whole (manifest first). Its generation is minted by the
first save when absent, so a store deleted and made again never repeats the generation a
process listed the old one at.
"""
from __future__ import annotations

import contextlib
import logging
import os
import posixpath
import time
import uuid
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from .chunk_index import ChunkIndex
from .chunk_store import ChunkStore
from .errors import CheckpointNotFound, CkptTurboError, FormatError, SaveInProgress
from .lease import Heartbeat, marker_is_fresh, pending_lease
from .manifest import Manifest
from .paths import CONTROL_DIR, OWN_STORE
from .runs import Location, RunStore
from .runtime import Runtime, gc_turn, pending_saves, resolve, runtime_of, wait_for_saves
from .store import TEMP_PREFIX
from .urls import url_key

log = logging.getLogger(__name__)

LOCK_WAIT = 600.0
LOCK_POLL = 0.5


def _fresh(store: ChunkStore, path: str, now: float) -> bool:
    try:
        return marker_is_fresh(store.get(path), now)
    except CheckpointNotFound:
        return False


def begin_save(run: RunStore, save_id: str, rank: int, wait: float = LOCK_WAIT, *,
               index: ChunkIndex | None = None) -> str:
    """Announce one rank of a save (a pending marker with a heartbeat), wait out a running
    gc, and return the gc generation; given the rank's chunk ``index``, bring it to that
    generation too.

    Called after staging and before the first dedup decision (see the module docstring).
    The order of the requests is the rule's: the marker, then the lock, then the generation.
    An index never listed is listed alongside the generation's read (both come after the
    lock is seen gone, so both are valid at that generation): one round trip less on a
    store's first save.
    """
    store = run.store
    path = run.pending_path(save_id, rank)
    runtime_of(run).keep_heartbeat(path, Heartbeat(store, path, pending_lease(), rank=rank))
    deadline = time.monotonic() + wait
    while _fresh(store, run.gc_lock, time.time()):
        if time.monotonic() > deadline:
            end_save(run, save_id, [rank])
            raise SaveInProgress(f"a gc of {store.url_of(run.chunks_root)} held its lock "
                                 f"for {wait}s")
        log.debug("save %s (rank %d) waits for the gc lock %s", save_id, rank,
                  store.url_of(run.gc_lock))  # tests wait for this line, not for a sleep
        time.sleep(LOCK_POLL)
    # a thread of its own, not the store's pool: there it could queue behind the uploads
    # of another save in flight on the same endpoint
    lister = (ThreadPoolExecutor(1, thread_name_prefix="ckptturbo-listing")
              if index is not None and not index.listed else None)
    listing = lister.submit(run.chunk_ids) if lister is not None else None
    try:
        gen = generation(run)
        if gen == "0" and run.own:  # a delete removes the generation with the store: mint anew
            gen = uuid.uuid4().hex
            store.put(run.gc_generation, gen.encode())
        if index is not None:
            index.sync(run, gen, listing.result() if listing is not None else None)
    finally:
        if lister is not None:  # its thread is joined unless a failure left it listing
            lister.shutdown(wait=listing is not None and listing.done())
    return gen


def uploaded(run: RunStore, save_id: str, rank: int) -> None:
    """This rank's uploads are done: stop the heartbeat, renewing the marker once more
    unless it was renewed within a sixth of its lease. The marker now holds for at least
    five sixths of a lease, in which the coordinator commits and removes it."""
    for beat in runtime_of(run).take_heartbeats([run.pending_path(save_id, rank)]):
        beat.stop(final_beat=True)


def end_save(run: RunStore, save_id: str, ranks: list[int] | range) -> None:
    """Remove the pending markers of these ranks of a save (absent ones are fine); a
    failure is only logged: it must not fail a committed save."""
    paths = [run.pending_path(save_id, rank) for rank in ranks]
    for beat in runtime_of(run).take_heartbeats(paths):
        beat.stop()  # first: a late heartbeat must not bring a marker back
    try:  # in parallel; every delete is attempted before the first failure is reported
        run.store.delete(paths)
    except CheckpointNotFound:
        pass
    except CkptTurboError as exc:  # advisory: the save itself stands, the markers expire
        log.warning("could not remove the pending markers of save %s (%s); gc of %s waits "
                    "until their lease expires", save_id, exc, run.store.url_of(run.root))


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
    error: str | None = None  # set (and the sizes 0) when the manifest is unreadable
    pending: bool = False  # a save in flight in this process, not committed yet (wait=False)
    tiers: tuple[str, ...] = ()  # listed across tiers (tiered_catalog): "memory", "durable"


def committed(run_url: str, storage_options: dict[str, Any] | None, session: Runtime | None,
              skip: Iterable[str] = ()) -> list[tuple[str, Manifest | FormatError]]:
    """(url, manifest) of every committed checkpoint directly under a run but those named
    in ``skip``, in listing order: one listing, then the manifests read in parallel (one
    after another, an object store's latency per checkpoint is what made listing a long
    run slow). An unreadable manifest comes as its FormatError. A checkpoint deleted
    between the listing and the read is left out: it no longer exists."""
    session = resolve(session)
    store = session.open_store(run_url, storage_options)
    left_out = {CONTROL_DIR, *skip}
    names = [n for n in (posixpath.basename(p) for p in store.list_dirs(store.root))
             if n not in left_out]

    def read(name: str) -> tuple[str, Manifest | FormatError] | None:
        url = f"{run_url.rstrip('/')}/{name}"
        try:
            return url, Location(url, storage_options, session=session).read_manifest()
        except CheckpointNotFound:
            return None
        except FormatError as exc:
            return url, exc

    return [found for found in store.map(read, names) if found is not None]


def is_committed(url: str, storage_options: dict[str, Any] | None = None, *,
                 session: Runtime | None = None) -> bool:
    """Whether a committed checkpoint is at ``url``: its manifest is there and verifies."""
    session = resolve(session)
    try:
        Location(url, storage_options, session=session).read_manifest()
    except CheckpointNotFound:
        return False
    return True


def list_checkpoints(run_url: str, storage_options: dict[str, Any] | None = None, *,
                     include_unreadable: bool = False, wait: bool = True,
                     session: Runtime | None = None) -> list[CheckpointInfo]:
    """Committed checkpoints directly under a run, oldest first; uncommitted ones are absent.

    A checkpoint whose manifest cannot be read is logged as a warning and left out, or
    with ``include_unreadable`` listed first with ``error`` set: one bad manifest must
    not hide the rest of the run. Saves in flight in this process under the run are waited
    for (read-your-writes); with ``wait=False`` they are listed last, ``pending=True``.
    """
    pending = [] if wait else [h.url for h in pending_saves(run_url, under=True)]
    if wait:
        wait_for_saves(run_url, under=True)
    found, bad = [], []
    for url, m in committed(run_url, storage_options, session):
        name = posixpath.basename(url)
        if isinstance(m, FormatError):
            log.warning("checkpoint %s is unreadable: %s", url, m)
            bad.append(CheckpointInfo(name, url, 0.0, 0, 0, 0, error=str(m)))
            continue
        found.append(CheckpointInfo(name, url, m.created, m.total_bytes, m.unique_bytes,
                                    len(m.items)))
    found.sort(key=lambda c: (c.created, c.name))
    listed = {url_key(c.url) for c in found}
    found += [CheckpointInfo(posixpath.basename(u.rstrip("/")), u, time.time(), 0, 0, 0,
                             pending=True)
              for u in pending if url_key(u) not in listed]
    return sorted(bad, key=lambda c: c.name) + found if include_unreadable else found


def delete_checkpoint(url: str, storage_options: dict[str, Any] | None = None, *,
                      session: Runtime | None = None) -> bool:
    """Remove the manifest (which makes the checkpoint cease to exist); chunks in the run's
    store stay for gc, a store of the checkpoint's own goes with it.

    A save of it in flight in this process is waited for first, so it cannot commit after
    the delete. An unreadable manifest is removed too (with a warning): that is how a run
    gets rid of it. The manifest goes first, so a half-deleted checkpoint never looks
    committed. On a file system the checkpoint's directory goes too once it is empty,
    also when it held no manifest (a save that never committed). A missing checkpoint
    raises CheckpointNotFound. Returns whether its chunks went with it (self-contained).
    """
    wait_for_saves(url)
    session = resolve(session)
    location = Location(url, storage_options, session=session)
    own = False
    try:
        try:
            own = location.read_manifest().chunk_store == OWN_STORE
        except FormatError as exc:
            log.warning("deleting unreadable checkpoint %s (%s)", url, exc)
        location.store.delete([location.manifest_path])
        return own
    finally:
        _drop_own_store(Location(url, storage_options, OWN_STORE, session=session).run)
        if location.store.is_local:
            _remove_empty_dirs(location.path)


def _drop_own_store(run: RunStore) -> None:
    """Delete a checkpoint's own store (its manifest is gone), under the gc protocol: a
    save of it in flight elsewhere keeps it (logged), and its fresh markers are kept."""
    store = run.store
    if not store.list_files(run.control_dir):  # a checkpoint in the run's store
        return
    try:
        with _gc_lock(run, dry_run=False):
            now = time.time()
            doomed = [f.path for f in store.list_files(run.control_dir) if f.path != run.gc_lock
                      and not (f.path.startswith(run.pending_dir) and _fresh(store, f.path, now))]
            store.delete(doomed)
    except SaveInProgress as exc:
        log.warning("kept the chunk store of %s: %s", store.url_of(run.root), exc)


def _remove_empty_dirs(path: str) -> None:
    """Remove a local checkpoint's directory and the empty ones under it; a directory that
    still holds files (someone else's, a save's fresh marker) is kept with its parents."""
    for root, _, _ in os.walk(path, topdown=False):
        with contextlib.suppress(OSError):
            os.rmdir(root)


@dataclass
class GcReport:
    referenced: int
    deleted: int
    deleted_bytes: int
    kept_recent: int
    dry_run: bool

    def __add__(self, other: GcReport) -> GcReport:
        """Two stores' reports as one (a run's store and its checkpoints' own)."""
        return GcReport(self.referenced + other.referenced, self.deleted + other.deleted,
                        self.deleted_bytes + other.deleted_bytes,
                        self.kept_recent + other.kept_recent, self.dry_run)


def collect_garbage(run_url: str, storage_options: dict[str, Any] | None = None, *,
                    dry_run: bool = False, grace_seconds: float = 0.0,
                    session: Runtime | None = None) -> GcReport:
    """Delete chunks of the run's store that no committed checkpoint of the run names, and
    chunks of each self-contained checkpoint's own store that its manifest does not name.

    Raises SaveInProgress while a save's marker holds its lease, and FormatError (deleting
    nothing) while a manifest of the run is unreadable: its chunks cannot be told apart.
    A run without a store of its own (every checkpoint self-contained) gets no lock or
    control file: its directory keeps listing only checkpoints.
    """
    session = resolve(session)
    run = RunStore.for_run(run_url, storage_options, session=session)
    shared = bool(run.store.list_files(run.pending_dir) or run.store.list_dirs(run.chunks_root))
    report = GcReport(0, 0, 0, 0, dry_run)
    with _gc_lock(run, dry_run) if shared else contextlib.nullcontext():
        referenced: set[str] = set()
        own, unreadable = [], []
        for url, manifest in committed(run_url, storage_options, session):
            if isinstance(manifest, FormatError):
                unreadable.append(f"{url} ({manifest})")
            elif manifest.chunk_store == OWN_STORE:
                own.append(url)
            else:
                referenced.update(manifest.chunks)
        if unreadable and shared:
            raise FormatError(f"gc of {run_url} deleted nothing: {len(unreadable)} unreadable "
                              f"manifest(s) might reference any chunk: {'; '.join(unreadable)}. "
                              "Restore them, or remove them with `ckptturbo rm`")
        if shared:
            report = _sweep(run, referenced, dry_run, grace_seconds)
    for url in own:
        own_store = Location(url, storage_options, OWN_STORE, session=session)
        report = report + collect_checkpoint(own_store, dry_run=dry_run,
                                             grace_seconds=grace_seconds)
    return report


def collect_checkpoint(location: Location, *, dry_run: bool = False,
                       grace_seconds: float = 0.0) -> GcReport:
    """Delete the chunks of a self-contained checkpoint's own store that its manifest does
    not name: what a save that replaced it, or a failed save to it, left behind. The
    manifest is read under the store's gc lock, so a save committed meanwhile is seen.

    A store a delete removed since the run's gc listed the checkpoint stays removed: its
    lock would write the directory back. The check and the lock come in this process's
    turn for the store, the turn a delete drops it in."""
    run = location.run
    with gc_turn(run.store.url_of(run.gc_lock)):
        if not run.store.list_files(run.control_dir):
            return GcReport(0, 0, 0, 0, dry_run)
        with _gc_lock(run, dry_run):
            try:
                manifest = location.read_manifest()
                referenced = set(manifest.chunks) if manifest.chunk_store == OWN_STORE else set()
            except CheckpointNotFound:  # deleted meanwhile: its store is garbage
                referenced = set()
            return _sweep(run, referenced, dry_run, grace_seconds)


def sweep_replaced(location: Location) -> None:
    """After a save replaced a self-contained checkpoint: free the old version's chunks,
    which no gc of the run's store would reach. A failure is only logged: the save stands,
    and ``ckptturbo gc`` of the run frees them later."""
    try:
        collect_checkpoint(location)
    except CkptTurboError as exc:
        log.warning("could not free the replaced chunks of %s (%s); `ckptturbo gc` of its "
                    "run frees them", location.url, exc)


@contextlib.contextmanager
def _gc_lock(run: RunStore, dry_run: bool) -> Iterator[None]:
    """Hold a store's gc lock (a lease) while chunks are judged and deleted, after this
    process's other gcs of the store: refuse while a save's marker is fresh, and bump the
    generation before anything is deleted. A dry run takes no lock and changes nothing."""
    store = run.store
    if dry_run:
        yield
        return
    with gc_turn(store.url_of(run.gc_lock)):
        lock = Heartbeat(store, run.gc_lock, pending_lease(), id=uuid.uuid4().hex)
        try:
            now = time.time()
            live = [p.path for p in store.list_files(run.pending_dir) if _fresh(store, p.path, now)]
            if live:
                raise SaveInProgress(f"{len(live)} save(s) in progress under "
                                     f"{store.url_of(run.root)}; run gc again when they are "
                                     "committed")
            store.put(run.gc_generation, uuid.uuid4().hex.encode())
            yield
        finally:
            lock.stop()
            try:
                store.delete([run.gc_lock])
            except CkptTurboError:
                log.warning("could not remove %s; it expires after its %ss lease",
                            run.gc_lock, lock.lease)


def _sweep(run: RunStore, referenced: set[str], dry_run: bool, grace_seconds: float) -> GcReport:
    """Delete the store's chunks not in ``referenced`` (older than the grace period).

    A local write's temporary file is a chunk on its way in (a replica a peer is sending
    into a memory tier holds no save marker); it goes only once older than a lease, when
    its writer is gone."""
    store, now = run.store, time.time()
    doomed, kept_recent, doomed_bytes = [], 0, 0
    for info in store.list_files(run.chunks_root):
        cid = info.path.rsplit("/", 1)[-1]
        if cid in referenced:
            continue
        grace = pending_lease() if cid.startswith(TEMP_PREFIX) else grace_seconds
        if info.mtime is not None and now - info.mtime < grace:
            kept_recent += 1
            continue
        doomed.append(info.path)
        doomed_bytes += info.size
    if not dry_run:
        store.delete(doomed)
    log.info("gc %s: %d referenced, %d unreferenced chunks (%d bytes)%s", store.url_of(run.root),
             len(referenced), len(doomed), doomed_bytes, " [dry run]" if dry_run else "")
    return GcReport(len(referenced), len(doomed), doomed_bytes, kept_recent, dry_run)
