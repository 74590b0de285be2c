"""Host staging: a reusable buffer pool, host<->device copies, and two-phase save handles.

The training loop should stall only for the copy of its state into host memory. The pool
is one arena allocated on first use and reused by every later save (pinned when CUDA is
present, so device-to-host copies run at full PCIe speed on a side stream); fresh
allocations per save would pay page faults or cudaHostAlloc each time. The arena is
handed out as a ring: uploads finish roughly in the order chunks were staged, so freed
space comes back at the tail, and a pool smaller than the state simply stages in waves.
"""
from __future__ import annotations

import collections
import os
import threading
import time
import warnings
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import numpy as np
import torch

from .results import SaveSummary

DEFAULT_POOL_FRACTION_OF_RAM = 0.25
MAX_DEFAULT_POOL_BYTES = 8 << 30


def default_pool_bytes(share: int, chunk_size: int) -> int:
    """The rank's share of the save, capped at a quarter of free RAM split over local ranks.

    Documented in docs/async.md: a pool this large stages everything in one wave; a
    smaller one (set ``pool_bytes=``) stages in waves while uploads free space.
    """
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    try:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        free = 8 << 30
    ram_cap = int(free * DEFAULT_POOL_FRACTION_OF_RAM / max(1, local_ranks))
    return max(chunk_size, min(share, ram_cap, MAX_DEFAULT_POOL_BYTES))


@dataclass
class HostBuffer:
    """A slice of the pool's arena; ``tensor`` is a uint8 view of it."""

    tensor: torch.Tensor
    offset: int
    nbytes: int


class HostBufferPool:
    """A ring-allocated arena of host memory with a byte budget and blocking acquire."""

    def __init__(self, capacity: int, *, pin: bool | None = None) -> None:
        if capacity <= 0:
            raise ValueError("pool capacity must be positive")
        self.capacity = int(capacity)
        self.pin = torch.cuda.is_available() if pin is None else pin
        self._arena: torch.Tensor | None = None
        self._cond = threading.Condition()
        self._live: collections.deque[list[Any]] = collections.deque()  # [start, end, freed]
        self._head = 0
        self.peak_in_use = 0
        self._in_use = 0

    @property
    def arena(self) -> torch.Tensor:
        if self._arena is None:
            self._arena = torch.empty(self.capacity, dtype=torch.uint8, pin_memory=self.pin)
        return self._arena

    @property
    def in_use(self) -> int:
        return self._in_use

    def acquire(self, nbytes: int, timeout: float | None = None) -> HostBuffer:
        """Reserve nbytes contiguous bytes, waiting for releases while the ring is full."""
        if nbytes == 0:
            return HostBuffer(self.arena[:0], 0, 0)
        if nbytes > self.capacity:
            raise ValueError(
                f"request of {nbytes} bytes exceeds the staging pool ({self.capacity})")
        deadline = None if timeout is None else time.monotonic() + timeout
        arena = self.arena
        with self._cond:
            while True:
                start = self._fit(nbytes)
                if start is not None:
                    break
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"staging pool stayed full for {timeout}s")
                self._cond.wait(remaining)
            self._live.append([start, start + nbytes, False])
            self._head = start + nbytes
            self._in_use += nbytes
            self.peak_in_use = max(self.peak_in_use, self._in_use)
        return HostBuffer(arena[start:start + nbytes], start, nbytes)

    def _fit(self, nbytes: int) -> int | None:
        if not self._live:
            self._head = 0
            return 0
        oldest = self._live[0][0]
        if self._head > oldest:  # not wrapped: free space is [head, capacity) and [0, oldest)
            if self._head + nbytes <= self.capacity:
                return self._head
            return 0 if nbytes <= oldest else None
        # wrapped: free space is [head, oldest)
        return self._head if self._head + nbytes <= oldest else None

    def release(self, buf: HostBuffer) -> None:
        if buf.nbytes == 0:
            return
        with self._cond:
            for entry in self._live:
                if entry[0] == buf.offset and entry[1] == buf.offset + buf.nbytes and not entry[2]:
                    entry[2] = True
                    break
            else:
                raise ValueError("releasing a buffer that is not live in this pool")
            self._in_use -= buf.nbytes
            while self._live and self._live[0][2]:
                self._live.popleft()
            self._cond.notify_all()


class DeviceCopier:
    """The one pinned-copy helper: host<->device copies on a side CUDA stream.

    Saves copy device tensors into pinned host buffers (:meth:`copy`, async, with an event
    to wait on). Loads that can read bytes straight into pinned memory (:meth:`landing`)
    queue their copies to the device from there (:meth:`upload`). Other loads copy bytes
    from pageable memory to the device (:meth:`to_device`):
    a copy from pageable memory makes the driver stage it through its own pinned buffer,
    synchronously, so the bytes go through a small ring of our own pinned buffers instead
    and each host-to-device copy runs asynchronously while the next piece is copied in
    (and the network fills the next ranges). A ring buffer is reused only after the event
    recorded behind its last copy has completed. On CPU everything is a plain copy.
    """

    def __init__(self, ring_piece: int = 16 << 20, ring_buffers: int = 2) -> None:
        self.ring_piece = ring_piece
        self.ring_buffers = ring_buffers
        self._streams: dict[torch.device, Any] = {}
        self._ring: list[torch.Tensor] = []
        self._events: list[Any] = []
        self._next = 0

    @property
    def ring_bytes(self) -> int:
        """Pinned host memory :meth:`to_device` holds (allocated on first use)."""
        return self.ring_piece * self.ring_buffers

    @staticmethod
    def _concrete(device: torch.device) -> torch.device:
        """"cuda" means the current device: one key per physical device."""
        if device.index is None:
            return torch.device("cuda", torch.cuda.current_device())
        return device

    def _stream(self, device: torch.device) -> Any:
        device = self._concrete(device)
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device=device)
        # tensors were allocated on the current stream: ours must not touch them earlier
        stream.wait_stream(torch.cuda.current_stream(device))
        return stream

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Any:
        """Start dst.copy_(src); returns an event to wait on (None when already done)."""
        if src.device.type != "cuda":
            dst.copy_(src)
            return None
        stream = self._stream(src.device)
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        return event

    @staticmethod
    def wait(event: Any) -> None:
        if event is not None:
            event.synchronize()

    @staticmethod
    def landing(nbytes: int) -> torch.Tensor:
        """Pinned host memory for bytes bound for a device, to read them into: copied to
        the device from there by :meth:`upload`, they cross the link once, at full speed,
        with no copy through the ring. It comes from torch's pinned-memory cache, so a
        later load reuses it instead of pinning pages again."""
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def upload(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Queue ``dst.copy_(src)`` from pinned host memory (a :meth:`landing` buffer) on
        the side stream; call :meth:`finish` before the caller's stream reads ``dst``.
        torch's pinned-memory cache records the copy, so ``src``'s memory is not handed
        out again before the copy has run, even once the caller drops it."""
        with torch.cuda.stream(self._stream(dst.device)):
            dst.copy_(src, non_blocking=True)

    def to_device(self, src: memoryview, dst: torch.Tensor, offset: int) -> None:
        """Queue the copy of host bytes ``src`` into ``dst[offset:]`` (a uint8 tensor);
        call :meth:`finish` before the caller's stream reads ``dst``."""
        if dst.device.type != "cuda":
            if len(src):
                dst.numpy()[offset:offset + len(src)] = np.frombuffer(src, dtype=np.uint8)
            return
        if not self._ring:
            self._ring = [torch.empty(self.ring_piece, dtype=torch.uint8, pin_memory=True)
                          for _ in range(self.ring_buffers)]
            self._events = [None] * self.ring_buffers
        stream = self._stream(dst.device)
        pos = 0
        while pos < len(src):
            n = min(self.ring_piece, len(src) - pos)
            i, self._next = self._next, (self._next + 1) % len(self._ring)
            self.wait(self._events[i])
            self._ring[i].numpy()[:n] = np.frombuffer(src[pos:pos + n], dtype=np.uint8)
            with torch.cuda.stream(stream):
                dst[offset + pos:offset + pos + n].copy_(self._ring[i][:n], non_blocking=True)
                self._events[i] = torch.cuda.Event()
                self._events[i].record(stream)
            pos += n

    def finish(self, device: torch.device) -> None:
        """Order the caller's stream after the copies queued so far (the tensor is ready)."""
        if device.type == "cuda" and self._concrete(device) in self._streams:
            device = self._concrete(device)
            torch.cuda.current_stream(device).wait_stream(self._streams[device])

    def close(self) -> None:
        """Wait for queued copies and drop the pinned ring."""
        for stream in self._streams.values():
            stream.synchronize()
        self._ring, self._events = [], []


def as_uint8(data: bytes | bytearray | memoryview) -> torch.Tensor:
    """A uint8 tensor over host bytes without copying (read-only bytes are never written)."""
    if not len(data):
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch warns about read-only buffers
        return torch.frombuffer(data, dtype=torch.uint8)


def tensor_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a tensor's logical bytes (row-major), copying only if strided."""
    t = tensor.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8)


# What ``durable`` carries: a SaveSummary, or for a tiered save that is not persisted None
Durable = TypeVar("Durable", SaveSummary, "SaveSummary | None")


class SaveHandle(Generic[Durable]):
    """Two futures of one save: ``staged`` (state copied; training may go on) and ``durable``.

    ``durable`` carries the SaveSummary once the manifest is committed, or the exception
    that made the save fail, in which case the checkpoint stays invisible.
    """

    def __init__(self, url: str) -> None:
        self.url = url
        self.staged: Future[None] = Future()
        self.durable: Future[Durable] = Future()
        self.staged.set_running_or_notify_cancel()
        self.durable.set_running_or_notify_cancel()

    def wait(self, timeout: float | None = None) -> Durable:
        return self.durable.result(timeout)

    result = wait

    def done(self) -> bool:
        return self.durable.done()

    def __repr__(self) -> str:
        state = "durable" if self.durable.done() else "staged" if self.staged.done() else "staging"
        return f"SaveHandle({self.url!r}, {state})"
