"""Is a chunk intact, and whom does a bad one hurt: one answer for the reader and the CLI.

A chunk's name is the BLAKE3 hash of its bytes, so checking it needs nothing but the
bytes. What a person (or a failed load) needs to hear is which tensors a bad chunk
breaks, so every report names them, found the same way everywhere.
"""
from __future__ import annotations

from collections import defaultdict

from .chunks import chunk_id
from .errors import CheckpointNotFound, IntegrityError, names_preview
from .manifest import Manifest
from .manifest_records import ItemRecord
from .runs import Location


def item_chunks(item: ItemRecord) -> set[str]:
    """The chunks holding bytes of one item (tensor or object), over all its shards."""
    return {p.chunk for s in item.shards for p in s.pieces}


def chunk_users(manifest: Manifest) -> dict[str, list[str]]:
    """Which items each chunk holds bytes of, names sorted."""
    users: dict[str, list[str]] = defaultdict(list)
    for fqn, item in sorted(manifest.items.items()):
        for cid in sorted(item_chunks(item)):
            users[cid].append(fqn)
    return users


def users_of(manifest: Manifest, cid: str) -> list[str]:
    """The items one chunk holds bytes of (cheaper than ``chunk_users`` for one chunk), those
    with the most bytes in it first: an error names only the first few."""
    held = {fqn: sum(p.length for s in item.shards for p in s.pieces if p.chunk == cid)
            for fqn, item in manifest.items.items() if cid in item_chunks(item)}
    return sorted(held, key=lambda fqn: (-held[fqn], fqn))


def chunk_problem(cid: str, data: bytes | bytearray | memoryview, size: int) -> str | None:
    """Why ``data`` is not chunk ``cid`` of ``size`` bytes ("corrupt: ..."), or None."""
    if len(data) != size:
        return f"corrupt: {len(data)} bytes, the manifest says {size}"
    if chunk_id(data) != cid:
        return "corrupt: its BLAKE3 hash does not match its name"
    return None


def stored_chunk_problem(location: Location, cid: str, size: int) -> str | None:
    """Read one chunk from storage: "missing", "corrupt: ...", or None when intact."""
    try:
        data = location.chunk_store.get(location.chunk_path(cid))
    except CheckpointNotFound:
        return "missing"
    return chunk_problem(cid, data, size)


def verify_chunk(location: Location, manifest: Manifest, url: str, cid: str,
                 data: bytes | bytearray | memoryview) -> None:
    """Raise IntegrityError naming the chunk, its hash and the items it breaks, unless
    ``data`` hashes to ``cid``."""
    actual = chunk_id(data)
    if actual != cid:
        raise damaged_chunk(location, manifest, url, cid,
                            f"corrupt: expected BLAKE3 {cid}, got {actual}")


def damaged_chunk(location: Location, manifest: Manifest, url: str, cid: str,
                  problem: str) -> IntegrityError:
    """The error for a chunk that is corrupt, truncated or missing, naming what it breaks."""
    users = users_of(manifest, cid)
    return IntegrityError(
        f"chunk {location.chunk_path(cid)} is {problem}; "
        f"it holds bytes of {names_preview([repr(u) for u in users])} "
        f"in checkpoint {url}")
