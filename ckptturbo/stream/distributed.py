"""Read once across ranks: each range is read from storage by one rank and chain-broadcast.

When N ranks load the same model, reading it N times makes storage the bottleneck and
multiplies the bill. Here rank 0 lists the files and fetches the headers (once), and
sends the description to the others; every rank then cuts the same reads, and the
read-once engine (:mod:`ckptturbo.readonce`) gives each one reader, balanced by bytes
within each batch by :func:`ckptturbo.plan.plan_reads` so all ranks read at once, and
forwards it along a chain of all ranks. Every rank yields every tensor, in the same
order, while storage serves each byte once (ranges inside rank 0's header GETs are
headed by rank 0 and forwarded from those bytes).

Memory: reads move in batches of about an eighth of ``memory_limit``. Before a batch the
engine reserves its bytes in the stream's budget (waiting for the consumer to free
earlier ranges); a delivered range keeps that reservation until the consumer releases it
(the broadcaster hands over its buffer, so nothing is copied). The broadcaster's
assembly buffers are reserved once, up front.

All ranks must pass the same arguments and consume the whole stream: a rank that stops
early leaves the others waiting in the broadcast until its ``timeout`` (CommunicationError).
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from .. import errors
from ..groups import host_transport_group
from ..plan import ChainAssignment, ReadNeed, plan_reads
from ..prefetch import MemoryBudget, Read
from ..readonce import ChainSettings, ReadOnce
from ..runtime import default_runtime
from .format import parse_header
from .headers import StreamFile
from .source import ByteSource, FileEntry

log = logging.getLogger(__name__)
BROADCAST_INFLIGHT = 2
BROADCAST_TIMEOUT = 300.0
BROADCAST_PIECE_MIN, BROADCAST_PIECE_MAX = 1 << 20, 8 << 20
UNBOUNDED = 1 << 62  # head reads are reserved per batch, not again by the prefetcher


def stream_group(group: Any) -> tuple[Any, int]:
    """The group bytes are forwarded on, and its size: ``group`` itself when it carries
    host memory (gloo), else a gloo group over the same ranks (an NCCL group of
    tensor-parallel workers), created once. Every rank of ``group`` calls this."""
    if group is None or not dist.is_initialized():
        return None, 1
    transport = host_transport_group(group, purpose="stream", keeper=default_runtime())
    return transport, dist.get_world_size(transport)


def describe_collectively(group: Any, describe: Callable[[], list[StreamFile]],
                          source: ByteSource) -> list[StreamFile]:
    """Rank 0 lists and reads headers (``describe``); the others get its result (or its error)."""
    payload: dict[str, Any] = {}
    files: list[StreamFile] = []
    failure: Exception | None = None
    if dist.get_rank(group) == 0:
        try:
            files = describe()
            payload = {"files": [(f.entry.path, f.entry.size, f.entry.mtime, f.raw) for f in files]}
        except Exception as exc:  # noqa: BLE001 - sent to the other ranks, then re-raised
            payload, failure = {"error": (type(exc).__name__, str(exc))}, exc
    obj = [payload]
    dist.broadcast_object_list(obj, group_src=0, group=group)
    if failure is not None:
        raise failure
    payload = obj[0]
    if "error" in payload:
        name, message = payload["error"]
        cls = getattr(errors, name, errors.CkptTurboError)
        if not (isinstance(cls, type) and issubclass(cls, errors.CkptTurboError)):
            cls = errors.CkptTurboError
        raise cls(f"rank 0 failed to describe the model: {message}")
    if files:
        return files
    out = []
    for path, size, mtime, raw in payload["files"]:
        entry = FileEntry(path, size, mtime)
        out.append(StreamFile(entry, parse_header(raw, source.url_of(entry), file_size=size), raw))
    source.register([f.entry for f in out])
    return out


def broadcast_piece(reads: Sequence[Read], piece: int) -> int:
    """The pieces chains forward reads in: about a quarter of the largest read, within
    [1 MiB, 8 MiB] (and ``piece``). A head forwards a read once it has all of it, and a
    chain of L ranks delivers a read of n pieces after n + L - 1 piece-steps: a read of one
    piece crosses every hop whole, one after the other (a 4 MiB read down 8 ranks of a
    250 MB/s fabric: 0.11 s, against 0.04 s in 1 MiB pieces); smaller pieces than 1 MiB
    cost more per-message overhead than they save."""
    largest = max((r.size for r in reads), default=0)
    return max(1, min(piece, BROADCAST_PIECE_MAX, max(BROADCAST_PIECE_MIN, largest // 4)))


def _key(read: Read) -> str:
    return f"{read.index:012d}"  # sorts like the index: plan_reads orders by key


class ReadOnceFeed:
    """Fills every rank's reads: its own from storage, the others' from peers.

    Serves the stream like a prefetcher (``at_file``/``wait``/``release``/``close``).
    ``tails`` (rank 0 only) are reads already held from header GETs, reserved in budget.
    """

    def __init__(self, group: Any, reads: list[Read], source: ByteSource, budget: MemoryBudget,
                 piece: int, streams: int, tails: dict[int, bytes]) -> None:
        self.group = group
        self.world = dist.get_world_size(group)
        self.budget = budget
        self.source = source
        self.reads = {r.index: r for r in reads}
        self.tails = tails
        self._closed = False
        self.static = BROADCAST_INFLIGHT * piece  # the broadcaster's assembly buffers
        # limit = tails (1/4) + broadcaster (2 pieces = 1/4) + CUDA staging (<= 1/4)
        #         + one batch delivered (<= 1/8)
        batches = self._batches(reads, max(piece, budget.limit // 8), self._tail_heads())
        self.engine = ReadOnce(
            batches, group=group, fetch=self._fetch, deliver=self._deliver, done=self._done,
            submit=source.store.submit, budget=MemoryBudget(UNBOUNDED), streams=streams,
            reserve=self._reserve,
            settings=ChainSettings(broadcast_piece(reads, piece), BROADCAST_INFLIGHT,
                                   BROADCAST_TIMEOUT))

    def _tail_heads(self) -> set[int]:
        """Only rank 0 knows which reads it serves from its header GETs: it tells the others."""
        obj = [sorted(self.tails)]
        dist.broadcast_object_list(obj, group_src=0, group=self.group)
        return set(obj[0])

    def _batches(self, reads: list[Read], batch_bytes: int,
                 tail_heads: set[int]) -> list[list[ChainAssignment]]:
        """Consecutive reads of about ``batch_bytes``, each batch balanced over the ranks;
        reads inside rank 0's header GETs are headed by rank 0. The same on every rank."""
        everyone = tuple(range(self.world))
        groups: list[list[Read]] = []
        size = batch_bytes
        for r in reads:
            if size + r.size > batch_bytes:
                groups.append([])
                size = 0
            groups[-1].append(r)
            size += r.size
        batches = []
        for group in groups:
            fixed = [ChainAssignment(_key(r), r.size, everyone)
                     for r in group if r.index in tail_heads]
            needs = [ReadNeed(_key(r), r.size, everyone)
                     for r in group if r.index not in tail_heads]
            batches.append(sorted(fixed + plan_reads(needs, self.world), key=lambda a: a.chunk))
        return batches

    def _reserve(self, batch: Sequence[ChainAssignment]) -> bool:
        need = sum(a.nbytes for a in batch)
        if not self.budget.acquire(need, cancelled=lambda: self._closed):
            return False
        for a in batch:
            self.reads[int(a.chunk)].reserved = True
        return True

    def _fetch(self, key: str) -> bytes | bytearray | memoryview:
        index = int(key)
        if index in self.tails:
            data = self.tails.pop(index)
            self.budget.release(len(data))  # now counted in its batch's reservation
            return data
        return self.source.fetch(self.reads[index])

    def _deliver(self, key: str, data: torch.Tensor) -> None:
        self.reads[int(key)].fill(data.numpy().data)  # host buffers: see stream_group

    def _done(self, error: BaseException | None) -> None:
        if error is None:
            return
        log.debug("stream read-once pass failed: %s", error)
        for read in self.reads.values():
            if not read.done.is_set():
                read.fail(error)

    def start(self) -> None:
        self.budget.acquire(self.static)
        self.engine.start()

    def at_file(self, file_index: int) -> None:
        """Batches, not files, bound what is in flight here."""

    def wait(self, read: Read) -> bytes | bytearray | memoryview:
        return read.result()

    def release(self, read: Read) -> None:
        if not read.released:
            read.released = True
            read.data = None
            if read.reserved:
                self.budget.release(read.size)

    def close(self) -> None:
        self._closed = True
        self.engine.close()
        if self.engine.running:
            return  # it may still fill reads: leave their reservations alone
        for read in self.reads.values():
            self.release(read)
        for index in list(self.tails):
            self.budget.release(len(self.tails.pop(index)))
        if self.static:
            self.budget.release(self.static)
            self.static = 0
