"""Read once across ranks: each range is read from storage by one rank and chain-broadcast.

When N ranks load the same model, reading it N times makes storage the bottleneck and
multiplies the bill. Here rank 0 lists the files (once) and sends the list to the
others; the ranks fetch the headers, each a share of the files spread over the group, and
exchange them; every rank then cuts the same reads, and the read-once engine
(:mod:`ckptturbo.readonce`) gives each one reader, balanced by bytes within each batch by
:func:`ckptturbo.plan.plan_reads` so all ranks read at once, and forwards it along a
chain of all ranks. Every rank yields every tensor, in the same order, while storage
serves each byte once (ranges inside a header GET are headed by the rank that made it
and forwarded from those bytes).

Headers are spread because no rank reads data before every header is known: a model of
many files described by rank 0 alone waits on one node's link and its ``streams``
requests (a 163-file model's header GETs in ten rounds), and the probes' data tails are
bytes one node reads while the others wait.

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
from concurrent.futures import Future
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from .. import errors
from ..agreement import gather
from ..errors import CkptTurboError
from ..groups import host_transport_group
from ..plan import ChainAssignment, ReadNeed, plan_reads
from ..prefetch import MemoryBudget, Read
from ..readonce import ChainSettings, ReadOnce, chain_piece
from ..runtime import default_runtime
from .format import parse_header
from .headers import StreamFile
from .source import ByteSource, FileEntry

log = logging.getLogger(__name__)
BROADCAST_INFLIGHT = 2
BROADCAST_TIMEOUT = 300.0
BROADCAST_PIECE_MAX = 8 << 20
UNBOUNDED = 1 << 62  # head reads are reserved per batch, not again by the prefetcher
WeightMap = dict[str, str] | None  # an index's tensor -> file map
Listing = tuple[list[FileEntry], WeightMap]
Announce = Callable[[list[FileEntry]], None]  # called by rank 0 with the candidate files
Failure = tuple[str, str, str]  # what failed, the exception's name, its message


def stream_group(group: Any) -> tuple[Any, int]:
    """The group bytes are forwarded on, and its size: ``group`` itself when it carries
    host memory (gloo), else a gloo group over the same ranks (an NCCL group of
    tensor-parallel workers), created once. Every rank of ``group`` calls this."""
    if group is None or not dist.is_initialized():
        return None, 1
    transport = host_transport_group(group, purpose="stream", keeper=default_runtime())
    return transport, dist.get_world_size(transport)


def header_rank(index: int, files: int, world: int) -> int:
    """The rank that fetches the header of file ``index`` of ``files``: the files spread
    evenly over the ranks in order (4 files on 8 ranks: ranks 0, 2, 4, 6; 16 on 8: two
    each), so that where ranks fill nodes in order the header GETs spread over the nodes."""
    return index * world // files


class _Described(NamedTuple):
    """What each rank sends in the headers' exchange."""

    headers: dict[int, tuple[bytes, int]]  # candidate -> (its header, its kept tail's end or 0)
    failed: dict[int, Failure]  # candidate -> why its header could not be read
    listing_failed: Failure | None  # rank 0's, after it had sent the candidates
    final: tuple[list[str], WeightMap] | None  # rank 0's: the paths of the files read, the map


def describe_collectively(group: Any, list_entries: Callable[[Announce], Listing],
                          header: Callable[[FileEntry], StreamFile], source: ByteSource,
                          submit: Callable[..., Future], budget: MemoryBudget,
                          ) -> tuple[list[StreamFile], WeightMap]:
    """Rank 0 lists the files (``list_entries``) and sends the candidates as soon as it
    knows them: a directory's files before its index is read (``list_entries`` calls the
    announce it is given), else the final list. Each rank fetches the headers of its share
    of the candidates (``header``, on ``submit``; see :func:`header_rank`) while rank 0
    reads the index; then every rank gets every header and rank 0's final list (the files
    an index selects). A rank's own files keep their header GETs' data tails (reserved in
    ``budget``; released for files the index leaves out). A failure on any rank (listing,
    a header) is raised on every rank."""
    me, world = dist.get_rank(group), dist.get_world_size(group)
    candidates: list[FileEntry] = []
    futures: dict[int, Future] = {}
    announced: list[bool] = []  # rank 0: the candidates are sent (there may be none)

    def start(entries: list[FileEntry]) -> None:
        """This rank's header GETs of the candidates, started."""
        candidates.extend(entries)
        source.register(entries)
        futures.update((i, submit(header, e)) for i, e in enumerate(entries)
                       if header_rank(i, len(entries), world) == me)

    def announce(entries: list[FileEntry]) -> None:
        dist.broadcast_object_list([{"entries": [(e.path, e.size, e.mtime) for e in entries]}],
                                   group_src=0, group=group)
        announced.append(True)
        start(entries)  # rank 0's share goes out while it reads the index

    listing: Listing | None = None
    failure: Exception | None = None  # rank 0's listing's
    if me == 0:
        try:
            listing = list_entries(announce)
        except Exception as exc:  # noqa: BLE001 - sent to the other ranks, then re-raised
            failure = exc
            if not announced:  # the others wait for the candidates: send the error instead
                dist.broadcast_object_list([{"error": _failure(exc, "list the model")}],
                                           group_src=0, group=group)
                raise
        if not announced and listing is not None:
            announce(listing[0])
    else:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, group_src=0, group=group)
        if "error" in box[0]:
            raise _remote_error(box[0]["error"], 0)
        start([FileEntry(*e) for e in box[0]["entries"]])
    fetched: dict[int, StreamFile] = {}
    failed: dict[int, Exception] = {}
    for i, fut in futures.items():
        try:
            fetched[i] = fut.result()
        except Exception as exc:  # noqa: BLE001 - sent to the other ranks, then re-raised
            failed[i] = exc
    mine = _Described({i: (f.raw, f.probe_end if f.tail else 0) for i, f in fetched.items()},
                      {i: _failure(e, "read a header") for i, e in failed.items()},
                      None if failure is None else _failure(failure, "list the model"),
                      None if listing is None else ([e.path for e in listing[0]], listing[1]))
    described: list[Any] = gather(group, mine)
    lead: _Described = described[0]
    at = {e.path: i for i, e in enumerate(candidates)}
    # an index names files of the listing; the header of a file it leaves out may fail:
    # that file is not read
    chosen = [at[path] for path in lead.final[0]] if lead.final is not None else []
    for i in fetched.keys() - set(chosen):  # the kept tails of files that will not be read
        budget.release(len(fetched[i].tail or b""))
    if lead.listing_failed is not None:  # rank 0 failed after sending the candidates
        raise failure if failure is not None else _remote_error(lead.listing_failed, 0)
    files = []
    for i in chosen:
        if i in failed:
            raise failed[i]
        rank = header_rank(i, len(candidates), world)
        if i in described[rank].failed:
            raise _remote_error(described[rank].failed[i], rank)
        raw, end = described[rank].headers[i]
        f = fetched[i] if i in fetched else StreamFile(
            candidates[i], parse_header(raw, source.url_of(candidates[i]),
                                        file_size=candidates[i].size), raw)
        f.held = (rank, end) if end else None
        files.append(f)
    return files, lead.final[1] if lead.final is not None else None


def _failure(exc: Exception, what: str) -> Failure:
    return what, type(exc).__name__, str(exc)


def _remote_error(error: Failure, rank: int) -> CkptTurboError:
    """Another rank's failure, as ckptturbo's exception of the same name where there is one."""
    what, name, message = error
    cls = getattr(errors, name, CkptTurboError)
    if not (isinstance(cls, type) and issubclass(cls, CkptTurboError)):
        cls = CkptTurboError
    return cls(f"rank {rank} failed to {what}: {message}")


def _rotated(ranks: tuple[int, ...], head: int) -> tuple[int, ...]:
    """The chain of all ``ranks`` (ascending) that starts at ``head``: a rotation."""
    return ranks[head:] + ranks[:head]


def _key(read: Read) -> str:
    return f"{read.index:012d}"  # sorts like the index: plan_reads orders by key


class ReadOnceFeed:
    """Fills every rank's reads: its own from storage, the others' from peers.

    Serves the stream like a prefetcher (``at_file``/``wait``/``release``/``close``).
    ``tails`` are the reads this rank already holds from its header GETs, reserved in
    budget; ``heads`` gives every such read of every rank (read index -> the rank that
    holds it and heads its chain; the same on every rank).
    """

    def __init__(self, group: Any, reads: list[Read], source: ByteSource, budget: MemoryBudget,
                 piece: int, streams: int, tails: dict[int, bytes],
                 heads: dict[int, int]) -> None:
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
        batches = self._batches(reads, max(piece, budget.limit // 8), heads)
        self.engine = ReadOnce(
            batches, group=group, fetch=self._fetch, deliver=self._deliver, done=self._done,
            submit=source.store.submit, budget=MemoryBudget(UNBOUNDED), streams=streams,
            reserve=self._reserve,
            settings=ChainSettings(
                chain_piece(max((r.size for r in reads), default=0),
                            min(piece, BROADCAST_PIECE_MAX)),
                BROADCAST_INFLIGHT, BROADCAST_TIMEOUT))

    def _batches(self, reads: list[Read], batch_bytes: int,
                 tail_heads: dict[int, int]) -> list[list[ChainAssignment]]:
        """Consecutive reads of about ``batch_bytes``, each batch balanced over the ranks;
        a read inside a header GET is headed by the rank that made it. The same on every
        rank."""
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
            fixed = [ChainAssignment(_key(r), r.size, _rotated(everyone, tail_heads[r.index]))
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
