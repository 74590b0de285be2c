"""The save pipeline of one rank: stage -> announce -> hash -> dedup -> put.

Training waits only for the first step. ``Upload.run`` copies every chunk this rank
writes into the host pool and calls ``on_staged``; nothing before that touches storage.
Then it announces the save (``catalog.begin_save``: pending marker, gc-lock wait, gc
generation), brings the run's chunk index up to that generation, and only then hashes
each chunk, skips those the store already holds and uploads the rest on the store's I/O
pool. A pool smaller than the state stages in waves: when it is full, the uploads that
free it must start, so the announcement happens then (staging cannot finish without it).
Results: each entry's stored pieces (``save_plan.encode_results`` packs them) and a ``SaveStats``.
"""
from __future__ import annotations

import functools
import io
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlanner, WriteItem, WriteItemType

from . import catalog, replicas
from .chunk_index import ChunkIndex
from .chunks import ChunkLayout, chunk_id, layout_chunks
from .errors import UnsupportedStateError
from .manifest_records import StoredPiece
from .results import SaveStats
from .runs import RunStore
from .runtime import index_for
from .staging import DeviceCopier, HostBuffer, HostBufferPool, tensor_bytes


@dataclass
class Entry:
    """One item this rank writes: its bytes, the ranges of them it owns, and where they went."""

    index: MetadataIndex
    flat: torch.Tensor  # uint8 view of the item's bytes (device may be cuda)
    ranges: list[tuple[int, int]]
    kind: str
    pieces: list[StoredPiece] = field(default_factory=list)
    written: int = 0
    reused: int = 0


@dataclass(frozen=True)
class _Staged:
    """One chunk's bytes, ready to hash: a pool buffer (or a zero-copy view of the source)."""

    layout: ChunkLayout
    view: torch.Tensor
    buf: HostBuffer | None = None
    pool: HostBufferPool | None = None
    event: Any = None

    def release(self) -> None:
        if self.buf is not None:
            assert self.pool is not None, "a pool buffer is staged with the pool it came from"
            self.pool.release(self.buf)


@dataclass(frozen=True)
class _Stored:
    layout: ChunkLayout
    cid: str
    new: bool


def plan_entries(planner: SavePlanner,
                 writes: list[tuple[WriteItem, list[tuple[int, int]] | None]],
                 checks: list[WriteItem], replica_check: str,
                 url: str) -> tuple[list[Entry], bytes]:
    """The entries this rank writes (``writes``: item and byte ranges, None for all of it),
    and the packed fingerprints of the replicated items it holds (``checks``). What cannot
    be saved (an object pickle refuses, a meta tensor) is an UnsupportedStateError naming it."""
    entries: list[Entry] = []
    for item, ranges in writes:
        if item.type == WriteItemType.BYTE_IO:
            try:
                # DCP resolves a BYTE_IO item to the BytesIO of its pickled object
                data = cast(io.BytesIO, planner.resolve_data(item)).getvalue()
            except Exception as exc:  # noqa: BLE001 - whatever pickling raised, named below
                raise UnsupportedStateError(
                    f"cannot save {item.index.fqn!r} to {url}: the object cannot be "
                    f"serialised ({type(exc).__name__}: {exc})") from exc
            flat = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else \
                torch.empty(0, dtype=torch.uint8)
            entries.append(Entry(item.index, flat, [(0, len(data))], "bytes"))
            continue
        flat = _tensor_bytes(planner, item, url)
        whole = [(0, flat.numel())]
        entries.append(Entry(item.index, flat, list(ranges) if ranges is not None else whole,
                             "tensor"))
    if replica_check == "off" or not checks:
        return entries, b""
    resolved = {e.index: e.flat for e in entries}
    prints = []
    for item in checks:
        held = resolved.get(item.index)
        if held is None:
            held = _tensor_bytes(planner, item, url)
        prints.append((replicas.item_key(item.index), replicas.fingerprint(held, replica_check)))
    return entries, replicas.pack(prints)


def _tensor_bytes(planner: SavePlanner, item: WriteItem, url: str) -> torch.Tensor:
    # only tensor items come here (writes skip BYTE_IO; replica checks compare tensors)
    tensor = cast(torch.Tensor, planner.resolve_data(item))
    if tensor.is_meta:
        raise UnsupportedStateError(f"cannot save {item.index.fqn!r} to {url}: it is a meta "
                                    "tensor, which holds no data (materialise it first)")
    return tensor_bytes(tensor)


def place(entries: list[Entry], stored: Iterable[tuple[ChunkLayout, str, bool]]) -> None:
    """Record where each entry's bytes went: (layout, chunk id, newly written) per chunk."""
    for layout, cid, new in stored:
        owner = entries[layout.pieces[0].key]
        if new:
            owner.written += layout.nbytes
        else:
            owner.reused += layout.nbytes
        offset = 0
        for p in layout.pieces:
            entries[p.key].pieces.append(StoredPiece(p.start, p.nbytes, cid, offset))
            offset += p.nbytes
    for entry in entries:
        entry.pieces.sort(key=lambda p: p.start)


class Upload:
    """One rank's part of one save; ``run`` may be called once."""

    def __init__(self, run_for: Callable[[], RunStore], save_id: str, rank: int, *,
                 pool_for: Callable[[int], HostBufferPool], copier: DeviceCopier,
                 chunk_size: int, pack_threshold: int, snapshot: bool,
                 on_staged: Callable[[], None] | None = None) -> None:
        self._run_for = run_for
        self.save_id = save_id
        self.rank = rank
        self.pool_for = pool_for
        self.copier = copier
        self.chunk_size = chunk_size
        self.pack_threshold = pack_threshold
        self.snapshot = snapshot
        self.on_staged = on_staged
        self.chunk_sizes: dict[str, int] = {}
        self._index: ChunkIndex | None = None
        self._inflight: dict[str, Future] = {}
        self._waiting: list[_Staged] = []  # staged, not yet handed to the I/O pool
        self._futures: list[tuple[ChunkLayout, Future]] = []

    @functools.cached_property
    def run_store(self) -> RunStore:
        """The run's chunk store, opened on first use: after staging, off the stall."""
        return self._run_for()

    def run(self, entries: list[Entry]) -> SaveStats:
        """Stage, announce, then hash/dedup/upload every chunk; fills each entry's pieces."""
        started = time.monotonic()
        try:
            staged_bytes = self._stage(entries)
            staged_at = time.monotonic()
            if self.on_staged is not None:  # every byte is in host memory: training may go on
                self.on_staged()
            self._submit_waiting()
            stored = self._collect()
            if self._index is not None:  # the marker's heartbeat stops; the commit removes it
                catalog.uploaded(self.run_store, self.save_id, self.rank)
        except BaseException:
            self._release_waiting()
            if self._index is not None:  # no manifest will follow: the marker may go now
                catalog.end_save(self.run_store, self.save_id, [self.rank])
            raise
        new = [s for s in stored if s.new]
        place(entries, ((s.layout, s.cid, s.new) for s in stored))
        written = sum(s.layout.nbytes for s in new)
        done = time.monotonic()
        return SaveStats(bytes_staged=staged_bytes, bytes_written=written,
                         bytes_reused=sum(s.layout.nbytes for s in stored) - written,
                         chunks_written=len(new), chunks_reused=len(stored) - len(new),
                         seconds_stage=staged_at - started, seconds_upload=done - started)

    # --- stage: copies only, no storage request -------------------------------------
    def _stage(self, entries: list[Entry]) -> int:
        layouts = layout_chunks(
            [(i, s, e) for i, entry in enumerate(entries) for s, e in entry.ranges if e > s],
            self.chunk_size, self.pack_threshold)
        share = sum(lay.nbytes for lay in layouts)
        staged_bytes = 0
        events: list[Any] = []  # of every wave: staged means all copies are complete
        for lay in layouts:
            first = lay.pieces[0]
            source = entries[first.key].flat
            if len(lay.pieces) == 1 and source.device.type == "cpu" and not self.snapshot:
                self._waiting.append(_Staged(lay, source[first.start:first.end]))
                continue
            pool = self.pool_for(share)
            try:
                buf = pool.acquire(lay.nbytes, timeout=0)
            except TimeoutError:  # the pool is full: only uploads can free it (waves)
                self._submit_waiting()
                buf = pool.acquire(lay.nbytes)
            view, pos, event = buf.tensor, 0, None
            for p in lay.pieces:
                event = self.copier.copy(view[pos:pos + p.nbytes],
                                         entries[p.key].flat[p.start:p.end]) or event
                pos += p.nbytes
            staged_bytes += lay.nbytes
            events.append(event)
            self._waiting.append(_Staged(lay, view, buf, pool, event))
        for event in events:
            DeviceCopier.wait(event)
        return staged_bytes

    # --- announce, then hash -> dedup -> put ----------------------------------------
    def _announce(self) -> ChunkIndex:
        """Pending marker, gc-lock wait, gc generation, chunk index at that generation."""
        if self._index is None:
            index = index_for(self.run_store)
            if not index.listed:  # first contact with this store: fail fast and clearly
                self.run_store.store.check_reachable()
            self._index = index  # set first: a failure below must remove the marker
            catalog.begin_save(self.run_store, self.save_id, self.rank, index=index)
        return self._index

    def _submit_waiting(self) -> None:
        if not self._waiting:
            return
        index = self._announce()
        store = self.run_store.store
        for s in self._waiting:
            self._futures.append((s.layout, store.submit(self._hash_and_put, s, index)))
        self._waiting.clear()

    def _release_waiting(self) -> None:
        for s in self._waiting:
            s.release()
        self._waiting.clear()

    def _collect(self) -> list[_Stored]:
        """Every upload's outcome; all are drained before the first failure is raised."""
        out, first_error = [], None
        for lay, fut in self._futures:
            try:
                cid, new = fut.result()
            except BaseException as exc:  # noqa: BLE001 - re-raised below, after draining
                first_error = first_error or exc
                continue
            self.chunk_sizes[cid] = lay.nbytes
            out.append(_Stored(lay, cid, new))
        if first_error is not None:
            raise first_error
        return out

    def _hash_and_put(self, staged: _Staged, index: ChunkIndex) -> tuple[str, bool]:
        try:
            DeviceCopier.wait(staged.event)
            data = staged.view.numpy().data  # the chunk's bytes, as a memoryview
            cid = chunk_id(data)
            if cid in index:
                return cid, False
            mine: Future = Future()
            other = self._inflight.setdefault(cid, mine)
            if other is not mine:  # the same bytes are being uploaded by another task
                other.result()
                return cid, False
            try:
                self.run_store.store.put(self.run_store.chunk_path(cid), data)
                index.add(cid)
                mine.set_result(True)
            except BaseException as exc:
                mine.set_exception(exc)
                raise
            return cid, True
        finally:
            staged.release()


# --- dcp.async_save: stage a whole state dict into pool-backed tensors -------------------
def stage_state_dict(state_dict: dict[str, Any], pool_for: Callable[[int], HostBufferPool],
                     copier: DeviceCopier) -> tuple[dict[str, Any], list[HostBuffer]]:
    """A copy of the state whose tensors live in the pool (or in one-off host tensors when
    the pool has no room), and the pool buffers to release once the copy is written."""
    pool = pool_for(_tree_tensor_bytes(state_dict))
    events: list[Any] = []
    buffers: list[HostBuffer] = []

    def stage(t: torch.Tensor) -> torch.Tensor:
        flat = tensor_bytes(t)
        n = flat.numel()
        buf = None
        if 0 < n <= pool.capacity - pool.in_use:
            try:
                buf = pool.acquire(n, timeout=0)
            except TimeoutError:
                buf = None  # fragmented: fall back to a one-off allocation
        if buf is not None:
            buffers.append(buf)
            host = buf.tensor
        else:  # bigger than what is left of the pool: a one-off allocation, freed after use
            host = torch.empty(n, dtype=torch.uint8, pin_memory=pool.pin and n > 0)
        events.append(copier.copy(host, flat))
        return host.view(t.dtype).reshape(t.shape)

    staged = _map_tensors(state_dict, stage)
    for event in events:
        DeviceCopier.wait(event)
    return staged, buffers


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
