"""A GPU cluster and its object store in miniature, on one machine: the profile (rates of a
real cluster, each with its source, scaled down by one factor), the topology that the
benchmark builds from it (network namespaces, shaped links), and the physical limit of
every scenario on that topology.

On loopback every byte costs the same cores three times (client, proxy, server), so a
benchmark there measures the CPU. Here each node is a network namespace whose link to the
others is shaped to the node's fabric rate, with a share of it for the object store, and
the store sits behind a link of its own and a proxy that adds S3's first-byte latency and
per-connection cap. Every rate is divided by the same factor, so that the machine's cores
stay mostly idle and the links, as on a cluster, decide.
"""
from __future__ import annotations

import logging
import math
import os
import shutil
import signal
import tempfile
import time
import types
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

from ckptturbo.chunks import DEFAULT_CHUNK_SIZE
from ckptturbo.testing import netns

from .cluster_store import Store
from .states import MiB

log = logging.getLogger("benchmarks")
MB = 1e6  # rates are in decimal units, as links are sold
# What of a link's rate carries payload: a full TCP segment (1,448 bytes with timestamps)
# travels in 1,514 bytes of Ethernet, IP and TCP, and the shaper counts them all
GOODPUT = 1448 / 1514


@dataclass(frozen=True)
class Profile:
    """The real rates (bytes/s) of one miniature node (``ranks_per_node`` GPUs' share of a
    GPU server) and of the object store, and the factors that scale them down."""

    ranks_per_node: int = 2
    # p5.48xlarge: 3,200 Gb/s of EFA for 8 H100s, 400 Gb/s per GPU (AWS EC2 P5 page)
    fabric: float = 2 * 400e9 / 8
    # S3 from one instance: ~8 GB/s measured on a 100 Gb/s instance (c5n.18xlarge, 8,003 MB/s,
    # github.com/dvassallo/s3-benchmark); AWS documents up to 100 Gb/s per instance. A
    # quarter of an 8-GPU server's share.
    store_share: float = 8e9 / 4
    # S3 per connection: "85-90 MB/s" per request (AWS, S3 performance design patterns:
    # horizontal scaling of connections); 100 MB/s in round figures
    conn: float = 100e6
    # first byte: tens of ms for a ranged GET in region (AWS documents 100-200 ms for small
    # objects); not scaled (a time)
    first_byte_s: float = 0.030
    scale: float = 1 / 400  # every link rate
    conn_scale: float = 1 / 40  # the per-connection cap (see docs/benchmarks.md: why not 1/400)

    def scaled(self, scale: float | None = None) -> Profile:
        return self if scale is None else replace(self, scale=scale, conn_scale=10 * scale)

    @property
    def node_rate(self) -> float:
        return self.fabric * self.scale

    @property
    def store_rate(self) -> float:
        """One node's share of bandwidth to the store."""
        return self.store_share * self.scale

    @property
    def conn_rate(self) -> float:
        return self.conn * self.conn_scale

    @property
    def chunk_size(self) -> int:
        """ckptturbo's chunk size in the miniature: its default (64 MiB) scaled like one
        connection's rate, to a power of two (2 MiB at 1/40), so that a chunk keeps one
        connection as long as on the real store (0.67 s at 100 MB/s). Unscaled, a rank's
        share of the miniature's state would be one or two chunks where a real one has
        dozens, and its few connections, not the links, would decide."""
        return 1 << round(math.log2(DEFAULT_CHUNK_SIZE * self.conn_scale))

    def describe(self) -> dict[str, Any]:
        return {**asdict(self), "miniature": {"node_MBps": self.node_rate / MB,
                                              "node_store_MBps": self.store_rate / MB,
                                              "conn_MBps": self.conn_rate / MB,
                                              "ckptturbo_chunk_MiB": self.chunk_size / MiB}}


PROFILE = Profile()


@dataclass(frozen=True)
class OnNode:
    """``setup`` for the launcher: rank ``r`` runs on node ``r // ranks_per_node`` (its
    namespace, host name and interface), then the benchmarks' own rank set-up."""

    nodes: tuple[netns.Host, ...]
    ranks_per_node: int
    then: Callable[[int], None] | None = None

    def __call__(self, rank: int) -> None:
        netns.enter(self.nodes[rank // self.ranks_per_node])
        if self.then is not None:
            self.then(rank)


class Cluster:
    """``nodes`` node namespaces and one for the store, shaped after ``profile``; the store
    (SeaweedFS behind the proxy) running in its namespace. :meth:`close` removes all of it;
    so does SIGTERM or Ctrl-C while it is open (they raise in the main thread)."""

    def __init__(self, nodes: int, profile: Profile = PROFILE, workdir: str | None = None) -> None:
        self.profile = profile
        if workdir is not None:
            os.makedirs(workdir, exist_ok=True)
        self.scratch = tempfile.mkdtemp(prefix="ckptturbo-cluster-", dir=workdir)
        self._hosts: netns.VirtualHosts | None = None
        self._store: Store | None = None
        self._names: list[str] = []
        self._links: list[str] = []
        self._pids: list[int] = []
        self._data = ""
        self._previous = signal.signal(signal.SIGTERM, _raise_interrupt)
        try:
            self._hosts = netns.VirtualHosts(nodes + 1)
            self._names = [h.netns for h in self._hosts.hosts]
            self._links = [self._hosts.bridge, *(h.link for h in self._hosts.hosts)]
            *self.nodes, self.store_host = self._hosts.hosts
            self.nodes = tuple(self.nodes)
            mbit = _mbit(profile.node_rate)
            share = {self.store_host.address: _mbit(profile.store_rate)}
            for node in self.nodes:
                self._hosts.shape(node, mbit, share)
            self._hosts.shape(self.store_host, _mbit(profile.store_rate * nodes))
            # SeaweedFS's volumes on a memory file system: the store's disks are not what
            # a remote object store's client waits for
            self._data = tempfile.mkdtemp(prefix="ckptturbo-cluster-s3-",
                                          dir="/dev/shm" if os.path.isdir("/dev/shm")
                                          else self.scratch)
            self._store = Store(self.store_host, self._data, profile.first_byte_s,
                                profile.conn_rate)
            self._pids += [self._store.server_pid, self._store.keeper_pid]
        except BaseException:
            self.close()
            raise
        log.info("cluster: %d nodes x %d ranks, node link %.1f MB/s (store share %.2f MB/s), "
                 "store link %.1f MB/s, %.2f MB/s per connection, %.0f ms first byte",
                 nodes, profile.ranks_per_node, profile.node_rate / MB, profile.store_rate / MB,
                 profile.store_rate * nodes / MB, profile.conn_rate / MB,
                 profile.first_byte_s * 1e3)

    @property
    def store(self) -> Store:
        assert self._store is not None
        return self._store

    def ranks(self, world: int, then: Callable[[int], None] | None = None) -> OnNode:
        """Rank placement for ``world`` ranks, ``ranks_per_node`` on each node from node 0."""
        per = self.profile.ranks_per_node
        if world > per * len(self.nodes):
            raise ValueError(f"{world} ranks do not fit {len(self.nodes)} nodes of {per}")
        return OnNode(self.nodes, per, then)

    def counters(self) -> dict[str, str]:
        """The files that count each link's bytes, readable from any namespace: ``store_out``
        (bytes the store sent), ``store_in``, and ``nodeI_in``/``nodeI_out``."""
        assert self._hosts is not None
        base = "/sys/class/net/{}/statistics/{}_bytes"
        out = {"store_out": base.format(self.store_host.link, "rx"),
               "store_in": base.format(self.store_host.link, "tx")}
        for i, node in enumerate(self.nodes):
            out[f"node{i}_in"] = base.format(node.link, "tx")
            out[f"node{i}_out"] = base.format(node.link, "rx")
        return out

    def leftovers(self, wait_s: float = 10.0) -> list[str]:
        """What of the cluster still exists after :meth:`close` (nothing, or a bug); the
        kernel removes a namespace's veth pairs shortly after the namespace, so this waits
        up to ``wait_s`` for them."""
        deadline = time.monotonic() + wait_s
        while True:
            left = [f"namespace {n}" for n in self._names if (netns._NETNS_DIR / n).exists()]
            left += [f"link {n}" for n in self._links if os.path.exists(f"/sys/class/net/{n}")]
            left += [f"process {pid}" for pid in self._pids if _alive(pid)]
            left += [f"directory {d}" for d in (self.scratch, self._data)
                     if d and os.path.exists(d)]
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.1)

    def close(self) -> None:
        if self._store is not None:
            self._store.stop()
            self._store = None
        if self._hosts is not None:
            self._hosts.close()
            self._hosts = None
        shutil.rmtree(self.scratch, ignore_errors=True)
        if self._data:  # the store removes it when it stops; not if it never started
            shutil.rmtree(self._data, ignore_errors=True)
        signal.signal(signal.SIGTERM, self._previous)

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _raise_interrupt(signum: int, frame: types.FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _mbit(rate: float) -> float:
    return round(rate * 8 / 1e6, 3)


def read_counters(files: dict[str, str]) -> dict[str, int]:
    out = {}
    for name, path in files.items():
        with open(path) as f:
            out[name] = int(f.read())
    return out


# --------------------------------------------------------------------------- physical limits
@dataclass(frozen=True)
class Limit:
    """The least time a scenario can take on the topology: ``nbytes`` over ``link`` at
    ``rate``, the slowest of the links it must use."""

    seconds: float
    link: str
    nbytes: int

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def slowest(*candidates: tuple[str, float, float]) -> Limit:
    """Of (link, payload bytes it must carry, its rate), the one that takes longest."""
    link, nbytes, rate = max(candidates, key=lambda c: c[1] / c[2])
    return Limit(nbytes / (rate * GOODPUT), link, int(nbytes))


def save_limit(p: Profile, unique: int, nodes: int) -> Limit:
    """A save writes every unique byte to the store once; at best each node sends an equal
    share over its store share, the store's link taking them all."""
    return slowest(("node -> store share", unique / nodes, p.store_rate),
                   ("store link", unique, p.store_rate * nodes))


def whole_load_limit(p: Profile, unique: int, nodes: int) -> Limit:
    """Every rank needs every byte: the store sends each byte once at least (its nodes'
    shares together), and every node takes in the whole state over its link."""
    return slowest(("store -> nodes' shares", unique, p.store_rate * nodes),
                   ("node link (in)", unique if nodes > 1 else 0, p.node_rate))


def sharded_load_limit(p: Profile, unique: int, nodes: int) -> Limit:
    """Each node reads its own shards (unique / nodes) from the store over its share."""
    return slowest(("node <- store share", unique / nodes, p.store_rate),
                   ("store link", unique, p.store_rate * nodes))


def recovery_limit(p: Profile, lost_bytes: int) -> Limit:
    """The lost node's shards come back from its peers over its own link."""
    return slowest(("lost node's link (in)", lost_bytes, p.node_rate))


def stream_limit(p: Profile, unique: int) -> Limit:
    """One node reads the model once over the node's store share: one process, or the
    tensor-parallel workers of one vLLM engine, which need its unique bytes once at least
    however many of them read."""
    return slowest(("node <- store share", unique, p.store_rate))
