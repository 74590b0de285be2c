"""Shared helpers of the ckptturbo benchmarks: state builders, timers, rank launching, a
byte-counting S3 proxy, page-cache eviction, RSS sampling, and the report (table, JSON, PNG).

Every scenario compares ckptturbo with a peer *in the same run*, alternating which goes
first, best of N repetitions, and quotes ratios (ckptturbo / peer): on a shared 2-core
machine absolute numbers move by 2x from minute to minute, ratios much less.
"""
from __future__ import annotations

import datetime
import fcntl
import json
import logging
import multiprocessing
import multiprocessing.connection
import os
import platform
import shutil
import signal
import socket
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import torch

log = logging.getLogger("benchmarks")

MiB = 1 << 20
GiB = 1 << 30


# --------------------------------------------------------------------------- states
def _fill(t: torch.Tensor, seed: int, block: torch.Tensor) -> torch.Tensor:
    """Fill a float tensor with distinct pseudo-random values, fast: a random block plus a
    per-block offset that is unique for (tensor seed, block index). No two 4 KiB ranges of
    any state built here are equal, and adding a constant to a tensor does not make it equal
    to another one, so content dedup cannot find accidental duplicates."""
    flat = t.view(-1)
    b = block.numel()
    # a per-tensor rotation of the block: adding a constant to one tensor (the scenarios'
    # "training step") never reproduces another tensor's bytes
    block = block.roll((seed * 7919 + 13) % b)
    whole = flat.numel() // b
    if whole:
        offsets = torch.arange(whole, dtype=torch.float32).mul_(1e-3).add_(float(seed))
        torch.add(block.view(1, b), offsets.view(whole, 1), out=flat[:whole * b].view(whole, b))
    tail = flat.numel() - whole * b
    if tail:
        flat[whole * b:].copy_(block[:tail]).add_(float(seed) + 0.5)
    return t


def _block(seed: int) -> torch.Tensor:
    return torch.rand(1 << 20, generator=torch.Generator().manual_seed(1000 + seed))  # 4 MiB


def transformer_state(size_bytes: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """A transformer-like fp32 state of about ``size_bytes``: token embedding and output
    head (a quarter of the bytes), then layers of four big matrices (qkv, out, up, down)
    plus biases and layer norms (the many small tensors), and a few scalars."""
    block = _block(seed)
    d = 1024 if size_bytes >= 256 * MiB else 256 if size_bytes >= 8 * MiB else 64
    vocab = max(16, size_bytes // 8 // (d * 4))
    layer_bytes = 12 * d * d * 4
    layers = max(1, (size_bytes - 2 * vocab * d * 4) // layer_bytes)
    shapes: dict[str, tuple[int, ...]] = {"tok_embeddings.weight": (vocab, d)}
    for i in range(layers):
        p = f"layers.{i}."
        shapes.update({
            p + "attn.qkv.weight": (3 * d, d), p + "attn.qkv.bias": (3 * d,),
            p + "attn.out.weight": (d, d), p + "attn.out.bias": (d,),
            p + "mlp.up.weight": (4 * d, d), p + "mlp.up.bias": (4 * d,),
            p + "mlp.down.weight": (d, 4 * d), p + "mlp.down.bias": (d,),
            p + "ln1.weight": (d,), p + "ln1.bias": (d,),
            p + "ln2.weight": (d,), p + "ln2.bias": (d,),
        })
    shapes.update({"norm.weight": (d,), "norm.bias": (d,), "output.weight": (vocab, d)})
    state = {}
    for k, (name, shape) in enumerate(shapes.items()):
        state[name] = _fill(torch.empty(shape), seed * 100_000 + k, block)
    state["step"] = torch.tensor(1000 + seed)
    return state


def one_big_state(size_bytes: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """One big tensor of 3/4 of ``size_bytes`` (768 MiB at 1 GiB) and 64 small ones."""
    block = _block(seed)
    big = size_bytes * 3 // 4 // 4
    d = 1024
    state = {"embedding.weight": _fill(torch.empty(big // d, d), seed * 100_000, block)}
    small = max(4096, (size_bytes - big * 4) // 64 // 4)
    for i in range(64):
        state[f"small.{i}"] = _fill(torch.empty(small if i % 2 else small // 16), seed * 100_000 + 1 + i, block)
    return state


def tensor_nbytes(state: dict[str, Any]) -> int:
    return sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))


def digests(state: dict[str, Any]) -> dict[str, str]:
    """BLAKE3 of every tensor's bytes (what "loaded equals saved" is checked against)."""
    import blake3

    out = {}
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            data = v.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
            out[k] = blake3.blake3(data, max_threads=blake3.blake3.AUTO).hexdigest()
        else:
            out[k] = repr(v)
    return out


def mismatches(state: dict[str, Any], expected: dict[str, str]) -> list[str]:
    got = digests(state)
    return sorted(k for k in set(got) | set(expected) if got.get(k) != expected.get(k))


def zero_(state: dict[str, Any]) -> None:
    for v in state.values():
        if isinstance(v, torch.Tensor):
            v.zero_()


def zeros_like(state: dict[str, Any]) -> dict[str, Any]:
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v for k, v in state.items()}


# --------------------------------------------------------------------------- timing
def quiet() -> None:
    """Silence DCP's per-call warnings that would drown the report."""
    import warnings

    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
    warnings.filterwarnings("ignore", message=".*TypedStorage is deprecated.*")
    warnings.filterwarnings("ignore", category=FutureWarning)


def now() -> float:
    return time.perf_counter()


def alternate(reps: int, variants: dict[str, Callable[[int], dict[str, Any]]],
              key: str = "seconds", between: Callable[[], None] | None = None) -> dict[str, dict]:
    """Run each variant ``reps`` times, alternating which goes first; keep every sample and
    the best (lowest ``key``). A variant returns a dict of metrics that includes ``key``."""
    names = list(variants)
    samples: dict[str, list[dict]] = {n: [] for n in names}
    for rep in range(reps):
        order = names if rep % 2 == 0 else list(reversed(names))
        for name in order:
            if between is not None:
                between()
            result = variants[name](rep)
            samples[name].append(result)
            log.info("  %-28s rep %d: %s", name, rep, _brief(result))
    return {n: {"best": min(s, key=lambda r: r[key]), "samples": s} for n, s in samples.items()}


def _brief(result: dict[str, Any]) -> str:
    parts = []
    for k, v in result.items():
        if isinstance(v, float):
            parts.append(f"{k}={v:.3f}")
        elif isinstance(v, int) and not isinstance(v, bool):
            parts.append(f"{k}={fmt_bytes(v) if 'bytes' in k else v}")
    return " ".join(parts)


def fmt_bytes(n: float) -> str:
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


# --------------------------------------------------------------------------- local disk
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


# --------------------------------------------------------------------------- memory
class RssSampler:
    """Samples this process's resident set size every ``interval`` seconds on a thread;
    ``peak_extra`` is the highest RSS seen minus the RSS when sampling started."""

    def __init__(self, interval: float = 0.002) -> None:
        self.interval = interval
        self.base = rss()
        self.peak = self.base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="rss-sampler")

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss())
            self._stop.wait(self.interval)

    def __enter__(self) -> "RssSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss())

    @property
    def peak_extra(self) -> int:
        return self.peak - self.base


_PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


# --------------------------------------------------------------------------- processes
def _child(fn: Callable[..., Any], rank: int, world: int, init_file: str | None,
           conn: Any, timeout: float, threads: int, args: tuple, kwargs: dict) -> None:
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s [rank {rank}] %(message)s",
                        datefmt="%H:%M:%S")
    logging.getLogger("benchmarks").setLevel(logging.INFO)
    torch.set_num_threads(threads)
    quiet()
    code = 0
    try:
        if init_file is not None:
            import torch.distributed as dist

            dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                    world_size=world, timeout=datetime.timedelta(seconds=timeout))
        value = fn(rank, world, *args, **kwargs)
        conn.send(("ok", value))
        if init_file is not None:
            import torch.distributed as dist

            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent
        code = 1
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()
    os._exit(code)


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 900,
              dist: bool = True, threads: int | None = None, **kwargs: Any) -> list[Any]:
    """Run module-level ``fn(rank, world, *args, **kwargs)`` in ``world`` fresh processes,
    joined by a gloo group (``dist=False``: plain isolated processes). Returns the ranks'
    return values; any failure or timeout kills the rest and raises with the traceback."""
    ctx = multiprocessing.get_context("spawn")
    tmp = tempfile.mkdtemp(prefix="ckptturbo-bench-pg-")
    threads = threads or max(1, (os.cpu_count() or 2) // world)
    procs, conns = [], []
    try:
        for rank in range(world):
            r, w = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_child, daemon=True, args=(
                fn, rank, world, os.path.join(tmp, "pg") if dist else None, w, timeout, threads,
                args, kwargs))
            p.start()
            w.close()
            procs.append(p)
            conns.append(r)
        results: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        waiting = dict(enumerate(conns))
        while waiting and time.monotonic() < deadline:
            ready = multiprocessing.connection.wait(list(waiting.values()),
                                                    timeout=max(0.0, deadline - time.monotonic()))
            for rank, conn in list(waiting.items()):
                if conn in ready:
                    try:
                        results[rank] = conn.recv()
                    except EOFError:
                        results[rank] = ("error", f"rank {rank} died (exit code {procs[rank].exitcode})")
                    del waiting[rank]
                    if results[rank][0] != "ok":
                        deadline = min(deadline, time.monotonic() + 5)
        for rank in range(world):
            if rank not in results:
                results[rank] = ("error", f"rank {rank}: no result within {timeout}s")
        failed = [(r, m[1]) for r, m in sorted(results.items()) if m[0] != "ok"]
        if failed:
            raise RuntimeError("benchmark ranks failed:\n" + "\n".join(f"rank {r}: {t}" for r, t in failed))
        return [results[r][1] for r in range(world)]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)
        for c in conns:
            c.close()
        shutil.rmtree(tmp, ignore_errors=True)


def run_isolated(fn: Callable[..., Any], *args: Any, timeout: float = 900, **kwargs: Any) -> Any:
    """``fn(0, 1, *args)`` in one fresh process without a process group (clean RSS)."""
    return run_ranks(fn, 1, *args, timeout=timeout, dist=False, threads=os.cpu_count() or 2,
                     **kwargs)[0]


def barrier_time() -> float:
    """All ranks meet, then read the clock (the start or end of a group-wide measurement)."""
    import torch.distributed as dist

    dist.barrier()
    return now()


def gather(value: Any) -> list[Any]:
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


# --------------------------------------------------------------------------- S3
def _splice_pump(src: socket.socket, dst: socket.socket, count: Callable[[int], None],
                 rate: float = 0.0) -> None:
    """Move bytes src -> dst until EOF (zero-copy through a pipe where splice exists), at
    most ``rate`` bytes/s when it is positive (paced after each piece of at most 1 MiB)."""
    burst = 256 << 10
    tokens, last = float(burst), time.monotonic()

    def pace(n: int) -> None:  # a token bucket: idle time earns at most ``burst`` bytes
        nonlocal tokens, last
        count(n)
        if rate > 0:
            t = time.monotonic()
            tokens = min(burst, tokens + (t - last) * rate) - n
            last = t
            if tokens < 0:
                time.sleep(-tokens / rate)

    try:
        if hasattr(os, "splice"):
            r, w = os.pipe()
            try:
                try:
                    fcntl.fcntl(w, 1031, 1 << 20)  # F_SETPIPE_SZ
                except OSError:
                    pass
                while True:
                    n = os.splice(src.fileno(), w, 1 << 20)
                    if n == 0:
                        break
                    left = n
                    while left:
                        left -= os.splice(r, dst.fileno(), left)
                    pace(n)
            finally:
                os.close(r)
                os.close(w)
        else:
            buf = bytearray(1 << 20)
            while True:
                n = src.recv_into(buf)
                if n == 0:
                    break
                dst.sendall(memoryview(buf)[:n])
                pace(n)
    except OSError:
        pass
    finally:
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass


def _proxy_main(listener: socket.socket, control: socket.socket, upstream: tuple[str, int],
                rate: float = 0.0) -> None:
    """Forward every connection to ``upstream``, counting bytes both ways (each direction of
    each connection capped at ``rate`` bytes/s when positive); a connection to ``control``
    gets back "<server->client bytes> <client->server bytes>\n"."""
    lock = threading.Lock()
    counts = [0, 0]

    def adder(i: int) -> Callable[[int], None]:
        def add(n: int) -> None:
            with lock:
                counts[i] += n
        return add

    def serve(client: socket.socket) -> None:
        try:
            server = socket.create_connection(upstream)
        except OSError:
            client.close()
            return
        for s in (client, server):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        t = threading.Thread(target=_splice_pump, args=(client, server, adder(1), rate), daemon=True)
        t.start()
        _splice_pump(server, client, adder(0), rate)
        t.join()
        client.close()
        server.close()

    def answer() -> None:
        while True:
            conn, _ = control.accept()
            with lock:
                text = f"{counts[0]} {counts[1]}\n"
            conn.sendall(text.encode())
            conn.close()

    threading.Thread(target=answer, daemon=True).start()
    while True:
        client, _ = listener.accept()
        threading.Thread(target=serve, args=(client,), daemon=True).start()


def proxy_counts(control_port: int) -> tuple[int, int]:
    """(bytes the server sent to clients, bytes clients sent) through the proxy so far."""
    with socket.create_connection(("127.0.0.1", control_port)) as s:
        data = b""
        while not data.endswith(b"\n"):
            more = s.recv(64)
            if not more:
                break
            data += more
    down, up = data.split()
    return int(down), int(up)


class CountingProxy:
    """A loopback TCP proxy in its own process that counts the bytes the server sends to
    clients: the bytes storage served, measured the same way for ckptturbo and DCP. It
    forwards with splice(2) (no copy through Python), so it costs little CPU. With
    ``conn_rate`` (bytes/s) each connection is capped in each direction, like a remote
    object store whose single streams are slow (S3: tens of MB/s per connection)."""

    def __init__(self, upstream_host: str, upstream_port: int, conn_rate: float = 0.0) -> None:
        ctx = multiprocessing.get_context("fork")
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(1024)
        self.control = socket.socket()
        self.control.bind(("127.0.0.1", 0))
        self.control.listen(64)
        self.port = self.listener.getsockname()[1]
        self.control_port = self.control.getsockname()[1]
        self.proc = ctx.Process(target=_proxy_main, daemon=True, args=(
            self.listener, self.control, (upstream_host, upstream_port), conn_rate))
        self.proc.start()

    def stop(self) -> None:
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(timeout=5)
        self.listener.close()
        self.control.close()


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
    control_port: int | None = None

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
        return proxy_counts(self.control_port)[0] if self.control_port else None

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


def storage_ceiling(be: "Backend", total: int = 256 * MiB, object_size: int = 16 * MiB,
                    workers: int = 8) -> dict[str, float]:
    """Raw parallel PUT and GET throughput of the storage with plain s3fs (bytes/s): what any
    checkpointer can at best get out of this server on this machine, right now."""
    import s3fs
    from concurrent.futures import ThreadPoolExecutor

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
             out["put_bytes_per_s"] / MiB, out["get_bytes_per_s"] / MiB, n, object_size // MiB, workers)
    return out


class S3Env:
    """SeaweedFS on loopback behind a byte-counting proxy (started before big states are
    built: the proxy process is forked)."""

    def __init__(self, data_dir: str | None = None, conn_mbps: float = 0.0) -> None:
        from urllib.parse import urlparse

        from ckptturbo import embedded_s3

        self.server = embedded_s3.start(data_dir)
        try:
            u = urlparse(self.server.endpoint)
            self.proxy = CountingProxy(u.hostname, u.port, conn_mbps * 1e6)
        except BaseException:
            self.server.stop()
            raise
        opts = dict(self.server.storage_options)
        opts["client_kwargs"] = {"endpoint_url": f"http://127.0.0.1:{self.proxy.port}"}
        self.backend = Backend("s3", self.server.url("bench"), opts,
                               dict(self.server.storage_options), self.proxy.control_port)
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

    def __enter__(self) -> "S3Env":
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

    def __enter__(self) -> "LocalEnv":
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


# --------------------------------------------------------------------------- report
@dataclass
class Comparison:
    name: str
    ours: float
    peer: float
    unit: str
    peer_name: str
    target: float | None
    op: str = "<="
    note: str = ""

    @property
    def ratio(self) -> float:
        return self.ours / self.peer if self.peer else float("inf")

    @property
    def met(self) -> bool | None:
        if self.target is None:
            return None
        return self.ratio <= self.target if self.op == "<=" else self.ratio >= self.target

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "ckptturbo": self.ours, "peer": self.peer, "unit": self.unit,
                "peer_name": self.peer_name, "ratio": self.ratio, "target": self.target,
                "op": self.op, "met": self.met, "note": self.note}


class Report:
    """Collects raw numbers, comparisons (ratio = ckptturbo / peer) with their targets and
    correctness checks; prints a table and writes ``<out>/<scenario>.json`` and ``.png``."""

    def __init__(self, scenario: str, params: dict[str, Any]) -> None:
        self.scenario = scenario
        self.params = params
        self.raw: dict[str, Any] = {}
        self.comparisons: list[Comparison] = []
        self.checks: dict[str, bool] = {}
        self.check_details: dict[str, str] = {}
        self.notes: list[str] = []
        self.started = time.time()

    def compare(self, name: str, ours: float, peer: float, unit: str, *, peer_name: str = "DCP",
                target: float | None = None, op: str = "<=", note: str = "") -> Comparison:
        c = Comparison(name, float(ours), float(peer), unit, peer_name, target, op, note)
        self.comparisons.append(c)
        return c

    def check(self, name: str, ok: bool, detail: str = "") -> None:
        self.checks[name] = bool(ok)
        if detail:
            self.check_details[name] = detail
        if not ok:
            log.error("CHECK FAILED: %s %s", name, detail)

    def note(self, text: str) -> None:
        self.notes.append(text)

    @property
    def checks_passed(self) -> bool:
        return bool(self.checks) and all(self.checks.values())

    def to_json(self) -> dict[str, Any]:
        return {
            "scenario": self.scenario, "params": self.params,
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "machine": machine(), "wall_seconds": time.time() - self.started,
            "comparisons": [c.to_json() for c in self.comparisons],
            "checks": self.checks, "check_details": self.check_details,
            "checks_passed": self.checks_passed, "notes": self.notes, "raw": self.raw,
        }

    def table(self) -> str:
        lines = [f"== {self.scenario}  {json.dumps(self.params)}"]
        head = f"{'measure':<46} {'ckptturbo':>12} {'peer':>12}  {'peer is':<22} {'ratio':>7}  target"
        lines += [head, "-" * len(head)]
        for c in self.comparisons:
            target = "" if c.target is None else f"{c.op} {c.target:g}  " + ("ok" if c.met else "MISSED")
            lines.append(f"{c.name:<46} {_fmt(c.ours, c.unit):>12} {_fmt(c.peer, c.unit):>12}  "
                         f"{c.peer_name:<22} {c.ratio:>7.3f}  {target}")
        lines.append("checks: " + ", ".join(f"{k}={'ok' if v else 'FAILED'}" for k, v in self.checks.items()))
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def finish(self, out_dir: str) -> dict[str, Any]:
        os.makedirs(out_dir, exist_ok=True)
        doc = self.to_json()
        with open(os.path.join(out_dir, f"{self.scenario}.json"), "w") as f:
            json.dump(doc, f, indent=1, default=str)
        try:
            self.plot(os.path.join(out_dir, f"{self.scenario}.png"))
        except Exception as exc:  # noqa: BLE001 - a plot must not lose the numbers
            log.warning("plot failed: %s", exc)
        print(self.table(), flush=True)
        return doc

    def plot(self, path: str) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        comps = self.comparisons
        if not comps:
            return
        cols = min(4, len(comps))
        rows = (len(comps) + cols - 1) // cols
        fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 3.0 * rows), squeeze=False)
        for ax, c in zip(axes.flat, comps):
            scale, unit = (MiB, "MiB") if c.unit == "bytes" else (1, c.unit)
            bars = ax.bar(["ckptturbo", c.peer_name], [c.ours / scale, c.peer / scale],
                          color=["#2a7ab0", "#bbbbbb"])
            for b, v in zip(bars, (c.ours, c.peer)):
                ax.annotate(_fmt(v, c.unit), (b.get_x() + b.get_width() / 2, b.get_height()),
                            ha="center", va="bottom", fontsize=7)
            ax.margins(y=0.15)
            verdict = "" if c.met is None else (" ok" if c.met else " MISSED")
            target = "" if c.target is None else f" (target {c.op} {c.target:g}{verdict})"
            ax.set_title(f"{c.name}\nratio {c.ratio:.2f}{target}", fontsize=8)
            ax.set_ylabel(unit, fontsize=7)
            ax.tick_params(labelsize=7)
        for ax in list(axes.flat)[len(comps):]:
            ax.axis("off")
        fig.suptitle(f"{self.scenario} ({json.dumps(self.params)})", fontsize=9)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)


def _fmt(v: float, unit: str) -> str:
    if unit == "bytes":
        return fmt_bytes(v)
    if unit == "s":
        return f"{v:.3f} s"
    if unit == "x":
        return f"{v:.3f}"
    return f"{v:.3g} {unit}"


def machine() -> dict[str, Any]:
    try:
        with open("/proc/meminfo") as f:
            mem = int(f.readline().split()[1]) * 1024
    except OSError:
        mem = 0
    return {"cpus": os.cpu_count(), "memory_bytes": mem, "gpu": torch.cuda.is_available(),
            "ckptturbo_source_blake3": source_digest(),
            "torch": torch.__version__, "python": platform.python_version(),
            "platform": platform.platform(), "loadavg_at_end": os.getloadavg()}


def source_digest() -> str:
    """BLAKE3 of ckptturbo's sources: which code the numbers were measured with (the tree
    changes under a benchmark run more often than its git commit does)."""
    import blake3

    import ckptturbo

    root = os.path.dirname(ckptturbo.__file__)
    h = blake3.blake3()
    for name in sorted(os.listdir(root)):
        if name.endswith(".py"):
            with open(os.path.join(root, name), "rb") as f:
                h.update(name.encode() + b"\0" + f.read())
    return h.hexdigest()[:16]
