"""What changed between the weights a server holds and a checkpoint: ``tensor_versions``
(from the manifest alone) and ``load_changes`` (only the bytes the server lacks).

A server remembers each tensor's ``TensorVersion.key``. ``load_changes`` skips the tensors
whose key it already serves; for a delta record whose chain holds the served key it reads
only the payloads after that version (``Change(kind="delta")``, the changed elements and
their new values), and otherwise the tensor's full value. Every read goes through
``TurboReader`` (``read_values``): verified chunks, and with a process group each chunk
read from storage once and forwarded, in batches of bounded memory.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from . import delta_codec
from .chunks import batched
from .errors import CheckpointKindError, CheckpointNotFound, MismatchError
from .failures import ckptturbo_errors
from .manifest import Manifest
from .manifest_delta import (
    TensorVersion,
    payload_spans,
    span_pieces,
    tensor_versions,
    versions_of,
)
from .manifest_records import ItemRecord, ShardRecord
from .reader import TurboReader
from .runs import Location
from .runtime import Runtime, single_process, wait_for_saves

log = logging.getLogger(__name__)

DEFAULT_MEMORY_LIMIT = 2 << 30


@dataclass(frozen=True)
class Change:
    """One tensor whose value differs from the one served.

    ``kind="full"``: ``tensor`` is the new value. ``kind="delta"``: ``mask`` (bool, the
    tensor's shape) marks the elements that changed since the served version and
    ``values`` (1-D, the tensor's dtype) holds their new values in row-major order, so
    ``served[mask] = values`` (bit for bit: ``served.view(int)[mask] = values.view(int)``)
    gives the new value. ``key`` is the new value's ``TensorVersion.key``."""

    name: str
    key: str
    kind: str
    tensor: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    values: torch.Tensor | None = None


def read_manifest(runtime: Runtime, url: str,
                  storage_options: dict[str, Any] | None) -> tuple[Location, Manifest]:
    """A checkpoint's manifest (after a save of it in flight here); a safetensors location
    raises CheckpointKindError, a missing checkpoint CheckpointNotFound."""
    kind = CheckpointKindError(f"{url}: holds safetensors, not a ckptturbo checkpoint: "
                               "stream it with ct.stream_safetensors")
    if url.rstrip("/").endswith(".safetensors"):
        raise kind
    wait_for_saves(url)
    location = Location(url, storage_options, session=runtime)
    try:
        return location, location.read_manifest()
    except CheckpointNotFound:
        if any(f.path.endswith(".safetensors") for f in location.store.list_files(location.path)):
            raise kind from None
        raise


def versions(runtime: Runtime, url: str,
             storage_options: dict[str, Any] | None) -> dict[str, TensorVersion]:
    """Every tensor's version, from the manifest alone (no tensor bytes are read)."""
    with ckptturbo_errors("reading the versions of", url):
        return tensor_versions(read_manifest(runtime, url, storage_options)[1])


def read_values(runtime: Runtime, url: str, storage_options: dict[str, Any] | None,
                manifest: Manifest, records: Mapping[str, ItemRecord],
                group: Any, cache_dir: str | None = None) -> dict[str, torch.Tensor]:
    """The values of ``records`` (tensor records of ``manifest``'s chunks, or records made
    from them), read with a ``TurboReader``: verified, and with ``group`` (every member
    calls with the same records) each chunk read from storage once across the group."""
    view = Manifest(items=dict(records), chunks=manifest.chunks,
                    chunk_store=manifest.chunk_store, dcp_version=manifest.dcp_version)
    reader = TurboReader(url, storage_options, session=runtime, process_group=group,
                         manifest=view, cache_dir=cache_dir)
    flat: dict[str, Any] = {name: torch.empty(tuple(r.size or ()), dtype=r.dtype)
                            for name, r in records.items()}
    planner = DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
    with single_process(group is None):
        dcp.load(flat, storage_reader=reader, planner=planner, process_group=group,
                 no_dist=group is None)
    return flat


def _payloads_record(item: ItemRecord, spans: list[tuple[int, int]]) -> ItemRecord:
    """A uint8 tensor record of a delta record's payloads in ``spans``, back to back."""
    pieces = span_pieces(item.shards[0], spans)
    n = sum(p.length for p in pieces)
    return ItemRecord("tensor", [ShardRecord((0,), (n,), n, pieces)], torch.uint8, (n,))


@dataclass
class _Wanted:
    """One tensor a load of changes reads: the record read, and how it becomes a Change."""

    name: str
    key: str
    item: ItemRecord  # the tensor's record in the checkpoint
    record: ItemRecord  # what is read: ``item``, or its payloads after the served version
    spans: list[tuple[int, int]] | None = None  # a delta: the payloads read, else None

    @property
    def nbytes(self) -> int:
        """Bytes in flight for it: what is read, and a delta's mask (a byte per element)
        and, when several payloads are merged, a full-size scratch tensor."""
        full = sum(s.nbytes for s in self.item.shards)
        if self.spans is None:
            return full
        numel = math.prod(self.item.size or ())
        return 2 * self.record.shards[0].nbytes + numel + (full if len(self.spans) > 1 else 0)


def _wanted(manifest: Manifest, served: Mapping[str, str],
            names: Any) -> list[_Wanted]:
    """The tensors whose key differs from the served one, and what to read of each."""
    out = []
    for name, item in manifest.items.items():
        if item.kind != "tensor" or (names is not None and name not in names):
            continue
        key, chain = versions_of(item)
        have = served.get(name)
        if have == key:
            continue
        if have is not None and have in chain:
            spans = payload_spans(item)[chain.index(have):]
            out.append(_Wanted(name, key, item, _payloads_record(item, spans), spans))
        else:
            out.append(_Wanted(name, key, item, item))
    return out


def load_changes(runtime: Runtime, url: str, served: Mapping[str, str], *, names: Any = None,
                 process_group: Any = None, storage_options: dict[str, Any] | None = None,
                 memory_limit: int | None = None, cache_dir: str | None = None) -> Iterator[Change]:
    """The ``Change`` of each tensor whose key differs from ``served[name]`` (see the module
    docstring); each is yielded once its bytes are verified. Failures are ckptturbo errors
    raised from the iterator."""
    limit = DEFAULT_MEMORY_LIMIT if memory_limit is None else int(memory_limit)
    if limit <= 0:
        raise MismatchError(f"loading changes of {url}: memory_limit must be positive")
    wanted_names = None if names is None else set(names)
    with ckptturbo_errors("loading changes of", url):
        _, manifest = read_manifest(runtime, url, storage_options)
        wanted = _wanted(manifest, served, wanted_names)
    log.info("%s: %d tensors differ from the served ones (%d as deltas)", url, len(wanted),
             sum(1 for w in wanted if w.spans))
    for batch in batched(wanted, lambda w: w.nbytes, limit):
        with ckptturbo_errors("loading changes of", url):
            values = read_values(runtime, url, storage_options, manifest,
                                 {w.name: w.record for w in batch}, process_group, cache_dir)
            changes = [_change(w, values.pop(w.name), url) for w in batch]
        yield from changes


def _change(w: _Wanted, data: torch.Tensor, url: str) -> Change:
    """The Change of one tensor from what was read of it."""
    if w.spans is None:
        return Change(w.name, w.key, "full", tensor=data)
    item = w.item
    dtype = item.dtype
    assert dtype is not None and item.size is not None, "a tensor record has dtype and size"
    numel = math.prod(item.size)
    parts, pos = [], 0
    for start, end in w.spans:
        parts.append(delta_codec.split(data[pos:pos + end - start], numel, dtype,
                                       f"{w.name!r} in {url}"))
        pos += end - start
    mask, values = delta_codec.compose(parts, numel, dtype)
    return Change(w.name, w.key, "delta", mask=mask.reshape(item.size), values=values)
