"""Where the benchmarks' checkpoints go: a scratch directory (:class:`LocalEnv`) or the
embedded SeaweedFS behind a byte-counting proxy (:class:`S3Env`), both seen by the
scenarios as a picklable :class:`Backend`; plus DCP's fsspec peers and page-cache eviction.
"""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any

from ckptturbo.testing import embedded_s3
from ckptturbo.testing.proxy_process import ProxyControl, ProxyProcess

from .measure import now
from .states import MiB

log = logging.getLogger("benchmarks")


def evict_page_cache(path: str) -> int:
    """Drop a directory's clean pages from the page cache (posix_fadvise DONTNEED; no root
    needed), so the next read comes from the disk. Returns the bytes evicted."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            p = os.path.join(root, name)
            try:
                fd = os.open(p, os.O_RDONLY)
            except OSError:
                continue
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                total += os.fstat(fd).st_size
            finally:
                os.close(fd)
    return total


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


def distcp_bytes_per_rank(files: dict[str, int], world: int) -> list[int]:
    """Per-rank bytes of a DCP checkpoint from its ``__<rank>_<n>.distcp`` file sizes."""
    per = [0] * world
    for name, size in files.items():
        base = name.rsplit("/", 1)[-1]
        if base.startswith("__") and base.endswith(".distcp"):
            per[int(base[2:].split("_", 1)[0])] += size
    return per


def local_files(path: str) -> dict[str, int]:
    return {os.path.join(r, f): os.path.getsize(os.path.join(r, f))
            for r, _, fs in os.walk(path) for f in fs}


def remove(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


@dataclass
class Backend:
    """Where a scenario's checkpoints go, picklable so that rank processes get it too.

    ``local``: a directory. ``s3``: a prefix on SeaweedFS, reached through the counting
    proxy (``storage_options``); ``direct_options`` reach the server itself, for listing
    and cleaning up without touching the count.
    """

    kind: str
    root: str
    storage_options: dict[str, Any] | None = None
    direct_options: dict[str, Any] | None = None
    proxy: ProxyControl | None = None

    def url(self, name: str) -> str:
        return f"{self.root.rstrip('/')}/{name}"

    # ckptturbo and DCP on this storage
    def ct_writer(self, url: str, **kw: Any) -> Any:
        import ckptturbo as ct

        return ct.TurboWriter(url, self.storage_options, **kw)

    def ct_reader(self, url: str, **kw: Any) -> Any:
        import ckptturbo as ct

        return ct.TurboReader(url, self.storage_options, **kw)

    def dcp_writer(self, url: str, **kw: Any) -> Any:
        if self.kind == "local":
            from torch.distributed.checkpoint import FileSystemWriter

            return FileSystemWriter(url, **kw)
        return fsspec_writer(url, self.storage_options, **kw)

    def dcp_reader(self, url: str) -> Any:
        if self.kind == "local":
            from torch.distributed.checkpoint import FileSystemReader

            return FileSystemReader(url)
        return fsspec_reader(url, self.storage_options)

    @property
    def peer_name(self) -> str:
        return "DCP FileSystem" if self.kind == "local" else "DCP Fsspec (s3fs)"

    # accounting and housekeeping
    def served(self) -> int | None:
        """Bytes storage has sent to clients so far (None on local disk)."""
        return self.proxy.stats().bytes_down if self.proxy else None

    def files(self, url: str) -> dict[str, int]:
        if self.kind == "local":
            return local_files(url) if os.path.exists(url) else {}
        import s3fs

        fs = s3fs.S3FileSystem(skip_instance_cache=True, **self.direct_options)
        try:
            return {p: int(d.get("size") or 0) for p, d in fs.find(url, detail=True).items()}
        except FileNotFoundError:
            return {}

    def remove(self, url: str) -> None:
        if self.kind == "local":
            shutil.rmtree(url, ignore_errors=True)
            return
        import s3fs

        fs = s3fs.S3FileSystem(skip_instance_cache=True, **self.direct_options)
        try:
            fs.rm(url, recursive=True)
        except (FileNotFoundError, OSError):
            pass

    def make_cold(self, url: str) -> None:
        """Local disk: evict the checkpoint from the page cache. S3: nothing (SeaweedFS
        keeps its volumes in the page cache; both sides see the same server)."""
        if self.kind == "local":
            evict_page_cache(url)


def storage_ceiling(be: Backend, total: int = 256 * MiB, object_size: int = 16 * MiB,
                    workers: int = 8) -> dict[str, float]:
    """Raw parallel PUT and GET throughput of the storage with plain s3fs (bytes/s): what any
    checkpointer can at best get out of this server on this machine, right now."""
    from concurrent.futures import ThreadPoolExecutor

    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True, **be.storage_options)
    blob = os.urandom(object_size)
    base = be.url("ceiling-probe")
    n = max(1, total // object_size)
    with ThreadPoolExecutor(workers) as ex:
        t = now()
        list(ex.map(lambda i: fs.pipe_file(f"{base}/{i}", blob), range(n)))
        put = now() - t
        t = now()
        list(ex.map(lambda i: fs.cat_file(f"{base}/{i}"), range(n)))
        get = now() - t
    be.remove(base)
    out = {"put_bytes_per_s": n * object_size / put, "get_bytes_per_s": n * object_size / get,
           "object_size": object_size, "workers": workers, "total": n * object_size}
    log.info("  storage ceiling: PUT %.0f MiB/s, GET %.0f MiB/s (%d x %d MiB objects, %d streams)",
             out["put_bytes_per_s"] / MiB, out["get_bytes_per_s"] / MiB, n, object_size // MiB,
             workers)
    return out


class S3Env:
    """SeaweedFS on loopback behind the fault proxy, used here to count bytes (and cap each
    connection's bandwidth), in a process of its own (forked: start it before big states
    are built)."""

    def __init__(self, data_dir: str | None = None, conn_mbps: float = 0.0) -> None:
        self.server = embedded_s3.start(data_dir)
        try:
            self.proxy = ProxyProcess(self.server.endpoint, conn_rate=conn_mbps * 1e6)
        except BaseException:
            self.server.stop()
            raise
        self.backend = Backend("s3", self.server.url("bench"),
                               self.proxy.storage_options(self.server.storage_options),
                               dict(self.server.storage_options), self.proxy.control)
        self._warm_up()

    def _warm_up(self) -> None:
        """SeaweedFS allocates its volumes on the first writes: do them before timing."""
        import s3fs

        fs = s3fs.S3FileSystem(skip_instance_cache=True, **self.server.storage_options)
        base = self.server.url("warmup")
        blob = os.urandom(2 * MiB)
        for i in range(8):
            fs.pipe_file(f"{base}/{i}", blob)
        for i in range(8):
            fs.cat_file(f"{base}/{i}")
        fs.rm(base, recursive=True)

    def stop(self) -> None:
        self.proxy.stop()
        self.server.stop()

    def __enter__(self) -> S3Env:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


class LocalEnv:
    """A scratch directory for local-disk checkpoints, removed at the end."""

    def __init__(self, workdir: str | None = None) -> None:
        self.dir = tempfile.mkdtemp(prefix="ckptturbo-bench-", dir=workdir)
        self.backend = Backend("local", self.dir)

    def stop(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> LocalEnv:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def environment(kind: str, workdir: str | None = None, conn_mbps: float = 0.0) -> Any:
    """A LocalEnv or an S3Env (SeaweedFS behind the counting proxy; ``conn_mbps`` > 0 caps
    every connection at that many MB/s (10^6 bytes/s) each way, as benchmarks/stream_s3.py's
    option of the same name does)."""
    return LocalEnv(workdir) if kind == "local" else S3Env(
        tempfile.mkdtemp(prefix="ckptturbo-bench-s3-", dir=workdir), conn_mbps)


def fsspec_writer(url: str, storage_options: dict[str, Any], **kw: Any) -> Any:
    """DCP's FsspecWriter with fsspec options; sync_files=False because fsync is not
    available on S3 files (DCP's own default would fail)."""
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    return FsspecWriter(url, sync_files=False, **kw, **storage_options)


def fsspec_reader(url: str, storage_options: dict[str, Any]) -> Any:
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    return FsspecReader(url, **storage_options)


def reset_fsspec_caches() -> None:
    """fsspec caches filesystem instances (and s3fs their listings): start every load cold."""
    import fsspec

    for cls in list(fsspec.AbstractFileSystem.__subclasses__()) + [fsspec.AbstractFileSystem]:
        try:
            cls.clear_instance_cache()
        except Exception:  # noqa: BLE001
            pass
    try:
        import s3fs

        s3fs.S3FileSystem.clear_instance_cache()
    except ImportError:
        pass
