"""DCP saves and loads on S3: ckptturbo vs AWS s3torchconnector's DCP writer and reader.

    python -m benchmarks.s3_peers                                   # 256 MiB, 1 and 4 ranks
    python -m benchmarks.s3_peers --size-mb 512 --ranks 1,4 --reps 5 --settings direct,20:40

``s3torchconnector.dcp.S3StorageWriter``/``S3StorageReader`` (AWS CRT client) is the fastest
DCP storage plugin for S3 that AWS ships; it is a benchmark-only extra (``pip install
--no-deps s3torchconnector s3torchconnectorclient tenacity``: with its dependencies it pulls
another torch). Without it the script says so and exits 2.

Every rank holds the same transformer-like state (DDP-style replication) and saves it with
``dcp.save``, then loads it back into zeroed tensors with ``dcp.load``, with each side in
turn: ckptturbo (``TurboWriter``/``TurboReader``, grouped load) and s3torchconnector (its
defaults; path-style addressing, which SeaweedFS needs). The rank processes are warm: one
unmeasured save and load of each side first, then ``--reps`` repetitions alternating which
side goes first. A time is from a barrier before the call to a barrier after it (the
slowest rank); CPU is user + system seconds of the rank processes, summed over ranks. Every
load is checked bit-exact.

``--settings``: ``direct`` is SeaweedFS on loopback; ``MS:MBPS`` goes through the tests'
proxy in a process of its own, adding MS milliseconds before each answer and capping each
connection at MBPS MB/s each way, like a remote object store. Prints medians, min-max and
ratios (ckptturbo / s3torchconnector, lower is better); ``--json`` keeps every sample.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import statistics
import sys
import tempfile
from typing import Any

import torch.distributed.checkpoint as dcp

from ckptturbo.testing import embedded_s3
from ckptturbo.testing.launcher import run_distributed
from ckptturbo.testing.proxy_process import ProxyProcess

from .measure import barrier_time, gather, quiet, rank_options
from .states import MiB, digests, mismatches, tensor_nbytes, transformer_state, zero_

log = logging.getLogger("benchmarks.s3_peers")
SIDES = ("ckptturbo", "s3torchconnector")
REGION = "us-east-1"


def peer_available() -> str | None:
    """Why s3torchconnector cannot run here, or None."""
    try:
        import s3torchconnector.dcp  # noqa: F401
    except ImportError as e:
        return f"s3torchconnector is not installed ({e})"
    return None


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def peer_environment(endpoint: str, options: dict[str, Any]) -> None:
    """s3torchconnector's CRT client takes the endpoint and credentials from the environment."""
    os.environ.update({"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": options["key"],
                       "AWS_SECRET_ACCESS_KEY": options["secret"], "AWS_REGION": REGION})


def writer(side: str, url: str, options: dict[str, Any], chunk_size: int | None = None) -> Any:
    """``side``'s DCP writer; ``chunk_size``: ckptturbo's (default: its own default)."""
    if side == "ckptturbo":
        import ckptturbo as ct

        return ct.TurboWriter(url, options, **({"chunk_size": chunk_size} if chunk_size else {}))
    from s3torchconnector import S3ClientConfig
    from s3torchconnector.dcp import S3StorageWriter

    return S3StorageWriter(REGION, url, s3client_config=S3ClientConfig(force_path_style=True))


def reader(side: str, url: str, options: dict[str, Any]) -> Any:
    if side == "ckptturbo":
        import ckptturbo as ct

        return ct.TurboReader(url, options)
    from s3torchconnector import S3ClientConfig
    from s3torchconnector.dcp import S3StorageReader

    return S3StorageReader(REGION, url, s3client_config=S3ClientConfig(force_path_style=True))


def _timed(rank: int, fn: Any) -> dict[str, float]:
    """Run ``fn`` on every rank between barriers: the slowest rank's time, every rank's CPU."""
    cpu0 = _cpu()
    t0 = barrier_time()
    fn()
    t1 = barrier_time()
    cpus = gather(_cpu() - cpu0)
    return {"seconds": t1 - t0, "cpu": sum(cpus)}


def _peers_rank(rank: int, world: int, endpoint: str, options: dict[str, Any], root: str,
                size: int, reps: int) -> dict[str, Any]:
    """One rank: warm-up save and load per side, then ``reps`` alternating repetitions."""
    quiet()
    peer_environment(endpoint, options)
    sd = transformer_state(size)
    expected = digests(sd)
    samples: dict[str, dict[str, list]] = {s: {"save": [], "load": []} for s in SIDES}
    correct = True
    for rep in range(-1, reps):  # rep -1 warms each side up, unmeasured
        order = SIDES if rep % 2 == 0 else tuple(reversed(SIDES))
        for side in order:
            url = f"{root}/{side}-{world}r-{rep + 1}"
            url = url + "/ckpt" if side == "ckptturbo" else url
            saved = _timed(rank, lambda side=side, url=url: dcp.save(
                sd, storage_writer=writer(side, url, options)))
            zero_(sd)
            loaded = _timed(rank, lambda side=side, url=url: dcp.load(
                sd, storage_reader=reader(side, url, options)))
            correct &= not mismatches(sd, expected)
            if rep >= 0:
                samples[side]["save"].append(saved)
                samples[side]["load"].append(loaded)
                if rank == 0:
                    log.info("  %d rank(s) %-16s rep %d: save %.2f s (%.2f CPU-s), load %.2f s "
                             "(%.2f CPU-s)", world, side, rep, saved["seconds"], saved["cpu"],
                             loaded["seconds"], loaded["cpu"])
    return {"samples": samples, "correct": all(gather(correct)), "unique_bytes": tensor_nbytes(sd)}


def _setting(spec: str) -> tuple[float, float]:
    """``direct`` -> (0, 0); ``MS:MBPS`` -> (seconds of latency, bytes/s per connection)."""
    if spec == "direct":
        return 0.0, 0.0
    ms, mbps = spec.split(":")
    return float(ms) / 1000, float(mbps) * 1e6


def measure(size_mb: int, ranks: list[int], reps: int, settings: list[str],
            workdir: str | None) -> list[dict[str, Any]]:
    rows = []
    server = embedded_s3.start(tempfile.mkdtemp(prefix="ckptturbo-bench-s3-", dir=workdir))
    try:
        for spec in settings:
            latency, rate = _setting(spec)
            proxy = None if spec == "direct" else ProxyProcess(server.endpoint, latency_s=latency,
                                                               conn_rate=rate)
            try:
                endpoint = server.endpoint if proxy is None else proxy.endpoint
                options = dict(server.storage_options, client_kwargs={"endpoint_url": endpoint})
                for world in ranks:
                    log.info("setting %s, %d rank(s), %d MiB", spec, world, size_mb)
                    res = run_distributed(_peers_rank, world, endpoint, options,
                                          server.url(f"peers-{spec.replace(':', '-')}-{world}"),
                                          size_mb * MiB, reps, **rank_options(world))[0]
                    rows.append({"setting": spec, "ranks": world, **res})
            finally:
                if proxy is not None:
                    proxy.stop()
    finally:
        server.stop()
    return rows


def summarise(rows: list[dict[str, Any]]) -> str:
    """One line per setting, ranks and operation: medians, ranges, ratios, CPU per GiB."""
    lines = ["| setting | ranks | op | ckptturbo median (min-max) "
             "| s3torchconnector median (min-max) | ratio | CPU-s/GiB ckptturbo "
             "| CPU-s/GiB s3torchconnector |",
             "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        gib = row["unique_bytes"] / (1 << 30)
        for op in ("save", "load"):
            cells, medians, cpus = [], [], []
            for side in SIDES:
                times = [s["seconds"] for s in row["samples"][side][op]]
                medians.append(statistics.median(times))
                cpus.append(statistics.median(s["cpu"] for s in row["samples"][side][op]) / gib)
                cells.append(f"{medians[-1]:.2f} s ({min(times):.2f}-{max(times):.2f})")
            lines.append(f"| {row['setting']} | {row['ranks']} | {op} | {cells[0]} | {cells[1]} | "
                         f"**{medians[0] / medians[1]:.2f}** | {cpus[0]:.2f} | {cpus[1]:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-mb", type=int, default=256)
    p.add_argument("--ranks", default="1,4", help="comma-separated world sizes")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--settings", default="direct,20:40",
                   help="direct and/or MS:MBPS, comma-separated")
    p.add_argument("--workdir", default=None)
    p.add_argument("--json", default=None, help="write every sample here")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    why = peer_available()
    if why:
        log.error("%s: pip install --no-deps s3torchconnector s3torchconnectorclient tenacity", why)
        return 2
    rows = measure(args.size_mb, [int(r) for r in args.ranks.split(",")], args.reps,
                   args.settings.split(","), args.workdir)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    sys.stdout.write(summarise(rows) + "\n")
    bad = [f"{r['setting']}/{r['ranks']}" for r in rows if not r["correct"]]
    if bad:
        log.error("a load did not equal the saved state: %s", ", ".join(bad))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
