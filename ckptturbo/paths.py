"""Where ckptturbo puts things in storage: every path name of the storage contract.

    <run>/.ckptturbo/chunks/<2 hex>/<64 hex>        content-addressed chunks, shared by the run
    <run>/.ckptturbo/pending/<save id>.<rank>       a rank of a save in progress (removed at commit;
                                                    dead once its heartbeat lease expires)
    <run>/.ckptturbo/gc.lock                        a gc in progress (same lease)
    <run>/.ckptturbo/gc.generation                  changes whenever a gc may delete chunks
    <run>/<checkpoint>/manifest.json                JSON, written last: the commit
    <run>/<checkpoint>/.ckptturbo/...               a self-contained checkpoint's own store
                                                    (manifest ``chunk_store`` "."): same layout

A manifest's ``chunk_store`` says where its chunks are: ".." (``RUN_STORE``, the run's
store, shared by its checkpoints), "." (``OWN_STORE``: the checkpoint's own directory, so
it can be copied or moved on its own) or an absolute URL.

``CONTROL_VERSION`` versions the chunk fan-out and the control records (``manifest_codec``
versions the manifest). Names only, no I/O: ``runs`` joins them onto a store, ``catalog``
does the I/O on the control paths and ``lease`` owns the records written there.
"""
from __future__ import annotations

from .chunks import validate_chunk_id

MANIFEST_NAME = "manifest.json"
# Reads of an object (chunk or manifest) that fails verification before it is reported
# damaged: damage in transit reads right a later time, damage at rest never does. Two: at 10%
# injected faults one chunk came back corrupted twice in a row in 20 seeds (soak run).
READS_OF_A_DAMAGED_OBJECT = 3
CONTROL_VERSION = 1  # chunk fan-out, pending markers, gc lock and generation
CONTROL_DIR = ".ckptturbo"
CHUNKS_DIR = f"{CONTROL_DIR}/chunks"
PENDING_DIR = f"{CONTROL_DIR}/pending"
GC_LOCK = f"{CONTROL_DIR}/gc.lock"
GC_GENERATION = f"{CONTROL_DIR}/gc.generation"
RUN_STORE = ".."  # manifest ``chunk_store``: the run's store, beside the checkpoint
OWN_STORE = "."  # manifest ``chunk_store``: inside the checkpoint's own directory


def chunk_relpath(cid: str) -> str:
    """Where a chunk lives under the chunks root (two-level fan-out)."""
    validate_chunk_id(cid)
    return f"{cid[:2]}/{cid}"
