"""Host-to-GPU copies for the streamer through a small ring of pinned buffers.

A copy from pageable memory makes the driver stage it through its own pinned buffer,
synchronously. Copying each piece into one of our pinned buffers and issuing the
host-to-device copy asynchronously on a side stream lets the GPU copy run while the next
piece is being copied in and while the network fills the next ranges. A buffer is reused
only after the event recorded behind its last copy has completed.
"""
from __future__ import annotations

import numpy as np
import torch

from .prefetch import MemoryBudget


class PinnedStager:
    """Copies bytes into CUDA tensors through ``nbuf`` pinned buffers of ``size`` bytes.

    The buffers are reserved from the streamer's memory budget for its whole life.
    """

    def __init__(self, device: torch.device, size: int, budget: MemoryBudget, nbuf: int = 2) -> None:
        self.device = device
        self.size = size
        self.budget = budget
        self.reserved = size * nbuf
        budget.acquire(self.reserved)
        self.buffers = [torch.empty(size, dtype=torch.uint8, pin_memory=True) for _ in range(nbuf)]
        self.events: list[torch.cuda.Event | None] = [None] * nbuf
        self.next = 0
        self.stream = torch.cuda.Stream(device)

    def copy(self, src: memoryview, dst: torch.Tensor, offset: int) -> None:
        """Queue the copy of ``src`` into ``dst[offset:]`` (a uint8 CUDA tensor)."""
        # dst was allocated on the current stream: our stream must not write it earlier
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        pos = 0
        while pos < len(src):
            n = min(self.size, len(src) - pos)
            i, self.next = self.next, (self.next + 1) % len(self.buffers)
            if self.events[i] is not None:
                self.events[i].synchronize()
            self.buffers[i].numpy()[:n] = np.frombuffer(src[pos:pos + n], dtype=np.uint8)
            with torch.cuda.stream(self.stream):
                dst[offset + pos:offset + pos + n].copy_(self.buffers[i][:n], non_blocking=True)
                event = torch.cuda.Event()
                event.record(self.stream)
            self.events[i] = event
            pos += n

    def finish(self) -> None:
        """Order the caller's stream after the copies queued so far (the tensor is ready)."""
        torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def close(self) -> None:
        self.stream.synchronize()
        self.buffers = []
        self.budget.release(self.reserved)
        self.reserved = 0
