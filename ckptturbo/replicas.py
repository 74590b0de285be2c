"""Are the ranks DCP treats as replicas of an item really holding the same bytes?

DCP saves one copy of a replicated item; if the replicas diverged (a bug in the training
loop), the others are silently lost. Each holder fingerprints its copy while writing, and
the coordinator compares the fingerprints before it commits. On the wire a fingerprint is
two int64: a key naming the item (a hash of its fqn and offset, so results need no item
names) and 64 bits of the BLAKE3 hash of its bytes; with ``replica_check="off"`` nothing
is computed or sent.
"""
from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex

from .chunks import chunk_id
from .errors import ReplicaMismatchError

log = logging.getLogger(__name__)

SAMPLE_BYTES = 4096
MODES = ("sample", "full", "off")


def fingerprint(flat: torch.Tensor, mode: str) -> int:
    """64 bits of a hash of the whole item ("full") or of three small windows of it ("sample")."""
    n = flat.numel()
    if mode == "full" or n <= 3 * SAMPLE_BYTES:
        data = flat.cpu()
    else:
        mid = n // 2
        data = torch.cat([flat[:SAMPLE_BYTES], flat[mid:mid + SAMPLE_BYTES],
                          flat[-SAMPLE_BYTES:]]).cpu()
    return int(chunk_id(data.numpy().data)[:16], 16) - (1 << 63)


def item_key(index: MetadataIndex) -> int:
    """A 64-bit name of an item, the same on every rank (Python's hash() is not)."""
    text = f"{index.fqn}\0{','.join(map(str, index.offset or ()))}".encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little", signed=True)


def pack(prints: Iterable[tuple[int, int]]) -> bytes:
    """(key, fingerprint) pairs as the bytes a rank sends."""
    return np.asarray(list(prints), dtype=np.int64).reshape(-1, 2).tobytes()


def check(sent: Iterable[bytes], indices: Iterable[MetadataIndex], raise_: bool) -> None:
    """Warn about (or raise for) every item whose holders' fingerprints differ. ``sent``:
    what each rank packed; ``indices``: every item of the checkpoint, to name a culprit.
    Replicas that agree send equal bytes (every DDP rank, every replica of an HSDP shard),
    so equal packs are compared once: the work grows with the distinct packs, not with
    world x items."""
    pairs = [np.frombuffer(b, dtype=np.int64).reshape(-1, 2) for b in _distinct(sent)]
    if not pairs:
        return
    both = np.concatenate(pairs)
    order = np.argsort(both[:, 0], kind="stable")  # one sort of the keys, not of the pairs
    keys, prints = both[order, 0], both[order, 1]
    differ = (keys[1:] == keys[:-1]) & (prints[1:] != prints[:-1])
    bad = set(keys[1:][differ].tolist())  # a key with two prints next to each other
    if not bad:
        return
    for idx in indices:
        if item_key(idx) not in bad:
            continue
        msg = (f"replicas of {idx.fqn!r} (offset {tuple(idx.offset or ())}) differ across "
               "ranks: DCP treats them as identical and would save only one copy")
        if raise_:
            raise ReplicaMismatchError(msg + "; the checkpoint was not committed")
        log.warning(msg)


def _distinct(packs: Iterable[bytes]) -> list[bytes]:
    """The distinct non-empty packs, in order. A pack is compared with the packs of its
    length and ends, not hashed: hashing reads all of every rank's pack (28 KiB of a DDP-3B
    rank: 20 ms over 4,096 ranks), an equal pack's comparison is one memcmp."""
    seen: dict[tuple[int, bytes, bytes], list[bytes]] = {}
    out: list[bytes] = []
    for pack in packs:
        if not pack:
            continue
        alike = seen.setdefault((len(pack), pack[:32], pack[-32:]), [])
        if not any(pack == other for other in alike):
            alike.append(pack)
            out.append(pack)
    return out
