"""TurboWriter: a DCP StorageWriter (and AsyncStager) that writes each distinct byte once.

A thin adapter: each DCP protocol method hands over to the module that does the work.
``prepare_local_plan`` / ``prepare_global_plan``: who writes which byte ranges
(``save_plan``, pure, no storage request). ``write_data``: stage, announce, hash, dedup,
upload (``upload``). ``finish``: check replicas (``replicas``), build the manifest
(``manifest.build_manifest``, pure), write it (the commit) and clear the save's markers.
``stage`` (dcp.async_save): copy the state into the host pool (``upload``).
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import time
import uuid
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult

from . import catalog, replicas, save_plan
from .checkpoint_id import servable
from .chunks import DEFAULT_CHUNK_SIZE, DEFAULT_PACK_THRESHOLD, chunk_id
from .delta_save import DeltaPlan
from .errors import CkptTurboError, ReplicaMismatchError
from .manifest import build_manifest
from .manifest_delta import versions_of, with_deltas
from .plan.digests import PlanDigest
from .results import SaveStats
from .runs import Location
from .runtime import Runtime, resolve
from .save_groups import DistinctPlans, assign_grouped, distinct_plans
from .save_plan import Assignment
from .staging import DeviceCopier, HostBuffer, HostBufferPool, default_pool_bytes
from .upload import Upload, plan_entries, stage_state_dict

log = logging.getLogger(__name__)

__all__ = ["TurboWriter", "ReplicaMismatchError"]  # the error was public here before errors.py


class TurboWriter(StorageWriter, AsyncStager):
    """Writes a DCP checkpoint as content-addressed chunks plus a JSON manifest.

    Args:
        url: checkpoint location, a path or fsspec URL (``s3://bucket/run/step-100``).
        storage_options: passed to fsspec unchanged (endpoint, key, secret, ...).
        store: where the chunks go: the checkpoint's parent, the run (default, or ".."), so
            its checkpoints share them; "." for the checkpoint's own directory, so that it
            can be copied or moved alone (no dedup with other checkpoints); or a URL.
        chunk_size: bytes per chunk of large tensors (the unit of parallelism and dedup).
        pool_bytes: host staging pool size; default: see ``staging.default_pool_bytes``.
        balance: split replicated items over their holders (False: DCP's whole-item dedup).
        weights: per-rank relative upload bandwidth for the balanced plan.
        replica_check: "sample" (cheap fingerprint), "full" (hash every replica) or "off".
        on_replica_mismatch: "warn" or "raise" (the checkpoint is then not committed).
        snapshot: copy CPU tensors before upload (set by ``ct.save``; DCP's own sync save
            blocks the caller, so reading CPU tensors in place is safe there).
        overwrite: as DCP's ``FileSystemWriter``: True (default) replaces a committed
            checkpoint at the URL (atomically: its manifest is swapped last); False makes a
            save to a URL that has one raise ``CheckpointExists`` ("Checkpoint already
            exists ...", DCP's wording) before anything is staged or uploaded, leaving it
            untouched.
        session: the ``ckptturbo.Session`` whose I/O threads and caches this writer uses
            (default: the process's default session).

    Counters, on the coordinator: ``plan_cache_hits``, saves that reused the last plan
    whole (the same local plans on the same ranks, or DCP's plan cache);
    ``plan_cache_partial_hits``, saves under ``TurboSavePlanner`` whose ranks had the same
    distinct local plans in another world (a subgroup, more or fewer ranks), which reused
    the part of the plan that depends on those plans only (``save_groups.DistinctPlans``).
    Both live in this object: a new process starts with empty caches.
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
        overwrite: bool = True,
        session: Runtime | None = None,
    ) -> None:
        if replica_check not in replicas.MODES:
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
        self.overwrite = overwrite
        self.rank = 0
        self.is_coordinator = True
        self.save_id = uuid.uuid4().hex
        self.on_staged: Callable[[], None] | None = None
        self.delta: DeltaPlan | None = None  # set by a delta save for its commit (delta_save)
        self.last_stats = SaveStats()
        self.plan_cache_hits = 0
        self.plan_cache_partial_hits = 0
        self._session = session
        self._init_runtime()

    def _init_runtime(self) -> None:
        self._location: Location | None = None
        self._pool: HostBufferPool | None = None
        self._copier = DeviceCopier()
        # coordinator: the last plan (signatures -> assignments) and the plans it came from
        self._cached_plan: tuple[tuple, list[Assignment], list[SavePlan]] | None = None
        # coordinator, grouped plans: the part of the last plan that fits any world with
        # the same distinct local plans (``save_groups.DistinctPlans``)
        self._distinct_plans: DistinctPlans | None = None
        self._held: tuple[str, list] | None = None  # this rank's last local items, by signature
        self._staged_buffers: collections.deque[list[HostBuffer]] = collections.deque()

    def __getstate__(self) -> dict[str, Any]:
        state = {k: v for k, v in self.__dict__.items() if not k.startswith("_")}
        state["on_staged"] = None
        state["delta"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._session = None  # the unpickling process's default session
        self._init_runtime()

    @property
    def runtime(self) -> Runtime:
        """The runtime whose I/O threads and caches this writer uses (the default one unless
        given; an unpickled writer uses its process's default)."""
        return resolve(self._session)

    @property
    def location(self) -> Location:
        if self._location is None or self._location.url != self.url:
            self._location = Location(self.url, self.storage_options, self.store_url,
                                      session=self.runtime)
        return self._location

    def _ensure_pool(self, share: int) -> HostBufferPool:
        if self._pool is None:
            capacity = self.pool_bytes or default_pool_bytes(share, self.chunk_size)
            self._pool = HostBufferPool(max(capacity, self.chunk_size))
        return self._pool

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
        """True only for local paths and fsspec URLs whose protocols are installed."""
        return servable(checkpoint_id)

    @property
    def checkpoint_id(self) -> str:
        return self.url

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.url, save_id=self.save_id)

    def _refuse_existing(self) -> None:
        """overwrite=False: a committed checkpoint at the URL stops the save here."""
        if not self.overwrite:
            self.location.refuse_committed()

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        # As FileSystemWriter, before any planning result is exchanged; one rank asks
        # storage, DCP hands its failure to every rank.
        if self.is_coordinator:
            self._refuse_existing()
        if not plan.usable:  # DCP's plan cache: the same plan as last time, nothing to add
            return plan
        grouped = plan.planner_data if isinstance(plan.planner_data, PlanDigest) else None
        local = grouped.local if grouped is not None else plan
        held = save_plan.holdings(local)
        self._held = (held.signature, local.items)
        if grouped is not None and not grouped.sender:  # the group's first rank sends them
            return plan
        return dataclasses.replace(plan, storage_data=held)

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Who writes which bytes; each rank gets back only its own ``Assignment`` (the
        items it sent stay on it). No storage request: that waits until after staging."""
        if plans and isinstance(plans[0].planner_data, PlanDigest):
            return self._prepare_grouped(plans)
        if plans and not any(p.usable for p in plans):
            self.plan_cache_hits += 1  # DCP's plan cache: every rank reuses the plan it has
            return plans
        last = self._cached_plan
        if not all(p.usable for p in plans):
            # DCP sends new plans only to ranks whose plan changed; the others keep theirs,
            # which must then still fit: replan with their last plans, and send every rank one.
            if last is None or len(last[2]) != len(plans):
                raise CkptTurboError(
                    "TurboWriter.prepare_global_plan: DCP's plan cache sent new plans for some "
                    "ranks only, and this writer did not make the plans the others keep; use the "
                    "same TurboWriter for every save with plan caching")
            plans = [p if p.usable else old for p, old in zip(plans, last[2], strict=True)]
        held = [p.storage_data for p in plans]
        if not all(isinstance(h, save_plan.Holdings) for h in held):
            raise CkptTurboError("TurboWriter.prepare_global_plan got plans it did not prepare")
        key = tuple(h.signature for h in held)
        if last is not None and last[0] == key:
            assignments = last[1]
            self.plan_cache_hits += 1
        else:
            assignments = save_plan.assign(plans, held, balance=self.balance,
                                           chunk_size=self.chunk_size, weights=self.weights,
                                           check_replicas=self.replica_check != "off",
                                           save_id=self.save_id)
        self._cached_plan = (key, assignments, plans)
        # one assignment per plan: assign makes one per rank, or the cache's key matched
        return [dataclasses.replace(p, items=[], storage_data=a)
                for p, a in zip(plans, assignments, strict=True)]

    def _prepare_grouped(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Plans from ``TurboSavePlanner``: one whole plan per distinct digest
        (``save_groups``). The same digests on the same ranks reuse the last plan; the same
        distinct digests in another world (more or fewer ranks, or plans on other ranks)
        reuse its world-independent part and assign the writes again."""
        key = tuple(p.planner_data.digest for p in plans)
        last = self._cached_plan
        if last is not None and last[0] == key:
            assignments = last[1]
            self.plan_cache_hits += 1
        else:
            kept, digests = self._distinct_plans, frozenset(key)
            if last is not None and kept is not None and kept.digests == digests:
                self.plan_cache_partial_hits += 1
                log.info("%s: %s, with the same %s: reusing their plan, assigning writes "
                         "again", self.url, _why_replan(last[0], key), _plans(len(digests)))
            else:
                if last is not None:
                    log.info("%s: the last plan does not fit (%s%s); planning again", self.url,
                             _why_replan(last[0], key), _new_plans(kept, digests))
                kept = self._distinct_plans = distinct_plans(plans)
            assignments = assign_grouped(plans, balance=self.balance, chunk_size=self.chunk_size,
                                         weights=self.weights,
                                         check_replicas=self.replica_check != "off",
                                         save_id=self.save_id, distinct=kept)
        self._cached_plan = (key, assignments, plans)
        return [dataclasses.replace(p, items=[], storage_data=a, planner_data=None)
                for p, a in zip(plans, assignments, strict=True)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> torch.futures.Future:
        started = time.monotonic()
        assignment = plan.storage_data if isinstance(plan.storage_data, Assignment) else None
        marker = assignment.marker_id(self.url) if assignment else self.save_id
        try:
            writes: list[tuple[WriteItem, list[tuple[int, int]] | None]]
            if assignment is None:  # a plan this writer did not prepare: every item, whole
                writes, checks = [(item, None) for item in plan.items], []
            else:
                items = save_plan.held_items(assignment, self._held)
                writes, checks = assignment.writes(items), assignment.replicated_items(items)
            entries, prints = plan_entries(planner, writes, checks, self.replica_check, self.url)
            # the store is opened only after staging: its first opening (client, imports)
            # must not lengthen the stall
            upload = Upload(lambda: self.location.run, marker,
                            self.rank, pool_for=self._ensure_pool, copier=self._copier,
                            chunk_size=self.chunk_size, pack_threshold=self.pack_threshold,
                            snapshot=self.snapshot, on_staged=self.on_staged)
            stats = upload.run(entries)
            self.last_stats = dataclasses.replace(stats, seconds_write=time.monotonic() - started)
        finally:
            if self._staged_buffers and self._pool is not None:  # dcp.async_save's copy
                for buf in self._staged_buffers.popleft():
                    self._pool.release(buf)
        fut: torch.futures.Future = torch.futures.Future()
        results = save_plan.encode_results(self.rank, marker, entries, upload.chunk_sizes, prints)
        fut.set_result([WriteResult(index=MetadataIndex(save_plan.RESULTS_FQN),
                                    size_in_bytes=stats.bytes_written, storage_data=results)])
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        location = self.location
        sent = [r.storage_data for rank in results for r in rank
                if isinstance(r.storage_data, save_plan.RankResults)]
        markers: dict[str, list[int]] = defaultdict(list)
        for r in sent:
            markers[r.save_id].append(r.rank)
        try:
            if self.delta is not None:  # the base chunks it names stay until the commit
                hold = chunk_id(f"{self.save_id}|delta".encode())[:32]
                markers[hold].append(self.rank)
                self.delta.hold(location.run, hold, self.rank, self.url)
            replicas.check((r.prints for r in sent), _indices(metadata),
                           raise_=self.on_replica_mismatch == "raise")
            manifest = build_manifest(metadata, save_plan.decode_results(sent), url=self.url,
                                      save_id=self.save_id,
                                      chunk_store_ref=location.chunk_store_ref,
                                      world_size=len(results))
            if self.delta is not None:
                manifest = with_deltas(manifest, self.delta.bases, self.delta.chunks)
                self.delta.committed = {name: versions_of(manifest.items[name])[0]
                                        for name in self.delta.values if name in manifest.items}
            replaces = location.self_contained and location.store.exists(location.manifest_path)
            location.write_manifest(manifest)
        finally:
            for marker, ranks in markers.items():
                catalog.end_save(location.run, marker, ranks)
        if replaces:  # the old version's chunks are in the same store; no run gc reaches them
            catalog.sweep_replaced(location)
        log.info("committed %s: %d items, %d new bytes, %d reused", self.url, len(manifest.items),
                 manifest.stats["bytes_written"], manifest.stats["bytes_reused"])

    # --- AsyncStager protocol (dcp.async_save) ------------------------------------------
    @property
    def should_synchronize_after_execute(self) -> bool:
        """False: ``stage()`` returns only once its copies are complete."""
        return False

    def stage(self, state_dict: dict[str, Any]) -> Future[dict[str, Any]]:
        """Copy the state into pool-backed host tensors; the returned future resolves when
        the copies are complete, and DCP uploads from those copies in the background.
        dcp.async_save stages before it plans, so overwrite=False is checked here too."""
        self._refuse_existing()
        staged, buffers = stage_state_dict(state_dict, self._ensure_pool, self._copier)
        self._staged_buffers.append(buffers)
        fut: Future[dict[str, Any]] = Future()
        fut.set_result(staged)
        return fut

    def synchronize_staging(self) -> None:
        """Nothing to do: stage() returns only once its copies are complete."""

    def close(self) -> None:
        """Drop the host pool (a later save makes a new one); I/O threads are the session's."""
        self._pool = None


def _why_replan(last: tuple, key: tuple) -> str:
    """Why a cached plan does not fit a save: the world or some ranks' plans changed."""
    if len(last) != len(key):
        return f"the world changed from {len(last)} to {len(key)} ranks"
    changed = sum(a != b for a, b in zip(last, key, strict=True))
    return f"{changed} of {len(key)} ranks' local plans changed"


def _new_plans(kept: DistinctPlans | None, digests: frozenset[str]) -> str:
    """What changed among the distinct local plans since the kept ones (none kept: the
    last save's plans were not grouped)."""
    if kept is None:
        return ""
    return (f"; {len(digests - kept.digests)} of {_plans(len(digests))} new, "
            f"{len(kept.digests - digests)} gone: the shard shapes or the state changed")


def _plans(n: int) -> str:
    return f"{n} distinct local plan{'' if n == 1 else 's'}"


def _indices(metadata: Metadata) -> Any:
    """Every item of a checkpoint's metadata, as the MetadataIndex a rank saw it by."""
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            for c in md.chunks:
                yield MetadataIndex(fqn, c.offsets)
        else:
            yield MetadataIndex(fqn)
