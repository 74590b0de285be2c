"""A tiered save: commit to the node's host memory first, persist every Nth to the durable URL.

The save itself is the ordinary one (DCP with a TurboWriter), aimed at this node's
memory-tier run instead of the durable URL, so staging, hashing, dedup, verification and
the commit rule are unchanged and the stall is still the copy. What follows the commit
runs on the save's thread, collectively, in the same order on every rank:

1. the coordinator's manifest goes to every other node's memory tier (it is small, and a
   node must be able to verify what it holds without asking another);
2. each node evicts its oldest memory-tier checkpoints beyond the budget (before `local`,
   so that no later save of this run is writing to the tier meanwhile); ``local`` resolves
   and the next save may start;
3. behind the next saves, on a gloo group of its own and after the run's earlier
   replications: each node's chunks are copied into ``Tiers.replicas`` other nodes' memory
   tiers (``peers``); ``replicated`` resolves. A failed replication fails only that future:
   the checkpoint stands in memory;
4. when this save is due to persist, on another group and after the run's earlier
   persists: each chunk is uploaded by one node that holds it, if the durable store lacks
   it, then the coordinator commits the durable manifest; ``durable`` resolves with the
   summary. A save that is not persisted resolves ``durable`` with None at once: a
   checkpoint only in memory is never reported durable.

Every collective step ends with all ranks agreeing on success, so a failure on one rank
fails the save on all of them instead of leaving the others waiting.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from concurrent.futures import Future
from typing import Any

import torch.distributed as dist

from . import eviction, peers, persist
from .agreement import agree
from .async_save import run_save
from .errors import CkptTurboError
from .failures import as_ckptturbo_error
from .manifest import Manifest
from .paths import MANIFEST_NAME, RUN_STORE
from .peers import Nodes, Replicated
from .results import SaveStats, SaveSummary
from .runs import Location
from .runtime import Runtime, pending_saves
from .staging import SaveHandle
from .tiers import Tiers
from .urls import split_checkpoint

log = logging.getLogger(__name__)


class TieredSaveHandle(SaveHandle["SaveSummary | None"]):
    """The futures of a tiered save, one per tier: ``staged`` (copied; training may go on),
    ``local`` (committed in this node's host memory; a SaveSummary), ``replicated`` (each
    node's chunks copied into other nodes' memory; a Replicated), ``durable`` (the
    SaveSummary of the persist, or None when this save was not persisted: ``persisted``
    says which before it resolves). ``wait()`` waits for all of them and returns
    ``durable``'s result."""

    def __init__(self, url: str, persisted: bool) -> None:
        super().__init__(url)
        self.persisted = persisted
        self.sequence = 0  # the save's number among the run's tiered saves in its session
        self.over_budget = False  # its latest eviction left the node's tier over its budget
        self.local: Future[SaveSummary] = Future()
        self.local.set_running_or_notify_cancel()
        self.replicated: Future[Replicated] = Future()
        self.replicated.set_running_or_notify_cancel()

    def wait(self, timeout: float | None = None) -> SaveSummary | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        with contextlib.suppress(Exception):  # a failed replication does not fail the save
            self.replicated.exception(timeout)
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        return self.durable.result(left)

    result = wait

    def done(self) -> bool:
        return self.replicated.done() and self.durable.done()

    def __repr__(self) -> str:
        state = ("durable" if self.durable.done() and self.persisted else
                 "local" if self.local.done() else "staged" if self.staged.done() else "staging")
        return f"TieredSaveHandle({self.url!r}, {state}, persisted={self.persisted})"


def save(session: Runtime, state_dict: dict[str, Any], url: str, tiers: Tiers, *,
         persist: bool, process_group: Any, collective: bool,
         storage_options: dict[str, Any] | None, planner: Any, wait_previous: bool,
         writer_options: dict[str, Any]) -> TieredSaveHandle:
    """``ct.save(..., tiers=...)``: see the module docstring."""
    run_url, name = split_checkpoint(url)
    memory_url = tiers.memory_url(url)
    _check_options(session, url, storage_options, writer_options)
    count = session.count_save(("tiers", run_url))
    handle = TieredSaveHandle(url, tiers.persists(count, persist))
    handle.sequence = count
    _bound_the_backlog(session, run_url, handle, wait_previous)
    persist_group, replicate_group = _tier_groups(session, process_group, collective)
    started = time.monotonic()

    def after_commit(group: Any, committed: SaveSummary) -> None:
        seconds = dict(committed.seconds, local=committed.seconds["durable"])
        del seconds["durable"]
        local = dataclasses.replace(committed, seconds=seconds)
        ranks = Nodes(group, tiers.node_name)
        memory = Location(memory_url, session=session)
        manifest_bytes = ranks.share(memory.store.get(memory.manifest_path)
                                     if ranks.coordinator else None)
        agree(group, f"writing the manifest of {url} to every node's memory tier",
              lambda: _commit_on_node(memory, manifest_bytes, ranks))
        if ranks.node_leader:  # before `local`: no later save of this writer runs yet
            handle.over_budget = _evict(session, run_url, tiers, keep={name})
        handle.local.set_result(local)  # the next save may start: what follows runs behind it
        if not handle.persisted:
            handle.durable.set_result(None)
        manifest = Manifest.from_bytes(manifest_bytes, f"{memory.url}/{MANIFEST_NAME}")
        _after(session, run_url, handle, "replicated")
        held = None  # which nodes hold which chunks once replicated: where a persist reads
        try:
            replicated, held = _replicate(url, memory, manifest, tiers.replicas,
                                          Nodes(replicate_group, tiers.node_name))
            failure = None
        except Exception as exc:  # noqa: BLE001 - the checkpoint stands in its node's memory
            failure = as_ckptturbo_error(exc, url, "replicating")
        if not handle.persisted:
            _evict_finished(session, run_url, tiers, ranks, handle)
        if failure is None:
            handle.replicated.set_result(replicated)
        else:
            handle.replicated.set_exception(failure)
        if handle.persisted:
            _after(session, run_url, handle, "durable")
            summary = _persist(session, url, memory, manifest,
                               Nodes(persist_group, tiers.node_name), storage_options, local,
                               started, held)
            _evict_finished(session, run_url, tiers, ranks, handle)
            handle.durable.set_result(summary)

    run_save(session, state_dict, url, memory_url, handle, process_group=process_group,
             collective=collective, storage_options=None, planner=planner,
             wait_previous=wait_previous, writer_options=writer_options, after_commit=after_commit)
    session.started(run_url, handle)  # started: its futures will resolve
    return handle


def _check_options(session: Runtime, url: str, storage_options: dict[str, Any] | None,
                   writer_options: dict[str, Any]) -> None:
    """Refuse a ``store=`` other than the run's, and with ``overwrite=False`` a committed
    checkpoint at ``url`` (the memory tier's writer checks its own)."""
    if writer_options.get("store", RUN_STORE) not in (None, RUN_STORE):
        raise CkptTurboError(f"saving {url}: tiers= keeps a run's chunks in one store per tier "
                             "(replication and persists copy between them); store="
                             f"{writer_options['store']!r} cannot be combined with it")
    if writer_options.get("overwrite") is False:
        Location(url, storage_options, session=session).refuse_committed()


def _tier_groups(session: Runtime, process_group: Any, collective: bool) -> tuple[Any, Any]:
    """The (persist, replicate) gloo groups: persists and replications run behind the next
    saves, so on groups of their own (made on the caller's thread, where every rank makes
    its groups in the same order); (None, None) without a process group."""
    if not (collective and dist.is_initialized()):
        return None, None
    return (session.gloo_group(process_group, "persist"),
            session.gloo_group(process_group, "replicate"))


def _evict_finished(session: Runtime, run_url: str, tiers: Tiers, ranks: Nodes,
                    handle: TieredSaveHandle) -> None:
    """The replicas received since the commit, and what had to stay for this save, evicted
    before its last future resolves: a save whose handle is done no longer touches the
    tier."""
    if ranks.node_leader:
        handle.over_budget = _evict(session, run_url, tiers, keep=set(), finishing=handle)


def _after(session: Runtime, run_url: str, handle: TieredSaveHandle, step: str) -> None:
    """Wait until the run's earlier saves have done ``step`` ("replicated", or "durable"
    for those persisted): one replication and one persist at a time, in save order on
    every rank, because each kind shares one group."""
    for older in _older(session, run_url, handle):
        if step != "durable" or older.persisted:
            with contextlib.suppress(Exception):  # its failure belongs to its own handle
                getattr(older, step).exception()


def _evict(session: Runtime, run_url: str, tiers: Tiers, keep: set[str],
           finishing: TieredSaveHandle | None = None) -> bool:
    """Evict the oldest checkpoints of this node's memory tier beyond its budget, keeping
    ``keep`` and the saves in flight but ``finishing`` (whose work is done but for this);
    whether the tier is still over its budget."""
    in_flight = {split_checkpoint(h.url)[1] for h in pending_saves(run_url, under=True)
                 if h is not finishing}
    try:
        return eviction.evict(tiers.memory_run(run_url), tiers.budget(),
                              keep=frozenset(in_flight | keep),
                              session=session).over_budget
    except (CkptTurboError, OSError) as exc:  # the checkpoints stand, over budget
        log.warning("memory tier of %s: eviction failed: %s", run_url, exc)
        return False


def _bound_the_backlog(session: Runtime, run_url: str, handle: TieredSaveHandle,
                       wait_previous: bool) -> None:
    """Replications and persists do not pile up past the memory budget: when the previous
    save's eviction left this node's tier over its budget, because checkpoints still being
    replicated or persisted cannot be evicted, a tiered save starts only once the oldest
    of those is done (the eviction after its commit then frees it). Queued behind a
    network or a store slower than the checkpoints sent to it, they would otherwise grow
    the tier (RAM) without bound; this makes that a stall the caller sees instead, as
    waiting for the previous async save does with DCP. Within the budget nothing waits.
    Only node leaders evict, so only they know: the node's other ranks wait for them in
    the save's first collective. With ``wait_previous=False`` nothing waits (a refusal
    on the leaders alone would leave the other ranks in that collective)."""
    previous = session.latest(run_url)
    if previous is None or not wait_previous:
        return
    with contextlib.suppress(Exception):  # its failure belongs to its own handle
        previous.local.exception()
    if not previous.over_budget:
        return
    pinned = next(iter(_older(session, run_url, handle)), None)
    if pinned is None:
        return
    what = "replication" if not pinned.replicated.done() else "persist"
    started = time.monotonic()
    with contextlib.suppress(Exception):  # its failure belongs to its own handle
        pinned.wait()
    log.warning("%s: waited %.2f s for the %s of %s: the memory tier is over its budget while "
                "the network or the durable store is slower than the checkpoints sent to it",
                handle.url, time.monotonic() - started, what, pinned.url)


def _older(session: Runtime, run_url: str, handle: TieredSaveHandle) -> list[TieredSaveHandle]:
    """The run's earlier tiered saves of this session still in flight, oldest first."""
    return [h for h in session.saves_in_flight(run_url, under=True)
            if isinstance(h, TieredSaveHandle) and h.sequence < handle.sequence]


def _replicate(url: str, memory: Location, manifest: Manifest, k: int,
               nodes: Nodes) -> tuple[Replicated, dict[str, set[str]]]:
    """Copy each node's chunks of the checkpoint into ``k`` other nodes' memory tiers
    (collective; see ``peers``). Also returns which node holds which chunk afterwards, so
    that a persist does not gather the holdings again."""
    run = memory.run
    held = peers.holdings(nodes, run.chunk_ids, list(manifest.chunks))
    copies = peers.plan_replicas(manifest.chunks, held, nodes.order, nodes.leaders, k) if k else []
    peers.exchange(nodes, copies, lambda cid, nbytes: peers.tier_chunk(run, cid, nbytes),
                   lambda cid, data: run.store.put(run.chunk_path(cid), data),
                   f"replicating {url}")
    for copy in copies:
        held[nodes.nodes[copy.target]].add(copy.cid)
    return Replicated(copies=min(1 + k, len(nodes.order)), chunks_sent=len(copies),
                      bytes_sent=sum(c.nbytes for c in copies)), held


def _commit_on_node(memory: Location, data: bytes, ranks: Nodes) -> None:
    """A node leader writes the coordinator's manifest into its own memory tier (the
    coordinator's node has it already) and removes the save's pending markers there: the
    coordinator's commit removes those of its own node only, and a marker left behind
    would keep the node's evictions from freeing chunks for one lease. Every rank's
    ``dcp.save`` has returned, and the next save of this run waits for ``local``, so every
    marker there is this save's."""
    if not ranks.node_leader or ranks.nodes[0] == ranks.node:
        return
    memory.store.put(memory.manifest_path, data)
    run = memory.run
    run.store.delete([info.path for info in run.store.list_files(run.pending_dir)])


def _persist(session: Runtime, url: str, memory: Location, manifest: Manifest, ranks: Nodes,
             storage_options: dict[str, Any] | None, local: SaveSummary, started: float,
             held: dict[str, set[str]] | None) -> SaveSummary:
    """Copy the checkpoint from the nodes' memory tiers to the durable URL (collective);
    ``held``: which node holds which chunk, when the replication just said (else gathered)."""
    durable = Location(url, storage_options, session=session)
    save_id = f"{manifest.storage_meta.get('save_id', 'tiered')}-persist"
    if held is None:
        held = peers.holdings(ranks, memory.run.chunk_ids, list(manifest.chunks))
    share = peers.spread(manifest.chunks, held)
    copied = agree(ranks.group, f"persisting {url}", lambda: persist.copy_chunks(
        memory.run, durable.run, manifest, share[ranks.node], save_id, ranks.rank)
        if ranks.node_leader else None)
    agree(ranks.group, f"committing {url}", lambda: persist.commit(
        durable, manifest, save_id, list(ranks.leaders.values())) if ranks.coordinator else None)
    done = [c for c in copied if c is not None]
    written = sum(c.bytes_written for c in done)
    chunks = sum(c.chunks_written for c in done)
    stats = SaveStats(bytes_staged=local.bytes_staged, bytes_written=written,
                      bytes_reused=manifest.unique_bytes - written, chunks_written=chunks,
                      chunks_reused=len(manifest.chunks) - chunks)
    return SaveSummary.of(url, stats, manifest.total_bytes,
                          {**local.seconds, "durable": time.monotonic() - started})
