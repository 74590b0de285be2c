"""Bounded retries of storage requests: what is worth retrying, for how long, and when a
store counts as down.

Transient failures (5xx, throttling, connection resets, timeouts) are retried with
exponential backoff and full jitter; permanent ones are mapped to ckptturbo's errors at
once, so a wrong URL or bad credentials fail fast instead of after minutes of retries.

Nothing waits without a bound. Every call gives up retrying after ``deadline`` seconds
(each attempt of a request to an object store is itself limited by ``request_timeout``,
which :class:`~ckptturbo.store.Store` applies). When a call exhausts its retries without
the store answering any request meanwhile, the store is taken to be down: for
``outage_cooldown`` seconds the other calls on it fail at once instead of each waiting out
its own deadline, so a save or load against a dead or partitioned store fails within one
deadline, not once per chunk.
"""
from __future__ import annotations

import logging
import os
import random
import time
from typing import Callable, TypeVar

from .errors import CheckpointNotFound, StorageAuthError, StorageError

log = logging.getLogger(__name__)
T = TypeVar("T")

# Bounds on waiting for an object store, in seconds; the environment may override them
# (CKPTTURBO_REQUEST_TIMEOUT, CKPTTURBO_DEADLINE, CKPTTURBO_OUTAGE_COOLDOWN) for every
# store a job opens, including those DCP's planners and background threads create.
DEFAULT_REQUEST_TIMEOUT = 60.0
DEFAULT_DEADLINE = 120.0
DEFAULT_OUTAGE_COOLDOWN = 30.0
_TRANSIENT_MARKERS = (
    "slowdown", "slow down", "throttl", "503", "500", "502", "504", "internalerror",
    "serviceunavailable", "requesttimeout", "timed out", "timeout", "connection reset",
    "connection aborted", "broken pipe", "server disconnected", "temporarily",
)
_AUTH_MARKERS = ("accessdenied", "access denied", "forbidden", "invalidaccesskeyid",
                 "signaturedoesnotmatch", "nocredentials", "unable to locate credentials",
                 "expiredtoken", "invalidtoken")


def seconds_setting(name: str, given: float | None, default: float | None,
                    error: type[Exception] = StorageError) -> float | None:
    """``given``, else the environment's CKPTTURBO_<name>, else ``default``; positive."""
    if given is not None:
        return float(given)
    raw = os.environ.get(f"CKPTTURBO_{name}")
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise error(f"CKPTTURBO_{name}={raw!r} is not a number of seconds") from None
    if value <= 0:
        raise error(f"CKPTTURBO_{name} must be positive, got {raw!r}")
    return value


def is_transient(exc: BaseException) -> bool:
    """Worth retrying: timeouts, dropped connections, throttling and 5xx answers. s3fs
    re-raises S3's answer as a bare ``OSError`` ("We encountered an internal error"), so the
    exceptions it was raised from are looked at too."""
    seen: BaseException | None = exc
    for _ in range(5):
        if seen is None:
            return False
        if _is_transient_one(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _is_transient_one(exc: BaseException) -> bool:
    if isinstance(exc, (TimeoutError, ConnectionError)):
        return True
    name = type(exc).__name__.lower()
    if "timeout" in name or "connectionclosed" in name or "disconnected" in name:
        return True
    text = f"{name} {exc}".lower()
    return any(m in text for m in _TRANSIENT_MARKERS)


def is_auth(exc: BaseException) -> bool:
    if isinstance(exc, PermissionError):
        return True
    text = f"{type(exc).__name__} {exc}".lower()
    return any(m in text for m in _AUTH_MARKERS)


class RetryPolicy:
    """Runs the requests of one store; ``url_of`` turns a path into the URL errors name,
    ``url`` is the store's own. The outage state is per store: one dead endpoint must not
    make requests to another fail."""

    def __init__(self, url: str, url_of: Callable[[str], str], *, retries: int, backoff: float,
                 request_timeout: float | None, deadline: float | None,
                 outage_cooldown: float | None) -> None:
        self.url = url
        self.url_of = url_of
        self.retries = retries
        self.backoff = backoff
        self.request_timeout = seconds_setting("REQUEST_TIMEOUT", request_timeout, DEFAULT_REQUEST_TIMEOUT)
        self.deadline = seconds_setting("DEADLINE", deadline, DEFAULT_DEADLINE)
        self.outage_cooldown = seconds_setting("OUTAGE_COOLDOWN", outage_cooldown, DEFAULT_OUTAGE_COOLDOWN)
        self._last_success = time.monotonic()  # when a request last succeeded
        self._down_until = 0.0

    def call(self, what: str, path: str, fn: Callable[[], T]) -> T:
        """Run one storage request with retries, within ``deadline`` seconds in all."""
        started = time.monotonic()
        delay = self.backoff
        for attempt in range(self.retries + 1):
            self._refuse_while_down(what, path)
            try:
                result = fn()
            except FileNotFoundError as exc:
                self._last_success = time.monotonic()
                raise CheckpointNotFound(f"{what}: {self.url_of(path)} does not exist ({exc})") from exc
            except (StorageError, CheckpointNotFound):
                raise
            except Exception as exc:  # noqa: BLE001 - classified and re-raised as ours
                if is_auth(exc):
                    raise StorageAuthError(
                        f"{what}: access to {self.url_of(path)} was refused ({exc}); "
                        "check the credentials in storage_options or the environment") from exc
                sleep = random.uniform(0, delay)
                elapsed = time.monotonic() - started
                if not is_transient(exc):
                    raise self._failure(what, path, exc, "") from exc
                if attempt == self.retries or elapsed + sleep > self.deadline:
                    if self._last_success < started:  # nothing succeeded while we tried
                        self._down_until = time.monotonic() + self.outage_cooldown
                    raise self._failure(what, path, exc, f" after {attempt + 1} attempts "
                                                         f"in {elapsed:.1f}s") from exc
                log.warning("%s %s: transient %s (%s); retry %d/%d in %.2fs", what, path,
                            type(exc).__name__, exc, attempt + 1, self.retries, sleep)
                time.sleep(sleep)
                delay = min(delay * 2, 10.0)
            else:
                self._last_success = time.monotonic()
                return result
        raise AssertionError("unreachable")

    def _failure(self, what: str, path: str, exc: BaseException, tries: str) -> StorageError:
        cause = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        if isinstance(exc, TimeoutError):
            cause += f" (no answer within request_timeout={self.request_timeout:g}s)"
        return StorageError(f"{what} {self.url_of(path)} failed{tries}: {cause}")

    def _refuse_while_down(self, what: str, path: str) -> None:
        """Fail at once while a recent call found the store unreachable (see module doc)."""
        if time.monotonic() < self._down_until:
            raise StorageError(
                f"{what} {self.url_of(path)} not attempted: {self.url} did not answer any "
                f"request for {self.deadline:g}s (deadline) and is treated as down; "
                f"retrying after {self.outage_cooldown:g}s")
