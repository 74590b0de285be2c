"""A delta save (``ct.save(..., delta_from=<base url>)``): each tensor that mostly kept its
base's bits is saved as a payload of its changed elements (``delta_codec``) instead of
its full bytes.

``prepare`` runs on the save's own thread before DCP's save, so the caller still waits only
for ``handle.staged``. It takes the base's values from the runtime when this process's
previous delta save committed the base (``Runtime.keep_delta_base``: a host copy of the
tensors it compared, one save's worth, so a chain of delta saves reads nothing back), and
otherwise reads them from the base checkpoint (verified, in batches of bounded memory).
It compares bit for bit, and
hands DCP a state dict in which every such tensor is replaced by its payload, a uint8
tensor (empty when nothing changed), stored, deduplicated and verified like any tensor.
The writer's commit then turns those items into delta records (``manifest_delta``): the
base's pieces plus the new payload, so the checkpoint needs no other manifest. A tensor
without a base of its shape and dtype, stored in several shards, or whose payload would
not be smaller than what the rebase rule allows (``delta_room``) is saved in full.
"""
from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict, unflatten_state_dict

from . import catalog, delta_codec
from .changes import DEFAULT_MEMORY_LIMIT, read_manifest, read_values
from .chunks import batched
from .errors import ChunksUnavailable, CkptTurboError
from .manifest_delta import DeltaBase, delta_room, versions_of
from .manifest_records import ItemRecord
from .runs import Location, RunStore
from .runtime import Runtime, index_for
from .urls import url_key

log = logging.getLogger(__name__)


class DeltaPlan:
    """What a delta save's commit needs: the base record of each tensor stored over it
    (``manifest_delta.with_deltas``) and the sizes of the base's chunks; and ``values``,
    host copies of the tensors compared, which the next delta save over this one takes
    as its base once this one committed."""

    def __init__(self, bases: dict[str, DeltaBase], chunks: Mapping[str, int],
                 values: dict[str, torch.Tensor]) -> None:
        self.bases = bases
        self.chunks = chunks
        self.values = values
        self.committed: dict[str, str] = {}  # name -> key, set by the commit

    def kept(self) -> dict[str, tuple[str, torch.Tensor]]:
        """What the runtime keeps for the next delta save over this one: each compared
        tensor with the key its committed record has (``Runtime.keep_delta_base``)."""
        return {name: (key, self.values[name]) for name, key in self.committed.items()}

    def hold(self, run: RunStore, marker: str, rank: int, url: str) -> None:
        """Keep the base chunks the commit names from a gc until the commit: announce as
        an upload does (pending marker ``marker``, gc-lock wait, the run's chunk index at
        that gc generation), then check that each is still in the store. The base was read
        before the announcement, and may have been deleted and collected since; from the
        marker on no gc starts, so a chunk found now is there at the commit. The caller
        removes the marker after the commit (``catalog.end_save``)."""
        index = index_for(run)
        catalog.begin_save(run, marker, rank, index=index)
        missing = sorted(cid for cid in {p.chunk for b in self.bases.values()
                                         for s in b.record.shards for p in s.pieces}
                         if cid not in index)
        if missing:
            raise ChunksUnavailable(f"saving {url}: {len(missing)} chunks of its delta base "
                                    f"were collected while it was saved (first: {missing[0]}); "
                                    "save it in full or from a base that exists")


def prepare(runtime: Runtime, state_dict: dict[str, Any], base_url: str, chunk_store: str,
            storage_options: dict[str, Any] | None
            ) -> tuple[dict[str, Any], DeltaPlan | None]:
    """The state dict DCP saves (payloads in place of the tensors stored as deltas) and the
    plan of the commit (None: no tensor is, the save is a plain one). ``chunk_store``: the
    URL of the new checkpoint's chunks (its ``Location``'s ``chunks_root``), where the
    base's chunks must be."""
    manifest = read_manifest(runtime, base_url, storage_options)[1]
    location = Location.for_manifest(base_url, storage_options, manifest, session=runtime)
    chunks_url = location.chunk_store.url_of(location.chunks_root)
    if url_key(chunks_url) != url_key(chunk_store):
        raise CkptTurboError(f"delta_from={base_url}: its chunks are in {chunks_url}, the new "
                             f"checkpoint's in {chunk_store}; a delta names its base's chunks, "
                             "so both must use one chunk store")
    plain = {k: (v.state_dict() if hasattr(v, "state_dict") and not isinstance(v, torch.Tensor)
                 else v) for k, v in state_dict.items()}
    flat, mapping = flatten_state_dict(plain)
    candidates = {name: manifest.items[name] for name, value in flat.items()
                  if _comparable(value, manifest.items.get(name))}
    bases: dict[str, DeltaBase] = {}
    kept = runtime.delta_base(base_url)
    values = {name: flat[name].detach().to("cpu", copy=True) for name in candidates}
    for batch in batched(candidates.items(), lambda item: 2 * flat[item[0]].nbytes,
                         DEFAULT_MEMORY_LIMIT):  # the base's values and the new ones
        _compare(runtime, base_url, storage_options, manifest, dict(batch), flat, bases, kept)
    log.info("delta save over %s: %d of %d entries as deltas, %d unchanged", base_url,
             sum(b.payload for b in bases.values()), len(flat),
             sum(not b.payload for b in bases.values()))
    if not bases:  # a plain save
        return state_dict, None
    return unflatten_state_dict(flat, mapping), DeltaPlan(bases, manifest.chunks, values)


def _comparable(value: Any, record: ItemRecord | None) -> bool:
    """A plain tensor whose base has its shape and dtype and may take a payload."""
    if record is None or type(value) is not torch.Tensor or value.is_meta:
        return False
    return (record.dtype == value.dtype and tuple(record.size or ()) == tuple(value.shape)
            and delta_room(record) > 0)


def _compare(runtime: Runtime, base_url: str, storage_options: dict[str, Any] | None,
             manifest: Any, batch: dict[str, ItemRecord], flat: dict[str, Any],
             bases: dict[str, DeltaBase], kept: dict[str, tuple[str, torch.Tensor]]) -> None:
    """Take one batch of base values (``kept`` where its key is the base record's, else
    read) and replace each tensor of ``flat`` that is stored as a delta (or unchanged) by
    its payload; record its base in ``bases``."""
    values = {name: kept[name][1] for name, record in batch.items()
              if name in kept and kept[name][0] == versions_of(record)[0]}
    unread = {name: record for name, record in batch.items() if name not in values}
    if unread:
        values.update(read_values(runtime, base_url, storage_options, manifest, unread, None))
    for name, record in batch.items():
        new = flat[name]
        mask = delta_codec.changed(values.pop(name), new.detach().cpu())
        grad = bool(new.requires_grad)
        if not mask.any():
            bases[name] = DeltaBase(record, False, grad)
            flat[name] = torch.empty(0, dtype=torch.uint8)
        elif delta_codec.payload_bytes(mask, new.element_size()) < delta_room(record):
            bases[name] = DeltaBase(record, True, grad)
            flat[name] = delta_codec.encode(mask, new.detach())
