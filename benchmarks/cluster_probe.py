"""The link probe of the cluster benchmark: what the store's shaped link carries for the
simplest S3 client, on the same topology in the same run as the checkpoints.

Every save and load is reported against its physical limit (bytes over the slowest link
at its nominal rate). Whether the emulation itself (``tc``'s shaping, the fault proxy's
first-byte delay and per-connection cap, SeaweedFS) can carry that rate with S3 requests
is a question of its own: the probe answers it with raw parallel PUTs and GETs from botocore
threads, no checkpoint logic at all, the same bytes as the DDP save in objects of the size
most of ckptturbo's chunks have there, from every node's namespace at once. Its time /
limit is the **link efficiency** the topology attains; each ckptturbo result is then also
read against that attainable time (its limit times the probe's time / limit).

Controls (the same requests from inside the store's namespace, where no ``tc`` shapes
anything): through the proxy, and straight to SeaweedFS, so that a shortfall of the probe
can be put on the element that causes it.
"""
from __future__ import annotations

import logging
import os
import statistics
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any

from . import cluster_topology as topo
from .cluster_jobs import timed
from .measure import gather, now
from .states import MiB

log = logging.getLogger("benchmarks")

# The DDP save of the 64 MiB state writes 40 chunks, 32 of them 1 MiB (the MLP matrices);
# the rest are packs of 2-4 MiB and the two 8 MiB embedding matrices (measured 2026-11-27)
OBJECT_BYTES = 1 * MiB
# ckptturbo's save kept 16 requests in flight at the store on average over 8 ranks: 2 each
FEW_IN_FLIGHT = 2
PROBE, CONTROL = "link probe", "no tc"


@dataclass(frozen=True)
class Variant:
    """One way of sending the probe's objects: how many requests each rank keeps in flight
    (0: all of its objects at once, up to ckptturbo's I/O threads per process); with
    ``whole_every`` n, the ranks whose number n divides send their share as one object
    instead, one connection at the per-connection cap: every rank (n = 1), as node 0's
    ranks send the DDP save's two 8 MiB embedding chunks, or every other rank (n = 2), a
    long request beside its node's other rank's short ones."""

    in_flight: int
    whole_every: int = 0

    def sizes(self, nbytes: int, world: int, rank: int) -> list[int]:
        """Rank ``rank``'s objects: its equal share of ``nbytes``, in OBJECT_BYTES pieces
        (or whole)."""
        share = nbytes // world
        if self.whole_every and rank % self.whole_every == 0:
            return [share]
        whole, rest = divmod(share, OBJECT_BYTES)
        return [OBJECT_BYTES] * whole + ([rest] if rest else [])

    def streams(self, objects: int) -> int:
        from ckptturbo.store import default_io_workers

        cap = default_io_workers(remote=True)
        return min(objects, self.in_flight or cap, cap)

    def side(self, nbytes: int, world: int) -> str:
        small = f"{OBJECT_BYTES // MiB} MiB x{self.streams(len(self.sizes(nbytes, world, 1)))}"
        whole = f"{nbytes // world / MiB:g} MiB x1"
        if not self.whole_every or nbytes // world <= OBJECT_BYTES:  # else the same as plain
            return f"botocore {small}/rank"
        return f"botocore {whole}/rank" if self.whole_every == 1 else f"botocore {whole} | {small}"


MANY, WHOLE = Variant(0), Variant(0, whole_every=1)  # the controls' two
VARIANTS = (MANY, Variant(FEW_IN_FLIGHT), WHOLE, Variant(0, whole_every=2))


def _client(endpoint: str, key: str, secret: str, streams: int) -> Any:
    """A plain botocore client (boto3's core, installed with s3fs; boto3 itself is only a
    benchmark extra): a connection per thread, one attempt per request, no checksum
    beyond what S3 requires (ckptturbo's own settings: its chunks are BLAKE3-verified)."""
    from botocore.config import Config
    from botocore.session import get_session

    config = Config(max_pool_connections=streams, retries={"total_max_attempts": 1},
                    request_checksum_calculation="when_required",
                    response_checksum_validation="when_required")
    return get_session().create_client("s3", endpoint_url=endpoint, aws_access_key_id=key,
                                       aws_secret_access_key=secret, region_name="us-east-1",
                                       config=config)


def probe_rank(rank: int, world: int, endpoint: str, key: str, secret: str, bucket: str,
               prefix: str, nbytes: int, variant: Variant, reps: int,
               counters: dict[str, str]) -> dict[str, Any]:
    """This rank's share of ``nbytes`` as the variant's objects: all PUT, then all GET
    back, each phase between barriers; one unmeasured round first, then ``reps``. Each
    sample also keeps when every rank had finished (``done``: seconds from the start)."""
    sizes = variant.sizes(nbytes, world, rank)
    body = os.urandom(max(sizes))
    keys = [f"{prefix}/r{rank}/{i}" for i in range(len(sizes))]
    streams = variant.streams(len(sizes))
    client = _client(endpoint, key, secret, streams)
    wrong: list[str] = []  # keys whose GET differed from their PUT

    def put(i: int) -> None:
        client.put_object(Bucket=bucket, Key=keys[i], Body=body[:sizes[i]])

    def get(i: int) -> None:
        if client.get_object(Bucket=bucket, Key=keys[i])["Body"].read() != body[:sizes[i]]:
            wrong.append(keys[i])

    samples = []
    with ThreadPoolExecutor(streams) as pool:
        for rep in range(-1, reps):
            ends: dict[str, float] = {}
            put_s = timed(rank, counters, "store_in", partial(_every, pool, put, keys, ends))
            get_s = timed(rank, counters, "store_out", partial(_every, pool, get, keys, ends))
            finished = gather(ends)  # each rank's end of each phase: per node, below
            if rep >= 0 and rank == 0:
                for sample, fn in ((put_s, put), (get_s, get)):
                    sample["done"] = [f[fn.__name__] - sample["window"][0] for f in finished]
                    sample["bytes"] = (nbytes // world) * world
                samples.append({"put": put_s, "get": get_s})
                log.info("  %s rep %d: PUT %.2f s, GET %.2f s", variant.side(nbytes, world),
                         rep, put_s["seconds"], get_s["seconds"])
        client.delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": k} for k in keys]})
    return {"samples": samples, "exact": all(gather(not wrong)),
            "side": variant.side(nbytes, world)}


def _every(pool: ThreadPoolExecutor, fn: Callable[[int], None], keys: list[str],
            ends: dict[str, float]) -> None:
    """``fn`` on every object, as many at once as the pool has threads; when
    this rank's last one ended goes into ``ends`` under ``fn``'s name."""
    list(pool.map(fn, range(len(keys))))
    ends[fn.__name__] = now()


def names(world: int, nodes: int) -> tuple[str, str]:
    """The probe's two scenarios (PUT, GET) on ``world`` ranks over ``nodes`` nodes."""
    return f"{PROBE} PUT {world}r/{nodes}n", f"{PROBE} GET {world}r/{nodes}n"


def per_node(sample: dict[str, Any], nodes: int, per: int, direction: str) -> list[dict[str, Any]]:
    """Each node's bytes (its link's counter) and seconds (its last rank's end) in a sample."""
    out = []
    for i in range(nodes):
        seconds = max(sample["done"][i * per:(i + 1) * per])
        sent = sample["links"].get(f"node{i}_{direction}", 0)
        out.append({"node": i, "bytes": sent, "seconds": seconds})
    return out


def efficiency(rows: list[dict[str, Any]]) -> dict[str, float]:
    """The attainable time / limit of each probed link (``store_in`` for PUTs,
    ``store_out`` for GETs, ``node1_in`` for the recovery's raw copies into the lost node):
    the best probe variant's median time over its limit."""
    best: dict[str, float] = {}
    for r in rows:
        if r["scenario"].startswith(PROBE):
            link = ("node1_in" if " node link " in r["scenario"] else
                    "store_in" if " PUT " in r["scenario"] else "store_out")
            best[link] = min(best.get(link, float("inf")), r["over_limit"])
    return best


def median_rate(samples: list[dict[str, Any]]) -> float:
    """The median payload rate (bytes/s) over samples with ``bytes`` and ``seconds``."""
    return statistics.median(s["bytes"] / s["seconds"] for s in samples)


def rate_line(name: str, samples: list[dict[str, Any]], nominal: float) -> str:
    """A line for the report's notes: rate, and its share of the link's nominal rate."""
    rate = median_rate(samples)
    return (f"{name}: {rate / topo.MB:.2f} MB/s of payload, {rate / nominal:.3f}x the store "
            f"link's nominal {nominal / topo.MB:.1f} MB/s ({topo.GOODPUT:.3f}x: TCP/IP headers)")


def node_line(name: str, nodes_seen: list[list[dict[str, Any]]], share: float) -> str:
    """A line for the report's notes: each node's median rate (its link's bytes over its
    last rank's time), and its share of the node's nominal store share."""
    rates = [statistics.median(s[i]["bytes"] / s[i]["seconds"] for s in nodes_seen)
             for i in range(len(nodes_seen[0]))]
    return f"{name}, per node: " + ", ".join(
        f"node{i} {r / topo.MB:.2f} MB/s ({r / share:.2f}x its share)" for i, r in enumerate(rates))
