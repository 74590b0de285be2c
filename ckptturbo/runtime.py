"""The runtime: the one owner of a process's checkpoint I/O state.

A save outlives the call that started it (the upload runs behind training), so something
must own it until it is durable. Without an owner nothing waits for it at interpreter exit
(the checkpoint is silently lost), a load in the same process cannot know that the
checkpoint it asks for is on its way, and nothing can release the threads saves leave
behind. A :class:`Runtime` owns all of it: the I/O thread pools of its stores (one per
endpoint and options), the gloo groups its saves and loads run on, what is kept for reuse
(writers with their staging pool and plan cache, handed in as closeables), the chunk
indexes of the runs it writes, the heartbeats of its pending markers, its saves in flight
and the latest tiered save of each run.

It sits below the catalog, the pipelines, the tiers and the operations, and imports none
of them: they hand it what it keeps. ``ckptturbo.session.Session`` is a runtime with the
public operations on top.

Process-wide, and only here: the default runtime (the default session), the set of open
runtimes (so that read-your-writes and the wait at exit cover every session of the
process), the turns of this process's gcs of one store, and DCP's single-process warning
filter (warnings filters are process-wide).
"""
from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Protocol, cast

from .chunk_index import ChunkIndex
from .chunk_store import use_default_opener
from .errors import CkptTurboError
from .store import Store
from .urls import covers, options_key, url_key

if TYPE_CHECKING:
    from .runs import RunStore

log = logging.getLogger(__name__)

MAX_KEPT = 8  # writers kept for reuse (pool, plan cache); the least recently used is closed
MAX_STORES = 64  # stores kept open per runtime (a cache: opened again when dropped)
MAX_CHUNK_INDEXES = 8  # runs whose chunk listing is remembered (a cache: relisted when dropped)


class Handle(Protocol):
    """What the runtime needs of a save's handle (``staging.SaveHandle``)."""

    url: str
    durable: Any  # a Future

    def done(self) -> bool:
        """Whether the save ended (durable or failed)."""


class Closeable(Protocol):
    """Something kept for reuse (a writer), closed when evicted or at ``close()``."""

    def close(self) -> None:
        """Release what it holds."""


class _Flight:
    """One save in flight: where it goes, its handle, its writer and the thread running it."""

    __slots__ = ("key", "handle", "writer", "thread")

    def __init__(self, key: str, handle: Handle, writer: Any, thread: threading.Thread) -> None:
        self.key, self.handle, self.writer, self.thread = key, handle, writer, thread


class Runtime:
    """Owns the checkpoint I/O state of a process, or of one component of it.

    Guarantees that hold across every runtime of the process: a load, ``exists``, listing
    or delete of a location with a save in flight waits for that save first; interpreter
    exit waits for every save in flight to become durable or fail. ``close()`` waits for
    the runtime's saves and stops its threads; it stays usable and makes them again on its
    next use.
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._executors: dict[tuple, ThreadPoolExecutor] = {}
        self._groups: dict[tuple, Any] = {}
        self._stores: collections.OrderedDict[tuple, Store] = collections.OrderedDict()
        self._buckets: set[tuple] = set()  # (endpoint, bucket) a store found (check_reachable)
        self._kept: collections.OrderedDict[tuple, Closeable] = collections.OrderedDict()
        self._indexes: collections.OrderedDict[tuple, ChunkIndex] = collections.OrderedDict()
        self._beats: dict[str, Any] = {}
        self._flights: list[_Flight] = []
        self._save_counts: collections.Counter[tuple] = collections.Counter()
        self._latest: dict[str, Any] = {}
        self._parked: dict[str, Any] = {}
        self._parked_lock = threading.Lock()  # not _lock: making one may do I/O
        self._delta_base: tuple[str, dict[str, Any]] | None = None
        _open_runtimes.add(self)

    # --- resources --------------------------------------------------------------------
    def executor(self, key: tuple, workers: int) -> ThreadPoolExecutor:
        """The I/O thread pool of one endpoint (and width), created on first use."""
        with self._lock:
            pool = self._executors.get((key, workers))
            if pool is None:
                pool = self._executors[(key, workers)] = ThreadPoolExecutor(
                    workers, thread_name_prefix="ckptturbo-io")
            return pool

    def bucket_found(self, key: tuple) -> bool:
        with self._lock:
            return key in self._buckets

    def note_bucket(self, key: tuple) -> None:
        with self._lock:
            self._buckets.add(key)

    def open_store(self, url: Any, storage_options: dict[str, Any] | None = None,
                   **settings: Any) -> Store:
        """The one way to open a store (``chunk_store.StoreOpener``): one per URL, options
        and ``settings`` (``Store``'s retry, timeout and width settings), kept while
        recently used; its requests run on this runtime's pool of its endpoint."""
        # the spelling too (a store's messages name its URL as given), and the location
        # (a relative path names another directory once the working directory changes)
        key = (str(url), url_key(url), options_key(storage_options), options_key(settings))
        with self._lock:
            found = self._stores.get(key)
            if found is not None:
                self._stores.move_to_end(key)
                return found
        opened = Store(str(url), storage_options, session=self, **settings)  # no lock: I/O
        with self._lock:
            found = self._stores.setdefault(key, opened)
            self._stores.move_to_end(key)
            while len(self._stores) > MAX_STORES:
                self._stores.popitem(last=False)
        return found

    def gloo_group(self, group: Any, purpose: str) -> Any:
        """A gloo group over the ranks of ``group`` (default: the world), one per purpose;
        every rank of ``group`` must ask for it the first time (creating one is collective)."""
        import torch.distributed as dist  # the command line's stores need no torch

        from . import groups

        key = (group or dist.group.WORLD, purpose)
        with self._lock:
            if key not in self._groups:
                self._groups[key] = groups.new_gloo_group(key[0])
            return self._groups[key]

    def release_groups(self, destroy: Callable[[Any], Any]) -> None:
        """Destroy the gloo groups this runtime made with ``destroy`` (torch's
        ``destroy_process_group``): at exit, while the interpreter is still whole, and before
        the application destroys its world group. A group left to finalisation can hold gloo
        work whose tensors need the GIL when freed, which aborts the process (terminate
        called without an active exception)."""
        with self._lock:
            made, self._groups = list(self._groups.values()), {}
        if not made:
            return
        import torch.distributed as dist

        if not dist.is_initialized():
            return  # destroy_process_group() already took every group
        for group in made:
            try:
                destroy(group)
            except (ValueError, RuntimeError) as e:  # already destroyed by the application
                log.debug("gloo group not destroyed: %s", e)

    def chunk_index(self, key: tuple) -> ChunkIndex:
        """What this runtime knows a run's chunk store holds (created empty, unlisted)."""
        with self._lock:
            index = self._indexes.get(key)
            if index is None:
                index = self._indexes[key] = ChunkIndex()
                while len(self._indexes) > MAX_CHUNK_INDEXES:
                    self._indexes.popitem(last=False)
            else:
                self._indexes.move_to_end(key)
            return index

    def count_save(self, key: tuple) -> int:
        """Count one more save of ``key`` (a tiered run) and return the count, from 1:
        "persist every Nth save" is counted per runtime, the same on every rank."""
        with self._lock:
            self._save_counts[key] += 1
            return self._save_counts[key]

    def latest(self, run: str) -> Any | None:
        """The latest tiered save of ``run`` this runtime started (see :meth:`started`)."""
        with self._lock:
            return self._latest.get(run)

    def started(self, run: str, handle: Handle) -> None:
        """Remember ``handle`` as the latest tiered save of ``run``."""
        with self._lock:
            self._latest[run] = handle

    def keep_delta_base(self, url: str, values: dict[str, Any]) -> None:
        """Keep the tensors a delta save committed to ``url`` (name -> (content key, host
        copy), one save's worth): the next save with ``delta_from=url`` compares with those
        whose key its base record has instead of reading them back from storage."""
        with self._lock:
            self._delta_base = (url_key(url), values)

    def delta_base(self, url: str) -> dict[str, Any]:
        """The tensors kept for ``delta_from=url`` (empty: none kept, read the base)."""
        with self._lock:
            kept = self._delta_base
        return kept[1] if kept is not None and kept[0] == url_key(url) else {}

    def park(self, key: str, make: Callable[[], Any]) -> Any | None:
        """Hold what ``make`` returns under ``key`` until it is claimed or dropped (a shard
        opened ahead of the handle that will read it); None when one is parked there."""
        with self._parked_lock:
            if key in self._parked:
                return None
            found = self._parked[key] = make()
            return found

    def claim(self, key: str) -> Any | None:
        """What is parked under ``key``, no longer parked."""
        with self._parked_lock:
            return self._parked.pop(key, None)

    def unpark(self, key: str, found: Any) -> bool:
        """Drop ``found`` from ``key`` (False: claimed or dropped already)."""
        with self._parked_lock:
            if self._parked.get(key) is not found:
                return False
            del self._parked[key]
            return True

    def keep_heartbeat(self, path: str, beat: Any) -> None:
        """Hold the heartbeat of a pending marker this runtime wrote, until it is taken back."""
        with self._lock:
            self._beats[path] = beat

    def take_heartbeats(self, paths: list[str]) -> list[Any]:
        """The heartbeats of these markers that the runtime holds, no longer held."""
        with self._lock:
            return [self._beats.pop(p) for p in paths if p in self._beats]

    def kept(self, key: tuple, make: Callable[[], Closeable]) -> Any:
        """What is kept under ``key`` for reuse (a writer, so that its pool and plan cache
        are reused), made by ``make`` on first use; at most MAX_KEPT are kept, and an
        evicted one is closed once the saves through it are durable."""
        with self._lock:
            found = self._kept.get(key)
            if found is not None:
                self._kept.move_to_end(key)
                return found
            found = self._kept[key] = make()
            while len(self._kept) > MAX_KEPT:
                _, old = self._kept.popitem(last=False)
                self._close_when_idle(old)
        return found

    def _close_when_idle(self, kept: Closeable) -> None:
        busy = self.saves_of(kept)
        if not busy:
            kept.close()
        else:  # a later save through it still waits for it
            busy[-1].durable.add_done_callback(lambda _, k=kept: k.close())

    # --- saves in flight ----------------------------------------------------------------
    def track(self, url: str, handle: Handle, writer: Any, target: Callable[[], None]) -> None:
        """Run ``target`` (the save) on a thread of its own, registered until it ends."""
        thread = threading.Thread(target=target, name="ckptturbo-save", daemon=True)
        flight = _Flight(url_key(url), handle, writer, thread)
        with self._lock:
            self._flights = [f for f in self._flights if f.thread.is_alive()]
            self._flights.append(flight)
        thread.start()

    def _in_flight(self, url: Any, under: bool) -> list[_Flight]:
        target = None if url is None else url_key(url)
        with self._lock:
            flights = list(self._flights)
        return [f for f in flights if not f.handle.done()
                and (target is None or covers(f.key, target, under))]

    def running(self) -> list[_Flight]:
        """Saves whose thread has not ended (a durable one may still be finishing)."""
        with self._lock:
            return [f for f in self._flights if f.thread.is_alive()]

    def saves_of(self, writer: Any) -> list[Any]:
        """The handles of the saves in flight through one writer, oldest first."""
        with self._lock:
            return [f.handle for f in self._flights if f.writer is writer and not f.handle.done()]

    def saves_in_flight(self, url: Any = None, *, under: bool = False) -> list[Any]:
        """This runtime's saves not yet durable (or failed): all of them, those to ``url``,
        or with ``under`` those to ``url`` and below it (a run's checkpoints)."""
        return [f.handle for f in self._in_flight(url, under)]

    def wait(self, url: Any = None, *, under: bool = False,
             timeout: float | None = None) -> list[Any]:
        """Wait until the saves in flight (as :meth:`saves_in_flight` selects them) are
        durable or failed; their failures stay with their handles. Returns those waited for.
        A save never waits for itself (a callback on its own thread)."""
        handles = [f.handle for f in self._in_flight(url, under)
                   if f.thread is not threading.current_thread()]
        deadline = None if timeout is None else time.monotonic() + timeout
        for handle in handles:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            with contextlib.suppress(Exception):
                handle.durable.exception(left)
        return handles

    # --- lifetime -----------------------------------------------------------------------
    def close(self, timeout: float | None = None) -> None:
        """Wait for this runtime's saves (a failure is logged: it belongs to its handle),
        then stop every thread the runtime started. The runtime stays usable."""
        pending = self.wait(timeout=timeout)
        for handle in pending:
            if handle.done() and handle.durable.exception() is not None:
                log.warning("save to %s failed: %s", handle.url, handle.durable.exception())
        with self._lock:
            flights, self._flights = self._flights, []
            kept = list(self._kept.values())
            self._kept.clear()
            executors = list(self._executors.values())
            self._executors.clear()
            self._indexes.clear()
            self._stores.clear()
        for flight in flights:
            if flight.thread is not threading.current_thread():
                flight.thread.join(timeout)
        for each in kept:
            each.close()
        for pool in executors:
            pool.shutdown(wait=True)


def runtime_of(run: RunStore) -> Runtime:
    """The runtime that opened ``run``'s store (the owner of its threads and caches)."""
    owner = run.owner
    if not isinstance(owner, Runtime):
        raise CkptTurboError(f"the store of {run.store.url!r} has no runtime of ckptturbo's to "
                             f"keep its caches (it was opened by {owner!r})")
    return owner


def index_for(run: RunStore) -> ChunkIndex:
    """The index of this run's chunk store kept by the runtime that writes to it."""
    return runtime_of(run).chunk_index(run.key)


# --- process-wide ------------------------------------------------------------------------
_open_runtimes: weakref.WeakSet[Runtime] = weakref.WeakSet()
_default: Runtime | None = None
_default_kind: type[Runtime] = Runtime
_default_lock = threading.Lock()


def open_runtimes() -> list[Runtime]:
    """Every runtime of the process that is still open (their saves in flight, their groups)."""
    return list(_open_runtimes)


def use_default_kind(kind: type[Runtime]) -> None:
    """Make the default runtime a ``kind`` (the API's ``Session``, which registers itself
    when ``ckptturbo.session`` is imported: with the package, before any default exists)."""
    global _default_kind
    with _default_lock:
        _default_kind = kind


def default_runtime() -> Runtime:
    """The runtime behind ``ct.save``, ``ct.load`` and every call not handed one."""
    global _default
    with _default_lock:
        if _default is None or not isinstance(_default, _default_kind):
            _default = _default_kind()
        return _default


def resolve(runtime: Runtime | None) -> Runtime:
    """``runtime``, or the default one when none was handed."""
    return runtime if runtime is not None else default_runtime()


use_default_opener(default_runtime)


def pending_saves(url: Any, *, under: bool = False) -> list[Any]:
    """Saves in flight to ``url`` (or below it) in any runtime of this process."""
    return [h for r in list(_open_runtimes) for h in r.saves_in_flight(url, under=under)]


def wait_for_saves(url: Any, *, under: bool = False) -> None:
    """Read-your-writes: wait for every save in flight in this process to ``url`` (with
    ``under``, also to the locations below it, such as a run's checkpoints)."""
    for runtime in list(_open_runtimes):
        waited = runtime.wait(url, under=under)
        if waited:
            log.info("waited for %d save(s) in flight to %s", len(waited), url)


_turns: dict[str, list[Any]] = {}  # a gc lock's URL -> [its turn, the gcs holding or waiting]
_turns_guard = threading.Lock()


@contextlib.contextmanager
def gc_turn(lock_url: str) -> Iterator[None]:
    """This process's gcs of one store (named by its gc lock's URL) take turns; the turn
    is re-entrant (a gc may look at the store in the turn it then locks it in), and
    forgotten when no gc holds or waits for it."""
    with _turns_guard:
        turn = _turns.setdefault(lock_url, [threading.RLock(), 0])
        turn[1] += 1
    try:
        with turn[0]:
            yield
    finally:
        with _turns_guard:
            turn[1] -= 1
            if turn[1] == 0:
                del _turns[lock_url]


# --- DCP's single-process warning --------------------------------------------------------
_SINGLE_PROCESS_WARNING = (r"torch\.distributed is disabled, unavailable or uninitialized, "
                           r"assuming the intent is to (save|load) in a single process")
_quiet_users = 0
_quiet_lock = threading.Lock()


@contextlib.contextmanager
def single_process(no_dist: bool) -> Iterator[None]:
    """Keep DCP's single-process warning out of ckptturbo's own group-less calls.

    DCP warns on every call without a process group, even when told ``no_dist=True``; a
    ct.save / ct.load without one means exactly that. One "ignore" filter is shared by
    the calls in flight (threads) and removed after the last; catch_warnings is not used
    because it would restore other threads' filters when a background save ends.
    """
    global _quiet_users
    if not no_dist:
        yield
        return
    with _quiet_lock:
        if _quiet_users == 0:
            warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_WARNING, category=UserWarning)
        _quiet_users += 1
    try:
        yield
    finally:
        with _quiet_lock:
            _quiet_users -= 1
            if _quiet_users == 0:
                filters = cast(list[Any], warnings.filters)  # a list, typed as a Sequence
                filters[:] = [f for f in filters
                              if not (f[0] == "ignore" and f[1] is not None
                                      and f[1].pattern == _SINGLE_PROCESS_WARNING)]
