"""Read-ahead for ``safe_open``: tensors fetched in the order the caller will ask for them.

Code written for ``safetensors.safe_open`` reads a file with ``for k in f.keys():
f.get_tensor(k)``. Over an object store, one ranged GET per call pays a round trip per
tensor on one connection at a time (8x slower than the streamer). The calls are
predictable: once the first calls follow ``keys()`` (sorted names) or the file's offset
order, every later one is known. :class:`ReadAhead` then reads the tensors in that order
with the streamer's machinery: neighbouring tensors coalesced into ranges of at most
``piece`` bytes (the first ones small, see :mod:`.ranges`), ``streams`` GETs in flight
through the :class:`~ckptturbo.prefetch.Prefetcher` within a memory budget, each range's
bytes copied into the destination tensors by the I/O thread that fetched it
(:class:`~.device.Scatter`). A call that leaves the order closes it: the handle goes back
to one GET per call, and nothing stays held.
"""
from __future__ import annotations

import logging
from typing import Callable, Sequence

import torch

from ..prefetch import MemoryBudget, Prefetcher, Read
from .device import Scatter
from .format import TensorInfo
from .ranges import RAMP_START, grid_step

log = logging.getLogger(__name__)
SKIP_AHEAD = 8  # a call this many tensors ahead of the order still follows it (the rest is waited out)


def guess_order(calls: Sequence[str], orders: Sequence[Sequence[str]]) -> list[str] | None:
    """The order the next calls will follow, from the first ones: the rest of the first of
    ``orders`` that starts with ``calls[0]`` or has ``calls[-2:]`` as neighbours."""
    for order in orders:
        if len(calls) == 1 and order and order[0] == calls[0]:
            return list(order[1:])
        if len(calls) >= 2:
            at = {name: i for i, name in enumerate(order)}
            i, j = at.get(calls[-2]), at.get(calls[-1])
            if i is not None and j == i + 1:
                return list(order[j + 1:])
    return None


def ordered_reads(tensors: Sequence[TensorInfo], path: str, piece: int,
                  streams: int) -> list[tuple[TensorInfo, list[Read]]]:
    """Reads for ``tensors`` in this order: runs of neighbours (each starting where the last
    ended) cut into pieces, smaller at first; each tensor with the reads that cover it."""
    total = sum(t.nbytes for t in tensors)
    step = grid_step(total, piece, streams)
    plan: list[tuple[TensorInfo, list[Read]]] = []
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


class ReadAhead:
    """Fetches ``tensors`` in order, ahead of the calls; :meth:`take` hands over each one."""

    def __init__(self, tensors: Sequence[TensorInfo], path: str, fetch: Callable[[Read], bytes],
                 submit: Callable, memory_limit: int, piece: int, streams: int) -> None:
        budget = MemoryBudget(memory_limit)
        plan = ordered_reads(tensors, path, max(1, min(piece, memory_limit // 4)), streams)
        self._names = [t.name for t, _ in plan]
        self._reads = sorted({r.index: r for _, rs in plan for r in rs}.values(), key=lambda r: r.index)
        self._covering = [rs for _, rs in plan]
        self._last_use = {r.index: slot for slot, (_, rs) in enumerate(plan) for r in rs}
        self._scatter = Scatter(plan)
        self._cursor = 0
        self.budget = budget
        self._prefetcher = Prefetcher(self._reads, fetch, submit, budget, streams=streams,
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

    @property
    def done(self) -> bool:
        return self._cursor >= len(self._names)

    def close(self) -> None:
        """Stop reading ahead; wait for requests in flight and free everything held."""
        self._prefetcher.close()
        self._scatter.close()
