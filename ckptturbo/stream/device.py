"""Where yielded tensors live: CPU tensors filled by the I/O threads, or tensors the
consumer's thread fills (CUDA through pinned memory; distributed streams).

On the CPU, :class:`Scatter` copies each read's bytes into the destination tensors it
covers on the I/O thread that fetched it, as soon as it arrives: the consumer's thread
only waits and yields, and the page faults of fresh destination memory (about a second
per GiB) are taken by the I/O threads while the network fills the next ranges. The read's
own bytes are dropped at once, so a range is held once, in its destinations.

:class:`Destination` is the consumer-thread path. For CUDA each read lands in pinned
memory on its I/O thread (:func:`land`) and the consumer queues the copies to the device;
bytes that did not land (a header GET's tail) go through
:class:`~ckptturbo.staging.DeviceCopier`'s pinned ring, whose buffers are reserved from the
stream's memory budget for its life.
"""
from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
import torch

from ..prefetch import MemoryBudget, Read
from ..staging import DeviceCopier
from .format import TensorInfo
from .source import Parts

MiB = 1 << 20
STAGING_PIECE = 16 * MiB  # at most; a stream with smaller reads stages in read-sized pieces


class Destination:
    """Allocates yielded tensors on ``device`` and copies read bytes into them."""

    def __init__(self, device: torch.device, budget: MemoryBudget, piece: int) -> None:
        self.device = device
        self.budget = budget
        self.copier = DeviceCopier(ring_piece=min(piece, STAGING_PIECE))
        self.reserved = self.copier.ring_bytes if device.type == "cuda" else 0
        budget.acquire(self.reserved)

    def new(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def copy(self, src: memoryview | torch.Tensor, dst: torch.Tensor, offset: int) -> None:
        """Queue src into ``dst[offset:]``: straight from a :func:`land` buffer, else
        through the pinned ring."""
        if isinstance(src, torch.Tensor):
            self.copier.upload(src, dst[offset:offset + len(src)])
        else:
            self.copier.to_device(src, dst, offset)

    def finish(self) -> None:
        """The tensor filled so far is ready for the consumer's stream."""
        self.copier.finish(self.device)

    def close(self) -> None:
        self.copier.close()
        self.budget.release(self.reserved)
        self.reserved = 0


def land(read: Read, data: bytes | bytearray | memoryview | Parts) -> torch.Tensor:
    """On the I/O thread that fetched it, copy a read's bytes (one buffer, or its part
    GETs' bodies) into pinned memory: the consumer's thread then only queues copies to the
    device, which run at the link's speed, instead of copying every byte through the ring
    itself. Reads land in parallel, one per I/O thread."""
    bodies = data.bodies if isinstance(data, Parts) else [data]
    out = DeviceCopier.landing(read.size)
    view, at = out.numpy(), 0
    for body in bodies:  # numpy copies without the GIL
        view[at:at + len(body)] = np.frombuffer(body, dtype=np.uint8)
        at += len(body)
    return out


class Scatter:
    """Fresh CPU destination tensors, filled from each read's bytes on the I/O thread.

    Tensors are numbered in yield order (``slot``). Each read knows the pieces of the
    tensors it covers; a destination is allocated (not touched: its pages are faulted by
    the copies) when the first of its reads arrives, and handed to the consumer by
    :meth:`take` once every read covering it is filled.
    """

    def __init__(self, plan: Sequence[tuple[TensorInfo, Sequence[Read]]],
                 pinned: bool = False) -> None:
        """``plan``: every tensor in yield order with the reads that cover its bytes;
        ``pinned``: destinations in pinned memory, for tensors bound for a GPU (their copy
        there then runs asynchronously, at the link's speed)."""
        self._pinned = pinned
        self._sizes = [t.nbytes for t, _ in plan]
        self._slots: list[torch.Tensor | None] = [None] * len(plan)
        # read index -> [(slot, destination offset, offset in the read, length)]
        self._pieces: dict[int, list[tuple[int, int, int, int]]] = {}
        self._lock = threading.Lock()
        for slot, (t, reads) in enumerate(plan):
            for r in reads:
                lo, hi = max(r.start, t.start), min(r.end, t.end)
                if lo < hi:
                    piece = (slot, lo - t.start, lo - r.start, hi - lo)
                    self._pieces.setdefault(r.index, []).append(piece)

    def deliver(self, read: Read, data: bytes | bytearray | memoryview | Parts) -> bytes:
        """Copy ``read``'s bytes (one buffer, or its part GETs' bodies) into their
        destinations, on the I/O thread; keep none."""
        bodies = data.bodies if isinstance(data, Parts) else [data]
        srcs, at = [], 0
        for body in bodies:
            srcs.append((at, np.frombuffer(body, dtype=np.uint8)))
            at += len(body)
        for slot, dst_at, src_at, n in self._pieces.pop(read.index, ()):
            dst = self._slot(slot)
            for base, src in srcs:  # the bodies overlapping [src_at, src_at + n)
                lo, hi = max(src_at, base), min(src_at + n, base + len(src))
                if lo < hi:  # numpy copies without the GIL
                    dst[dst_at + lo - src_at:dst_at + hi - src_at] = src[lo - base:hi - base]
        return b""

    def _slot(self, slot: int) -> np.ndarray:
        with self._lock:
            t = self._slots[slot]
            if t is None:
                size = self._sizes[slot]
                t = self._slots[slot] = (DeviceCopier.landing(size) if self._pinned
                                         else torch.empty(size, dtype=torch.uint8))
            return t.numpy()

    def take(self, slot: int) -> torch.Tensor:
        """The filled destination of tensor ``slot`` (its reads have all been waited for)."""
        with self._lock:
            t, self._slots[slot] = self._slots[slot], None
        return torch.empty(0, dtype=torch.uint8) if t is None else t

    def close(self) -> None:
        """Drop the destinations not yet taken (a stream closed early)."""
        with self._lock:
            self._slots = [None] * len(self._slots)
            self._pieces.clear()


def covering(tensors: Sequence[TensorInfo],
             reads: Sequence[Read]) -> list[tuple[TensorInfo, list[Read]]]:
    """Each of one file's tensors (by offset) with the reads (by offset) that cover it."""
    out, ri = [], 0
    for t in tensors:
        while ri < len(reads) and reads[ri].end <= t.start:
            ri += 1
        rj = ri
        while rj < len(reads) and reads[rj].start < t.end:
            rj += 1
        out.append((t, list(reads[ri:rj])))
    return out
