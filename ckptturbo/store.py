"""All object I/O, through fsspec, for every protocol.

One ``Store`` wraps one fsspec filesystem. Everything above it (writer, reader,
streamer, CLI) speaks in full paths of that filesystem and never imports a storage SDK,
so ``file://``, ``s3://``, ``gs://`` and ``memory://`` share one code path. What differs
per protocol is kept here: local files get fsync + atomic rename, object stores get
single PUTs (atomic by nature, multipart above ``multipart_threshold``) and no fsync.

Every request goes through :class:`~ckptturbo.retry.RetryPolicy` (bounded retries of
transient failures, a deadline per call, and an outage state so that a dead store fails a
save or load within one deadline). On object stores every attempt of a request also has a
wall-clock limit (``request_timeout``), which covers an upload whose peer stopped reading,
where socket read timeouts never fire.
"""
from __future__ import annotations

import asyncio
import base64
import copy
import os
import uuid
import zlib
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import Any, Protocol, TypeVar, runtime_checkable

import fsspec
from fsspec.asyn import AsyncFileSystem
from fsspec.implementations.local import LocalFileSystem

from .chunk_store import ObjectInfo, default_opener
from .chunks import batched
from .errors import CheckpointNotFound, CkptTurboError, ShortReadError, StorageError
from .retry import RetryPolicy, is_past_the_end
from .urls import options_key

T = TypeVar("T")


@runtime_checkable
class IOPools(Protocol):
    """What a store needs from its owner (``ckptturbo.runtime.Runtime``): the I/O thread
    pool of an endpoint, shared by every store the owner opens on it."""

    def executor(self, key: tuple, workers: int) -> ThreadPoolExecutor:
        """The pool of ``key`` (an endpoint) with ``workers`` threads, made on first use."""

    def bucket_found(self, key: tuple) -> bool:
        """Whether a store of this owner found the bucket ``key`` (endpoint, bucket) before."""

    def note_bucket(self, key: tuple) -> None:
        """A store of this owner found the bucket ``key``."""


# A local write goes to a file of this name beside its target, then is renamed over it
TEMP_PREFIX = ".tmp-"
_BULK_DELETE = 1000  # S3's most keys in one DeleteObjects request
_LOCAL_DELETES_PER_TASK = 256


def _one(path: str) -> int:
    """A path's weight when paths are cut into batches of a number of them."""
    return 1

# Every chunk is BLAKE3-verified end to end, so botocore's own CRC32 of each body is
# redundant CPU work on both sides; it is computed only where S3 requires it. Retries are
# ours (RetryPolicy.call, bounded by a deadline), so botocore makes one attempt per call.
# Parameter validation is off so that a body can be a memoryview of the staging buffer
# (botocore's validator accepts only bytes, bytearray or files; the rest of botocore,
# SigV4 and aiohttp take any buffer): a copy per body cost ~0.7 CPU-s per GiB saved.
DEFAULT_S3_CONFIG: dict[str, Any] = {"connect_timeout": 5, "read_timeout": 30,
                     "retries": {"total_max_attempts": 1},
                     "request_checksum_calculation": "when_required",
                     "response_checksum_validation": "when_required",
                     "parameter_validation": False}


def default_io_workers(remote: bool = False) -> int:
    """Concurrent requests per process. Each connection to an object store is capped (by
    the server, the path, TCP windows: tens of MB/s each), so a remote store gets 32 on any
    CPU count, as AWS's CRT client does (benchmarks/s3_clients.py: through a link capped at
    40 MB/s per connection, 32 connections read 1.98x what 8 read; a tie on loopback).
    Disks want fewer streams, by CPU count."""
    if remote:
        return 32
    return max(8, min(32, 4 * (os.cpu_count() or 2)))


def all_results(futures: Iterable[Future[T]]) -> list[T]:
    """Every result, in order; the first failure is raised once all have finished (no
    request is left running behind an error)."""
    results, first_error = [], None
    for fut in futures:
        try:
            results.append(fut.result())
        except BaseException as exc:  # noqa: BLE001 - re-raised below, after draining
            first_error = first_error or exc
    if first_error is not None:
        raise first_error
    return results


class Store:
    """A storage location reached through fsspec, with retries and bounded parallelism.

    ``read_part_size``: a larger read from an object store goes out as concurrent ranged
    GETs of this size. Object stores cap what one connection moves (tens of MB/s on S3),
    so a 64 MiB chunk fetched whole waits on one connection; AWS's CRT client splits at
    8 MiB for the same reason.
    """

    read_part_size = 8 << 20

    def __init__(
        self,
        url: str,
        storage_options: dict[str, Any] | None = None,
        *,
        max_workers: int | None = None,
        retries: int = 5,
        backoff: float = 0.2,
        multipart_threshold: int = 128 << 20,
        part_size: int = 32 << 20,
        request_timeout: float | None = None,
        deadline: float | None = None,
        outage_cooldown: float | None = None,
        session: IOPools | None = None,
    ) -> None:
        self._session = session
        self.url = str(url)
        self.storage_options = dict(storage_options or {})
        self.multipart_threshold = multipart_threshold
        self.part_size = part_size
        protocol = fsspec.utils.get_protocol(self.url)
        remote = protocol not in ("file", "local", "memory")
        self.max_workers = max_workers or default_io_workers(remote)
        options = dict(self.storage_options)
        self._body_views = False  # may bodies be memoryviews (see DEFAULT_S3_CONFIG)?
        self._crc_puts = False  # does each single PUT carry a CRC32 (see _s3_config)?
        if protocol in ("s3", "s3a"):
            config = _s3_config(options, self.max_workers)
            options["config_kwargs"] = config
            options.setdefault("max_concurrency", 8)
            self._body_views = not config.get("parameter_validation", True)
            self._crc_puts = (not _endpoint(options).startswith("https://")
                              and not config["s3"].get("payload_signing_enabled", False))
        try:
            self.fs, self.root = fsspec.core.url_to_fs(self.url, **options)
        except ImportError as exc:
            extra = " (pip install 'ckptturbo[s3]')" if protocol in ("s3", "s3a") else ""
            raise StorageError(f"cannot open storage for {self.url!r}: {exc}{extra}") from exc
        except ValueError as exc:
            raise StorageError(f"cannot open storage for {self.url!r}: {exc}") from exc
        self.protocol = protocol
        self.is_local = isinstance(self.fs, LocalFileSystem)
        self.root = self.root.rstrip("/") or "/"
        self.endpoint = (protocol, options_key(self.storage_options))
        self.policy = RetryPolicy(self.url, self.url_of, retries=retries, backoff=backoff,
                                  request_timeout=request_timeout, deadline=deadline,
                                  outage_cooldown=outage_cooldown)

    # --- pickling: filesystems and the runtime stay behind (the unpickling process's own
    # runtime opens the store again)
    def __getstate__(self) -> dict[str, Any]:
        policy = self.policy
        return {"url": self.url, "storage_options": self.storage_options,
                "max_workers": self.max_workers, "retries": policy.retries,
                "backoff": policy.backoff,
                "multipart_threshold": self.multipart_threshold, "part_size": self.part_size,
                "request_timeout": policy.request_timeout, "deadline": policy.deadline,
                "outage_cooldown": policy.outage_cooldown}

    def __setstate__(self, state: dict[str, Any]) -> None:
        url, options = state.pop("url"), state.pop("storage_options")
        Store.__init__(self, url, options, **state)

    # --- paths
    def join(self, base: str, *parts: str) -> str:
        """``base`` (a full path of this store) extended by relative, '..'-free names."""
        cleaned = []
        for part in parts:
            for piece in str(part).split("/"):
                if piece in ("", "."):
                    continue
                if piece == "..":
                    raise StorageError(f"refusing path with '..' under {self.url!r}: {parts}")
                cleaned.append(piece)
        base = base.rstrip("/")
        return "/".join([base, *cleaned]) if cleaned else (base or "/")

    def url_of(self, path: str) -> str:
        """A URL a user can paste, for error messages and listings."""
        if self.is_local:
            return path
        return f"{self.protocol}://{path}"

    # --- execution helpers
    @property
    def session(self) -> IOPools:
        """The runtime that owns this store's I/O threads: the one that opened it
        (``Runtime.open_store``), else the process's default runtime (a store built
        directly, or unpickled), as handed to ``chunk_store.use_default_opener``."""
        if self._session is None:
            owner = default_opener(self.url)
            if not isinstance(owner, IOPools):
                raise StorageError(f"the default opener {owner!r} runs no I/O for {self.url!r}")
            self._session = owner
        return self._session

    @property
    def pool(self) -> ThreadPoolExecutor:
        """The I/O threads of this endpoint, shared by every store of the session on it."""
        return self.session.executor(self.endpoint, self.max_workers)

    def submit(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> Future[T]:
        return self.pool.submit(fn, *args, **kwargs)

    def map(self, fn: Callable[[Any], T], items: Iterable[Any]) -> list[T]:
        """Run fn over items on the I/O pool; the first failure is raised after all finish."""
        return all_results([self.submit(fn, item) for item in items])

    def _request(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call an fsspec method; on async filesystems (s3, gcs) its coroutine runs bounded
        by the policy (request_timeout and the call's deadline), which cancels the request
        itself rather than abandoning a thread to it."""
        if isinstance(self.fs, AsyncFileSystem):
            coro = getattr(self.fs, f"_{method}")(*args, **kwargs)
            return self.policy.run_async(self.fs.loop, coro)
        return getattr(self.fs, method)(*args, **kwargs)

    # --- writes
    def put(self, path: str, data: bytes | bytearray | memoryview, *, durable: bool = True) -> None:
        """Write an object whole: readers see the old object or the new one, never a part.

        ``durable=False`` skips the local fsyncs, for advisory markers whose loss in a
        crash is harmless (an fsync can wait behind a whole save's dirty pages).
        """
        if self.is_local:
            self.policy.call("write", path, lambda: self._put_local(path, data, durable))
            return

        multipart = len(data) >= self.multipart_threshold and self.protocol in ("s3", "s3a")
        checked = {"ChecksumCRC32": _crc32(data)} if self._crc_puts and not multipart else {}

        def put_remote() -> None:
            body: Any
            if self._body_views:  # a flat byte view: its len() is what botocore sends
                body = memoryview(data).cast("B")
            elif multipart:
                body = _BytesSlices(data)
            else:
                body = bytes(data) if isinstance(data, memoryview) else data
            if multipart:
                self._request("pipe_file", path, body, chunksize=self.part_size)
            else:
                self._request("pipe_file", path, body, **checked)

        self.policy.call("write", path, put_remote)

    def _put_local(self, path: str, data: bytes | bytearray | memoryview, durable: bool) -> None:
        directory = os.path.dirname(path)
        os.makedirs(directory, exist_ok=True)
        tmp = os.path.join(directory, f"{TEMP_PREFIX}{uuid.uuid4().hex}")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                if durable:
                    os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        if not durable:
            return
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    # --- reads
    def get(self, path: str, start: int | None = None, end: int | None = None) -> bytes:
        """Bytes [start, end) of an object (all of it by default), fewer where the object
        ends first (none past its end), as a file's read would return."""
        if self.is_local:
            return self.policy.call("read", path, lambda: self._get_local(path, start, end))
        # max_concurrency=1: s3fs would otherwise HEAD every whole-object read first (and
        # LIST after a 404) to decide whether to split it; ours are small or ranged
        one = {"max_concurrency": 1} if self.protocol in ("s3", "s3a") else {}

        def read() -> bytes:
            try:
                return self._request("cat_file", path, start=start, end=end, **one)
            except OSError as exc:
                if start is not None and is_past_the_end(exc):
                    return b""
                raise

        return self.policy.call("read", path, read)

    def _get_local(self, path: str, start: int | None, end: int | None) -> bytes:
        with open(path, "rb") as f:
            if start:
                f.seek(start)
            return f.read() if end is None else f.read(end - (start or 0))

    def get_into(self, path: str, out: memoryview, start: int = 0) -> None:
        """Fill ``out`` with the object's bytes from ``start``, avoiding a copy on local disk."""
        def read_local() -> None:
            with open(path, "rb", buffering=0) as f:
                f.seek(start)
                got = 0
                while got < len(out):
                    n = f.readinto(out[got:])
                    if not n:
                        raise ShortReadError(f"short read of {path}: {got} of {len(out)} bytes")
                    got += n

        if self.is_local:
            self.policy.call("read", path, read_local)
            return
        if isinstance(self.fs, AsyncFileSystem):
            got = self.policy.call("read", path, lambda: self.policy.run_async(
                self.fs.loop, self._cat_parts_into(path, out, start)))
        else:
            data = self.get(path, start, start + len(out))
            got = len(data)
            if got == len(out):
                out[:] = data
        if got != len(out):
            raise ShortReadError(f"short read of {self.url_of(path)}: {got} of {len(out)} bytes")

    async def _cat_parts_into(self, path: str, out: memoryview, start: int) -> int:
        """One attempt at filling ``out`` with concurrent ranged GETs of ``read_part_size``;
        returns the bytes the object had (fewer than asked when it is truncated)."""
        size, step = len(out), self.read_part_size

        async def part(lo: int) -> int:
            hi = min(lo + step, size)
            try:
                return await self._range_into(path, out[lo:hi], start + lo)
            except OSError as exc:
                if is_past_the_end(exc):
                    return 0
                raise

        parts = [asyncio.ensure_future(part(lo)) for lo in range(0, size, step)]
        try:
            return sum(await asyncio.gather(*parts))
        except BaseException:  # incl. the cancellation of a timed-out attempt
            for task in parts:
                task.cancel()
            await asyncio.gather(*parts, return_exceptions=True)
            raise

    async def _range_into(self, path: str, out: memoryview, offset: int) -> int:
        """One ranged GET into ``out``; the bytes the object had there.

        On S3 the body is copied into ``out`` piece by piece as it arrives: s3fs's
        ``cat_file`` joins the pieces into one ``bytes`` first, a second copy of every
        byte loaded (0.1-0.2 CPU-s per GiB)."""
        if self.protocol not in ("s3", "s3a"):
            data = await self.fs._cat_file(path, start=offset, end=offset + len(out))
            got = min(len(data), len(out))
            out[:got] = memoryview(data)[:got]
            return got
        bucket, key, version = self.fs.split_path(path)
        extra = {"VersionId": version} if version else {}
        answer = await self.fs._call_s3("get_object", Bucket=bucket, Key=key,
                                        Range=f"bytes={offset}-{offset + len(out) - 1}", **extra)
        body = answer["Body"]
        expected = min(int(answer.get("ContentLength", len(out))), len(out))
        got = 0
        try:
            pieces = body.raw_stream.content  # aiohttp's reader: readany() hands over its buffers
            while got < expected and (piece := await pieces.readany()):
                n = min(len(piece), expected - got)
                out[got:got + n] = memoryview(piece)[:n]
                got += n
        finally:
            body.close()
        if got < expected:  # the connection ended inside the body
            raise ConnectionError(f"{self.url_of(path)}: the body ended after {got} of "
                                  f"{expected} bytes")
        return got

    # --- metadata
    def exists(self, path: str) -> bool:
        return self.policy.call("stat", path, lambda: self._request("exists", path))

    def info(self, path: str) -> ObjectInfo:
        raw = self.policy.call("stat", path, lambda: self._request("info", path))
        return ObjectInfo(path, int(raw.get("size") or 0), _mtime(raw))

    def list_files(self, prefix: str) -> list[ObjectInfo]:
        """Every object under prefix (recursive); an absent prefix lists as empty."""
        parent, _, name = prefix.rstrip("/").rpartition("/")
        if self.protocol in ("s3", "s3a") and "/" in parent:
            # one LIST of "<prefix>/": s3fs's find(prefix) adds a HEAD and a LIST when the
            # prefix is empty (a run's first save), to tell an absent prefix from a file
            kwargs: dict[str, Any] = {"prefix": name + "/"}
        else:
            parent, kwargs = prefix, {}
        try:
            found = self.policy.call("list", prefix, lambda: self._request(
                "find", parent, detail=True, **kwargs))
        except CheckpointNotFound:
            self.check_reachable()  # an absent prefix is empty; an absent bucket is an error
            return []
        return [ObjectInfo(p, int(d.get("size") or 0), _mtime(d))
                for p, d in sorted(found.items()) if d.get("type", "file") == "file"]

    def list_dirs(self, prefix: str) -> list[str]:
        """Immediate children of prefix that are directories (or common prefixes)."""
        try:
            entries = self.policy.call("list", prefix, lambda: self._request(
                "ls", prefix, detail=True, refresh=True))
        except CheckpointNotFound:
            self.check_reachable()
            return []
        return sorted(e["name"].rstrip("/") for e in entries if e.get("type") == "directory")

    def delete(self, paths: Iterable[str]) -> None:
        """Delete every path; an absent one raises CheckpointNotFound once all the others
        are done. A save's commit removes one marker per rank and a gc pass every doomed
        chunk: thousands of paths. On S3 they go in DeleteObjects requests of up to 1,000
        keys (absent keys are no error there); on a local disk a few hundred to a task."""
        paths = list(paths)
        if not paths:
            return
        if self.protocol in ("s3", "s3a"):
            self.map(self._delete_objects, batched(paths, _one, _BULK_DELETE))
            return
        per_task = _LOCAL_DELETES_PER_TASK if self.is_local else 1  # a remote one: a request
        self.map(self._delete_each, batched(paths, _one, per_task))

    def _delete_objects(self, paths: list[str]) -> None:
        """One DeleteObjects request per bucket for these paths. A key S3 could not delete
        (it answers per key, in a request that succeeded) fails the call as StorageError,
        naming the key, S3's code and message; the request as a whole is retried as any."""
        by_bucket: dict[str, list[str]] = {}
        for p in paths:
            by_bucket.setdefault(self.fs.split_path(p)[0], []).append(p)
        for bucket, mine in by_bucket.items():
            def request(bucket: str = bucket, mine: list[str] = mine) -> None:
                keys = [{"Key": self.fs.split_path(p)[1]} for p in mine]
                answer = self._request("call_s3", "delete_objects", Bucket=bucket,
                                       Delete={"Objects": keys, "Quiet": True})
                for p in mine:
                    self.fs.invalidate_cache(p)
                errors = answer.get("Errors") or []
                if errors:
                    first = errors[0]
                    raise StorageError(
                        f"delete: {self.url_of(bucket + '/' + first.get('Key', ''))} was not "
                        f"deleted ({first.get('Code')}: {first.get('Message')}; "
                        f"{len(errors)} of {len(mine)} keys of the request failed)")
            self.policy.call("delete", f"{mine[0]} (and {len(mine) - 1} more)", request)

    def _delete_each(self, paths: list[str]) -> None:
        """Delete paths one by one, each attempted; the first failure is raised after."""
        failure: BaseException | None = None
        for p in paths:
            try:
                self.policy.call("delete", p, partial(self._request, "rm_file", p))
            except CkptTurboError as exc:
                failure = failure or exc
        if failure is not None:
            raise failure

    def check_reachable(self) -> None:
        """Fail fast with a clear error when the location (bucket, directory) is unusable.
        A bucket is listed once per owner (runtime) and endpoint: a process's later saves
        to new runs in it pay no request for it (S3 answers a bucket's listing in tens of
        ms, SeaweedFS at times in seconds)."""
        if self.is_local:
            return
        bucket = self.root.split("/", 1)[0]
        key = (self.endpoint, bucket)
        if self.session.bucket_found(key):
            return
        try:
            self.policy.call("open bucket", bucket,
                             lambda: self._request("ls", bucket, refresh=True))
        except CheckpointNotFound as exc:
            raise CheckpointNotFound(f"bucket {self.protocol}://{bucket} does not exist "
                                     f"(opening {self.url})") from exc
        self.session.note_bucket(key)


def _s3_config(options: dict[str, Any], workers: int) -> dict[str, Any]:
    """botocore's config for a Store: ours (DEFAULT_S3_CONFIG) under the user's.

    Deep copies: botocore writes into the nested dicts it is given (``retries`` gains a
    ``mode``), which changed the options of every later Store and so fsspec's cache key,
    and the second Store of a process made a second filesystem and S3 client.

    A connection per I/O thread (botocore's pool holds 10, and a thread beyond it waits).
    The payload is not SHA-256-signed (``UNSIGNED-PAYLOAD``, as AWS's CRT client sends):
    the hash cost 0.5 CPU-s per GiB, on s3fs's one event-loop thread. Over TLS nothing
    replaces it (TLS protects the body, BLAKE3 verifies it on every read). Over plain HTTP
    each single PUT carries a CRC32 of its body that the store checks (``Store.put``), at
    0.15 CPU-s per GiB on the I/O thread, so a body damaged in transit is refused and sent
    again instead of committed. (Multipart parts, for chunks above ``multipart_threshold``,
    go through s3fs without one: a body damaged there is found by BLAKE3 when read.)
    """
    config = copy.deepcopy(DEFAULT_S3_CONFIG)
    config.update(max_pool_connections=max(10, workers), s3={"payload_signing_enabled": False})
    user = copy.deepcopy(options.get("config_kwargs") or {})
    if "s3" in user:
        user["s3"] = {**config["s3"], **user["s3"]}
    config.update(user)
    return config


def _crc32(data: bytes | bytearray | memoryview) -> str:
    """S3's ``x-amz-checksum-crc32`` of a body (base64 of the big-endian CRC)."""
    crc = zlib.crc32(memoryview(data).cast("B"))
    return base64.b64encode(crc.to_bytes(4, "big")).decode("ascii")


def _endpoint(options: dict[str, Any]) -> str:
    """The endpoint s3fs will reach (AWS itself, over https, unless one is named)."""
    endpoint = (options.get("endpoint_url")
                or (options.get("client_kwargs") or {}).get("endpoint_url")
                or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL"))
    return str(endpoint or "https://s3.amazonaws.com")


class _BytesSlices:
    """A buffer whose slices are ``bytes``, for a user config with botocore's parameter
    validation on (it accepts bytes, not memoryviews): s3fs cuts multipart bodies by
    slicing, so each part is copied only as it is sent."""

    def __init__(self, data: bytes | bytearray | memoryview) -> None:
        self._view = memoryview(data).cast("B")

    def __len__(self) -> int:
        return len(self._view)

    def __getitem__(self, key: slice) -> bytes:
        return bytes(self._view[key])


def _mtime(info: dict[str, Any]) -> float | None:
    for key in ("mtime", "LastModified", "created"):
        value = info.get(key)
        if value is None:
            continue
        if hasattr(value, "timestamp"):
            return float(value.timestamp())
        try:
            return float(value)
        except (TypeError, ValueError):
            continue
    return None
