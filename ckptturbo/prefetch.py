"""Clairvoyant, memory-bounded prefetch of byte ranges in the order they will be consumed.

The one prefetcher of the library: TurboReader's direct loads (chunks in first-use
order), the chain heads of the read-once engine (``readonce``: the units a rank reads
for its chains, in the order the broadcaster sends them) and the safetensors streamer
(file ranges in yield order). Each knows every range it will need, and in which order,
before the first byte arrives. Following NoPFS, the optimal policy is then
simple: fetch exactly the next range not yet present, at the first opportunity, and drop
each range as soon as it has been consumed. :class:`Prefetcher` does that with up to three
bounds: at most ``streams`` requests in flight, a :class:`MemoryBudget` that every range
reserves before its request is issued and returns when the consumer releases it, and
optionally (``lookahead``) only ranges of the files starting at the consumer's current one.
The budget is the bound that matters: a file window stops reads while the consumer lags,
even far under the budget, so the streamer reads by bytes alone; the read-once engine
uses the window as a gate (its "files" are batches it has reserved). Ranges
are issued strictly in consumption order and released in that order too, so the range
the consumer waits for can always be issued (everything before it is released), which
makes the bound deadlock-free. A range larger than the whole budget is issued alone,
once nothing else is held, so a small budget slows a load down instead of stalling it.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from .errors import CkptTurboError

log = logging.getLogger(__name__)


class MemoryBudget:
    """Bytes held by the streamer, bounded by ``limit``; tracks the peak for tests and stats."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        self.peak = 0
        self._cv = threading.Condition()

    def try_acquire(self, nbytes: int, *, alone: bool = False) -> bool:
        """Reserve ``nbytes`` if they fit; with ``alone``, also when nothing else is held."""
        with self._cv:
            if self.held + nbytes > self.limit and not (alone and self.held == 0):
                return False
            self._take(nbytes)
            return True

    def acquire(self, nbytes: int, cancelled: Callable[[], bool] = lambda: False) -> bool:
        """Block until ``nbytes`` fit (False if ``cancelled`` became true meanwhile)."""
        if nbytes > self.limit:
            raise ValueError(f"cannot reserve {nbytes} bytes under a limit of {self.limit}")
        with self._cv:
            while self.held + nbytes > self.limit:
                if cancelled():
                    return False
                self._cv.wait(0.1)
            self._take(nbytes)
            return True

    def _take(self, nbytes: int) -> None:
        self.held += nbytes
        self.peak = max(self.peak, self.held)

    def release(self, nbytes: int) -> None:
        with self._cv:
            self.held -= nbytes
            self._cv.notify_all()


@dataclass(eq=False)
class Read:
    """One ranged read [start, end) of ``path``; ``file`` is its file's position in the stream."""

    index: int
    file: int
    path: str
    start: int
    end: int
    data: bytes | bytearray | memoryview | None = None  # or what ``deliver`` kept of them
    error: BaseException | None = None
    reserved: bool = False  # its size is counted in the budget until released
    released: bool = False
    done: threading.Event = field(default_factory=threading.Event, repr=False)

    @property
    def size(self) -> int:
        return self.end - self.start

    def fill(self, data: bytes | bytearray | memoryview) -> None:
        self.data = data
        self.done.set()

    def fail(self, exc: BaseException) -> None:
        self.error = exc
        self.done.set()

    def result(self) -> bytes | bytearray | memoryview:
        """Block until the read is filled; raise what made it fail."""
        self.done.wait()
        if self.error is not None:
            raise self.error
        assert self.data is not None
        return self.data


class Prefetcher:
    """Keeps the next reads in flight, bounded by streams, memory and (optionally) files.

    ``lookahead=None`` issues reads as far ahead as the budget allows. ``deliver``, when
    given, runs on the I/O thread with each read's bytes before the read counts as filled,
    and what it returns is what the read keeps (the streamer copies the bytes into their
    destination tensors there and keeps nothing). ``fetch`` returns a read's ``size`` bytes
    in whatever form its consumer or ``deliver`` takes (a buffer, a device load's pinned
    landing tensor, the streamer's part bodies), hence typed ``Any``.
    """

    def __init__(self, reads: list[Read], fetch: Callable[[Read], Any],
                 submit: Callable[..., Future], budget: MemoryBudget, *,
                 streams: int, lookahead: int | None,
                 deliver: Callable[[Read, bytes | bytearray | memoryview], Any] | None = None,
                 ) -> None:
        self.reads = reads
        self._fetch = fetch
        self._submit = submit
        self._deliver = deliver
        self.budget = budget
        self.streams = max(1, streams)
        self.lookahead = None if lookahead is None else max(1, lookahead)
        self._lock = threading.Lock()
        self._next = 0
        self._inflight = 0
        self._file = 0
        self._closed = False
        self._futures: list[Future] = []

    def start(self) -> None:
        self._pump()

    def at_file(self, file_index: int) -> None:
        """The consumer moved on to ``file_index``: later files enter the lookahead window."""
        self._file = file_index
        self._pump()

    def wait(self, read: Read) -> bytes | bytearray | memoryview:
        return read.result()

    def release(self, read: Read) -> None:
        """The consumer is done with ``read``: drop its bytes and let the next reads go."""
        with self._lock:
            if read.released:
                return
            read.released = True
            read.data = None
        if read.reserved:
            self.budget.release(read.size)
        self._pump()

    def close(self) -> None:
        """Stop issuing, wait for requests in flight, and return every reservation."""
        with self._lock:
            self._closed = True
            futures = list(self._futures)
        for fut in futures:
            fut.exception()  # wait; errors no longer matter to anyone
        for read in self.reads:
            self.release(read)

    def _pump(self) -> None:
        with self._lock:
            while (not self._closed and self._next < len(self.reads)
                   and self._inflight < self.streams):
                read = self.reads[self._next]
                if read.done.is_set():  # already filled (kept from a header probe)
                    self._next += 1
                    continue
                if self.lookahead is not None and read.file >= self._file + self.lookahead:
                    break
                if not self.budget.try_acquire(read.size, alone=read.size > self.budget.limit):
                    break
                read.reserved = True
                self._inflight += 1
                self._next += 1
                self._futures = [f for f in self._futures if not f.done()]
                self._futures.append(self._submit(self._run, read))

    def _run(self, read: Read) -> None:
        try:
            data = self._fetch(read)
            if len(data) != read.size:
                raise CkptTurboError(f"short read of {read.path} [{read.start}, {read.end}): "
                                     f"got {len(data)} bytes")
            read.fill(data if self._deliver is None else self._deliver(read, data))
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer that waits on it
            log.debug("read %s [%d, %d) failed: %s", read.path, read.start, read.end, exc)
            with self._lock:
                self._closed = True  # nothing after a failed read will be consumed
            read.fail(exc)
        finally:
            with self._lock:
                self._inflight -= 1
            self._pump()
