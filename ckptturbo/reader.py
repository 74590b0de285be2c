"""TurboReader: a DCP StorageReader that verifies every byte and reads each chunk once.

Metadata comes from the JSON manifest (nothing stored is unpickled by the reader).
Each rank works out which chunks its read items touch; with a process group and
``broadcast=True`` the coordinator assigns every chunk to one reader among the ranks that
need it and the others receive it down a pipelined chain (``broadcast.py``), so storage
serves each chunk once however many ranks load it. Every chunk is checked against its
BLAKE3 id before any of its bytes reach a tensor.
"""
from __future__ import annotations

import dataclasses
import io
import logging
import threading
import warnings
from collections import defaultdict
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader

from .chunks import chunk_id
from .errors import CkptTurboError, FormatError, IntegrityError, MismatchError
from .layout import Location, Manifest, ShardRecord
from .plan import ReadNeed, plan_reads

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReadChains:
    """The coordinator's read plan, the same on every rank: (chunk, nbytes, chain) rows."""

    rows: tuple[tuple[str, int, tuple[int, ...]], ...]


class TurboReader(StorageReader):
    """Loads a checkpoint written by TurboWriter.

    Args:
        url: checkpoint location (path or fsspec URL).
        storage_options: passed to fsspec unchanged.
        verify: check every chunk's BLAKE3 id (default True).
        broadcast: with a process group, read each chunk from storage once and forward
            it to the other ranks that need it. "auto" (default) does so for object stores;
            local files are read by every rank, since ranks of one node share the page
            cache, which is faster than forwarding. True forces it (e.g. a shared network
            file system mounted as a local path).
        read_ahead_bytes: how many fetched-but-unconsumed bytes a rank may hold.
        piece_size: forwarding unit of the chain broadcast.
        timeout: seconds before a silent peer makes every rank fail.
        process_group: the group DCP loads with (default: the world); chunks are forwarded
            over it.
        allow_pickle: DCP's planner unpickles non-tensor objects with
            ``torch.load(weights_only=False)``; by default the reader first proves each such
            object loads with ``weights_only=True`` and refuses it otherwise.
    """

    def __init__(
        self,
        url: str,
        storage_options: dict[str, Any] | None = None,
        *,
        verify: bool = True,
        broadcast: bool | str = "auto",
        read_ahead_bytes: int = 1 << 30,
        piece_size: int = 8 << 20,
        timeout: float = 300.0,
        allow_pickle: bool = False,
        process_group: Any = None,
    ) -> None:
        self.url = str(url)
        self.storage_options = storage_options
        self.verify = verify
        self.broadcast = broadcast
        self.read_ahead_bytes = read_ahead_bytes
        self.piece_size = piece_size
        self.timeout = timeout
        self.allow_pickle = allow_pickle
        self.process_group = process_group
        self.rank = 0
        self.is_coordinator = True
        self.bytes_from_storage = 0
        self._location: Location | None = None
        self._manifest: Manifest | None = None
        self._shards: dict[MetadataIndex, ShardRecord] = {}
        self._chunk_sizes: dict[str, int] = {}
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.update(_location=None, _lock=None, process_group=None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    # --- DCP StorageReader protocol -------------------------------------------------
    def reset(self, checkpoint_id: Any = None) -> None:
        if checkpoint_id is not None:
            self.url = str(checkpoint_id)
            self._location = None
            self._manifest = None
        self.bytes_from_storage = 0

    @property
    def checkpoint_id(self) -> str:
        return self.url

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return isinstance(checkpoint_id, str) or hasattr(checkpoint_id, "__fspath__")

    def read_manifest(self) -> Manifest:
        if self._manifest is None:
            manifest = Location(self.url, self.storage_options).read_manifest()
            self._location = Location.for_manifest(self.url, self.storage_options, manifest)
            self._manifest = manifest
        return self._manifest

    @property
    def location(self) -> Location:
        if self._location is None:
            self.read_manifest()
        return self._location

    def read_metadata(self) -> Metadata:
        return self.read_manifest().to_metadata()

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.rank = int(kwargs.get("rank", 0) or 0)
        self._shards = dict(metadata.storage_data or {})
        self._chunk_sizes = dict(self.read_manifest().chunks)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def _broadcasting(self) -> bool:
        if self.broadcast == "auto":
            return not self.location.chunk_store.is_local
        return bool(self.broadcast)

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        if not self._broadcasting() or len(plans) < 2:
            return plans
        needers: dict[str, set[int]] = defaultdict(set)
        for rank, plan in enumerate(plans):
            for cid in self._chunks_of(plan.items):
                needers[cid].add(rank)
        needs = [ReadNeed(cid, self._chunk_sizes[cid], tuple(sorted(ranks)))
                 for cid, ranks in sorted(needers.items())]
        chains = ReadChains(tuple((a.chunk, a.nbytes, tuple(a.chain))
                                  for a in plan_reads(needs, len(plans))))
        return [dataclasses.replace(p, storage_data=chains) for p in plans]

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future:
        jobs = [self._job(item, planner) for item in plan.items]
        chains = plan.storage_data if isinstance(plan.storage_data, ReadChains) else None
        needed = self._chunks_of(plan.items)
        if chains is not None and dist.is_initialized():
            chunks = self._broadcast_chunks(chains, needed)
        else:
            chunks = self._fetch_chunks(needed, self._in_place_targets(jobs))
        self._consume(jobs, chunks, planner)
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(None)
        return fut

    # --- planning helpers -----------------------------------------------------------
    def _shard(self, item: ReadItem) -> ShardRecord:
        try:
            return self._shards[item.storage_index]
        except KeyError:
            raise MismatchError(f"{item.storage_index.fqn!r}: the checkpoint has no shard at "
                                f"offset {tuple(item.storage_index.offset or ())}") from None

    def _span(self, item: ReadItem) -> tuple[int, int]:
        """The byte range of the shard that holds the requested box (row-major)."""
        shard = self._shard(item)
        if item.type == LoadItemType.BYTE_IO:
            return 0, shard.nbytes
        if any(n == 0 for n in item.lengths):
            return 0, 0
        strides = _row_major_strides(shard.sizes)
        first = sum(o * s for o, s in zip(item.storage_offsets, strides))
        last = sum((o + n - 1) * s for o, n, s in zip(item.storage_offsets, item.lengths, strides))
        itemsize = shard.nbytes // max(1, _numel(shard.sizes))
        return first * itemsize, (last + 1) * itemsize

    def _chunks_of(self, items: list[ReadItem]) -> list[str]:
        seen: dict[str, None] = {}
        for item in items:
            start, end = self._span(item)
            for p in self._shard(item).pieces:
                if p.start < end and p.start + p.length > start:
                    seen.setdefault(p.chunk, None)
        return list(seen)

    def _job(self, item: ReadItem, planner: LoadPlanner) -> "_Job":
        shard = self._shard(item)
        start, end = self._span(item)
        fqn = item.dest_index.fqn
        if item.type == LoadItemType.BYTE_IO:
            return _Job(item, shard, start, end, None, bytearray(end - start))
        target = planner.resolve_tensor(item)
        meta = self.read_manifest().items.get(item.storage_index.fqn)
        stored_dtype = meta.dtype if meta is not None else target.dtype
        if target.dtype != stored_dtype:
            raise MismatchError(f"{fqn!r}: checkpoint holds {stored_dtype}, the state dict "
                                f"expects {target.dtype} (convert after loading instead)")
        if tuple(target.shape) != tuple(item.lengths):
            raise MismatchError(f"{fqn!r}: destination box {tuple(target.shape)} does not match "
                                f"the stored box {tuple(item.lengths)}")
        full = (start, end) == (0, shard.nbytes) and tuple(item.lengths) == tuple(shard.sizes)
        if full and target.is_contiguous() and target.device.type == "cpu":
            dest = target.reshape(-1).view(torch.uint8) if target.numel() else None
            return _Job(item, shard, start, end, target, dest, direct=True)
        return _Job(item, shard, start, end, target, bytearray(end - start))

    # --- chunk sources ---------------------------------------------------------------
    def _in_place_targets(self, jobs: list["_Job"]) -> dict[str, memoryview]:
        """Chunks that are exactly one slice of one destination tensor: those are read
        straight into the tensor's memory and verified there, with no buffer or copy."""
        users: dict[str, int] = defaultdict(int)
        for job in jobs:
            for p in job.shard.pieces:
                if p.start < job.end and p.start + p.length > job.start:
                    users[p.chunk] += 1
        targets: dict[str, memoryview] = {}
        for job in jobs:
            if not job.direct or job.dest is None:
                continue
            for p in job.shard.pieces:
                if users[p.chunk] == 1 and p.offset == 0 and p.length == self._chunk_sizes[p.chunk]:
                    targets[p.chunk] = memoryview(job.dest[p.start:p.start + p.length].numpy())
                    job.in_place.add(p.chunk)
        return targets

    def _fetch_verified(self, cid: str, out: memoryview | None = None) -> memoryview:
        location = self.location
        size = self._chunk_sizes[cid]
        view = memoryview(bytearray(size)) if out is None else out
        if size:
            location.chunk_store.get_into(location.chunk_path(cid), view)
        with self._lock:
            self.bytes_from_storage += size
        self._check(cid, view)
        return view

    def _check(self, cid: str, data: memoryview) -> None:
        if not self.verify:
            return
        actual = chunk_id(data)
        if actual != cid:
            users = sorted({fqn for fqn, item in self.read_manifest().items.items()
                            for s in item.shards for p in s.pieces if p.chunk == cid})
            raise IntegrityError(
                f"chunk {self.location.chunk_path(cid)} is corrupt: expected BLAKE3 {cid}, got "
                f"{actual}; it holds bytes of {', '.join(map(repr, users[:20]))}"
                f"{' ...' if len(users) > 20 else ''} in checkpoint {self.url}")

    def _fetch_chunks(self, cids: list[str], into: dict[str, memoryview] | None = None
                      ) -> Iterator[tuple[str, memoryview]]:
        """Parallel GETs in first-use order, at most read_ahead_bytes outstanding."""
        prefetch = _Prefetcher(self, cids, into)
        try:
            for cid in cids:
                yield cid, prefetch.take(cid)
        finally:
            prefetch.close()

    def _broadcast_chunks(self, chains: ReadChains, needed: list[str]) -> Iterator[tuple[str, memoryview]]:
        """Chunks arrive from storage (this rank heads the chain) or from a peer.

        A local failure never breaks a chain: a head that cannot read or verify its chunk
        forwards zeros (every receiver then fails verification and names the chunk), and a
        receiver whose copy is corrupt keeps forwarding. Failures are raised once the
        broadcast is over, so no rank is left waiting on a peer that gave up.
        """
        from .broadcast import ChainBroadcaster, Transfer

        transfers = [Transfer(tid, nbytes, chain) for tid, (_, nbytes, chain) in enumerate(chains.rows)]
        ids = [cid for cid, _, _ in chains.rows]
        headed = [t for t in transfers if t.chain[0] == self.rank]
        prefetch = _Prefetcher(self, [ids[t.tid] for t in headed])
        arrived: list[tuple[str, memoryview]] = []
        ready = threading.Condition()
        failures: list[BaseException] = []
        bad: set[str] = set()
        finished = [False]

        def source(t: Transfer) -> Iterator[torch.Tensor]:
            cid = ids[t.tid]
            try:
                data = prefetch.take(cid)
            except CkptTurboError as exc:
                failures.append(exc)
                bad.add(cid)
                yield torch.zeros(t.nbytes, dtype=torch.uint8)
                return
            yield _as_uint8(data)

        def sink(t: Transfer, buf: torch.Tensor) -> None:
            cid = ids[t.tid]
            if cid in bad:
                return
            data = memoryview(buf.cpu().numpy()).cast("B")
            if t.chain[0] != self.rank:
                try:
                    self._check(cid, data)
                except IntegrityError as exc:
                    failures.append(exc)
                    return
            with ready:
                arrived.append((cid, data))
                ready.notify_all()

        def run() -> None:
            try:
                ChainBroadcaster(self.process_group, piece_size=self.piece_size,
                                 timeout=self.timeout).run(transfers, source, sink)
            except BaseException as exc:  # noqa: BLE001 - handed to the consuming thread
                failures.insert(0, exc)
            finally:
                prefetch.close()
                with ready:
                    finished[0] = True
                    ready.notify_all()

        thread = threading.Thread(target=run, name="ckptturbo-broadcast", daemon=True)
        thread.start()
        wanted = set(needed)
        while True:
            with ready:
                while not arrived and not finished[0]:
                    ready.wait()
                batch, arrived[:] = list(arrived), []
                done = finished[0]
            for cid, data in batch:
                if cid in wanted and not failures:
                    yield cid, data
            if done and not batch:
                break
        thread.join()
        if failures:
            raise failures[0]

    # --- consumption -----------------------------------------------------------------
    def _consume(self, jobs: list["_Job"], chunks: Iterator[tuple[str, memoryview]],
                 planner: LoadPlanner) -> None:
        """Copy each verified chunk's bytes into every job that needs them; finish a job
        once all its bytes are in. Chunks are dropped as soon as they are consumed."""
        waiting: dict[str, list[_Job]] = defaultdict(list)
        for job in jobs:
            for p in job.shard.pieces:
                if p.start < job.end and p.start + p.length > job.start:
                    if job not in waiting[p.chunk]:
                        waiting[p.chunk].append(job)
                    job.missing += 1
            if job.missing == 0:
                self._finish(job, planner)
        for cid, data in chunks:
            for job in waiting.pop(cid, ()):
                job.fill(cid, data)
                if job.missing == 0:
                    self._finish(job, planner)
        unfinished = [j.item.dest_index.fqn for j in jobs if not j.done]
        if unfinished:
            raise CkptTurboError(f"load incomplete: no bytes arrived for {unfinished[:5]}")

    def _finish(self, job: "_Job", planner: LoadPlanner) -> None:
        job.done = True
        item = job.item
        if item.type == LoadItemType.BYTE_IO:
            data = bytes(job.dest)
            if not self.allow_pickle:
                _refuse_unsafe_pickle(data, item.dest_index.fqn, self.url)
            planner.load_bytes(item, io.BytesIO(data))
            return
        target = job.target
        if not job.direct and target.numel():
            shard = job.shard
            flat = _frombuffer(job.dest).view(target.dtype)
            src = torch.as_strided(flat, tuple(item.lengths), _row_major_strides(shard.sizes), 0)
            target.copy_(src)
        planner.commit_tensor(item, target)


class _Prefetcher:
    """Reads chunks in the order they will be taken (first use, or chain order for the
    chunks a rank heads), several at a time, within the reader's read-ahead budget.
    Chunks with an entry in ``into`` are read straight into that memory."""

    def __init__(self, reader: "TurboReader", cids: list[str],
                 into: dict[str, memoryview] | None = None) -> None:
        self._reader = reader
        self._into = into or {}
        self._queue = list(reversed(cids))
        self._futures: dict[str, Future] = {}
        self._outstanding = 0
        self._lock = threading.Lock()
        self._fill()

    def _fill(self) -> None:
        store = self._reader.location.chunk_store
        sizes = self._reader._chunk_sizes
        with self._lock:
            while self._queue and (not self._futures or self._outstanding + sizes[self._queue[-1]]
                                   <= self._reader.read_ahead_bytes) \
                    and len(self._futures) < store.max_workers:
                cid = self._queue.pop()
                self._outstanding += sizes[cid]
                self._futures[cid] = store.submit(self._reader._fetch_verified, cid,
                                                  self._into.get(cid))

    def take(self, cid: str) -> memoryview:
        with self._lock:
            fut = self._futures.pop(cid)
        try:
            return fut.result()
        finally:
            with self._lock:
                self._outstanding -= self._reader._chunk_sizes[cid]
            self._fill()

    def close(self) -> None:
        with self._lock:
            for fut in self._futures.values():
                fut.cancel()
            self._futures.clear()
            self._queue.clear()


@dataclass(eq=False)
class _Job:
    """One read item: where its bytes go while chunks arrive."""

    item: ReadItem
    shard: ShardRecord
    start: int
    end: int
    target: torch.Tensor | None
    dest: Any
    direct: bool = False
    missing: int = 0
    done: bool = False
    in_place: set[str] = dataclasses.field(default_factory=set)

    def fill(self, cid: str, data: memoryview) -> None:
        dest = self.dest
        for p in self.shard.pieces:
            if p.chunk != cid:
                continue
            lo, hi = max(p.start, self.start), min(p.start + p.length, self.end)
            if lo >= hi:
                continue
            src = data[p.offset + lo - p.start: p.offset + hi - p.start]
            if cid in self.in_place:
                pass  # the chunk was read into the destination itself
            elif self.direct:
                dest[lo - self.start: hi - self.start].copy_(_frombuffer(src))
            else:
                memoryview(dest)[lo - self.start: hi - self.start] = src
            self.missing -= 1


def _refuse_unsafe_pickle(data: bytes, fqn: str, url: str) -> None:
    """Prove an object loads with torch's restricted unpickler before DCP unpickles it."""
    try:
        torch.load(io.BytesIO(data), weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any refusal means: not provably safe
        raise FormatError(
            f"object {fqn!r} in {url} needs full unpickling, which can run arbitrary code; "
            f"pass allow_pickle=True to TurboReader only for checkpoints you trust ({exc})") from exc


def _frombuffer(buf: Any) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only buffers are never written
        return torch.frombuffer(buf, dtype=torch.uint8)


def _as_uint8(data: memoryview) -> torch.Tensor:
    return _frombuffer(data) if len(data) else torch.empty(0, dtype=torch.uint8)


def _row_major_strides(sizes: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for s in reversed(sizes):
        strides.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(strides))


def _numel(sizes: tuple[int, ...]) -> int:
    n = 1
    for s in sizes:
        n *= s
    return n
