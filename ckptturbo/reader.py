"""TurboReader: a DCP StorageReader that verifies every byte and reads each chunk once.

Metadata comes from the JSON manifest (nothing stored is unpickled by the reader).
Each rank works out which chunks its read items touch; with a process group and
``broadcast=True`` the coordinator assigns every chunk to one reader among the ranks that
need it and the others receive it down a pipelined chain (``broadcast.py``), so storage
serves each chunk once however many ranks load it. The coordinator schedules the chains
once and sends each rank only its own part (``ReadChains``: its chunks, and its
predecessor and successor in each chain), in a compact form. Every chunk is checked against its
BLAKE3 id by the rank that read it from storage, before any of its bytes reach a tensor
or a peer.
"""
from __future__ import annotations

import dataclasses
import os
from array import array
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader

from .assemble import Job, consume, device_bound, finish_job, in_place_targets, item_span, make_job
from .broadcast_schedule import (
    LOCAL,
    PackedChains,
    Part,
    RotatedChains,
    Rotations,
    rotated_parts,
    schedule_rotations,
)
from .checkpoint_id import servable
from .chunk_cache import CachedChunkSource
from .chunk_source import ChunkSource
from .errors import CkptTurboError, MismatchError
from .groups import Transport, check_transport, load_transport
from .manifest import Manifest
from .manifest_records import ShardRecord
from .plan import ReadNeed, chunks_touched, plan_readers
from .plan.digests import PlanDigest
from .prefetch import MemoryBudget, Prefetcher, Read
from .readonce import Arrivals, ChainSettings, RankBatch, ReadOnce, chain_piece
from .runs import Location
from .runtime import Runtime, resolve, wait_for_saves
from .staging import DeviceCopier, as_uint8
from .stream.cache import DiskCache


class LocalReads(NamedTuple):
    """What a rank adds to its local load plan: the manifest ordinals of the chunks its
    items touch (int32, native order), and its item list itself (pickled as a reference to
    the plan's own list, so it costs nothing on the wire; the coordinator uses it to see
    whether the planner left a rank's items as the rank sent them)."""

    items: list[ReadItem]
    needs: bytes


class ReadChains(NamedTuple):
    """One rank's part of the coordinator's read plan: only what this rank takes part in.

    ``chains``: the transfers (chunk ordinals) of the chunks this rank reads from storage
    (it heads their chain) or receives, with their start steps, grouped by the ranks that
    need them (pickled once for every rank of such a group), from which ``rank``
    computes its own :class:`~ckptturbo.broadcast_schedule.Part` of each (sizes come from
    the manifest); ``plan_id`` is the same on every rank of the load; ``items_as_sent``:
    the plan's items were left out because the rank already has them (its local plan,
    unchanged by the planner)."""

    plan_id: int | None
    piece_size: int
    max_inflight: int
    items_as_sent: bool
    rank: int
    chains: PackedChains


class TurboReader(StorageReader):
    """Loads a checkpoint written by TurboWriter.

    Args:
        url: checkpoint location (path or fsspec URL).
        storage_options: passed to fsspec unchanged.
        verify: where chunks are checked against their BLAKE3 ids. True or "storage"
            (default): by the rank that read them from storage, before they reach a tensor
            or are forwarded; "all": every receiving rank checks them again too (one more
            hash of every forwarded byte per rank); False: not at all (trusted storage).
        broadcast: with a process group, read each chunk from storage once and forward
            it to the other ranks that need it. "auto" (default) does so for object stores;
            local files are read by every rank, since ranks of one node share the page
            cache, which is faster than forwarding. True forces it (e.g. a shared network
            file system mounted as a local path).
        read_ahead_bytes: how many fetched-but-unconsumed bytes a rank may hold.
        piece_size: the largest forwarding unit of the chain broadcast: chains forward
            chunks in pieces of a quarter of the largest chunk, within [512 KiB,
            piece_size] (``readonce.chain_piece``).
        timeout: seconds before a silent peer makes every rank fail.
        process_group: the group DCP loads with (default: the world).
        transport: how forwarded chunks travel. "auto": as CUDA tensors over
            ``process_group`` when it speaks NCCL and most of the load's bytes go to CUDA
            tensors (the rank that read a chunk copies it to its GPU once); else as host
            buffers, on ``process_group`` itself when it carries them (gloo, or
            "cpu:gloo,cuda:nccl"), or on a gloo group over its ranks, created once.
            "gloo": always host buffers on such a dedicated group, apart from the job's
            traffic. ``self.transport_used`` says what the last load chose.
        allow_pickle: the one switch for trusted checkpoints. DCP's planner unpickles
            non-tensor objects with ``torch.load(weights_only=False)``, which can run any
            code. By default (False) the reader first loads each object with torch's
            restricted unpickler (``weights_only=True``, plus ``io.BytesIO`` and whatever
            ``torch.serialization.add_safe_globals`` allows) and hands the planner a fresh
            serialisation of what that produced, or refuses the object with ``FormatError``.
            True hands the stored bytes over unchecked.
        session: the ``ckptturbo.Session`` (a runtime) whose I/O threads and gloo groups this reader
            uses (default: the process's default session).
        cache_dir: a node-local directory shared by the processes of a node (the node's
            cache tier, :mod:`ckptturbo.chunk_cache`): chunks found there are not read from
            storage, chunks read are left there, and a chunk several processes want at
            once is read by one of them. ``cache_bytes`` bounds it (LRU; 64 GiB default).
        manifest: the checkpoint's manifest when the caller has read it, or a view of it
            (``changes`` reads byte spans of tensors as tensors of their own: items made
            of the manifest's chunks, with its chunk table and store); default: read here.

    A save of the same checkpoint in flight in this process (any session) is waited for
    before the manifest is read: a load sees what this process saved before it.

    Tensors are read in their stored dtype and copied into the destination, which casts
    (fp32 stored, bf16 target) exactly as DCP's ``FileSystemReader`` does.
    """

    def __init__(
        self,
        url: str,
        storage_options: dict[str, Any] | None = None,
        *,
        verify: bool | str = True,
        broadcast: bool | str = "auto",
        read_ahead_bytes: int = 1 << 30,
        piece_size: int = 8 << 20,
        timeout: float = 300.0,
        allow_pickle: bool = False,
        process_group: Any = None,
        transport: str = "auto",
        session: Runtime | None = None,
        manifest: Manifest | None = None,
        cache_dir: str | None = None,
        cache_bytes: int | None = None,
    ) -> None:
        self._session = session
        self.url = str(url)
        self.storage_options = storage_options
        self.verify = verify
        self.verify_mode = verify_mode(verify)
        check_transport(transport)
        self.transport = transport
        self.transport_used: Transport | None = None
        self.broadcast = broadcast
        self.read_ahead_bytes = read_ahead_bytes
        self.piece_size = piece_size
        self.timeout = timeout
        self.allow_pickle = allow_pickle
        self.process_group = process_group
        self.rank = 0
        self.is_coordinator = True
        self._source: ChunkSource | None = None
        self._location: Location | None = None
        self._manifest: Manifest | None = manifest
        self.cache_dir = cache_dir
        self.cache_bytes = cache_bytes
        self._shards: Mapping[MetadataIndex, ShardRecord] = {}
        self._chunk_sizes: dict[str, int] = {}
        self._local_items: list[ReadItem] | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.update(_location=None, _source=None, _session=None, process_group=None,
                     transport_used=None)
        return state

    # --- DCP StorageReader protocol -------------------------------------------------
    def reset(self, checkpoint_id: Any = None) -> None:
        if checkpoint_id is not None:
            self.url = str(checkpoint_id)
            self._location = None
            self._manifest = None
        self._source = None

    @property
    def chunks(self) -> ChunkSource:
        """This checkpoint's verified chunk reads (and their counts), since the last reset."""
        if self._source is None:
            if self.cache_dir:
                self._source = CachedChunkSource(self.location, self.read_manifest(), self.url,
                                                 self.verify_mode,
                                                 DiskCache(self.cache_dir, self.cache_bytes),
                                                 self.timeout)
            else:
                self._source = ChunkSource(self.location, self.read_manifest(), self.url,
                                           self.verify_mode)
        return self._source

    @property
    def bytes_from_storage(self) -> int:
        """Bytes this rank read from storage since the last reset (chunks, not the manifest)."""
        return self._source.bytes_from_storage if self._source is not None else 0

    @property
    def chunks_verified(self) -> int:
        """Chunks this rank hashed since the last reset."""
        return self._source.chunks_verified if self._source is not None else 0

    @property
    def checkpoint_id(self) -> str:
        return self.url

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        """True only for local paths and fsspec URLs whose protocols are installed."""
        return servable(checkpoint_id)

    def read_manifest(self) -> Manifest:
        if self._manifest is None:
            wait_for_saves(self.url)
            location = Location(self.url, self.storage_options, session=self.runtime)
            manifest = location.read_manifest()
            self._location = Location.for_manifest(self.url, self.storage_options, manifest,
                                                   session=self.runtime)
            self._manifest = manifest
        return self._manifest

    @property
    def runtime(self) -> Runtime:
        """The runtime whose I/O threads and gloo groups this reader uses (the default one unless
        given; an unpickled reader uses its process's default)."""
        return resolve(self._session)

    @property
    def location(self) -> Location:
        manifest = self.read_manifest()
        if self._location is None:  # unpickled: the manifest travels, the location does not
            self._location = Location.for_manifest(self.url, self.storage_options, manifest,
                                                   session=self.runtime)
        return self._location

    def read_metadata(self) -> Metadata:
        return self.read_manifest().to_metadata()

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.rank = int(kwargs.get("rank", 0) or 0)
        # the manifest's own tables, not copies: its storage_data looks shards up when asked
        self._shards = metadata.storage_data if metadata.storage_data is not None else {}
        self._chunk_sizes = self.read_manifest().chunks

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """With chained loads, tell the coordinator which chunks this rank needs (computed
        here, where the items are, not on the coordinator for every rank)."""
        grouped = plan.planner_data if isinstance(plan.planner_data, PlanDigest) else None
        items = own_items(plan)
        self._local_items = items
        if not (dist.is_initialized() and self._broadcasting()):
            return plan
        if grouped is not None and not grouped.sender:  # the first rank of its group sends
            return plan
        ordinal = self._chunk_ordinals()
        needs = array("i", (ordinal[cid] for cid in self._chunks_of(items)))
        return dataclasses.replace(plan, storage_data=LocalReads(items, needs.tobytes()))

    def _broadcasting(self) -> bool:
        if self.broadcast == "auto":
            return not self.location.chunk_store.is_local
        return bool(self.broadcast)

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """Who reads each chunk from storage and the chain that forwards it, scheduled once
        here; each rank gets back only its own parts (and not the items it sent)."""
        if not self._broadcasting() or len(plans) < 2:
            return [dataclasses.replace(p, storage_data=None)
                    if isinstance(p.storage_data, LocalReads) else p for p in plans]
        settings = ChainSettings(chain_piece(max(self._chunk_sizes.values(), default=0),
                                             self.piece_size))
        groups = self._read_plan(plans, settings)
        chained = any((g.starts != LOCAL).any() for g in groups)
        plan_id = int.from_bytes(os.urandom(7), "little") if chained else None
        out = []
        for member, (plan, mine) in enumerate(zip(plans, _groups_of_ranks(groups, len(plans)),
                                                  strict=True)):
            as_sent = (isinstance(plan.storage_data, LocalReads)
                       and plan.items is plan.storage_data.items)
            chains = ReadChains(plan_id, settings.piece_size, settings.max_inflight, as_sent,
                                member, mine)
            out.append(dataclasses.replace(plan, items=[] if as_sent else plan.items,
                                           storage_data=chains))
        return out

    def _read_plan(self, plans: list[LoadPlan], settings: ChainSettings) -> list[RotatedChains]:
        """Each chunk's reader and the schedule of its chain, from the chunks each rank
        needs. Ranks that need the same chunks (one digest with ``TurboLoadPlanner``, or
        equal needs) are one group, and a chunk's needers are the union of the groups that
        need it, built once per distinct union: O(world + groups x chunks), where a
        whole-state load of thousands of ranks sorted world x chunks (rank, chunk) pairs."""
        ids = list(self._chunk_sizes)
        sizes = np.fromiter(self._chunk_sizes.values(), dtype=np.int64, count=len(ids))
        ordinal = self._chunk_ordinals()
        group_of: dict[str | bytes, int] = {}
        needs_of: list[np.ndarray] = []  # per group, the chunks (ordinals) its ranks need
        ranks_of: list[list[int]] = []
        for rank, plan in enumerate(plans):
            sent = plan.storage_data
            grouped = plan.planner_data if isinstance(plan.planner_data, PlanDigest) else None
            needs: np.ndarray | None = None
            if isinstance(sent, LocalReads):
                needs = np.frombuffer(sent.needs, dtype=np.int32)
            elif grouped is None or grouped.digest not in group_of:
                # a plan that did not pass through prepare_local_plan
                needs = np.array([ordinal[c] for c in self._chunks_of(plan.items)], np.int32)
            key: str | bytes
            if grouped is not None:
                key = grouped.digest
            else:
                assert needs is not None  # computed above for every plan without a digest
                key = needs.tobytes()
            g = group_of.get(key)
            if g is None:
                assert needs is not None  # a digest seen first is its sender's, with needs
                g = group_of[key] = len(needs_of)
                needs_of.append(needs)
                ranks_of.append([])
            ranks_of[g].append(rank)
        counts = np.fromiter((len(n) for n in needs_of), dtype=np.int64, count=len(needs_of))
        chunk = np.concatenate(needs_of) if needs_of else np.empty(0, np.int32)
        group = np.repeat(np.arange(len(needs_of), dtype=np.int64), counts)
        order = np.lexsort((group, chunk))  # by chunk, then group
        chunk, group = chunk[order], group[order]
        bounds = np.flatnonzero(np.diff(chunk)) + 1
        firsts = np.concatenate(([0], bounds)) if len(chunk) else bounds
        union: dict[tuple[int, ...], int] = {}  # groups -> index of their ranks' union
        needers: list[tuple[int, ...]] = []
        union_of: dict[int, int] = {}  # chunk ordinal -> its needers' index
        read_needs = []
        for c, gs in zip(chunk[firsts].tolist(), np.split(group, bounds) if len(chunk) else [],
                         strict=True):
            key_of = tuple(gs.tolist())
            u = union.get(key_of)
            if u is None:
                u = union[key_of] = len(needers)
                needers.append(tuple(sorted(r for g in key_of for r in ranks_of[g])))
            union_of[c] = u
            read_needs.append(ReadNeed(ids[c], int(sizes[c]), needers[u]))
        sets: list[list[tuple[int, int, int]]] = [[] for _ in needers]  # (tid, nbytes, head)
        arrays = [np.asarray(ranks, dtype=np.int64) for ranks in needers]
        for need, reader in plan_readers(read_needs, len(plans)):
            c = ordinal[need.chunk]
            u = union_of[c]
            sets[u].append((c, need.nbytes, int(np.searchsorted(arrays[u], reader))))
        rotations = []
        for ranks, rows in zip(arrays, sets, strict=True):
            table = np.asarray(rows, dtype=np.int64).reshape(-1, 3)
            rotations.append(Rotations(ranks, table[:, 0], table[:, 1], table[:, 2]))
        return schedule_rotations(rotations, len(plans), settings.piece_size,
                                  settings.max_inflight)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future:
        manifest = self.read_manifest()
        chains = plan.storage_data if isinstance(plan.storage_data, ReadChains) else None
        items = plan.items
        if chains is not None and chains.items_as_sent:
            if self._local_items is None:
                raise CkptTurboError("TurboReader.read_data got a plan whose items stayed on "
                                     "this rank, but this reader prepared no local plan")
            items = self._local_items
        jobs = [make_job(item, self._shard(item), _stored_dtype(manifest, item), planner)
                for item in items]
        if chains is not None and dist.is_initialized():
            self._load_chained(jobs, chains, planner)
        else:
            self._load_direct(jobs, planner)
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

    def _chunk_ordinals(self) -> dict[str, int]:
        """Chunk id -> its position in the manifest's chunk table (the same on every rank)."""
        table = self._chunk_sizes
        if getattr(self, "_ordinals_of", None) is not table:
            self._ordinal = {cid: i for i, cid in enumerate(table)}
            self._ordinals_of = table
        return self._ordinal

    def _chunks_of(self, items: list[ReadItem]) -> list[str]:
        return chunks_touched(_spans((i, self._shard(i)) for i in items))

    def _finisher(self, planner: LoadPlanner, copier: DeviceCopier) -> Any:
        return lambda job: finish_job(job, planner, self.allow_pickle, self.url, copier)

    def _load_direct(self, jobs: list[Job], planner: LoadPlanner) -> None:
        """Parallel GETs in first-use order, at most read_ahead_bytes outstanding."""
        cids = chunks_touched((j.shard.pieces, j.start, j.end) for j in jobs)
        into = in_place_targets(jobs, self._chunk_sizes, torch.device("cpu"))
        to_device = device_bound(jobs) - into.keys()
        location = self.location
        reads = [Read(i, 0, location.chunk_path(cid), 0, self._chunk_sizes[cid])
                 for i, cid in enumerate(cids)]
        chunks = self.chunks
        copier = DeviceCopier()

        def fetch(read: Read) -> memoryview | torch.Tensor:
            """A chunk bound for a device lands in pinned memory, checked there."""
            cid = cids[read.index]
            if cid not in to_device:
                return chunks.fetch_into(cid, into)
            landing = copier.landing(read.size)
            chunks.fetch(cid, landing.numpy().data)
            return landing

        prefetcher = Prefetcher(reads, fetch, location.chunk_store.submit,
                                MemoryBudget(self.read_ahead_bytes),
                                streams=location.chunk_store.max_workers, lookahead=1)
        by_id = dict(zip(cids, reads, strict=True))
        prefetcher.start()
        try:
            arrived = ((cid, _host_tensor(prefetcher.wait(r))) for cid, r in by_id.items())
            consume(jobs, arrived, self._finisher(planner, copier),
                    lambda cid: prefetcher.release(by_id[cid]), copier)
        finally:
            prefetcher.close()
            copier.close()

    def chain_batch(self, chains: ReadChains) -> RankBatch:
        """This rank's parts of the read plan, as the read-once engine takes them."""
        ids = list(self._chunk_sizes)
        rows = rotated_parts(chains.chains.unpack(), chains.rank).tolist()
        parts = [Part(tid, self._chunk_sizes[ids[tid]], step, prev, nxt)
                 for tid, step, prev, nxt in rows]
        return RankBatch(parts, {p.tid: ids[p.tid] for p in parts}, chains.plan_id)

    def _load_chained(self, jobs: list[Job], chains: ReadChains, planner: LoadPlanner) -> None:
        """Chunks arrive from storage (this rank heads their chain) or from a peer, through
        the read-once engine; only the chunks this rank's items use are consumed."""
        arrivals = Arrivals()
        wanted = set(chunks_touched((j.shard.pieces, j.start, j.end) for j in jobs))
        store = self.location.chunk_store

        def deliver(cid: str, data: torch.Tensor) -> None:
            if cid in wanted:
                arrivals.put(cid, data)

        cuda_bytes = sum(j.end - j.start for j in jobs if j.target is not None and j.target.is_cuda)
        transport = load_transport(self.runtime, self.process_group, self.transport, cuda_bytes,
                                   sum(j.end - j.start for j in jobs))
        self.transport_used = transport
        into = in_place_targets(jobs, self._chunk_sizes, transport.device)
        copier = DeviceCopier()
        chunks = self.chunks
        engine = ReadOnce([self.chain_batch(chains)], group=transport.group,
                          fetch=lambda cid: chunks.fetch_into(cid, into), into=into.get,
                          deliver=deliver, done=arrivals.finish, submit=store.submit,
                          budget=MemoryBudget(self.read_ahead_bytes), streams=store.max_workers,
                          check=chunks.check if self.verify_mode != "off" else None,
                          check_all=self.verify_mode == "all",
                          settings=ChainSettings(chains.piece_size, chains.max_inflight,
                                                 timeout=self.timeout, device=transport.device))
        engine.start()
        try:  # a chunk is dropped once used
            consume(jobs, arrivals, self._finisher(planner, copier), lambda cid: None, copier)
        finally:
            engine.close(timeout=self.timeout)
            copier.close()


def _groups_of_ranks(groups: list[RotatedChains], world: int) -> list[PackedChains]:
    """Each rank's groups of transfers, packed once for the ranks that are in the same
    groups (every rank of a DDP job; the replicas of an HSDP shard)."""
    member_of: list[list[int]] = [[] for _ in range(world)]
    for g, group in enumerate(groups):
        for rank in group.ranks().tolist():
            member_of[rank].append(g)
    shared: dict[tuple[int, ...], PackedChains] = {}
    out = []
    for gs in map(tuple, member_of):
        if gs not in shared:
            shared[gs] = PackedChains.of(tuple(groups[g] for g in gs))
        out.append(shared[gs])
    return out


def own_items(plan: LoadPlan) -> list[ReadItem]:
    """The items a rank reads: its plan's, or with ``TurboLoadPlanner`` the local plan the
    grouped one stands for (a rank that is not the first with its digest sends none)."""
    if isinstance(plan.planner_data, PlanDigest):
        return plan.planner_data.local.items
    return plan.items


def verify_mode(verify: bool | str) -> str:
    """"storage", "all" or "off" for a ``verify`` argument; anything else is an error."""
    if verify is True or verify == "storage":
        return "storage"
    if verify == "all":
        return "all"
    if verify is False:
        return "off"
    raise ValueError(f"verify must be True, False, 'storage' or 'all', got {verify!r}")


def _spans(shards: Iterable[tuple[ReadItem, ShardRecord]]) -> Iterator[tuple[list, int, int]]:
    """(pieces, start, end) of each (read item, its shard): each shard looked up once."""
    for item, shard in shards:
        yield (shard.pieces, *item_span(shard, item))


def _host_tensor(data: bytes | bytearray | memoryview | torch.Tensor) -> torch.Tensor:
    return data if isinstance(data, torch.Tensor) else as_uint8(data)


def _stored_dtype(manifest: Manifest, item: ReadItem) -> torch.dtype | None:
    meta = manifest.items.get(item.storage_index.fqn)
    return meta.dtype if meta is not None else None
