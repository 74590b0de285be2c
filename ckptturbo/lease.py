"""Leases on the control records a save or a gc leaves in storage, and their heartbeat.

A pending marker (``pending/<save id>.<rank>``) or a ``gc.lock`` says "someone is working
here, do not touch what I rely on". A process that is SIGKILLed cannot remove its record,
so each record carries its writer's last heartbeat (``time``) and a ``lease``: the writer
rewrites the record every third of the lease while it works, and anyone who finds a
record whose heartbeat is older than its lease treats the writer as dead. The lease is
``$CKPTTURBO_PENDING_LEASE`` seconds (default ``DEFAULT_LEASE``). Records written before
leases existed carry none and are trusted for ``MARKER_TTL``; a declared lease is capped
by it, so a hostile record cannot block a run for longer than that. Times are the
writers' wall clocks: the hosts of a run must agree to well within a lease.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Any

from .chunk_store import ChunkStore
from .errors import CkptTurboError, FormatError
from .paths import CONTROL_VERSION

log = logging.getLogger(__name__)

MARKER_TTL = 6 * 3600.0
LEASE_ENV = "CKPTTURBO_PENDING_LEASE"
DEFAULT_LEASE = 300.0


def pending_lease() -> float:
    """The lease this process declares: ``$CKPTTURBO_PENDING_LEASE`` or ``DEFAULT_LEASE``."""
    raw = os.environ.get(LEASE_ENV, "").strip()
    if not raw:
        return DEFAULT_LEASE
    try:
        lease = float(raw)
    except ValueError:
        raise FormatError(f"{LEASE_ENV}={raw!r} is not a number of seconds") from None
    if not 0 < lease <= MARKER_TTL:
        raise FormatError(f"{LEASE_ENV}={raw!r} must be in (0, {MARKER_TTL:g}] seconds")
    return lease


def marker_record(lease: float | None = None, **fields: Any) -> bytes:
    """A pending marker or gc lock: the heartbeat time, the lease it holds for, its writer."""
    record: dict[str, Any] = {"version": CONTROL_VERSION, "time": time.time(), **fields}
    if lease is not None:
        record["lease"] = lease
    return json.dumps(record).encode()


def marker_is_fresh(data: bytes, now: float) -> bool:
    """The writer's heartbeat is younger than the record's lease (MARKER_TTL when it
    declares none or a lease out of range); an unreadable record is expired."""
    try:
        doc = json.loads(data)
        lease = float(doc.get("lease", MARKER_TTL))
        if not 0 < lease <= MARKER_TTL:  # NaN fails this too
            lease = MARKER_TTL
        return now - float(doc.get("time", 0)) < lease
    except (ValueError, TypeError, AttributeError, RecursionError):
        return False


class Heartbeat:
    """Writes a record now and rewrites it every lease/3 on a daemon thread until stopped.

    A failed rewrite is logged and retried at the next beat: the record then ages, and
    once it is older than its lease a gc may treat its writer as dead.
    """

    def __init__(self, store: ChunkStore, path: str, lease: float, **fields: Any) -> None:
        self.store, self.path, self.lease, self.fields = store, path, lease, fields
        self._stop = threading.Event()
        self._last = 0.0  # monotonic time of the last rewrite that landed
        self._beat(raise_=True)
        self._thread = threading.Thread(target=self._loop, name=f"ckptturbo-lease:{path}",
                                        daemon=True)
        self._thread.start()

    def _beat(self, raise_: bool = False) -> None:
        try:
            self.store.put(self.path, marker_record(self.lease, **self.fields), durable=False)
            self._last = time.monotonic()
        except CkptTurboError as exc:
            if raise_:
                raise
            log.warning("could not refresh %s (%s); it expires %ss after its last refresh",
                        self.store.url_of(self.path), exc, self.lease)

    def _loop(self) -> None:
        while not self._stop.wait(self.lease / 3):
            self._beat()

    def stop(self, final_beat: bool = False) -> None:
        """No more refreshes; ``final_beat``: the record must hold for most of a lease from
        now (until a commit that removes it), so it is renewed once more unless it was
        within the last sixth of its lease (a save shorter than that pays no request)."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join()
        if final_beat and time.monotonic() - self._last > self.lease / 6:
            self._beat()
