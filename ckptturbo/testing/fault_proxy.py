"""FaultProxy: a loopback HTTP proxy in front of an S3 server that adds latency, caps
bandwidth, counts bytes and injects storage faults, reproducibly from a seed.

On one machine SeaweedFS answers every request in a millisecond and never fails, which
hides what matters for checkpoints on object stores: round trips, per-connection
bandwidth, and the errors, resets, stalls and corrupt bodies that real stores produce.
The benchmarks put this proxy in front of the embedded server to measure like a remote
store; the reliability tests put it there to prove that ckptturbo retries, times out and
verifies as it claims.

Use::

    from ckptturbo.testing import embedded_s3
    from ckptturbo.testing.fault_proxy import Faults, FaultProxy, Outage

    with embedded_s3.running() as server, FaultProxy(server.endpoint, seed=7,
            faults=Faults(slow_down=0.05, truncate=0.05), latency_s=0.03) as proxy:
        options = proxy.storage_options(server.storage_options)   # fsspec/s3fs options
        ...                                                        # use the store
        proxy.set_outage(Outage.BLACK_HOLE)                        # a partition, until
        proxy.set_outage(Outage.NONE)                              # switched off again
        proxy.stats()   # ProxyStats: requests, bytes each way, peak in flight, faults
        proxy.events()  # FaultEvent per injected fault: method, target, kind, offset

Per request, one fault at most is drawn from :class:`Faults` (rates in [0, 1], summing
to at most 1):

* ``error_500``: ``500 InternalError``; ``slow_down``: ``503 SlowDown`` (S3 XML bodies).
* ``reset``: the connection is reset (RST) as soon as the request head arrives.
* ``black_hole``: the request is read and never answered (the client's read timeout).
* ``stall_upload``: part-way through the request body the proxy stops reading and
  forwarding and stays silent (mid-upload partition); requests without a body pass.
* ``stall_download``: part-way through the response body the proxy stops sending and
  stays silent, the connection open (mid-download partition).
* ``truncate``: the response body is cut short and the connection closed.
* ``flip_byte``: one byte of the response body is inverted (a client that validates
  response checksums, as recent botocore does by default, reports a checksum mismatch).
* ``flip_upload``: one byte of the request body is inverted on its way to the store
  (a store that checks the body's signature or checksum refuses it; one that does not
  keeps the damaged object).

Response faults apply only to responses with a body; the offset where a body fault acts
is drawn uniformly in the body (in the first chunk of a chunked body). ``Faults.methods``
and ``Faults.path_contains`` restrict faults to matching requests.

Reproducible: the draw for a request depends only on the seed, the request (method,
path, query without ``uploadId``, Range) and how many identical requests came before it,
not on timing or on the interleaving of concurrent connections (only identical requests
in flight at once may swap their draws). A retried request is a new draw, so retries get
through at rates below 1.

Outages (:class:`Outage`), switchable while running, apply to every request: ``SLOW_DOWN``
answers 503, ``REFUSE`` closes the listening port (connection refused; open connections
are reset at their next request), ``BLACK_HOLE`` accepts and never answers.
``set_outage`` returns once the port is as the outage says (closed, or listening again).

``latency_s`` delays every request before it is forwarded (a first-byte round trip);
``conn_rate`` caps each connection in each direction (bytes/s). Everything binds
127.0.0.1 and the upstream must be on loopback. ``stop()`` (or leaving the ``with``)
closes every connection and joins every thread: each loop here ends on its socket's end
or on stop. To keep a benchmark's process free of the proxy's work, run it in its own
process with :class:`ckptturbo.testing.proxy_process.ProxyProcess`.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import random
import socket
import threading
from dataclasses import dataclass
from enum import Enum
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit

from .proxy_conn import Connection

log = logging.getLogger(__name__)

FAULT_KINDS = ("error_500", "slow_down", "reset", "black_hole", "stall_upload",
               "stall_download", "truncate", "flip_byte", "flip_upload")


@dataclass(frozen=True)
class Faults:
    """Per-request fault rates (see the module docstring for what each does)."""

    error_500: float = 0.0
    slow_down: float = 0.0
    reset: float = 0.0
    black_hole: float = 0.0
    stall_upload: float = 0.0
    stall_download: float = 0.0
    truncate: float = 0.0
    flip_byte: float = 0.0
    flip_upload: float = 0.0
    methods: tuple[str, ...] = ()  # only requests with one of these methods (empty: all)
    path_contains: str = ""  # only requests whose path contains this
    limit: int = 0  # at most this many faults in all, then requests pass (0: no limit)

    def __post_init__(self) -> None:
        rates = [getattr(self, k) for k in FAULT_KINDS]
        if any(r < 0 or r > 1 for r in rates) or sum(rates) > 1 + 1e-9:
            raise ValueError(f"fault rates must be in [0, 1] and sum to at most 1: {self}")

    def applies(self, method: str, path: str) -> bool:
        return ((not self.methods or method in self.methods)
                and self.path_contains in path)

    def pick(self, u: float) -> str | None:
        """The fault whose slice of [0, 1) holds ``u``, or None."""
        for kind in FAULT_KINDS:
            u -= getattr(self, kind)
            if u < 0:
                return kind
        return None


class Outage(str, Enum):
    NONE = "none"
    SLOW_DOWN = "slow_down"
    REFUSE = "refuse"
    BLACK_HOLE = "black_hole"


@dataclass(frozen=True)
class Decision:
    """What happens to one request: a fault kind (or None) and where in a body it acts."""

    fault: str | None
    fraction: float  # the body offset as a fraction of the body's length

    def offset(self, size: int) -> int:
        return min(size - 1, int(self.fraction * size)) if size > 0 else 0


@dataclass(frozen=True)
class FaultEvent:
    method: str
    target: str
    fault: str
    offset: int | None = None  # where in a body a body fault acted


@dataclass
class ProxyStats:
    requests: int = 0
    connections: int = 0
    bytes_down: int = 0  # sent to clients (responses, headers included)
    bytes_up: int = 0  # sent to the server (requests, headers included)
    in_flight: int = 0  # requests whose response has not been fully sent yet
    peak_in_flight: int = 0
    faults: dict[str, int] = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def with_endpoint(options: dict[str, Any], endpoint: str) -> dict[str, Any]:
    """A copy of s3fs/fsspec ``options`` that reaches ``endpoint`` instead."""
    out = dict(options)
    out["client_kwargs"] = {**options.get("client_kwargs", {}), "endpoint_url": endpoint}
    return out


def request_key(method: str, target: str, range_header: str) -> str:
    """What identifies "the same request" across runs: uploadId is random per upload."""
    parts = urlsplit(target)
    query = urlencode(sorted((k, v) for k, v in parse_qsl(parts.query, keep_blank_values=True)
                             if k != "uploadId"))
    return f"{method} {parts.path}?{query} {range_header}"


class FaultProxy:
    """The proxy (threads in this process); see the module docstring."""

    def __init__(self, upstream: str, *, seed: int = 0, faults: Faults | None = None,
                 latency_s: float = 0.0, conn_rate: float = 0.0, port: int = 0) -> None:
        parts = urlsplit(upstream if "//" in upstream else f"http://{upstream}")
        if parts.hostname not in ("127.0.0.1", "localhost") or parts.port is None:
            raise ValueError(f"the proxy forwards to a loopback host:port only, not {upstream!r}")
        self.upstream = ("127.0.0.1", parts.port)
        self.seed = seed
        self.latency_s = latency_s
        self.conn_rate = conn_rate
        self._faults = faults or Faults()
        self._outage = Outage.NONE
        self._lock = threading.Lock()
        self._stats = ProxyStats()
        self._events: collections.deque[FaultEvent] = collections.deque(maxlen=100_000)
        self._seen: collections.Counter[str] = collections.Counter()
        self._decided_faults = 0  # for Faults.limit
        self.stopping = threading.Event()
        self._conns: set[Connection] = set()
        self._port_changed = threading.Condition()  # the listener was closed or opened
        listener = self._listen(port)
        self._listener: socket.socket | None = listener
        self.port = listener.getsockname()[1]
        self._acceptor = threading.Thread(target=self._accept_loop, daemon=True,
                                          name=f"fault-proxy-{self.port}")
        self._started = False

    # ------------------------------------------------------------------ lifecycle
    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def storage_options(self, options: dict[str, Any]) -> dict[str, Any]:
        """A copy of s3fs/fsspec ``options`` with the endpoint replaced by this proxy."""
        return with_endpoint(options, self.endpoint)

    def start(self) -> FaultProxy:
        if not self._started:
            self._started = True
            self._acceptor.start()
        return self

    def stop(self) -> None:
        """Close the port and every connection, and wait for every thread to end."""
        self.stopping.set()
        if self._started:
            self._acceptor.join(timeout=10)
        self.close_listener()
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            conn.shutdown()
        for conn in conns:
            conn.join(timeout=10)

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # ------------------------------------------------------------------ control
    def set_faults(self, faults: Faults) -> None:
        self._faults = faults

    def set_outage(self, outage: Outage | str, timeout: float = 10.0) -> None:
        """Switch the outage; once started, return only when the port is as it says: closed
        for ``REFUSE``, listening again for the others (the accept loop acts within 0.2 s),
        so that a caller can test the outage at once instead of sleeping first."""
        self._outage = Outage(outage)
        log.info("fault proxy %d: outage %s", self.port, self._outage.value)
        listening = self._outage is not Outage.REFUSE
        with self._port_changed:
            ready = self._port_changed.wait_for(
                lambda: (self._listener is not None) == listening or not self._started
                or self.stopping.is_set(), timeout)
        if not ready:
            raise TimeoutError(f"fault proxy {self.port}: the port is not "
                               f"{'listening' if listening else 'closed'} after {timeout}s")

    @property
    def outage(self) -> Outage:
        return self._outage

    def stats(self) -> ProxyStats:
        with self._lock:
            return dataclasses.replace(self._stats, faults=dict(self._stats.faults))

    def reset_stats(self) -> None:
        """Zero the counters (connections and requests in flight stay counted as such)."""
        with self._lock:
            self._stats = ProxyStats(in_flight=self._stats.in_flight,
                                     peak_in_flight=self._stats.in_flight)

    def events(self) -> list[FaultEvent]:
        with self._lock:
            return list(self._events)

    # ------------------------------------------------------------------ used by Connection
    def decide(self, method: str, target: str, range_header: str) -> Decision:
        """Draw this request's fate (outages first, then the fault rates)."""
        with self._lock:
            self._stats.requests += 1
            self._stats.in_flight += 1
            self._stats.peak_in_flight = max(self._stats.peak_in_flight, self._stats.in_flight)
        outage = self._outage
        if outage is not Outage.NONE:
            return Decision({Outage.SLOW_DOWN: "slow_down", Outage.REFUSE: "reset",
                             Outage.BLACK_HOLE: "black_hole"}[outage], 0.0)
        faults = self._faults
        if not faults.applies(method, urlsplit(target).path):
            return Decision(None, 0.0)
        key = request_key(method, target, range_header)
        with self._lock:
            nth = self._seen[key]
            self._seen[key] += 1
            rng = random.Random(f"{self.seed}|{key}|{nth}")
            fault = faults.pick(rng.random())
            if fault is not None and faults.limit:
                if self._decided_faults >= faults.limit:
                    fault = None
                else:
                    self._decided_faults += 1
        return Decision(fault, rng.random())

    def record(self, method: str, target: str, fault: str, offset: int | None = None) -> None:
        with self._lock:
            self._stats.faults[fault] = self._stats.faults.get(fault, 0) + 1
            self._events.append(FaultEvent(method, target, fault, offset))
        log.debug("fault proxy %d: %s on %s %s", self.port, fault, method, target)

    def finished(self, n: int = 1) -> None:
        with self._lock:
            self._stats.in_flight -= n

    def count(self, down: int = 0, up: int = 0) -> None:
        with self._lock:
            self._stats.bytes_down += down
            self._stats.bytes_up += up

    def forget(self, conn: Connection) -> None:
        with self._lock:
            self._conns.discard(conn)

    # ------------------------------------------------------------------ accepting
    def _listen(self, port: int) -> socket.socket:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        sock.listen(1024)
        sock.settimeout(0.2)  # the accept loop looks at `stopping` and the outage this often
        return sock

    def close_listener(self) -> None:
        """Close the listening socket: new connections are refused (the accept loop opens
        it again on the same port unless the outage is REFUSE or the proxy stops)."""
        if self._listener is not None:
            self._listener.close()
            with self._port_changed:
                self._listener = None
                self._port_changed.notify_all()

    def _accept_loop(self) -> None:
        while not self.stopping.is_set():
            if self._outage is Outage.REFUSE:
                self.close_listener()  # connects now fail with "connection refused"
                self.stopping.wait(0.05)
                continue
            listener = self._listener
            if listener is None:
                try:
                    listener = self._listen(self.port)
                except OSError as exc:  # the port is briefly unavailable: try again
                    log.warning("fault proxy: cannot listen on %d again yet: %s", self.port, exc)
                    self.stopping.wait(0.1)
                    continue
                with self._port_changed:
                    self._listener = listener
                    self._port_changed.notify_all()
            try:
                client, _ = listener.accept()
            except (TimeoutError, OSError):
                continue
            client.setblocking(True)
            try:
                server = socket.create_connection(self.upstream, timeout=10)
            except OSError as exc:
                log.warning("fault proxy: upstream %s unreachable: %s", self.upstream, exc)
                client.close()
                continue
            server.setblocking(True)
            conn = Connection(self, client, server)
            with self._lock:
                self._conns.add(conn)
                self._stats.connections += 1
            conn.start()
