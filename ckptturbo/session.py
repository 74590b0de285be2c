"""The session: the one owner of a process's checkpoint I/O.

A save outlives the call that started it (the upload runs behind training), so something
must own it until it is durable. Without an owner nothing waits for it at interpreter exit
(the checkpoint is silently lost), a load in the same process cannot know that the
checkpoint it asks for is on its way, and nothing can release the threads saves leave
behind. A :class:`Session` owns all of it: the I/O thread pools of its stores (one per
endpoint and options), the gloo groups its saves and loads run on, the writers kept for
reuse (staging pool, plan cache), the chunk indexes of the runs it writes, the heartbeats
of its pending markers, and its saves in flight.

Process-wide, and only here: the default session behind ``ct.save``/``ct.load``, the set
of open sessions (so that read-your-writes and the wait at exit cover every session of the
process), and DCP's single-process warning filter (warnings filters are process-wide).
"""
from __future__ import annotations

import collections
import contextlib
import logging
import os
import sys
import threading
import time
import warnings
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable, Iterator

import fsspec

from .retry import seconds_setting

if TYPE_CHECKING:
    from .catalog import CheckpointInfo
    from .chunk_index import ChunkIndex
    from .staging import SaveHandle
    from .tiers import Tiers
    from .writer import TurboWriter

log = logging.getLogger(__name__)

MAX_WRITERS = 8  # writers kept for reuse (pool, plan cache); the least recently used is closed
MAX_CHUNK_INDEXES = 8  # runs whose chunk listing is remembered (a cache: relisted when dropped)
EXIT_REPORT_EVERY = 10.0  # seconds between "still waiting" lines at exit


def url_key(url: Any) -> str:
    """One spelling per location, so that a save to ``run/step-1`` and a load of
    ``file:///abs/run/step-1/`` are known to be the same checkpoint."""
    text = os.fspath(url) if isinstance(url, os.PathLike) else str(url)
    protocol = fsspec.utils.get_protocol(text)
    if protocol in ("file", "local"):
        path = text.split("://", 1)[1] if "://" in text else text
        return "file://" + os.path.abspath(os.path.expanduser(path)).rstrip("/")
    if protocol == "s3a":
        text = "s3" + text[3:]
    return text.rstrip("/")


def _covers(key: str, target: str, under: bool) -> bool:
    return key == target or (under and key.startswith(target + "/"))


class _Flight:
    """One save in flight: where it goes, its handle, its writer and the thread running it."""

    __slots__ = ("key", "handle", "writer", "thread")

    def __init__(self, key: str, handle: SaveHandle, writer: Any, thread: threading.Thread) -> None:
        self.key, self.handle, self.writer, self.thread = key, handle, writer, thread


class Session:
    """Owns the checkpoint I/O of a process, or of one component of it.

    ``ct.save``/``ct.load``/``ct.load_state_dict``/``ct.delete``/``ct.exists``/
    ``ct.list_checkpoints`` are the methods of :func:`default_session`. A component that must
    leave nothing running when it is done (a framework plugin's ``teardown``) makes its own
    session and closes it. ``close()`` waits for the session's saves and stops its threads;
    the session stays usable and makes them again on its next use.

    Guarantees that hold across every session of the process: a load, ``exists``, listing
    or delete of a location with a save in flight waits for that save first; interpreter
    exit waits for every save in flight to become durable or fail.
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._executors: dict[tuple, ThreadPoolExecutor] = {}
        self._groups: dict[tuple, Any] = {}
        self._writers: collections.OrderedDict[tuple, TurboWriter] = collections.OrderedDict()
        self._indexes: collections.OrderedDict[tuple, ChunkIndex] = collections.OrderedDict()
        self._beats: dict[str, Any] = {}
        self._flights: list[_Flight] = []
        self._save_counts: collections.Counter[tuple] = collections.Counter()
        _open_sessions.add(self)

    # --- resources --------------------------------------------------------------------
    def executor(self, key: tuple, workers: int) -> ThreadPoolExecutor:
        """The I/O thread pool of one endpoint (and width), created on first use."""
        with self._lock:
            pool = self._executors.get((key, workers))
            if pool is None:
                pool = self._executors[(key, workers)] = ThreadPoolExecutor(
                    workers, thread_name_prefix="ckptturbo-io")
            return pool

    def gloo_group(self, group: Any, purpose: str) -> Any:
        """A gloo group over the ranks of ``group`` (default: the world), one per purpose;
        every rank of ``group`` must ask for it the first time (creating one is collective)."""
        from . import groups
        import torch.distributed as dist

        key = (group or dist.group.WORLD, purpose)
        with self._lock:
            if key not in self._groups:
                self._groups[key] = groups.new_gloo_group(key[0])
            return self._groups[key]

    def _release_groups(self) -> None:
        """Destroy the gloo groups this session made, while the interpreter is still whole.
        A group left to finalisation can hold gloo work whose tensors need the GIL when
        freed, which aborts the process (terminate called without an active exception)."""
        with self._lock:
            made, self._groups = list(self._groups.values()), {}
        if not made:
            return
        import torch.distributed as dist

        if not dist.is_initialized():
            return  # destroy_process_group() already took every group
        for group in made:
            try:
                dist.destroy_process_group(group)
            except (ValueError, RuntimeError) as e:  # already destroyed by the application
                log.debug("gloo group not destroyed at exit: %s", e)

    def chunk_index(self, key: tuple) -> ChunkIndex:
        """What this session knows a run's chunk store holds (created empty, unlisted)."""
        from .chunk_index import ChunkIndex

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
        "persist every Nth save" is counted per session, the same on every rank."""
        with self._lock:
            self._save_counts[key] += 1
            return self._save_counts[key]

    def keep_heartbeat(self, path: str, beat: Any) -> None:
        """Hold the heartbeat of a pending marker this session wrote, until it is taken back."""
        with self._lock:
            self._beats[path] = beat

    def take_heartbeats(self, paths: list[str]) -> list[Any]:
        """The heartbeats of these markers that the session holds, no longer held."""
        with self._lock:
            return [self._beats.pop(p) for p in paths if p in self._beats]

    def writer(self, url: str, storage_options: dict[str, Any] | None, options: dict[str, Any],
               collective: bool) -> TurboWriter:
        """One writer per run and settings, so its pool and plan cache are reused; at most
        MAX_WRITERS are kept, and an evicted one is closed once its saves are durable."""
        from .writer import TurboWriter

        run = url_key(url).rsplit("/", 1)[0]
        key = (run, collective, repr(sorted((storage_options or {}).items())),
               repr(sorted(options.items())))
        with self._lock:
            writer = self._writers.get(key)
            if writer is not None:
                self._writers.move_to_end(key)
                return writer
            writer = self._writers[key] = TurboWriter(url, storage_options, snapshot=True,
                                                      session=self, **options)
            while len(self._writers) > MAX_WRITERS:
                _, old = self._writers.popitem(last=False)
                self._close_when_idle(old)
        return writer

    def _close_when_idle(self, writer: TurboWriter) -> None:
        busy = self.saves_of(writer)
        if not busy:
            writer.close()
        else:  # a later save to that run still waits for it
            busy[-1].durable.add_done_callback(lambda _, w=writer: w.close())

    # --- saves in flight ----------------------------------------------------------------
    def track(self, url: str, handle: SaveHandle, writer: Any, target: Callable[[], None]) -> None:
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
                and (target is None or _covers(f.key, target, under))]

    def _running(self) -> list[_Flight]:
        """Saves whose thread has not ended (a durable one may still be finishing)."""
        with self._lock:
            return [f for f in self._flights if f.thread.is_alive()]

    def saves_of(self, writer: Any) -> list[SaveHandle]:
        """The saves in flight through one writer, oldest first."""
        with self._lock:
            return [f.handle for f in self._flights if f.writer is writer and not f.handle.done()]

    def saves_in_flight(self, url: Any = None, *, under: bool = False) -> list[SaveHandle]:
        """This session's saves not yet durable (or failed): all of them, those to ``url``,
        or with ``under`` those to ``url`` and below it (a run's checkpoints)."""
        return [f.handle for f in self._in_flight(url, under)]

    def wait(self, url: Any = None, *, under: bool = False, timeout: float | None = None) -> list[SaveHandle]:
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

    # --- the operations ---------------------------------------------------------------
    def save(self, state_dict: dict[str, Any], url: Any, **kwargs: Any) -> SaveHandle:
        """``ct.save`` on this session; see :func:`ckptturbo.api.save`."""
        from .operations import save

        return save(self, state_dict, url, **kwargs)

    def load(self, state_dict: dict[str, Any], url: Any, **kwargs: Any) -> Any:
        """``ct.load`` on this session; see :func:`ckptturbo.api.load`."""
        from .operations import load

        return load(self, state_dict, url, **kwargs)

    def load_state_dict(self, url: Any, **kwargs: Any) -> dict[str, Any]:
        """``ct.load_state_dict`` on this session; see :func:`ckptturbo.api.load_state_dict`."""
        from .operations import load_state_dict

        return load_state_dict(self, url, **kwargs)

    def delete(self, url: Any, *, storage_options: dict[str, Any] | None = None,
               tiers: Tiers | None = None) -> None:
        """Make a committed checkpoint cease to exist (a save of it in flight is waited for
        first, so that it cannot commit afterwards). ``tiers``: from this node's memory tier
        too (``tiered_catalog``)."""
        from . import catalog, tiered_catalog

        if tiers is not None:
            tiered_catalog.delete_tiered(str(url), storage_options, tiers, session=self)
            return
        catalog.delete_checkpoint(str(url), storage_options, session=self)

    def exists(self, url: Any, *, storage_options: dict[str, Any] | None = None,
               tiers: Tiers | None = None) -> bool:
        """Whether a committed checkpoint is at ``url``, once a save of it in flight ends.
        ``tiers``: in this node's memory tier or at ``url``."""
        from . import catalog, tiered_catalog

        if tiers is not None:
            return tiered_catalog.exists_tiered(str(url), storage_options, tiers, session=self)
        wait_for_saves(url)
        return catalog.is_committed(str(url), storage_options, session=self)

    def list_checkpoints(self, run_url: Any, *, storage_options: dict[str, Any] | None = None,
                         wait: bool = True, tiers: Tiers | None = None) -> list[CheckpointInfo]:
        """Committed checkpoints directly under a run, oldest first. Saves in flight in this
        process under the run are waited for; with ``wait=False`` they are listed at once,
        last, with ``pending=True``. ``tiers``: those in this node's memory tier too, under
        their durable URLs, each saying which tiers hold it (``CheckpointInfo.tiers``)."""
        from . import catalog, tiered_catalog

        if tiers is not None:
            return tiered_catalog.list_tiered(str(run_url), storage_options, tiers, wait=wait,
                                              session=self)
        return catalog.list_checkpoints(str(run_url), storage_options, wait=wait, session=self)

    # --- lifetime -----------------------------------------------------------------------
    def close(self, timeout: float | None = None) -> None:
        """Wait for this session's saves (a failure is logged: it belongs to its handle),
        then stop every thread the session started. The session stays usable."""
        pending = self.wait(timeout=timeout)
        for handle in pending:
            if handle.done() and handle.durable.exception() is not None:
                log.warning("save to %s failed: %s", handle.url, handle.durable.exception())
        with self._lock:
            flights, self._flights = self._flights, []
            writers = list(self._writers.values())
            self._writers.clear()
            executors = list(self._executors.values())
            self._executors.clear()
            self._indexes.clear()
        for flight in flights:
            if flight.thread is not threading.current_thread():
                flight.thread.join(timeout)
        for writer in writers:
            writer.close()
        for pool in executors:
            pool.shutdown(wait=True)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<ckptturbo.Session: {len(self.saves_in_flight())} saves in flight>"


# --- process-wide ------------------------------------------------------------------------
_open_sessions: weakref.WeakSet[Session] = weakref.WeakSet()
_default: Session | None = None
_default_lock = threading.Lock()


def default_session() -> Session:
    """The session behind ``ct.save``, ``ct.load`` and the other module-level functions."""
    global _default
    with _default_lock:
        if _default is None:
            _default = Session()
        return _default


def pending_saves(url: Any, *, under: bool = False) -> list[SaveHandle]:
    """Saves in flight to ``url`` (or below it) in any session of this process."""
    return [h for s in list(_open_sessions) for h in s.saves_in_flight(url, under=under)]


def wait_for_saves(url: Any, *, under: bool = False) -> None:
    """Read-your-writes: wait for every save in flight in this process to ``url`` (with
    ``under``, also to the locations below it, such as a run's checkpoints)."""
    for session in list(_open_sessions):
        waited = session.wait(url, under=under)
        if waited:
            log.info("waited for %d save(s) in flight to %s", len(waited), url)


def _wait_at_exit() -> None:
    """Interpreter exit: every save in flight becomes durable (or fails) before the I/O
    thread pools stop. Runs before concurrent.futures refuses new work at exit; bounded by
    the saves' own storage deadlines, or by CKPTTURBO_EXIT_TIMEOUT seconds when set. Each
    save's thread is joined too: a daemon thread still inside torch when the interpreter
    finalises aborts the process. Then the gloo groups the sessions made are destroyed."""
    if _wait_for_flights_at_exit():  # a save given up on may still be inside a collective
        for session in list(_open_sessions):
            session._release_groups()


def _wait_for_flights_at_exit() -> bool:
    """Whether every save's thread has ended."""
    flights = [f for s in list(_open_sessions) for f in s._running()]
    if not flights:
        return True
    limit = seconds_setting("EXIT_TIMEOUT", None, None, ValueError)
    deadline = None if limit is None else time.monotonic() + limit
    log.info("waiting at exit for %d checkpoint save(s) in flight: %s", len(flights),
                ", ".join(f.handle.url for f in flights))
    for flight in flights:
        handle = flight.handle
        while flight.thread.is_alive():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                break
            flight.thread.join(EXIT_REPORT_EVERY if left is None else min(EXIT_REPORT_EVERY, left))
            if flight.thread.is_alive():
                log.warning("still waiting at exit for the save to %s", handle.url)
        if not handle.done():
            sys.stderr.write(f"ckptturbo: gave up at exit on the save to {handle.url} after "
                             f"CKPTTURBO_EXIT_TIMEOUT={limit}s; it is not committed\n")
        elif handle.durable.exception() is not None:
            sys.stderr.write(f"ckptturbo: the save to {handle.url} failed and is not committed: "
                             f"{handle.durable.exception()}\n")
    return not any(f.thread.is_alive() for f in flights)


# Registered with threading (not atexit): its exit hooks run, newest first, before
# concurrent.futures stops accepting work, which the uploads of a save still need.
threading._register_atexit(_wait_at_exit)


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
                warnings.filters[:] = [f for f in warnings.filters
                                       if not (f[0] == "ignore" and f[1] is not None
                                               and f[1].pattern == _SINGLE_PROCESS_WARNING)]
