"""Which object-store client moves ckptturbo's requests fastest, and at what CPU cost.

    python -m benchmarks.s3_clients [--chunk-mib 32] [--chunks 8] [--reps 3]
                                    [--latency-ms 20] [--conn-mbps 40] [--json out.json]

ckptturbo's own request pattern, on SeaweedFS on loopback ("direct") and through the
benchmarks' latency/bandwidth proxy in a process of its own ("proxy": ``--latency-ms`` per
request, each connection capped at ``--conn-mbps``):

* ``put``: ``--chunks`` whole-chunk PUTs of ``--chunk-mib`` each, from memoryviews of one
  host buffer (as the save pipeline hands them over), all in flight at once;
* ``get``: the same bytes read back as 8 MiB ranged GETs, all in flight at once;
* ``control``: 20 sequential small-object requests (a marker PUT, a GET of it, a GET of
  an absent object), the calls a save makes before its first chunk.

Clients, each with the same number of caller threads per row:

* ``s3fs today``: :class:`ckptturbo.store.Store` as it was before issue 23 (each body
  copied to ``bytes``, payload SHA-256-signed, whole-object reads preceded by a HEAD);
* ``s3fs no copy``: :class:`~ckptturbo.store.Store` as it is now (memoryview bodies, no
  HEAD before a whole-object read), on 8 I/O threads; the payload is signed, as Store
  does over plain HTTP;
* ``s3fs unsigned``: the same, with ``payload_signing_enabled=False`` forced (botocore
  then sends ``UNSIGNED-PAYLOAD`` even on plain HTTP; Store does so over HTTPS only,
  where TLS protects the body);
* ``s3fs 32 conn``: unsigned, 32 I/O threads and 32 pooled connections (Store's default
  for object stores now: what it does against an HTTPS endpoint);
* ``obstore`` (Rust ``object_store``) and ``crt`` (AWS's ``s3torchconnectorclient``),
  skipped with a message when not importable.

Reported per client and phase: MB/s (median over ``--reps`` alternating repetitions) and
client CPU seconds (user + system of this process, which includes the native clients'
threads) per GiB moved. Ratios against ``s3fs today`` go to the log and the JSON.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ckptturbo.store import Store
from ckptturbo.testing import embedded_s3
from ckptturbo.testing.proxy_process import ProxyProcess

log = logging.getLogger("benchmarks.s3_clients")

MiB = 1 << 20
RANGE = 8 * MiB
CONTROL_ROUNDS = 20


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class Client:
    """One client's three calls; ``threads`` is how many requests are put in flight."""

    name = ""
    threads = 8

    def put(self, key: str, body: memoryview) -> None:
        raise NotImplementedError

    def get(self, key: str, start: int, end: int) -> Any:
        raise NotImplementedError

    def get_small(self, key: str) -> bytes | None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class StoreClient(Client):
    """ckptturbo's Store on ``threads`` I/O threads; ``before=True`` reproduces its
    requests before issue 23 (a copy of each body, a HEAD before a whole-object read)."""

    def __init__(self, name: str, server: Any, endpoint: str, *, before: bool = False,
                 unsigned: bool = False, threads: int = 8) -> None:
        self.name, self.threads, self.before = name, threads, before
        options = dict(server.storage_options, client_kwargs={"endpoint_url": endpoint})
        config: dict[str, Any] = {"max_pool_connections": max(10, threads)}
        if unsigned:
            config["s3"] = {"payload_signing_enabled": False}
        if before:
            config["s3"] = {"payload_signing_enabled": True}
        options["config_kwargs"] = config
        self.store = Store(f"s3://{server.bucket}", options, max_workers=threads)

    def _path(self, key: str) -> str:
        return f"{self.store.root}/{key}"

    def put(self, key: str, body: memoryview) -> None:
        self.store.put(self._path(key), bytes(body) if self.before else body)

    def get(self, key: str, start: int, end: int) -> Any:
        return self.store.get(self._path(key), start, end)

    def get_small(self, key: str) -> bytes | None:
        from ckptturbo.errors import CheckpointNotFound

        try:
            if self.before:  # s3fs's default whole-object read: HEAD (+ LIST on 404), then GET
                path = self._path(key)
                return self.store.policy.call("read", path,
                                              lambda: self.store._request("cat_file", path))
            return self.store.get(self._path(key))
        except CheckpointNotFound:
            return None


class ObstoreClient(Client):
    def __init__(self, server: Any, endpoint: str, threads: int) -> None:
        from obstore.store import S3Store

        self.name, self.threads = "obstore", threads
        self.store = S3Store(server.bucket, endpoint=endpoint, access_key_id=server.key,
                             secret_access_key=server.secret, region="us-east-1",
                             virtual_hosted_style_request=False,
                             client_options={"allow_http": True,
                                             "pool_max_idle_per_host": str(threads)})

    def put(self, key: str, body: memoryview) -> None:
        import obstore

        obstore.put(self.store, key, body, use_multipart=False)

    def get(self, key: str, start: int, end: int) -> Any:
        import obstore

        return obstore.get_range(self.store, key, start=start, end=end)

    def get_small(self, key: str) -> bytes | None:
        import obstore

        try:
            return obstore.get(self.store, key).bytes().to_bytes()
        except FileNotFoundError:
            return None


class CrtClient(Client):
    def __init__(self, server: Any, endpoint: str, threads: int) -> None:
        from s3torchconnectorclient._mountpoint_s3_client import MountpointS3Client

        os.environ.setdefault("AWS_ACCESS_KEY_ID", server.key)
        os.environ.setdefault("AWS_SECRET_ACCESS_KEY", server.secret)
        self.name, self.threads, self.bucket = "crt", threads, server.bucket
        self.client = MountpointS3Client("us-east-1", endpoint=endpoint, force_path_style=True,
                                         part_size=8 * MiB, max_attempts=1)

    def put(self, key: str, body: memoryview) -> None:
        stream = self.client.put_object(self.bucket, key)
        stream.write(bytes(body))  # its binding takes bytes only: one copy per body
        stream.close()

    def get(self, key: str, start: int, end: int) -> Any:
        return b"".join(self.client.get_object(self.bucket, key, start=start, end=end))

    def get_small(self, key: str) -> bytes | None:
        from s3torchconnectorclient import S3Exception

        try:
            return b"".join(self.client.get_object(self.bucket, key))
        except S3Exception:
            return None


def make_clients(server: Any, endpoint: str) -> list[Client]:
    clients: list[Client] = [
        StoreClient("s3fs today", server, endpoint, before=True),
        StoreClient("s3fs no copy", server, endpoint),
        StoreClient("s3fs unsigned", server, endpoint, unsigned=True),
        StoreClient("s3fs 32 conn", server, endpoint, unsigned=True, threads=32),
    ]
    for name, make in (("obstore", lambda: ObstoreClient(server, endpoint, 32)),
                       ("crt", lambda: CrtClient(server, endpoint, 32))):
        try:
            clients.append(make())
        except ImportError as exc:
            log.warning("skipping %s: not installed (%s)", name, exc)
    return clients


def run_phase(client: Client, calls: list[Callable[[], Any]], nbytes: int) -> dict[str, float]:
    cpu0, t0 = cpu_seconds(), time.perf_counter()
    with ThreadPoolExecutor(client.threads) as pool:
        for fut in [pool.submit(c) for c in calls]:
            fut.result()
    seconds, cpu = time.perf_counter() - t0, cpu_seconds() - cpu0
    return {"seconds": seconds, "mb_s": nbytes / seconds / 1e6,
            "cpu_s_per_gib": cpu / (nbytes / (1 << 30))}


def one_rep(client: Client, payload: memoryview, chunk: int,
            chunks: int) -> dict[str, dict[str, float]]:
    prefix = f"bench-{uuid.uuid4().hex[:8]}"
    keys = [f"{prefix}/c{i}" for i in range(chunks)]
    total = chunk * chunks
    puts = [lambda k=k, i=i: client.put(k, payload[i * chunk:(i + 1) * chunk])
            for i, k in enumerate(keys)]
    out = {"put": run_phase(client, puts, total)}
    gets = [lambda k=k, s=s: client.get(k, s, min(s + RANGE, chunk))
            for k in keys for s in range(0, chunk, RANGE)]
    out["get"] = run_phase(client, gets, total)
    marker = f"{prefix}/pending/0"
    t0 = time.perf_counter()
    for _ in range(CONTROL_ROUNDS):
        client.put(marker, memoryview(b'{"t": 0}'))
        client.get_small(marker)
        client.get_small(f"{prefix}/absent")
    out["control"] = {"ms_per_round": (time.perf_counter() - t0) / CONTROL_ROUNDS * 1000}
    return out


def measure(server: Any, endpoint: str, args: argparse.Namespace) -> dict[str, Any]:
    chunk = args.chunk_mib * MiB
    payload = memoryview(bytearray(os.urandom(chunk)) * args.chunks)
    clients = make_clients(server, endpoint)
    for client in clients:  # opening the client, first connections: not what is measured
        client.put("warm-up", payload[:1 << 20])
        client.get("warm-up", 0, 1 << 20)
        client.get_small("warm-up")
    samples: dict[str, list[dict]] = {c.name: [] for c in clients}
    for rep in range(args.reps):
        for client in (clients if rep % 2 == 0 else clients[::-1]):
            result = one_rep(client, payload, chunk, args.chunks)
            samples[client.name].append(result)
            log.info("  %-14s rep %d: put %.0f MB/s %.2f CPU-s/GiB, get %.0f MB/s %.2f CPU-s/GiB, "
                     "control %.1f ms/round", client.name, rep, result["put"]["mb_s"],
                     result["put"]["cpu_s_per_gib"], result["get"]["mb_s"],
                     result["get"]["cpu_s_per_gib"], result["control"]["ms_per_round"])
    for c in clients:
        c.close()
    return {name: summarize(s) for name, s in samples.items()}


def summarize(samples: list[dict]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for phase, metrics in samples[0].items():
        out[phase] = {m: {"median": statistics.median(s[phase][m] for s in samples),
                          "min": min(s[phase][m] for s in samples),
                          "max": max(s[phase][m] for s in samples)} for m in metrics}
    return out


def table(results: dict[str, Any], setting: str) -> str:
    base = results["s3fs today"]
    lines = [f"{setting}: client | put MB/s (x today) | put CPU-s/GiB | get MB/s (x today) | "
             f"get CPU-s/GiB | control ms/round (x today)"]
    for name, r in results.items():
        def ratio(phase: str, metric: str, r: dict[str, Any] = r) -> float:
            return r[phase][metric]["median"] / base[phase][metric]["median"]
        lines.append(f"  {name:14s} | {r['put']['mb_s']['median']:6.0f} "
                     f"({ratio('put', 'mb_s'):.2f}x) | "
                     f"{r['put']['cpu_s_per_gib']['median']:.2f} | "
                     f"{r['get']['mb_s']['median']:6.0f} ({ratio('get', 'mb_s'):.2f}x) | "
                     f"{r['get']['cpu_s_per_gib']['median']:.2f} | "
                     f"{r['control']['ms_per_round']['median']:.1f} "
                     f"({ratio('control', 'ms_per_round'):.2f}x)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunk-mib", type=int, default=32)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--latency-ms", type=float, default=20.0)
    parser.add_argument("--conn-mbps", type=float, default=40.0)
    parser.add_argument("--settings", default="direct,proxy")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("ckptturbo").setLevel(logging.WARNING)
    server = embedded_s3.start(tempfile.mkdtemp(prefix="ckptturbo-bench-clients-"))
    results: dict[str, Any] = {"params": vars(args)}
    try:
        for setting in args.settings.split(","):
            if setting == "direct":
                results[setting] = measure(server, server.endpoint, args)
            else:
                with ProxyProcess(server.endpoint, latency_s=args.latency_ms / 1000,
                                  conn_rate=args.conn_mbps * 1e6) as proxy:
                    results[setting] = measure(server, proxy.endpoint, args)
            print(table(results[setting], setting), flush=True)
    finally:
        server.stop()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
