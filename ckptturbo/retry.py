"""Bounded retries of storage requests: what is worth retrying, for how long, and when a
store counts as down.

What is retried is decided by the exception's type and the store's error code, never by
words in a message (a ``KeyError('layer.500.weight')`` is not a server error):
:func:`classify` sorts a failure into no answer (timeouts, refused or dropped
connections), busy (5xx answers, throttling), refused credentials, not found, or
permanent. The first two are retried with exponential backoff and full jitter; the others
fail at once, so a wrong URL or bad credentials fail fast instead of after minutes.

**The bound.** Every call gives up after ``deadline`` seconds (default 110) in all: each
attempt may take at most ``request_timeout`` seconds (default 60) *and* at most what is
left of the deadline, and at most ``retries + 1`` attempts are made (with 1 s request
timeouts, a call against a silent store gives up after about 12 s). A call that gives up
because the store did not answer marks the store down: for ``outage_cooldown`` seconds
every other call on it fails at once, and attempts already waiting are cancelled. So a save
or load against a dead or partitioned store fails within one call's bound of the moment the
store stopped answering, whichever path meets it first (the first request, the uploads in
flight, the commit). A store that answers with errors while it serves other requests
(throttling) is not marked down. While a call waits longer than ``PROGRESS_AFTER`` seconds a
warning says so at least every ``PROGRESS_EVERY`` seconds, naming the request, how long it
has waited, and the settings that change the bound. The per-attempt bound and the
cancellation apply to object stores reached through asynchronous fsspec filesystems (s3,
gcs, azure, http); local files are not retried for silence.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import logging
import os
import random
import ssl
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import Enum
from typing import TypeVar, overload

from .errors import CheckpointNotFound, StorageAuthError, StorageError

log = logging.getLogger(__name__)
T = TypeVar("T")

# Bounds on waiting for an object store, in seconds; the environment may override them
# (CKPTTURBO_REQUEST_TIMEOUT, CKPTTURBO_DEADLINE, CKPTTURBO_OUTAGE_COOLDOWN) for every
# store a job opens, including those DCP's planners and background threads create.
DEFAULT_REQUEST_TIMEOUT = 60.0
DEFAULT_DEADLINE = 110.0  # with the set-up of a save around it, a dead store fails it within 2 min
DEFAULT_OUTAGE_COOLDOWN = 30.0
PROGRESS_AFTER = 5.0    # a call waiting this long is reported ...
PROGRESS_EVERY = 9.5    # ... and again after this long (checked twice a second: <= 10 s apart)
_POLL = 0.5             # how often a waiting attempt looks at the store's state
_MIN_ATTEMPT = 0.05     # an attempt with less of the deadline left is not started


class Failure(Enum):
    """What a failed storage request means for the caller."""

    NO_ANSWER = "no answer"    # timeout, connection refused, reset or dropped: retry
    BUSY = "busy"              # the store answered 5xx or "slow down": retry
    AUTH = "auth"              # credentials missing, wrong or not permitted: fail now
    NOT_FOUND = "not found"    # no such object or bucket: fail now
    PERMANENT = "permanent"    # anything else (a bad request, a bug, a value error): fail now

    @property
    def transient(self) -> bool:
        return self in (Failure.NO_ANSWER, Failure.BUSY)


# S3 error codes, as botocore's retry handler and s3torchconnector sort them.
_BUSY_CODES = frozenset({
    "InternalError", "ServiceUnavailable", "SlowDown", "Throttling", "ThrottlingException",
    "ThrottledException", "RequestThrottled", "RequestThrottledException",
    "TooManyRequestsException", "RequestLimitExceeded", "BandwidthLimitExceeded",
    "ProvisionedThroughputExceededException", "PriorRequestNotComplete",
    "TransactionInProgressException", "OperationAborted",
    # a body that arrived other than it was sent (its SHA-256 or CRC32 disagrees): send again
    "XAmzContentSHA256Mismatch", "BadDigest"})
_NO_ANSWER_CODES = frozenset({"RequestTimeout", "RequestTimeoutException"})
_AUTH_CODES = frozenset({
    "AccessDenied", "AccountProblem", "AllAccessDisabled", "InvalidAccessKeyId",
    "SignatureDoesNotMatch", "ExpiredToken", "ExpiredTokenException", "InvalidToken",
    "TokenRefreshRequired", "InvalidSecurity", "NotSignedUp", "RequestTimeTooSkewed",
    "UnrecognizedClientException", "Forbidden"})
_NOT_FOUND_CODES = frozenset({"NoSuchKey", "NoSuchBucket", "NoSuchUpload", "NotFound", "404"})
_BUSY_STATUS = frozenset({429, 500, 502, 503, 504})
_NO_ANSWER_ERRNOS = frozenset(getattr(errno, name) for name in (
    "ECONNRESET", "ECONNREFUSED", "ECONNABORTED", "ETIMEDOUT", "EPIPE", "EHOSTUNREACH",
    "ENETUNREACH", "ENETDOWN", "ENETRESET", "EHOSTDOWN") if hasattr(errno, name))
# s3fs turns S3's InternalError into OSError(EREMOTEIO) and SlowDown/ServiceUnavailable into
# OSError(EBUSY) (s3fs.errors); EAGAIN is "try again" wherever it comes from.
_BUSY_ERRNOS = frozenset(getattr(errno, name) for name in ("EREMOTEIO", "EBUSY", "EAGAIN")
                         if hasattr(errno, name))
# Packages whose exceptions wrap the one that says what happened (their __cause__/__context__)
_STORAGE_PACKAGES = frozenset({"botocore", "aiobotocore", "aiohttp", "urllib3", "requests",
                               "fsspec", "s3fs", "gcsfs", "adlfs", "azure", "google"})
# The one message still read: S3's InternalError text, for an s3fs OSError that arrives
# without the botocore error it was made from (older s3fs releases raised it bare).
_S3_INTERNAL_ERROR_TEXT = "we encountered an internal error"


def classify(exc: BaseException) -> Failure:
    """What a failed request means, from the exception's type and the store's error code.

    The chain of causes is followed only through exceptions that wrap another (OSErrors,
    which s3fs raises for botocore's errors, and exceptions of the storage client
    packages), so a ``ValueError`` raised while handling a timeout is not a timeout.
    """
    chain = _chain(exc)
    if any(isinstance(e, ssl.SSLCertVerificationError) for e in chain):
        return Failure.PERMANENT  # retrying cannot fix a certificate
    for link in chain:
        verdict = _classify_one(link)
        if verdict is not None:
            return verdict
    if (type(exc) is OSError and exc.errno is None and exc.__cause__ is None
            and _S3_INTERNAL_ERROR_TEXT in str(exc).lower()):
        return Failure.BUSY
    return Failure.PERMANENT


def is_transient(exc: BaseException) -> bool:
    """Worth retrying: the store did not answer, or answered that it is busy."""
    return classify(exc).transient


def is_auth(exc: BaseException) -> bool:
    return classify(exc) is Failure.AUTH


def is_past_the_end(exc: BaseException) -> bool:
    """A ranged read that starts past the object's end (S3's InvalidRange, HTTP 416): the
    object is shorter than the read expected, which is a short read, not a failed request."""
    for link in _chain(exc):
        answer = _store_answer(link)
        if answer is not None:
            return answer[0] == "InvalidRange" or answer[1] == 416
        if _package(link) == "aiohttp" and getattr(link, "status", None) == 416:
            return True
    return False


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and its causes, followed only through exceptions that wrap another."""
    chain: list[BaseException] = []
    seen: BaseException | None = exc
    while seen is not None and len(chain) < 8:
        chain.append(seen)
        if not _wraps(seen):
            break
        seen = seen.__cause__ or seen.__context__
    return chain


def _store_answer(exc: BaseException) -> tuple[str, int | None] | None:
    """The store's error code and HTTP status carried by botocore's ClientError, else None."""
    response = getattr(exc, "response", None)
    if _package(exc) != "botocore" or not isinstance(response, dict):
        return None
    status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
    code = str((response.get("Error") or {}).get("Code") or "")
    return code, status if isinstance(status, int) else None


def _wraps(exc: BaseException) -> bool:
    return isinstance(exc, OSError) or _package(exc) in _STORAGE_PACKAGES


def _package(exc: BaseException) -> str:
    return type(exc).__module__.split(".", 1)[0]


def _classify_one(exc: BaseException) -> Failure | None:
    """The verdict of one exception of a chain, or None when it does not say."""
    answer = _store_answer(exc)
    if answer is not None:
        return _from_code(*answer)
    if isinstance(exc, PermissionError):
        return Failure.AUTH
    if isinstance(exc, FileNotFoundError):
        return Failure.NOT_FOUND
    if isinstance(exc, (TimeoutError, ConnectionError)):  # also asyncio's and fsspec's timeouts
        return Failure.NO_ANSWER
    if isinstance(exc, OSError) and exc.errno is not None:
        if exc.errno in _NO_ANSWER_ERRNOS:
            return Failure.NO_ANSWER
        if exc.errno in _BUSY_ERRNOS:
            return Failure.BUSY
        return None  # an s3fs translation (EIO, EINVAL, ...): its cause may say more
    return _from_client_library(exc)


def _from_code(code: str, status: int | None) -> Failure:
    if code in _AUTH_CODES or status in (401, 403):
        return Failure.AUTH
    if code in _NOT_FOUND_CODES or status == 404:
        return Failure.NOT_FOUND
    if code in _NO_ANSWER_CODES or status == 408:
        return Failure.NO_ANSWER
    if code in _BUSY_CODES or status in _BUSY_STATUS:
        return Failure.BUSY
    return Failure.PERMANENT


def _from_client_library(exc: BaseException) -> Failure | None:
    """Exception types of the HTTP stacks under fsspec's object stores. A module is looked
    at only if it is imported: an exception of a package that was never imported cannot
    be this one, and classifying must not import it."""
    botocore = sys.modules.get("botocore.exceptions")
    if botocore is not None:
        if isinstance(exc, (botocore.NoCredentialsError, botocore.PartialCredentialsError,
                            botocore.CredentialRetrievalError, botocore.NoAuthTokenError,
                            botocore.TokenRetrievalError, botocore.UnauthorizedSSOTokenError)):
            return Failure.AUTH
        if isinstance(exc, (botocore.ConnectionError, botocore.HTTPClientError,
                            botocore.IncompleteReadError)):
            return Failure.NO_ANSWER  # incl. connect/read timeouts and closed connections
    aiohttp = sys.modules.get("aiohttp")
    if aiohttp is not None:
        if isinstance(exc, aiohttp.ClientResponseError):
            return _from_code("", exc.status)
        if isinstance(exc, (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError)):
            return Failure.NO_ANSWER
    urllib3 = sys.modules.get("urllib3.exceptions")
    if urllib3 is not None and isinstance(exc, (urllib3.TimeoutError, urllib3.ProtocolError,
                                                urllib3.NewConnectionError)):
        return Failure.NO_ANSWER
    requests = sys.modules.get("requests.exceptions")
    if requests is not None:
        if isinstance(exc, (requests.ConnectionError, requests.Timeout,
                            requests.ChunkedEncodingError)):
            return Failure.NO_ANSWER
        if isinstance(exc, requests.HTTPError) and exc.response is not None:
            return _from_code("", exc.response.status_code)
    # gcsfs's HttpError (.code) and azure-core's HttpResponseError (.status_code)
    if _package(exc) in ("gcsfs", "azure", "google"):
        for attr in ("status_code", "code"):
            status = getattr(exc, attr, None)
            if isinstance(status, int) and 400 <= status < 600:
                return _from_code("", status)
    return None


@overload
def seconds_setting(name: str, given: float | None, default: float,
                    error: type[Exception] = ...) -> float: ...
@overload
def seconds_setting(name: str, given: float | None, default: None,
                    error: type[Exception] = ...) -> float | None: ...
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


@dataclass
class _Call:
    """One call in progress, for the attempts' bounds and the progress warnings."""

    what: str
    path: str
    started: float
    attempt_started: float
    failures: int = 0
    last_error: str = ""


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
        self.request_timeout = seconds_setting("REQUEST_TIMEOUT", request_timeout,
                                               DEFAULT_REQUEST_TIMEOUT)
        self.deadline = seconds_setting("DEADLINE", deadline, DEFAULT_DEADLINE)
        self.outage_cooldown = seconds_setting("OUTAGE_COOLDOWN", outage_cooldown,
                                               DEFAULT_OUTAGE_COOLDOWN)
        self._last_success = time.monotonic()  # when a request last succeeded
        self._down_until = 0.0
        self._down_reason = ""
        self._calls: dict[int, _Call] = {}
        self._lock = threading.Lock()
        self._last_progress = 0.0
        self._current = threading.local()  # the call this thread's attempt belongs to

    def call(self, what: str, path: str, fn: Callable[[], T]) -> T:
        """Run one storage request with retries, within ``deadline`` seconds in all."""
        started = time.monotonic()
        call = _Call(what, path, started, started)
        with self._lock:
            self._calls[id(call)] = call
        outer, self._current.call = getattr(self._current, "call", None), call
        try:
            return self._attempts(call, fn)
        finally:
            self._current.call = outer
            with self._lock:
                del self._calls[id(call)]

    def _attempts(self, call: _Call, fn: Callable[[], T]) -> T:
        what, path = call.what, call.path
        delay = self.backoff
        for attempt in range(self.retries + 1):
            self._refuse_while_down(what, path)
            call.attempt_started = time.monotonic()
            try:
                result = fn()
            except FileNotFoundError as exc:
                self._last_success = time.monotonic()
                raise CheckpointNotFound(
                    f"{what}: {self.url_of(path)} does not exist ({exc})") from exc
            except (StorageError, CheckpointNotFound):
                raise
            except Exception as exc:  # noqa: BLE001 - classified and re-raised as ours
                kind = classify(exc)
                if kind is Failure.AUTH:
                    raise StorageAuthError(
                        f"{what}: access to {self.url_of(path)} was refused ({_cause(exc)}); "
                        "check the credentials in storage_options or the environment") from exc
                if kind is Failure.NOT_FOUND:
                    raise CheckpointNotFound(f"{what}: {self.url_of(path)} does not exist "
                                             f"({_cause(exc)})") from exc
                if not kind.transient:
                    raise self._failure(what, path, exc, "") from exc
                sleep = random.uniform(0, delay)
                elapsed = time.monotonic() - call.started
                if attempt == self.retries or elapsed + sleep + _MIN_ATTEMPT > self.deadline:
                    # the store did not answer, or answered nothing but errors meanwhile
                    if kind is Failure.NO_ANSWER or self._last_success < call.started:
                        self._mark_down(what, path, exc)
                    raise self._failure(what, path, exc, f" after {attempt + 1} attempts in "
                                        f"{elapsed:.1f}s{self._bounds()}") from exc
                call.failures += 1
                call.last_error = _cause(exc)
                log.info("%s %s: %s; retry %d/%d in %.2fs", what, self.url_of(path),
                         call.last_error, attempt + 1, self.retries, sleep)
                self._pause(sleep)
                delay = min(delay * 2, 10.0)
            else:
                self._last_success = time.monotonic()
                return result
        raise AssertionError("unreachable")

    def run_async(self, loop: asyncio.AbstractEventLoop, coro: Awaitable[T]) -> T:
        """Run one attempt (a coroutine of an async fsspec filesystem) on its event loop,
        within ``request_timeout`` and what is left of its call's deadline. The attempt is
        cancelled as soon as another call finds the store down; while it waits, it reports
        progress (see the module docstring)."""
        call: _Call | None = getattr(self._current, "call", None)
        timeout = self.request_timeout
        if call is not None:
            timeout = min(timeout, self.deadline - (time.monotonic() - call.started))
        timeout = max(timeout, _MIN_ATTEMPT)
        future = asyncio.run_coroutine_threadsafe(_within(coro, timeout), loop)
        while True:
            done, _ = concurrent.futures.wait([future], timeout=_POLL)
            if done:
                return future.result()
            if time.monotonic() < self._down_until:
                future.cancel()
                raise self._down_error(call.what if call else "request", call.path if call else "")
            self._report_progress()

    # --- the outage state and progress reports
    def _mark_down(self, what: str, path: str, exc: BaseException) -> None:
        with self._lock:
            self._down_until = time.monotonic() + self.outage_cooldown
            self._down_reason = f"{what} {self.url_of(path)} got no usable answer ({_cause(exc)})"

    def _refuse_while_down(self, what: str, path: str) -> None:
        """Fail at once while a recent call found the store unreachable (see module doc)."""
        if time.monotonic() < self._down_until:
            raise self._down_error(what, path)

    def _down_error(self, what: str, path: str) -> StorageError:
        return StorageError(
            f"{what} {self.url_of(path)} not completed: {self.url} is treated as down for "
            f"{self.outage_cooldown:g}s (outage_cooldown) because {self._down_reason}"
            f"{self._bounds()}")

    def _pause(self, seconds: float) -> None:
        """Sleep before a retry; cut short when the store is found down meanwhile."""
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0 and time.monotonic() >= self._down_until:
            time.sleep(min(left, _POLL))
            self._report_progress()

    def _report_progress(self) -> None:
        """One warning per store at most every PROGRESS_EVERY seconds, while a call has
        waited longer than PROGRESS_AFTER: what it waits for, how long, and the bounds."""
        now = time.monotonic()
        with self._lock:
            if now - self._last_progress < PROGRESS_EVERY or not self._calls:
                return
            oldest = min(self._calls.values(), key=lambda c: c.started)
            waited = now - oldest.started
            if waited < PROGRESS_AFTER:
                return
            self._last_progress = now
            waiting = sum(now - c.started >= PROGRESS_AFTER for c in self._calls.values())
        failed = (f"{oldest.failures} attempt(s) failed, last: {oldest.last_error}"
                  if oldest.failures else "no answer yet")
        log.warning("waiting for %s: %d request(s) waiting, the oldest (%s %s) for %.0fs, %s; "
                    "giving up within %.0fs of its start%s", self.url, waiting, oldest.what,
                    self.url_of(oldest.path), waited, failed, self.call_bound, self._bounds())

    @property
    def call_bound(self) -> float:
        """The longest one call may take against a silent store: ``retries + 1`` attempts of
        at most ``request_timeout`` and the backoff between them, never more than ``deadline``."""
        sleeps = sum(min(self.backoff * 2 ** i, 10.0) for i in range(self.retries))
        return min(self.deadline, (self.retries + 1) * self.request_timeout + sleeps)

    def _bounds(self) -> str:
        return (f" (bounds: request_timeout={self.request_timeout:g}s per attempt, "
                f"deadline={self.deadline:g}s per request; set CKPTTURBO_REQUEST_TIMEOUT / "
                "CKPTTURBO_DEADLINE to change them)")

    def _failure(self, what: str, path: str, exc: BaseException, tries: str) -> StorageError:
        return StorageError(f"{what} {self.url_of(path)} failed{tries}: {_cause(exc)}")


async def _within(coro: Awaitable[T], timeout: float) -> T:
    try:
        return await asyncio.wait_for(coro, timeout)
    except asyncio.TimeoutError:
        raise TimeoutError(f"no answer within {timeout:.3g}s") from None


def _cause(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
