"""The object store of the miniature cluster: SeaweedFS and the fault proxy in a network
namespace of their own, in a process of their own.

SeaweedFS listens on the namespace's loopback only; the proxy (no faults) listens on the
namespace's interface, so every byte the nodes move to or from the store crosses the
store's shaped link, and pays what the proxy adds like a remote object store does: a
first-byte delay per request and a bandwidth cap per connection. Neither shares an
interpreter with the benchmark or its ranks.

The keeper process ends (proxy stopped, server stopped, data removed) when the benchmark
closes its end of the pipe or dies, so an interrupted run leaves no server behind.
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import socket
import threading
from typing import Any

from ckptturbo.testing import embedded_s3, netns
from ckptturbo.testing.fault_proxy import FaultProxy

log = logging.getLogger("benchmarks")
_START_TIMEOUT_S = 60.0


class _ExposedProxy(FaultProxy):
    """The fault proxy listening on the store's own address instead of loopback (its
    upstream, SeaweedFS, is on the namespace's loopback as the proxy requires)."""

    def __init__(self, upstream: str, address: str, **kwargs: Any) -> None:
        self._address = address
        super().__init__(upstream, **kwargs)

    def _listen(self, port: int) -> socket.socket:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self._address, port))
        sock.listen(1024)
        sock.settimeout(0.2)
        return sock


def _warm_up(server: embedded_s3.S3Server) -> None:
    """SeaweedFS allocates its volumes on the first writes: do them before any clock."""
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True, **server.storage_options)
    base = server.url("warmup")
    blob = os.urandom(2 << 20)
    for i in range(8):
        fs.pipe_file(f"{base}/{i}", blob)
    fs.rm(base, recursive=True)


def _keeper(host: netns.Host, data_dir: str, latency_s: float, conn_rate: float,
            conn: Any) -> None:
    """In the store's namespace: serve until the pipe closes; answer "stats" requests."""
    netns.enter(host)
    server = embedded_s3.start(data_dir)
    proxy = None
    try:
        _warm_up(server)
        proxy = _ExposedProxy(server.endpoint, host.address, latency_s=latency_s,
                              conn_rate=conn_rate).start()
        conn.send(("ready", f"http://{host.address}:{proxy.port}", server.pid, server.endpoint))
        while True:
            try:
                request = conn.recv()
            except (EOFError, OSError):
                break
            if request == "stats":
                conn.send(proxy.stats().to_json())
    except BaseException as exc:  # noqa: BLE001 - reported to the benchmark
        conn.send(("error", f"{type(exc).__name__}: {exc}", 0, ""))
    finally:
        if proxy is not None:
            proxy.stop()
        server.stop()
        os._exit(0)


class Store:
    """The store keeper, seen from the benchmark: endpoint, fsspec options, byte counts."""

    def __init__(self, host: netns.Host, data_dir: str, latency_s: float, conn_rate: float) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.server_pid = 0
        self._asking = threading.Lock()
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_keeper, args=(host, data_dir, latency_s, conn_rate, child),
                                 daemon=True, name="cluster-store")
        self._proc.start()
        self.keeper_pid = self._proc.pid
        child.close()
        if not self._conn.poll(_START_TIMEOUT_S):
            self.stop()
            raise RuntimeError(f"the store did not start within {_START_TIMEOUT_S:.0f} s")
        # server_endpoint: SeaweedFS itself, on the store namespace's loopback (no proxy)
        state, self.endpoint, self.server_pid, self.server_endpoint = self._conn.recv()
        if state != "ready":
            self.stop()
            raise RuntimeError(f"the store did not start: {self.endpoint}")
        self.bucket = embedded_s3.BUCKET
        self.key, self.secret = embedded_s3.ACCESS_KEY, embedded_s3.SECRET_KEY
        log.info("store: SeaweedFS (pid %d) behind the proxy at %s", self.server_pid, self.endpoint)

    @property
    def storage_options(self) -> dict[str, Any]:
        return {"key": self.key, "secret": self.secret,
                "client_kwargs": {"endpoint_url": self.endpoint}}

    def url(self, name: str) -> str:
        return f"s3://{self.bucket}/{name}"

    def stats(self) -> dict[str, Any]:
        """The proxy's counts so far (requests, bytes each way, requests in flight now)."""
        with self._asking:
            self._conn.send("stats")
            return self._conn.recv()

    def stop(self) -> None:
        """Close the pipe: the keeper stops the proxy and the server; reap it by PID."""
        self._conn.close()
        self._proc.join(timeout=20)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(timeout=5)
            try:  # the keeper could not stop its server: do it here, by its PID
                os.kill(self.server_pid, signal.SIGKILL)
            except (ProcessLookupError, AttributeError):
                pass
