"""Read once, forward down chains: the load engine of TurboReader and the distributed streamer.

When N ranks need the same stored bytes, reading them N times makes storage the
bottleneck and multiplies the bill. Here every *unit* (a chunk for TurboReader, a byte
range of a file for the streamer) is read from storage by exactly one rank, the head of
its chain as :func:`ckptturbo.plan.plan_reads` chose it, and
:class:`~ckptturbo.broadcast.ChainBroadcaster` forwards it to every other rank that needs
it, in pipelined pieces.

Division of work. The caller plans: either every rank passes the same batches of
``ChainAssignment`` (the whole job; each rank extracts its own parts), or each rank passes
its own :class:`RankBatch` (its parts of the schedule a coordinator computed once, as
TurboReader does: no rank then holds the plan of the whole job). It says how to read one
unit from storage (``fetch``, which also verifies what it read) and what to do with a
delivered one (``deliver``). The engine, in one background thread per rank, runs the
broadcaster batch by batch; each head reads its units through the one
:class:`~ckptturbo.prefetch.Prefetcher`, in the order the broadcaster will send them
(:func:`~ckptturbo.broadcast_schedule.source_order_of`), ``streams`` at a time within ``budget``.

Units travel in buffers on ``settings.device``: host memory (gloo), or CUDA memory over
NCCL, in which case a head copies what it read to the device through the pinned ring of
:class:`~ckptturbo.staging.DeviceCopier` (asynchronously, on a side stream, while the
prefetcher's GETs go on) and every rank delivers device tensors. Buffers follow the
broadcaster's ownership contract: ``deliver(key, buffer)`` owns the uint8 tensor
``buffer`` from then on (no copy is made); on a host-buffer head it is the buffer
``fetch`` returned, and with ``into`` it is the unit's destination itself. A head's
read-ahead reservation ends when the broadcaster takes the bytes: from then on they are
one of its ``max_inflight`` buffers. (Holding the reservation until the consumer is done
could deadlock: the broadcaster waits for the next source's bytes before it finishes the
transfers that would free the room for them.)

Memory: before each batch the engine calls ``reserve(batch)``, which may block until the
consumer has freed room (and returns False to stop); a caller without its own bound
passes one batch and no ``reserve``, and the prefetcher's budget bounds the read-ahead.

Verification happens where bytes leave storage: ``fetch`` verifies what a head read,
before the first piece goes down the chain, so receivers need not hash again (on GPUs
that would cost a device-to-host copy of every forwarded byte). Failures never break a
chain: a head that cannot read or verify its unit forwards zeros, and a receiver runs
``check`` on every all-zero unit it gets (a scan, far cheaper than a hash), so a failed
head's zeros fail it and name the unit while a genuine all-zero unit passes; with
``check_all`` receivers check every unit (a defence against bytes damaged between
ranks). A receiver whose copy fails keeps forwarding; neither is delivered. Once the pass
is over, ``done`` gets the first failure (the broadcaster's own, such as a dead peer,
first), so no rank is left waiting on a peer that gave up.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .broadcast import ChainBroadcaster
from .broadcast_schedule import (
    Part,
    Transfer,
    needs_communication,
    own_parts,
    plan_digest,
    source_order_of,
)
from .errors import CkptTurboError
from .plan import ChainAssignment
from .prefetch import MemoryBudget, Prefetcher, Read
from .staging import DeviceCopier, as_uint8

log = logging.getLogger(__name__)

Buffer = bytes | bytearray | memoryview
Fetch = Callable[[str], Buffer]
Deliver = Callable[[str, torch.Tensor], None]
Check = Callable[[str, memoryview], None]


PIECE_FLOOR = 512 << 10


def chain_piece(largest: int, cap: int) -> int:
    """The pieces chains forward units in: a quarter of the ``largest`` unit, within
    [512 KiB, ``cap``] (``cap``, the caller's ``piece_size``, wins below the floor).

    A head forwards a unit once it has all of it, and a chain of L ranks delivers a unit of
    n pieces after n + L - 1 piece-steps, so a unit of one piece crosses every hop whole,
    one hop after the other; smaller pieces pipeline the hops but pay each step's
    per-message cost. Measured on the cluster benchmark's 8 ranks over 4 nodes (250 MB/s
    links; 32 units of 2 MiB to every rank, 0.28 s on the wire): 0.66 s in whole units,
    0.59 s in 1 MiB pieces, 0.50 s in 512 KiB; its grouped load of 2 MiB chunks over 4
    nodes, 4.42 s in whole chunks and 4.27 s in 512 KiB pieces. A 64 MiB chunk keeps the
    default 8 MiB."""
    return max(1, min(cap, max(PIECE_FLOOR, largest // 4)))


@dataclass(frozen=True)
class ChainSettings:
    """How units travel; every rank must use the same (the broadcaster checks)."""

    piece_size: int = 8 << 20
    max_inflight: int = 4
    timeout: float = 300.0
    device: torch.device = torch.device("cpu")  # where chain buffers live: "cpu" or a CUDA device


@dataclass(frozen=True)
class RankBatch:
    """One rank's share of one batch: its parts, the unit key of each, and the id of the
    plan they belong to (the same on every rank; None when no transfer communicates)."""

    parts: Sequence[Part]
    keys: dict[int, str]
    plan_id: int | None

    @classmethod
    def of(cls, batch: Sequence[ChainAssignment], rank: int, first_tid: int,
           settings: ChainSettings) -> RankBatch:
        """This rank's share of a batch every rank has whole (tids from ``first_tid``)."""
        transfers = [Transfer(first_tid + i, a.nbytes, a.chain) for i, a in enumerate(batch)]
        parts = own_parts(transfers, rank, settings.piece_size, settings.max_inflight)
        chained = any(needs_communication(t) for t in transfers)
        keys = {first_tid + i: a.chunk for i, a in enumerate(batch)}
        return cls(parts, keys, plan_digest(transfers) if chained else None)


class ReadOnce:
    """One read-once pass over ``batches`` on this rank; see the module docstring.

    Args:
        batches: consecutive groups of units: the same ``ChainAssignment`` lists on every
            rank of ``group``, or each rank's own :class:`RankBatch`.
        group: the process group the chains use (ranks in assignments are group ranks).
        fetch: reads one unit this rank heads from storage, verified; run on ``submit``.
        deliver: gets every unit this rank needs, in the engine's thread, as it arrives.
        done: called once at the end with the first failure, or None.
        submit: runs fetches (the store's pool), ``streams`` at a time.
        budget: bounds the bytes this rank has read ahead for its chains.
        check: verifies a unit received from a peer (None: trust the head's check); run
            on all-zero units, or on every unit with ``check_all`` (a CUDA unit is copied
            to the host for it).
        reserve: called before each batch (with the batch as given); False stops the pass.
        into: where a unit's bytes should end up on this rank (a uint8 tensor of its size on
            the chain's device, its final destination) or None; such a unit is received
            straight into it, and a CUDA head copies its bytes there (a host head's ``fetch``
            reads into host destinations itself). The tensor is what ``deliver`` then gets.
    """

    def __init__(self, batches: Sequence[Sequence[ChainAssignment] | RankBatch], *,
                 group: dist.ProcessGroup | None,
                 fetch: Fetch, deliver: Deliver, done: Callable[[BaseException | None], None],
                 submit: Callable[..., Future], budget: MemoryBudget, streams: int,
                 check: Check | None = None, check_all: bool = False,
                 reserve: Callable[[Any], bool] | None = None,
                 into: Callable[[str], torch.Tensor | None] | None = None,
                 settings: ChainSettings = ChainSettings()) -> None:
        self.rank = dist.get_rank(group)
        self._deliver, self._done, self._check, self._reserve = deliver, done, check, reserve
        self._check_all = check_all
        self._fetch = fetch
        self._into = into
        self.device = settings.device
        self.broadcaster = ChainBroadcaster(group, piece_size=settings.piece_size,
                                            max_inflight=settings.max_inflight,
                                            timeout=settings.timeout,
                                            device=settings.device)
        self._copier = DeviceCopier()
        self._given = list(batches)
        self._batches: list[RankBatch] = []
        self._keys: dict[int, str] = {}
        heads: list[Read] = []
        for b, batch in enumerate(self._given):
            if not isinstance(batch, RankBatch):
                batch = RankBatch.of(batch, self.rank, len(self._keys), settings)
            self._keys.update(batch.keys)
            sizes = {p.tid: p.nbytes for p in batch.parts}
            # the prefetcher's "file" is the batch, counted from 1: nothing is read before
            # the first batch has been reserved (at_file(1))
            for tid in source_order_of(batch.parts):
                heads.append(Read(tid, b + 1, self._keys[tid], 0, sizes[tid]))
            self._batches.append(batch)
        self._heads = {r.index: r for r in heads}
        self.prefetcher = Prefetcher(heads, self._fetch_read, submit, budget, streams=streams,
                                     lookahead=1)
        self._failed: set[int] = set()
        self.failures: list[BaseException] = []
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="ckptturbo-readonce", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def close(self, timeout: float = 5.0) -> None:
        """Stop before the next batch and wait (up to ``timeout``) for the thread to end."""
        self._closed = True
        if self._thread.is_alive():
            self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("read-once engine still waiting on peers after close")

    def _fetch_read(self, read: Read) -> Buffer:
        return self._fetch(read.path)

    def _run(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # a new thread starts on device 0
        self.prefetcher.start()
        try:
            for b, (given, batch) in enumerate(zip(self._given, self._batches, strict=True)):
                if self._closed or (self._reserve is not None and not self._reserve(given)):
                    break
                self.prefetcher.at_file(b + 1)
                self.broadcaster.run_parts(batch.parts, self._source, self._sink, self._destination,
                                           plan_id=batch.plan_id)
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer through done()
            log.debug("rank %d: read-once pass failed: %s", self.rank, exc)
            self.failures.insert(0, exc)
        finally:
            self.prefetcher.close()
            self._copier.close()
            self._done(self.failures[0] if self.failures else None)

    def _source(self, t: Part) -> Iterator[torch.Tensor]:
        read = self._heads[t.tid]
        try:
            wire = self._to_wire(read.result(), self._destination(t))
        except CkptTurboError as exc:
            self.failures.append(exc)
            self._failed.add(t.tid)
            wire = torch.zeros(t.nbytes, dtype=torch.uint8, device=self.device)
        finally:
            self.prefetcher.release(read)  # the broadcaster holds the bytes now
        yield wire

    def _destination(self, t: Part) -> torch.Tensor | None:
        return self._into(self._keys[t.tid]) if self._into is not None else None

    def _to_wire(self, data: Buffer, destination: torch.Tensor | None) -> torch.Tensor:
        """A head's verified bytes as a buffer on the chain's device."""
        if self.device.type == "cpu":
            return as_uint8(data)
        buffer = destination if destination is not None else \
            torch.empty(len(data), dtype=torch.uint8, device=self.device)
        self._copier.to_device(memoryview(data).cast("B"), buffer, 0)
        self._copier.finish(self.device)  # sends are queued on the current stream
        return buffer

    def _sink(self, t: Part, buffer: torch.Tensor) -> None:
        if t.tid in self._failed:
            return
        key = self._keys[t.tid]
        check = self._check
        if check is not None and self._must_check(t, buffer):
            try:
                check(key, buffer.cpu().numpy().data.cast("B"))
            except CkptTurboError as exc:
                self.failures.append(exc)
                return
        self._deliver(key, buffer)

    def _must_check(self, t: Part, buffer: torch.Tensor) -> bool:
        if t.is_head or self._check is None:
            return False
        return self._check_all or not bool(buffer.any())


class Arrivals:
    """Hands delivered units from the engine's thread to the consuming thread, in arrival
    order; iteration ends when the pass is done and then raises its first failure."""

    def __init__(self) -> None:
        self._items: list[tuple[str, torch.Tensor]] = []
        self._cv = threading.Condition()
        self._finished = False
        self._error: BaseException | None = None

    def put(self, key: str, data: torch.Tensor) -> None:
        with self._cv:
            self._items.append((key, data))
            self._cv.notify_all()

    def finish(self, error: BaseException | None) -> None:
        with self._cv:
            self._finished, self._error = True, error
            self._cv.notify_all()

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        while True:
            with self._cv:
                while not self._items and not self._finished:
                    self._cv.wait()
                batch, self._items = self._items, []
                finished = self._finished
            yield from batch
            if finished and not batch:
                break
        if self._error is not None:
            raise self._error
