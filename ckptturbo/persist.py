"""Persisting a checkpoint from the memory tier to the durable store.

The chunks are already hashed and named, so a persist is a copy of the chunks the durable
store lacks (known from the run's chunk index, as in any save) followed by the manifest,
the commit. It follows the same protocol as a save against a concurrent gc: each node
announces itself with a pending marker before its first dedup decision, and the markers go
after the commit. Each chunk read from memory is checked against its name before it is
uploaded: a copy damaged at rest in host memory must never become the durable one.

The work is split by node: each chunk is uploaded by one of the nodes whose memory tier
holds it (peer replicas make several; ``peers.spread`` picks one, balancing bytes), one
process per node does the node's share, and the coordinator, after every node is done,
checks that the durable store holds every chunk the manifest names before it writes the
manifest.
"""
from __future__ import annotations

import logging

from . import catalog
from .chunk_store import ChunkStore
from .errors import IntegrityError, StorageError, names_preview
from .integrity import chunk_problem
from .manifest import Manifest
from .results import SaveStats
from .runs import Location, RunStore
from .runtime import index_for

log = logging.getLogger(__name__)


def copy_chunk(cid: str, size: int, source: ChunkStore, source_path: str, target: ChunkStore,
               target_path: str) -> None:
    """Copy one chunk between tiers, checked against its name on the way: a copy damaged
    at rest in the source must not become the target's."""
    data = source.get(source_path)
    problem = chunk_problem(cid, data, size)
    if problem is not None:
        raise IntegrityError(f"chunk {source_path} {problem}; not copied to {target_path}")
    target.put(target_path, data)


def copy_chunks(memory: RunStore, durable: RunStore, manifest: Manifest, ours: list[str],
                save_id: str, rank: int) -> SaveStats:
    """Upload those of ``ours`` (this node's share of the manifest's chunks) that the
    durable store lacks. Announced by a pending marker (``rank``'s) that the commit removes."""
    index = index_for(durable)
    catalog.begin_save(durable, save_id, rank, index=index)
    try:
        todo = [cid for cid in ours if cid not in index]

        def copy(cid: str) -> None:
            copy_chunk(cid, manifest.chunks[cid], memory.store, memory.chunk_path(cid),
                       durable.store, durable.chunk_path(cid))
            index.add(cid)

        durable.store.map(copy, todo)
    except BaseException:
        catalog.end_save(durable, save_id, [rank])
        raise
    catalog.uploaded(durable, save_id, rank)
    written = sum(manifest.chunks[c] for c in todo)
    return SaveStats(chunks_written=len(todo), bytes_written=written,
                     chunks_reused=len(ours) - len(todo),
                     bytes_reused=sum(manifest.chunks[c] for c in ours) - written)


def commit(location: Location, manifest: Manifest, save_id: str, ranks: list[int]) -> None:
    """Write the durable manifest once the durable store holds every chunk it names (the
    check costs one listing and keeps a chunk no node held from making a torn checkpoint),
    then remove the persist's pending markers."""
    run = location.run
    try:
        present = run.chunk_ids()
        missing = [cid for cid in manifest.chunks if cid not in present]
        if missing:
            raise StorageError(
                f"cannot persist {location.url}: {len(missing)} of its chunks are neither in a "
                f"node's memory tier nor in {run.store.url_of(run.chunks_root)} "
                f"({names_preview(missing, 3)}); the durable store keeps its previous checkpoints")
        manifest.storage_meta = {**manifest.storage_meta, "checkpoint_id": location.url}
        location.write_manifest(manifest)
    finally:
        catalog.end_save(run, save_id, ranks)
    log.info("persisted %s (%d chunks)", location.url, len(manifest.chunks))
