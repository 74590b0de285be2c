"""TurboWriter: a DCP StorageWriter (and AsyncStager) that writes each distinct byte once.

DCP's planner already removes replicated items from all but one rank, whole. That keeps
one rank busy writing a replicated embedding while its peers idle. So each rank records
everything it holds in ``prepare_local_plan``; the coordinator then splits replicated
items into chunk-aligned byte ranges balanced over their holders (``plan.plan_writes``),
and every rank writes its ranges in ``write_data``. Chunks are named by their BLAKE3
hash, so bytes that an earlier checkpoint of the run (or another key) already stored are
not uploaded again. The coordinator commits by writing the manifest last.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import logging
import time
import uuid
from collections import defaultdict
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult

from . import catalog
from .chunks import DEFAULT_CHUNK_SIZE, DEFAULT_PACK_THRESHOLD, StoredPiece, chunk_id, layout_chunks
from .errors import CkptTurboError, StorageError
from .layout import ItemRecord, Location, Manifest, ShardRecord
from .plan import PlanItem, plan_writes
from .staging import DeviceCopier, HostBuffer, HostBufferPool, default_pool_bytes, tensor_bytes

log = logging.getLogger(__name__)

REPLICA_SAMPLE_BYTES = 4096


@dataclass(frozen=True)
class Holdings:
    """A rank's tensor items before DCP's dedup: (index, nbytes), in plan order."""

    rank: int
    items: tuple[tuple[MetadataIndex, int], ...]
    signature: str | None = None  # equal to the previous save's => the cached plan applies


@dataclass(frozen=True)
class Assignment:
    """What the coordinator tells one rank: its byte ranges, and the run's gc generation."""

    ranges: dict[MetadataIndex, tuple[tuple[int, int], ...]]
    replicated: frozenset[MetadataIndex]
    gc_generation: str
    save_id: str


@dataclass
class ShardPart:
    """A rank's contribution to one shard: the pieces it wrote, plus accounting."""

    kind: str
    nbytes: int
    pieces: list[StoredPiece]
    chunk_sizes: dict[str, int]
    written: int = 0
    reused: int = 0
    fingerprint: str | None = None


@dataclass
class _Entry:
    index: MetadataIndex
    flat: torch.Tensor  # uint8 view of the item's bytes (device may be cuda)
    ranges: list[tuple[int, int]]
    kind: str
    pieces: list[StoredPiece] = field(default_factory=list)


class ReplicaMismatchError(CkptTurboError):
    """Ranks that DCP treats as replicas of an item hold different bytes."""


class TurboWriter(StorageWriter, AsyncStager):
    """Writes a DCP checkpoint as content-addressed chunks plus a JSON manifest.

    Args:
        url: checkpoint location, a path or fsspec URL (``s3://bucket/run/step-100``).
        storage_options: passed to fsspec unchanged (endpoint, key, secret, ...).
        store: chunk store URL; defaults to the checkpoint's parent (the run).
        chunk_size: bytes per chunk of large tensors (the unit of parallelism and dedup).
        pool_bytes: host staging pool size; default: see ``staging.default_pool_bytes``.
        balance: split replicated items over their holders (False: DCP's whole-item dedup).
        weights: per-rank relative upload bandwidth for the balanced plan.
        replica_check: "sample" (cheap fingerprint), "full" (hash every replica) or "off".
        on_replica_mismatch: "warn" or "raise" (the checkpoint is then not committed).
        snapshot: copy CPU tensors before upload (set by ``ct.save``; DCP's own sync save
            blocks the caller, so reading CPU tensors in place is safe there).
    """

    def __init__(
        self,
        url: str,
        storage_options: dict[str, Any] | None = None,
        *,
        store: str | None = None,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        pack_threshold: int = DEFAULT_PACK_THRESHOLD,
        pool_bytes: int | None = None,
        balance: bool = True,
        weights: list[float] | None = None,
        replica_check: str = "sample",
        on_replica_mismatch: str = "warn",
        snapshot: bool = False,
    ) -> None:
        if replica_check not in ("sample", "full", "off"):
            raise ValueError("replica_check must be 'sample', 'full' or 'off'")
        if on_replica_mismatch not in ("warn", "raise"):
            raise ValueError("on_replica_mismatch must be 'warn' or 'raise'")
        self.url = str(url)
        self.storage_options = storage_options
        self.store_url = store
        self.chunk_size = int(chunk_size)
        self.pack_threshold = int(pack_threshold)
        self.pool_bytes = pool_bytes
        self.balance = balance
        self.weights = weights
        self.replica_check = replica_check
        self.on_replica_mismatch = on_replica_mismatch
        self.snapshot = snapshot
        self.rank = 0
        self.is_coordinator = True
        self.save_id = uuid.uuid4().hex
        self.on_staged: Callable[[], None] | None = None
        self.last_stats: dict[str, Any] = {}
        self.plan_cache_hits = 0
        self._init_runtime()

    def _init_runtime(self) -> None:
        self._location: Location | None = None
        self._pool: HostBufferPool | None = None
        self._copier = DeviceCopier()
        self._known: set[str] | None = None
        self._known_generation: str | None = None
        self._cached_plan: tuple[tuple, list[Assignment]] | None = None
        self._last_signature: str | None = None
        self._staged_buffers: collections.deque[list[HostBuffer]] = collections.deque()

    def __getstate__(self) -> dict[str, Any]:
        state = {k: v for k, v in self.__dict__.items() if not k.startswith("_")}
        state["on_staged"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_runtime()

    @property
    def location(self) -> Location:
        if self._location is None or self._location.url != self.url:
            self._location = Location(self.url, self.storage_options, self.store_url)
        return self._location

    # --- DCP StorageWriter protocol -------------------------------------------------
    def reset(self, checkpoint_id: Any = None) -> None:
        if checkpoint_id is not None:
            self.url = str(checkpoint_id)
        self.save_id = uuid.uuid4().hex

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.rank = int(kwargs.get("rank", 0) or 0)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return isinstance(checkpoint_id, str) or hasattr(checkpoint_id, "__fspath__")

    @property
    def checkpoint_id(self) -> str:
        return self.url

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.url, save_id=self.save_id)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        items = tuple((item.index, _item_nbytes(item)) for item in plan.items
                      if item.type != WriteItemType.BYTE_IO)
        signature = _signature(items)
        cached = signature if signature == self._last_signature else None
        self._last_signature = signature
        # With a cached plan the item list is not sent again: only its signature.
        holdings = Holdings(self.rank, () if cached else items, signature)
        return dataclasses.replace(plan, storage_data=holdings)

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        location = self.location
        location.store.check_reachable()
        generation = catalog.begin_save(location, self.save_id)
        holdings = [p.storage_data for p in plans]
        if not all(isinstance(h, Holdings) for h in holdings):
            raise CkptTurboError("TurboWriter.prepare_global_plan got plans it did not prepare")
        key = tuple(h.signature for h in holdings)
        silent = any(not h.items and h.signature != _signature(()) for h in holdings)
        if self._cached_plan is not None and self._cached_plan[0] == key:
            assignments = self._cached_plan[1]
            self.plan_cache_hits += 1
        else:
            # A rank that sent only its signature expected a cached plan this coordinator
            # does not have: fall back to DCP's whole-item choice, which needs no item list.
            assignments = self._assign(plans, holdings, balance=self.balance and not silent)
            self._cached_plan = (key, assignments)
        by_index = {item.index: item for p in plans for item in p.items}
        out = []
        for plan, assignment in zip(plans, assignments):
            kept_objects = [i for i in plan.items if i.type == WriteItemType.BYTE_IO]
            tensors = [by_index[idx] for idx in assignment.ranges if idx in by_index]
            checks = [by_index[idx] for idx in assignment.replicated
                      if idx in by_index and idx not in assignment.ranges]
            final = dataclasses.replace(
                assignment, gc_generation=generation, save_id=self.save_id)
            out.append(dataclasses.replace(plan, items=kept_objects + tensors + checks,
                                           storage_data=final))
        return out

    def _assign(self, plans: list[SavePlan], holdings: list[Holdings],
                balance: bool) -> list[Assignment]:
        world = len(plans)
        holders: dict[MetadataIndex, list[int]] = defaultdict(list)
        sizes: dict[MetadataIndex, int] = {}
        for h in holdings:
            for idx, nbytes in h.items:
                holders[idx].append(h.rank if world > 1 else 0)
                sizes[idx] = nbytes
        if not balance:
            # DCP's own dedup already chose one rank per item: keep its choice.
            ranges_by_rank = [{i.index: ((0, _item_nbytes(i)),) for i in p.items
                               if i.type != WriteItemType.BYTE_IO} for p in plans]
        else:
            keys = {idx: f"{idx.fqn}@{','.join(map(str, idx.offset or ()))}" for idx in holders}
            back = {v: k for k, v in keys.items()}
            items = [PlanItem(keys[idx], sizes[idx], tuple(sorted(set(r))))
                     for idx, r in holders.items()]
            per_rank = plan_writes(items, world, chunk_size=self.chunk_size, weights=self.weights)
            ranges_by_rank = []
            for ranges in per_rank:
                mine: dict[MetadataIndex, list[tuple[int, int]]] = defaultdict(list)
                for r in ranges:
                    mine[back[r.key]].append((r.start, r.end))
                ranges_by_rank.append({k: tuple(v) for k, v in mine.items()})
        replicated = frozenset(idx for idx, r in holders.items() if len(set(r)) > 1)
        out = []
        for rank in range(world):
            held = {idx for idx, _ in holdings[rank].items}
            out.append(Assignment(ranges_by_rank[rank], frozenset(replicated & held), "", ""))
        return out

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> torch.futures.Future:
        started = time.monotonic()
        assignment = plan.storage_data if isinstance(plan.storage_data, Assignment) else None
        try:
            results = self._write(plan, planner, assignment, started)
        finally:
            if self._staged_buffers and self._pool is not None:
                for buf in self._staged_buffers.popleft():
                    self._pool.release(buf)
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(results)
        return fut

    def _write(self, plan: SavePlan, planner: SavePlanner, assignment: Assignment | None,
               started: float) -> list[WriteResult]:
        location = self.location
        self._refresh_known(location, assignment.gc_generation if assignment else None)
        entries: list[_Entry] = []
        fingerprints: dict[MetadataIndex, str] = {}
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                data = planner.resolve_data(item).getvalue()
                flat = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else \
                    torch.empty(0, dtype=torch.uint8)
                entries.append(_Entry(item.index, flat, [(0, len(data))], "bytes"))
                continue
            flat = tensor_bytes(planner.resolve_data(item))
            if assignment is not None and item.index in assignment.replicated:
                fingerprints[item.index] = self._fingerprint(flat)
            if assignment is None:
                ranges = [(0, flat.numel())]
            else:
                ranges = list(assignment.ranges.get(item.index, ()))
            if ranges:
                entries.append(_Entry(item.index, flat, ranges, "tensor"))
        stats = self._stage_and_upload(entries, location)
        results = []
        for entry in entries:
            chunk_sizes = {p.chunk: stats["chunk_sizes"][p.chunk] for p in entry.pieces}
            written = stats["written_by_entry"].get(id(entry), 0)
            reused = stats["reused_by_entry"].get(id(entry), 0)
            part = ShardPart(entry.kind, entry.flat.numel(), entry.pieces, chunk_sizes, written,
                             reused, fingerprints.pop(entry.index, None))
            results.append(WriteResult(index=entry.index, size_in_bytes=sum(
                p.length for p in entry.pieces), storage_data=part))
        for idx, fp in fingerprints.items():  # replicas this rank holds but did not write
            results.append(WriteResult(index=idx, size_in_bytes=0, storage_data=ShardPart(
                "tensor", -1, [], {}, fingerprint=fp)))
        self.last_stats = {k: v for k, v in stats.items() if not k.endswith("_entry")
                           and k != "chunk_sizes"}
        self.last_stats["seconds_write"] = time.monotonic() - started
        return results

    def _fingerprint(self, flat: torch.Tensor) -> str:
        """A hash of the whole item ("full") or of three small windows of it ("sample")."""
        if self.replica_check == "off":
            return ""
        n = flat.numel()
        if self.replica_check == "full" or n <= 3 * REPLICA_SAMPLE_BYTES:
            data = flat.cpu()
        else:
            mid = n // 2
            data = torch.cat([flat[:REPLICA_SAMPLE_BYTES], flat[mid:mid + REPLICA_SAMPLE_BYTES],
                              flat[-REPLICA_SAMPLE_BYTES:]]).cpu()
        return chunk_id(data.numpy())

    def _refresh_known(self, location: Location, generation: str | None) -> None:
        """Chunks known to be in the store; relisted when a gc may have deleted some."""
        if self._known is not None and generation == self._known_generation:
            return
        listed = location.chunk_store.list_files(location.chunks_root)
        self._known = {info.path.rsplit("/", 1)[-1] for info in listed}
        self._known_generation = generation

    def _ensure_pool(self, share: int) -> HostBufferPool:
        if self._pool is None:
            capacity = self.pool_bytes or default_pool_bytes(share, self.chunk_size)
            self._pool = HostBufferPool(max(capacity, self.chunk_size))
        return self._pool

    def _stage_and_upload(self, entries: list[_Entry], location: Location) -> dict[str, Any]:
        """Copy each chunk into the pool (the only part training waits for), then hash and
        upload it on the I/O pool; a pool smaller than the state stages in waves."""
        layouts = layout_chunks(
            [(i, s, e) for i, entry in enumerate(entries) for s, e in entry.ranges if e > s],
            self.chunk_size, self.pack_threshold)
        share = sum(lay.nbytes for lay in layouts)
        store = location.chunk_store
        inflight: dict[str, Future] = {}
        futures = []
        stats: dict[str, Any] = {"bytes_staged": 0, "bytes_written": 0, "bytes_reused": 0,
                                 "chunks_written": 0, "chunks_reused": 0, "chunk_sizes": {},
                                 "written_by_entry": defaultdict(int),
                                 "reused_by_entry": defaultdict(int)}
        events: list[Any] = []
        deferred: list[tuple] = []  # uploads wait until staging is done: on few cores
        # hashing competes with the copy the training loop is waiting for
        t0 = time.monotonic()

        def start_uploads() -> None:
            for lay, args in deferred:
                futures.append((lay, store.submit(self._hash_and_put, *args)))
            deferred.clear()

        for lay in layouts:
            first = lay.pieces[0]
            source = entries[first.key].flat
            zero_copy = (len(lay.pieces) == 1 and source.device.type == "cpu"
                         and not self.snapshot)
            if zero_copy:
                view, buf, event = source[first.start:first.end], None, None
            else:
                pool = self._ensure_pool(share)
                try:
                    buf = pool.acquire(lay.nbytes, timeout=0)
                except TimeoutError:  # the pool is full: uploads must free it (waves)
                    start_uploads()
                    buf = pool.acquire(lay.nbytes)
                view, pos, event = buf.tensor, 0, None
                for p in lay.pieces:
                    event = self._copier.copy(view[pos:pos + p.nbytes],
                                              entries[p.key].flat[p.start:p.end]) or event
                    pos += p.nbytes
                stats["bytes_staged"] += lay.nbytes
            events.append(event)
            deferred.append((lay, (view, buf, event, location, inflight)))
        for event in events:
            DeviceCopier.wait(event)
        stats["seconds_stage"] = time.monotonic() - t0
        if self.on_staged is not None:  # every byte is in host memory: training may go on
            self.on_staged()
        start_uploads()
        first_error: BaseException | None = None
        for lay, fut in futures:
            try:
                cid, new = fut.result()
            except BaseException as exc:  # noqa: BLE001 - drain every upload, raise the first
                first_error = first_error or exc
                continue
            stats["chunk_sizes"][cid] = lay.nbytes
            owner = id(entries[lay.pieces[0].key])
            if new:
                stats["bytes_written"] += lay.nbytes
                stats["chunks_written"] += 1
                stats["written_by_entry"][owner] += lay.nbytes
            else:
                stats["bytes_reused"] += lay.nbytes
                stats["chunks_reused"] += 1
                stats["reused_by_entry"][owner] += lay.nbytes
            offset = 0
            for p in lay.pieces:
                entries[p.key].pieces.append(StoredPiece(p.start, p.nbytes, cid, offset))
                offset += p.nbytes
        if first_error is not None:
            raise first_error
        for entry in entries:
            entry.pieces.sort(key=lambda p: p.start)
        stats["seconds_upload"] = time.monotonic() - t0
        return stats

    def _hash_and_put(self, view: torch.Tensor, buf: HostBuffer | None, event: Any,
                      location: Location, inflight: dict[str, Future]) -> tuple[str, bool]:
        try:
            DeviceCopier.wait(event)
            data = view.numpy()
            cid = chunk_id(data)
            known = self._known if self._known is not None else set()
            if cid in known:
                return cid, False
            mine: Future = Future()
            other = inflight.setdefault(cid, mine)
            if other is not mine:  # the same bytes are being uploaded by another task
                other.result()
                return cid, False
            try:
                location.chunk_store.put(location.chunk_path(cid), memoryview(data))
                known.add(cid)
                mine.set_result(True)
            except BaseException as exc:
                mine.set_exception(exc)
                raise
            return cid, True
        finally:
            if buf is not None:
                self._pool.release(buf)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        location = self.location
        parts: dict[MetadataIndex, list[ShardPart]] = defaultdict(list)
        for rank_results in results:
            for wr in rank_results:
                parts[wr.index].append(wr.storage_data)
        self._check_replicas(parts)
        chunks: dict[str, int] = {}
        items: dict[str, ItemRecord] = {}
        written = reused = 0
        for fqn, md in metadata.state_dict_metadata.items():
            if isinstance(md, BytesStorageMetadata):
                shard, w, r = _merge(parts.get(MetadataIndex(fqn), []), fqn, (), (), chunks)
                items[fqn] = ItemRecord("bytes", [shard])
            else:
                shards = []
                w = r = 0
                for c in md.chunks:
                    shard, dw, dr = _merge(parts.get(MetadataIndex(fqn, c.offsets), []), fqn,
                                           tuple(c.offsets), tuple(c.sizes), chunks)
                    shards.append(shard)
                    w, r = w + dw, r + dr
                items[fqn] = ItemRecord("tensor", shards, md.properties.dtype, tuple(md.size),
                                        bool(md.properties.requires_grad))
            written, reused = written + w, reused + r
        manifest = Manifest(
            items=items, chunks=chunks, planner_data=metadata.planner_data,
            storage_meta={"checkpoint_id": self.url, "save_id": self.save_id},
            stats={"bytes_written": written, "bytes_reused": reused, "world_size": len(results)},
            chunk_store=location.chunk_store_ref, dcp_version=metadata.version)
        location.write_manifest(manifest)
        catalog.end_save(location, self.save_id)
        log.info("committed %s: %d items, %d new bytes, %d reused", self.url, len(items),
                 written, reused)

    def _check_replicas(self, parts: dict[MetadataIndex, list[ShardPart]]) -> None:
        for idx, plist in parts.items():
            prints = {p.fingerprint for p in plist if p.fingerprint}
            if len(prints) > 1:
                msg = (f"replicas of {idx.fqn!r} (offset {tuple(idx.offset or ())}) differ across "
                       "ranks: DCP treats them as identical and would save only one copy")
                if self.on_replica_mismatch == "raise":
                    raise ReplicaMismatchError(msg + "; the checkpoint was not committed")
                log.warning(msg)

    # --- AsyncStager protocol (dcp.async_save) ------------------------------------------
    _synchronize_after_execute = False

    def stage(self, state_dict: dict[str, Any]) -> Future[dict[str, Any]]:
        """Copy the state into pool-backed host tensors; the returned future resolves when
        the copies are complete, and DCP uploads from those copies in the background."""
        sizes = _tree_tensor_bytes(state_dict)
        pool = self._ensure_pool(sizes)
        events: list[Any] = []
        self._staged_buffers.append([])
        staged = _map_tensors(state_dict, lambda t: self._stage_tensor(t, pool, events))
        fut: Future[dict[str, Any]] = Future()
        for event in events:
            DeviceCopier.wait(event)
        fut.set_result(staged)
        return fut

    def _stage_tensor(self, t: torch.Tensor, pool: HostBufferPool, events: list[Any]) -> torch.Tensor:
        flat = tensor_bytes(t)
        n = flat.numel()
        buf = None
        if 0 < n <= pool.capacity - pool.in_use:
            try:
                buf = pool.acquire(n, timeout=0)
            except TimeoutError:
                buf = None  # fragmented: fall back to a one-off allocation
        if buf is not None:
            self._staged_buffers[-1].append(buf)
            host = buf.tensor
        else:  # bigger than what is left of the pool: a one-off allocation, freed after use
            host = torch.empty(n, dtype=torch.uint8, pin_memory=pool.pin and n > 0)
        events.append(self._copier.copy(host, flat))
        return host.view(t.dtype).reshape(t.shape)

    def synchronize_staging(self) -> None:
        """Nothing to do: stage() returns only once its copies are complete."""

    def close(self) -> None:
        if self._location is not None:
            self._location.store.close()


def _merge(plist: list[ShardPart], fqn: str, offsets: tuple, sizes: tuple,
           chunks: dict[str, int]) -> tuple[ShardRecord, int, int]:
    data_parts = [p for p in plist if p.nbytes >= 0]
    if not data_parts:
        raise StorageError(f"no rank wrote {fqn!r} at offset {offsets}: the save is incomplete")
    nbytes = data_parts[0].nbytes
    pieces = sorted((piece for p in data_parts for piece in p.pieces), key=lambda p: p.start)
    for p in data_parts:
        chunks.update(p.chunk_sizes)
    record = ShardRecord(offsets, sizes, nbytes, pieces)
    record.check(fqn)
    return record, sum(p.written for p in data_parts), sum(p.reused for p in data_parts)


def _item_nbytes(item: WriteItem) -> int:
    td = item.tensor_data
    n = 1
    for s in td.chunk.sizes:
        n *= s
    return n * td.properties.dtype.itemsize


def _signature(items: tuple[tuple[MetadataIndex, int], ...]) -> str:
    doc = [(i.fqn, list(i.offset or ()), n) for i, n in items]
    return chunk_id(json.dumps(doc).encode())


def _tree_tensor_bytes(obj: Any) -> int:
    total = 0

    def add(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    _map_tensors(obj, add)
    return total


def _map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Rebuild containers with every tensor (DTensor: its local shard) passed through fn."""
    from torch.distributed.tensor import DTensor

    if isinstance(obj, DTensor):
        local = fn(obj.to_local())
        return DTensor.from_local(local, obj.device_mesh, obj.placements, run_check=False,
                                  shape=obj.shape, stride=obj.stride())
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_map_tensors(v, fn) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_map_tensors(v, fn) for v in obj)
    return obj
