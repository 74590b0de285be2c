"""Several hosts on one machine, for tests of what crosses a network between nodes.

Each host is a network namespace with its own interface (``eth0``), address and host
name, joined by a veth pair to a bridge in the caller's namespace. On loopback every
"node" of a test shares one interface and one address, so code that quietly assumed a
local peer (an address, a host name, a shared socket) would pass; here a memory tier's
replicas and a recovery's chunks really travel between interfaces, a host's link can be
cut like a failed switch port, and the byte counters of each link show what crossed it.

Addresses are link-local (169.254.0.0/16): never routed off this machine, and the
namespaces have no route but the bridge. Services the hosts must reach (an S3 server)
bind to :attr:`VirtualHosts.gateway`, the bridge's address in the caller's namespace.
Needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN) and iproute2's ``ip``.
"""
from __future__ import annotations

import ctypes
import itertools
import logging
import os
import shutil
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

_CLONE_NEWNET = 0x40000000
_CLONE_NEWUTS = 0x04000000
_NETNS_DIR = Path("/run/netns")
_created = itertools.count()
INTERFACE = "eth0"


@dataclass(frozen=True)
class Host:
    """One host: its host name, namespace, address, and its link's end on the bridge."""

    name: str
    netns: str
    address: str
    link: str


def available() -> str | None:
    """None when hosts can be made here, else why not (for a test's skip reason)."""
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN and CAP_SYS_ADMIN)"
    return None


def _run(*cmd: str) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise OSError(f"{' '.join(cmd)}: {done.stderr.strip()}")


def _ip(*args: str) -> None:
    _run("ip", *args)


def _libc_call(name: str, *args: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if getattr(libc, name)(*args) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{name}: {os.strerror(err)}")


def enter(host: Host) -> None:
    """Move the calling process (single-threaded: a fresh child) onto ``host``: its network
    namespace, a host name of its own, and gloo bound to the host's interface."""
    fd = os.open(_NETNS_DIR / host.netns, os.O_RDONLY)
    try:
        _libc_call("setns", fd, _CLONE_NEWNET)
    finally:
        os.close(fd)
    _libc_call("unshare", _CLONE_NEWUTS)
    socket.sethostname(host.name)
    os.environ["GLOO_SOCKET_IFNAME"] = INTERFACE


@dataclass(frozen=True)
class RanksOnHosts:
    """``setup`` for :func:`~ckptturbo.testing.launcher.run_distributed`: rank ``r`` runs on
    ``hosts[r // ranks_per_host]`` (picklable, so it reaches the children)."""

    hosts: tuple[Host, ...]
    ranks_per_host: int

    def __call__(self, rank: int) -> None:
        enter(self.hosts[rank // self.ranks_per_host])


class VirtualHosts:
    """``count`` hosts named ``host0``... on one bridge; removed again by :meth:`close`
    (the namespaces take their veth pairs with them)."""

    def __init__(self, count: int) -> None:
        n = next(_created)
        tag = f"ct{os.getpid() % 100000}x{n}"
        subnet = 169, 254, 100 + (os.getpid() + n) % 150
        self.bridge = f"{tag}b"
        self.gateway = ".".join(map(str, (*subnet, 1)))
        self.hosts = tuple(Host(f"host{i}", f"{tag}-host{i}", ".".join(map(str, (*subnet, 10 + i))),
                                f"{tag}v{i}") for i in range(count))
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for host in self.hosts:
                _ip("netns", "add", host.netns)
                _ip("link", "add", host.link, "type", "veth", "peer", "name", INTERFACE,
                    "netns", host.netns)
                _ip("link", "set", host.link, "master", self.bridge, "up")
                _ip("-n", host.netns, "addr", "add", f"{host.address}/24", "dev", INTERFACE)
                _ip("-n", host.netns, "link", "set", INTERFACE, "up")
                _ip("-n", host.netns, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise
        log.info("hosts %s on bridge %s (%s)", [h.address for h in self.hosts], self.bridge,
                 self.gateway)

    def ranks(self, ranks_per_host: int) -> RanksOnHosts:
        return RanksOnHosts(self.hosts, ranks_per_host)

    def cut(self, host: Host) -> None:
        """The host's link goes down: its packets are dropped, no connection is reset."""
        _ip("link", "set", host.link, "down")

    def heal(self, host: Host) -> None:
        _ip("link", "set", host.link, "up")

    def limit(self, host: Host, mbit: float | None) -> None:
        """The host's link carries at most ``mbit`` Mbit/s each way (a token bucket at
        both of its ends), like a slow or congested network; None lifts the limit."""
        ends = (("tc", "qdisc"), ("tc", "-n", host.netns, "qdisc"))
        for end, device in zip(ends, (host.link, INTERFACE), strict=True):
            if mbit is None:
                _run(*end, "del", "dev", device, "root")
            else:
                _run(*end, "replace", "dev", device, "root", "tbf", "rate", f"{mbit}mbit",
                     "burst", "32kb", "latency", "1s")

    def shape(self, host: Host, mbit: float, toward: dict[str, float] | None = None) -> None:
        """The host's link carries at most ``mbit`` Mbit/s each way, and its traffic with
        each address in ``toward`` at most that address's Mbit/s, within the link's rate
        (an HTB tree at both ends: a node's NIC, with its share for the object store).
        :meth:`limit` with None lifts it."""
        ends = (("tc",), ("tc", "-n", host.netns))
        for end, device, match in zip(ends, (host.link, INTERFACE), ("src", "dst"), strict=True):
            _run(*end, "qdisc", "replace", "dev", device, "root", "handle", "1:", "htb",
                 "default", "2", "r2q", "100")
            _run(*end, "class", "replace", "dev", device, "parent", "1:", "classid", "1:1",
                 "htb", "rate", f"{mbit}mbit", "ceil", f"{mbit}mbit")
            classes = [(None, mbit), *(toward or {}).items()]
            for minor, (address, rate) in enumerate(classes, start=2):
                _run(*end, "class", "replace", "dev", device, "parent", "1:1", "classid",
                     f"1:{minor}", "htb", "rate", f"{rate}mbit", "ceil", f"{rate}mbit")
                if address is not None:
                    _run(*end, "filter", "replace", "dev", device, "parent", "1:", "protocol",
                         "ip", "prio", "1", "u32", "match", "ip", match, f"{address}/32",
                         "flowid", f"1:{minor}")

    def bytes_received(self, host: Host) -> int:
        """Bytes the network has delivered to the host (what its link's bridge end sent)."""
        return int(Path(f"/sys/class/net/{host.link}/statistics/tx_bytes").read_text())

    def bytes_sent(self, host: Host) -> int:
        """Bytes the host has sent into the network (what its link's bridge end received)."""
        return int(Path(f"/sys/class/net/{host.link}/statistics/rx_bytes").read_text())

    def close(self) -> None:
        for host in self.hosts:
            if (_NETNS_DIR / host.netns).exists():
                _ip("netns", "del", host.netns)
        if Path(f"/sys/class/net/{self.bridge}").exists():
            _ip("link", "del", self.bridge)

    def __enter__(self) -> VirtualHosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
