"""Read-ahead for ``safe_open``: tensors fetched in the order the caller will ask for them.

Code written for ``safetensors.safe_open`` reads a file with ``for k in f.keys():
f.get_tensor(k)``. Over an object store, one ranged GET per call pays a round trip per
tensor on one connection at a time (8x slower than the streamer). The calls are
predictable: once the first calls follow ``keys()`` (sorted names) or the file's offset
order, every later one is known, the first call's tensor included. :class:`ReadAhead`
then reads them with the streamer's machinery: the file's needed bytes cut on an offset
grid into ranges that spread them over the ``streams`` requests (:func:`grid_step`: few
requests, as the stream's; each request costs milliseconds of CPU), issued in the order
the calls first need them through the :class:`~ckptturbo.prefetch.Prefetcher` within a
memory budget; a range of two parts or more goes out as concurrent part GETs
(:meth:`~.source.ByteSource.fetch_parts`), and each range's bytes are copied once, into
the destination tensors, by the I/O thread that fetched them (:class:`~.device.Scatter`).
``keys()`` differs from the offset order where dtypes differ (safetensors puts wider
dtypes first), so one range may hold a tensor wanted now and one wanted much later; it
stays reserved until its last tensor is taken. A plan whose ranges would hold more than
the budget at some call falls back to ranges that follow the calls (:func:`ordered_reads`),
and one that cannot fit at all is not read ahead. A call that leaves the order closes it:
the handle goes back to one GET per call, and nothing stays held.
"""
from __future__ import annotations

import logging
from bisect import bisect_right
from collections.abc import Callable, Sequence

import torch

from ..prefetch import MemoryBudget, Prefetcher, Read
from .device import Scatter
from .format import TensorInfo
from .headers import StreamFile
from .ranges import RAMP_START, cut_end, grid_step, intervals
from .source import ByteSource

log = logging.getLogger(__name__)
# a call this many tensors ahead of the order still follows it (the rest is waited out)
SKIP_AHEAD = 8
Plan = list[tuple[TensorInfo, list[Read]]]  # tensors in call order, each with the reads covering it


def guess_order(calls: Sequence[str],
                orders: Sequence[Sequence[str]]) -> tuple[int, list[str]] | None:
    """Which of ``orders`` the calls follow, and its rest from the last call on: the first
    that starts with ``calls[0]`` or has ``calls[-2:]`` as neighbours."""
    for k, order in enumerate(orders):
        if len(calls) == 1 and order and order[0] == calls[0]:
            return k, list(order)
        if len(calls) >= 2:
            at = {name: i for i, name in enumerate(order)}
            i, j = at.get(calls[-2]), at.get(calls[-1])
            if i is not None and j == i + 1:
                return k, list(order[j:])
    return None


def grid_plan(tensors: Sequence[TensorInfo], path: str, piece: int, streams: int,
              spread: int) -> Plan:
    """Reads on the file's offset grid, listed in the order the calls first need them.

    The step spreads ``spread`` bytes over ``streams`` requests (as the stream's grid
    does, within ``piece``); a sliver under a quarter step at a span's end joins the
    read before it."""
    step = grid_step(spread, piece, streams)
    reads: list[Read] = []
    for a, b in intervals(tensors):
        pos = a
        while pos < b:
            end = cut_end(pos, pos + step, b, step, piece)
            reads.append(Read(len(reads), 0, path, pos, end))
            pos = end
    starts = [r.start for r in reads]
    plan: Plan = []
    for t in tensors:
        lo = bisect_right(starts, t.start) - 1
        covered = []
        for r in reads[max(lo, 0):]:
            if r.start >= t.end:
                break
            if r.end > t.start:
                covered.append(r)
        plan.append((t, covered))
    first_need: dict[int, int] = {}
    for slot, (_, rs) in enumerate(plan):
        for r in rs:
            first_need.setdefault(r.index, slot)
    reads.sort(key=lambda r: (first_need.get(r.index, len(plan)), r.start))
    for i, r in enumerate(reads):  # the Prefetcher issues (and Scatter keys) by list position
        r.index = i
    return plan


def ordered_reads(tensors: Sequence[TensorInfo], path: str, piece: int,
                  streams: int, spread: int) -> Plan:
    """Reads for ``tensors`` in this order: runs of neighbours (each starting where the last
    ended) cut into pieces, smaller at first; each tensor with the reads that cover it.
    Each read serves consecutive calls, so it is held only while they are made."""
    step = grid_step(spread, piece, streams)
    plan: Plan = []
    reads: list[Read] = []
    size = min(RAMP_START, step)
    run_end = None
    for t in tensors:
        covered: list[Read] = []
        pos = t.start
        if run_end == t.start and reads and reads[-1].size < size:  # extend the run's last read
            last = reads[-1]
            grow = min(t.end, last.start + size) - last.end
            last.end += grow
            covered.append(last)
            pos += grow
        while pos < t.end:
            end = min(t.end, pos + size)
            reads.append(Read(len(reads), 0, path, pos, end))
            covered.append(reads[-1])
            pos = end
            if len(reads) % 2 == 0:
                size = min(step, 2 * size)
        run_end = t.end
        plan.append((t, covered))
    return plan


def peak_held(plan: Plan) -> int:
    """The most bytes the plan's reads hold at one call: a read is reserved from before
    the first call that needs it (reads are issued in that order) to its last one."""
    span: dict[int, tuple[int, int, int]] = {}
    for slot, (_, rs) in enumerate(plan):
        for r in rs:
            first = span.get(r.index, (slot, slot, r.size))[0]
            span[r.index] = (first, slot, r.size)
    delta = [0] * (len(plan) + 1)
    for first, last, size in span.values():
        delta[first] += size
        delta[last + 1] -= size
    peak = held = 0
    for d in delta:
        held += d
        peak = max(peak, held)
    return peak


def plan_reads(tensors: Sequence[TensorInfo], path: str, piece: int, streams: int,
               memory_limit: int, files: int = 1) -> Plan | None:
    """The grid plan if it fits ``memory_limit`` at every call, else the call-order plan
    if that fits, else None (reading ahead would stall: per-call reads instead).

    Ranges spread the bytes in flight over the ``streams`` requests: this file's, or with
    ``files`` shards read one after another (ahead into the next, :mod:`.nextfile`) the
    whole model's, estimated as ``files`` times this one's, as the stream spreads the
    whole stream's (16 MiB ranges rather than 4 for 4 shards of 128 MiB: a third of the
    requests, each costing milliseconds of CPU)."""
    spread = files * sum(t.nbytes for t in tensors)
    for make in (grid_plan, ordered_reads):
        plan = make(tensors, path, piece, streams, spread)
        if peak_held(plan) <= memory_limit:
            return plan
        log.debug("%s: a %s read-ahead would hold over %d bytes", path, make.__name__, memory_limit)
    return None


def start_read_ahead(file: StreamFile, order: Sequence[str], source: ByteSource,
                     budget: MemoryBudget, chunk_size: int, streams: int, files: int,
                     pinned: bool = False) -> ReadAhead | None:
    """A read-ahead of ``file``'s tensors in ``order`` (those the header GET did not bring
    already) within ``budget``, for a handle or a next shard; None when no plan fits.
    ``pinned``: the tensors land in pinned memory (a handle on a GPU)."""
    by_name = file.header.by_name
    tensors = [by_name[n] for n in order if by_name[n].nbytes and not file.in_tail(by_name[n].end)]
    piece = max(1, min(chunk_size, budget.limit // 4))
    plan = plan_reads(tensors, file.entry.path, piece, streams, budget.limit, files)
    if not plan:
        return None
    return ReadAhead(plan, source.fetch_parts, source.store.submit, budget, streams, pinned)


class ReadAhead:
    """Fetches ``tensors`` in order, ahead of the calls; :meth:`take` hands over each one."""

    def __init__(self, plan: Plan, fetch: Callable[[Read], object], submit: Callable,
                 budget: MemoryBudget, streams: int, pinned: bool = False) -> None:
        """``plan``: from :func:`plan_reads` (within ``budget.limit``); ``fetch`` returns a
        read's bytes (or its part GETs' bodies, which :class:`~.device.Scatter` takes as
        they are)."""
        self._names = [t.name for t, _ in plan]
        by_index = {r.index: r for _, rs in plan for r in rs}
        self._reads = sorted(by_index.values(), key=lambda r: r.index)
        self._covering = [rs for _, rs in plan]
        self._last_use = {r.index: slot for slot, (_, rs) in enumerate(plan) for r in rs}
        self._scatter = Scatter(plan, pinned)
        self._cursor = 0
        self.budget = budget
        self._prefetcher = Prefetcher(self._reads, fetch, submit, self.budget, streams=streams,
                                      lookahead=None, deliver=self._scatter.deliver)
        self._prefetcher.start()

    def position(self, name: str) -> int | None:
        """Where ``name`` is in the order, if it is at most SKIP_AHEAD ahead of the cursor."""
        for slot in range(self._cursor, min(len(self._names), self._cursor + SKIP_AHEAD + 1)):
            if self._names[slot] == name:
                return slot
        return None

    def take(self, slot: int) -> torch.Tensor:
        """Tensor ``slot``'s bytes (tensors before it are skipped: their reads are waited
        for and released)."""
        reads = {r.index: r for s in range(self._cursor, slot + 1) for r in self._covering[s]}
        for r in reads.values():  # in order
            self._prefetcher.wait(r)
            if self._last_use[r.index] <= slot:
                self._prefetcher.release(r)
        for s in range(self._cursor, slot):
            self._scatter.take(s)  # skipped: dropped
        self._cursor = slot + 1
        return self._scatter.take(slot)

    def pump(self) -> None:
        """Issue the reads that fit now (the budget is shared: see :mod:`.nextfile`)."""
        self._prefetcher.start()

    @property
    def issued_all(self) -> bool:
        """Every read has gone out (they go in order): requests will soon be idle."""
        last = self._reads[-1] if self._reads else None
        return last is None or last.reserved or last.done.is_set()

    @property
    def done(self) -> bool:
        return self._cursor >= len(self._names)

    def close(self) -> None:
        """Stop reading ahead; wait for requests in flight and free everything held."""
        self._prefetcher.close()
        self._scatter.close()
