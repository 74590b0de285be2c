"""Are the ranks DCP treats as replicas of an item really holding the same bytes?

DCP saves one copy of a replicated item; if the replicas diverged (a bug in the training
loop), the others are silently lost. Each holder fingerprints its copy while writing, and
the coordinator compares the fingerprints before it commits.
"""
from __future__ import annotations

import logging

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex

from .chunks import chunk_id
from .errors import ReplicaMismatchError
from .layout import ReplicaPrint, ShardPart

log = logging.getLogger(__name__)

SAMPLE_BYTES = 4096
MODES = ("sample", "full", "off")


def fingerprint(flat: torch.Tensor, mode: str) -> str:
    """A hash of the whole item ("full") or of three small windows of it ("sample")."""
    if mode == "off":
        return ""
    n = flat.numel()
    if mode == "full" or n <= 3 * SAMPLE_BYTES:
        data = flat.cpu()
    else:
        mid = n // 2
        data = torch.cat([flat[:SAMPLE_BYTES], flat[mid:mid + SAMPLE_BYTES],
                          flat[-SAMPLE_BYTES:]]).cpu()
    return chunk_id(data.numpy())


def check(prints: dict[MetadataIndex, list[ShardPart | ReplicaPrint]], raise_: bool) -> None:
    """Warn about (or raise for) every item whose holders' fingerprints differ."""
    for idx, parts in prints.items():
        seen = {p.fingerprint for p in parts if p.fingerprint}
        if len(seen) > 1:
            msg = (f"replicas of {idx.fqn!r} (offset {tuple(idx.offset or ())}) differ across "
                   "ranks: DCP treats them as identical and would save only one copy")
            if raise_:
                raise ReplicaMismatchError(msg + "; the checkpoint was not committed")
            log.warning(msg)
