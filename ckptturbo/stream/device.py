"""Where yielded tensors live: fresh CPU tensors, or CUDA tensors filled through pinned memory.

The copy out of a read's bytes happens in the consumer's thread while the network fills
the next ranges; for CUDA it goes through :class:`~ckptturbo.staging.DeviceCopier`'s
pinned ring, whose buffers are reserved from the stream's memory budget for its life.
"""
from __future__ import annotations

import torch

from ..prefetch import MemoryBudget
from ..staging import DeviceCopier

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

    def copy(self, src: memoryview, dst: torch.Tensor, offset: int) -> None:
        self.copier.to_device(src, dst, offset)

    def finish(self) -> None:
        """The tensor filled so far is ready for the consumer's stream."""
        self.copier.finish(self.device)

    def close(self) -> None:
        self.copier.close()
        self.budget.release(self.reserved)
        self.reserved = 0
