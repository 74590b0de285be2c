"""Loading from tiers: the newest checkpoint that can be assembled, each chunk from the
nearest holder.

A tiered load looks for checkpoints in each node's memory tier and in the durable store
(listed by one rank: the store is the same for all). A manifest in memory that was never
persisted is as trustworthy as a durable one: it carries its own checksum and names its
chunks by their hashes. Candidates are the checkpoints any rank finds, tried newest
first; a rank whose node lacks a candidate's manifest (the node was lost and restarted)
gets it from a rank whose memory has it, checks its checksum and keeps it in its node's
memory tier; the durable manifest is read only when no node's memory has one. The ranks
agree on each outcome, so they all load the same checkpoint.

Each rank reads a chunk from its own node's memory when it is there. The chunks the ranks
of a node need and its memory lacks are copied from the other nodes' memory tiers that
hold them (``peers``: replicas a tiered save made, or chunks another node's ranks wrote)
to the rank that needs them, which verifies them, keeps them in its node's tier and loads
them from the received bytes; only what no node holds is read from the durable store. The
copies are planned before any byte is read, so a checkpoint where some rank needs a chunk
that no tier holds (evicted, and never persisted) is skipped for the next older one with
the state untouched; they run while the ranks read what their nodes hold (the node links
carry the lost node's bytes while the other ranks' reads use the cores).
"""
from __future__ import annotations

import contextlib
import logging
import os
import posixpath
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner

from . import catalog
from .agreement import agree, gather
from .chunk_source import ChunkSource
from .errors import (
    CheckpointNotFound,
    ChunksUnavailable,
    CkptTurboError,
    FormatError,
    names_preview,
)
from .failures import as_ckptturbo_error
from .manifest import Manifest
from .paths import MANIFEST_NAME
from .peers import Copy, Nodes, exchange, held_bits, held_by_node, plan_fetches, tier_chunk
from .reader import TurboReader, own_items
from .runs import Location
from .runtime import wait_for_saves
from .tiers import Tiers
from .urls import split_checkpoint

if TYPE_CHECKING:
    from .runtime import Runtime

log = logging.getLogger(__name__)
T = TypeVar("T")

MEMORY, DURABLE = "memory", "durable"


@dataclass(frozen=True)
class Recovered:
    """What a tiered load loaded: the checkpoint's durable URL, the tier its manifest came
    from on this rank, the chunk bytes this rank read from each tier, and the chunk bytes
    this rank received from other nodes' memory tiers (the lowest rank of a node that needs
    a chunk receives it, loads it from the received bytes and keeps it in its node's tier,
    where the node's other ranks read it)."""

    url: str
    manifest_tier: str
    bytes_from_memory: int
    bytes_from_durable: int
    bytes_from_peers: int = 0


class TieredChunkSource(ChunkSource):
    """Chunks of one checkpoint from this node's memory tier when it holds them, else from
    the durable run's store; verified alike. ``bytes_from_durable`` counts the latter."""

    def __init__(self, location: Location, manifest: Manifest, url: str, verify: str,
                 memory: Location, durable: Location) -> None:
        super().__init__(location, manifest, url, verify)
        self.memory = memory
        self.durable = durable
        # the memory tier is a local directory: a stat per chunk of this checkpoint costs
        # less than listing every chunk the tier holds for the whole run
        self.in_memory = {c for c in manifest.chunks if os.path.exists(memory.chunk_path(c))}
        self._in_durable: set[str] | None = None
        self.bytes_from_durable = 0
        self.bytes_from_peers = 0
        self._received: dict[str, memoryview] = {}
        self._copies: tuple[Nodes, list[Copy]] | None = None  # planned, not yet run
        self._coming: set[str] = set()  # chunks the planned copies bring into this node
        self._arrived = threading.Condition(self._lock)  # a chunk received, or copies ended
        self._copied = False
        self._copy_failure: BaseException | None = None

    def holder(self, cid: str) -> Location:
        return self.memory if cid in self.in_memory or cid in self._coming else self.durable

    def plan_from_peers(self, nodes: Nodes, cids: list[str], ordinal: dict[str, int]) -> None:
        """Plan the copies into this node's memory tier of the chunks its ranks need (this
        rank's: ``cids``) that it lacks and another node's memory holds (collective: one
        gather of what each rank lacks and each node holds). ``ordinal``: each chunk's
        position in the manifest's chunk table. Nothing moves yet: ``copying_from_peers``
        runs the copies while the ranks read what their nodes hold, and a chunk planned for
        this node counts as held (``require``)."""
        ids = list(self.manifest.chunks)
        mine = np.array(sorted(ordinal[c] for c in cids if c not in self.in_memory), np.int32)
        bits = held_bits(self.in_memory, ids) if nodes.node_leader else None
        everyone = gather(nodes.group, (mine.tobytes(), bits))
        lacking = {rank: {ids[i] for i in np.frombuffer(raw, np.int32).tolist()}
                   for rank, (raw, _) in enumerate(everyone)}
        if not any(lacking.values()):
            return
        held = held_by_node(nodes, [b for _, b in everyone], ids)
        copies = plan_fetches(self.manifest.chunks, lacking, nodes.nodes, held)
        self._copies = (nodes, copies)
        self._coming = {c.cid for c in copies if nodes.nodes[c.target] == nodes.node}

    @contextlib.contextmanager
    def copying_from_peers(self) -> Iterator[None]:
        """The planned copies (``plan_from_peers``; collective: every rank enters, and
        leaves only once they are done), run on a thread of their own while the body
        reads: a rank reads the chunks its node holds while its node's missing ones are
        still on the wire. A chunk is received by the lowest rank of the node that needs
        it, verified, kept in the tier and served to that rank's read from the received
        bytes as soon as it is in: it is hashed once, not again when read. The node's other
        ranks read it from the tier once the copies have ended on every rank. A failed copy
        fails the reads waiting for it and, once the copies have ended, is raised here on
        every rank."""
        if self._copies is None:
            yield
            return
        nodes, copies = self._copies
        self._copies = None
        run = self.memory.run

        def keep(cid: str, data: memoryview) -> None:
            run.store.put(run.chunk_path(cid), data)
            with self._arrived:
                self._received[cid] = data
                self.chunks_verified += 1
                self._arrived.notify_all()

        def copy() -> None:
            try:
                self.bytes_from_peers += exchange(
                    nodes, copies, lambda cid, nbytes: tier_chunk(run, cid, nbytes), keep,
                    f"loading {self.url}")
            except BaseException as exc:  # noqa: BLE001 - raised below and by the reads
                self._copy_failure = exc
            finally:
                with self._arrived:
                    self._copied = True
                    self._arrived.notify_all()

        copier = threading.Thread(target=copy, name="ckptturbo-peer-copies", daemon=True)
        copier.start()
        try:
            yield
        finally:
            copier.join()
            if self._copy_failure is not None:
                raise self._copy_failure
            self.in_memory |= self._coming
            self._coming = set()

    def _wait_for_copy(self, cid: str) -> None:
        """If chunk ``cid`` is one of the copies: until this rank has received it, or, for
        one another rank of this node receives, until the copies have ended."""
        if cid not in self._coming:
            return
        with self._arrived:
            self._arrived.wait_for(lambda: self._copied or cid in self._received)
            if cid not in self._received and self._copy_failure is not None:
                raise CkptTurboError(f"chunk {cid} of {self.url} was to be copied from another "
                                     f"node's memory tier, and the copies failed: "
                                     f"{self._copy_failure}") from self._copy_failure

    def fetch(self, cid: str, out: memoryview | None = None) -> memoryview:
        """A chunk this rank received from a peer (verified on receipt) comes from the
        received bytes, once; one still on its way is waited for; any other is read and
        verified as usual."""
        self._wait_for_copy(cid)
        with self._lock:
            received = self._received.pop(cid, None)
        if received is None:
            return super().fetch(cid, out)
        if out is None:
            return received
        out[:] = received
        return out

    def require(self, cids: list[str]) -> None:
        """Raise ChunksUnavailable unless each of ``cids`` is in one of this rank's tiers
        (the durable store is listed only when memory lacks some)."""
        lacking = [cid for cid in cids if cid not in self.in_memory and cid not in self._coming]
        if not lacking:
            return
        if self._in_durable is None:
            self._in_durable = self.durable.run.chunk_ids()
        missing = [cid for cid in lacking if cid not in self._in_durable]
        if missing:
            raise ChunksUnavailable(
                f"checkpoint {self.url}: {len(missing)} chunks this rank needs are neither in "
                "this node's memory tier nor in "
                f"{self.durable.run.store.url_of(self.durable.chunks_root)} "
                f"({names_preview(missing, 3)})")

    def _read_checked(self, cid: str, view: memoryview) -> None:
        super()._read_checked(cid, view)
        if self.holder(cid) is self.durable:
            with self._lock:
                self.bytes_from_durable += len(view)


class TieredReader(TurboReader):
    """A TurboReader over one checkpoint in the tiers: the manifest from this node's memory
    tier when it is there (else the durable one), chunks from the nearest holder. Chunks
    are not forwarded between ranks by the chain broadcast (its schedule knows nothing of
    holders). Before any byte is read, each rank checks that it can reach every chunk its
    items need; with ``peers``, the copies of a node's missing chunks from other nodes'
    memory are planned first (they count as reachable) and run during the reads."""

    def __init__(self, memory_url: str, url: str, storage_options: dict[str, Any] | None = None,
                 *, peers: Nodes | None = None, **options: Any) -> None:
        options["broadcast"] = False
        super().__init__(url, storage_options, **options)
        self.memory_url = memory_url
        self.peers = peers
        self.manifest_tier: str | None = None

    def read_manifest(self) -> Manifest:
        """The manifest from this node's memory tier, else the durable one (``recover`` has
        already chosen: a rank whose memory lacks it adopted a peer's copy first)."""
        if self._manifest is not None:
            return self._manifest
        wait_for_saves(self.url)
        try:
            return self._use(Location(self.memory_url, session=self.runtime).read_manifest(),
                             MEMORY)
        except (CheckpointNotFound, FormatError) as exc:
            if isinstance(exc, FormatError):  # damaged at rest: its checksum refused it
                log.warning("%s; reading the durable copy of %s instead", exc, self.url)
            durable = Location(self.url, self.storage_options, session=self.runtime)
            return self._use(durable.read_manifest(), DURABLE)

    def _use(self, manifest: Manifest, tier: str) -> Manifest:
        self._manifest, self.manifest_tier = manifest, tier
        # the durable side of the checkpoint: where chunks memory lacks are read
        self._location = Location.for_manifest(self.url, self.storage_options, manifest,
                                               session=self.runtime)
        return manifest

    @property
    def chunks(self) -> TieredChunkSource:
        source = self._source
        if not isinstance(source, TieredChunkSource):
            memory = Location(self.memory_url, session=self.runtime)
            source = self._source = TieredChunkSource(self.location, self.read_manifest(),
                                                      self.url, self.verify_mode, memory,
                                                      self.location)
        return source

    @property
    def bytes_from_durable(self) -> int:
        source = self._source
        return source.bytes_from_durable if isinstance(source, TieredChunkSource) else 0

    @property
    def bytes_from_peers(self) -> int:
        source = self._source
        return source.bytes_from_peers if isinstance(source, TieredChunkSource) else 0

    def memory_manifest_bytes(self) -> bytes | None:
        """The stored bytes of the manifest in this node's memory tier, to hand to ranks
        whose node lacks it; None when they cannot be read (those ranks then read the
        tiers themselves: this rank must take part in the hand-over either way)."""
        memory = Location(self.memory_url, session=self.runtime)
        try:
            return memory.store.get(memory.manifest_path)
        except (CkptTurboError, OSError) as exc:
            log.warning("cannot hand the manifest of %s to the ranks that lack it: %s",
                        self.url, exc)
            return None

    def adopt_manifest(self, data: bytes) -> None:
        """Keep the manifest another rank read (checked against its own checksum) in this
        node's memory tier and load as from there: the chunks a peer copies in for it must
        be named by a manifest there, or the tier's next gc would free them. Decoded once:
        reading it back from the tier would give the same manifest."""
        wait_for_saves(self.url)
        memory = Location(self.memory_url, session=self.runtime)
        manifest = Manifest.from_bytes(data, f"{memory.url}/{MANIFEST_NAME}")
        memory.store.put(memory.manifest_path, data)
        self._use(manifest, MEMORY)

    def prepare_local_plan(self, plan: Any) -> Any:
        needs = self._chunks_of(own_items(plan))
        if self.peers is not None:
            self.chunks.plan_from_peers(self.peers, needs, self._chunk_ordinals())
        self.chunks.require(needs)
        return super().prepare_local_plan(plan)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future:
        """The reads, while the chunks this node lacks are copied in from its peers."""
        with self.chunks.copying_from_peers():
            future = super().read_data(plan, planner)
            future.wait()
        return future


def recover(session: Runtime, url: str, tiers: Tiers, *, storage_options: dict[str, Any] | None,
            group: Any, attempt: Callable[[TieredReader], T], reader_options: dict[str, Any]
            ) -> tuple[T, Recovered]:
    """Run ``attempt`` (a load through a reader) on the newest checkpoint the ranks of
    ``group`` can assemble. ``url`` is a checkpoint (only it is tried) or a run (its
    checkpoints in memory and in the durable store are). Raises CheckpointNotFound naming
    both tiers when none can be assembled.

    The durable store is asked (by rank 0 alone) while the ranks list their memory tiers
    and, when those hold checkpoints of the run, while the newest of them loads: its
    answer (a request through the store's latency) is joined after that load, and only a
    durable checkpoint newer than the one loaded is then tried. Memory holds the newest
    checkpoint but where it was evicted, lost with every node that held it, or another
    job wrote to the durable run; a checkpoint that cannot be assembled fails before a
    byte of the state is written, so the one loaded stays whole."""
    wait_for_saves(url, under=True)
    first = group is None or dist.get_rank(group) == 0
    with ThreadPoolExecutor(1, thread_name_prefix="ckptturbo-listing") as lister:
        durable = (lister.submit(_candidates, session, url, tiers, storage_options, True)
                   if first else None)
        found = agree(group, f"listing the memory tiers of {url}",
                      lambda: _candidates(session, url, tiers, storage_options, False))
        nodes = Nodes(group, tiers.node_name, [f.node for f in found])
        load = _Loads(session, tiers, storage_options, nodes, attempt, reader_options)
        # a checkpoint some node's memory holds at the URL is the only candidate, whatever
        # the durable store says; a run whose checkpoints memory holds loads the newest
        # before the durable store's answer is joined; otherwise that answer decides
        at_url = any(f.at_url for f in found)
        ahead = not at_url and any(f.created for f in found)
        if not at_url and not ahead:
            found = _with_durable(group, found, durable, url)
        run, names = _agreed_candidates(found)
        loaded = load.newest(run, names, found)
        if ahead:  # was the durable store's newest newer than what memory held?
            found = _with_durable(group, found, durable, url)
            run, names = _agreed_candidates(found)
            if loaded is not None and loaded[2] in names:
                names = names[:names.index(loaded[2])]
            loaded = load.newest(run, names, found) or loaded
    if loaded is None:
        raise CheckpointNotFound(
            f"no checkpoint of {run} can be assembled from the memory tiers "
            f"{tiers.memory_run(run)} of the nodes {', '.join(nodes.order)} or the durable "
            f"store ({len(found[nodes.rank].created)} found on this rank)")
    return loaded[0], loaded[1]


def _with_durable(group: Any, found: list[_Found], durable: Future[_Found] | None,
                  url: str) -> list[_Found]:
    """``found`` (every rank's memory tier) with rank 0's entry replaced by what it found
    in both tiers (``durable``: its listing of both, rank 0's alone); collective."""
    listed = agree(group, f"listing the durable store of {url}",
                   lambda: durable.result() if durable is not None else None)
    both = listed[0]
    assert both is not None, "rank 0 lists both tiers (recover submits it there)"
    return [both, *found[1:]]


class _Loads:
    """The attempts of one recovery: each candidate tried once, newest first."""

    def __init__(self, session: Runtime, tiers: Tiers, storage_options: dict[str, Any] | None,
                 nodes: Nodes, attempt: Callable[[TieredReader], Any],
                 reader_options: dict[str, Any]) -> None:
        self.session, self.tiers, self.storage_options = session, tiers, storage_options
        self.nodes, self.attempt, self.reader_options = nodes, attempt, reader_options
        self.tried: set[str] = set()

    def newest(self, run: str, names: list[str], found: list[_Found]
               ) -> tuple[Any, Recovered, str] | None:
        """(the attempt's result, what it loaded, the name) of the first of ``names`` not
        tried before that loads; None when none does (a checkpoint that cannot be
        assembled is skipped, every other failure raised)."""
        for name in names:
            if name in self.tried:
                continue
            self.tried.add(name)
            checkpoint = f"{run}/{name}"
            reader = TieredReader(self.tiers.memory_url(checkpoint), checkpoint,
                                  self.storage_options, peers=self.nodes, session=self.session,
                                  **self.reader_options)
            problems = _read_manifests(reader, self.nodes, [name in f.in_memory for f in found],
                                       checkpoint)
            if any(problems):
                log.warning("skipping %s: %s", checkpoint, "; ".join(p for p in problems if p))
                continue
            try:
                result = self.attempt(reader)
            except BaseException as exc:  # noqa: BLE001 - one kind is skipped, the rest raised
                error = as_ckptturbo_error(exc, checkpoint, "loading")
                if not isinstance(error, ChunksUnavailable):
                    raise
                log.info("skipping %s: %s", checkpoint, error)
                continue
            return result, Recovered(checkpoint, reader.manifest_tier or DURABLE,
                                     reader.bytes_from_storage - reader.bytes_from_durable,
                                     reader.bytes_from_durable, reader.bytes_from_peers), name
        return None


def _agreed_candidates(found: list[_Found]) -> tuple[str, list[str]]:
    """(run, names newest first) from every rank's ``_candidates``: the checkpoint when a
    rank found one at the URL itself, else every checkpoint some rank found."""
    for f in found:
        if f.at_url:
            return f.run, list(f.created)
    return found[0].run, newest_first([f.created for f in found])


def _read_manifests(reader: TieredReader, nodes: Nodes, in_memory: list[bool],
                    checkpoint: str) -> list[str | None]:
    """Every rank reads the checkpoint's manifest (collective; returns every rank's
    problem, None where it has it): from its node's memory tier when the listing found it
    there (``in_memory``, by rank), else from the first rank whose memory holds it, else
    from the durable store. A peer's memory is nearer than the durable store, and the copy
    a rank adopts into its node's memory names the chunks peers then copy in. One gather
    when no rank lacks it; a broadcast before it when some do."""
    shared = None
    if any(in_memory) and not all(in_memory):
        source = in_memory.index(True)
        mine = reader.memory_manifest_bytes() if nodes.rank == source else None
        shared = nodes.share(mine, source)
    adopt = shared if not in_memory[nodes.rank] else None
    return agree(nodes.group, f"reading the manifest of {checkpoint}",
                 lambda: _manifest_problem(reader, adopt))


def _manifest_problem(reader: TieredReader, shared: bytes | None) -> str | None:
    """Why this rank cannot read the manifest (None when it has): ``shared``, a peer's
    memory copy, is adopted when given and sound, else this node's memory copy or the
    durable one is read."""
    try:
        if shared is not None:
            try:
                reader.adopt_manifest(shared)
                return None
            except FormatError as exc:  # damaged on the way: the tiers may have a sound one
                log.warning("%s; reading it from the tiers instead", exc)
        reader.read_manifest()
    except (CheckpointNotFound, FormatError) as exc:
        return str(exc)
    return None


@dataclass(frozen=True)
class _Found:
    """What one rank found in the tiers (``_candidates``): the run, {name: created} of its
    checkpoints, whether a checkpoint was found at the URL itself, the rank's node, and
    the names whose manifest the node's memory tier holds (readable)."""

    run: str
    created: dict[str, float]
    at_url: bool
    node: str
    in_memory: frozenset[str]


def _candidates(session: Runtime, url: str, tiers: Tiers, storage_options: dict[str, Any] | None,
                lists_durable: bool) -> _Found:
    """What this rank can find: ``url`` alone
    when a tier holds a manifest there (readable or not: the load decides), else every
    checkpoint of the run ``url`` in this node's memory tier. Only the rank that
    ``lists_durable`` asks the durable store (the same store for every rank: one rank's
    answer is everyone's, and a request through an object store's latency per rank is
    most of a listing's time)."""
    try:
        run, name = split_checkpoint(url)
        locations = [Location(tiers.memory_url(url), session=session)]
        if lists_durable:
            locations.append(Location(url, storage_options, session=session))
    except CkptTurboError:
        locations = []  # no parent to hold a chunk store: a run
    node = tiers.node_name
    for location in locations:
        if location.store.exists(location.manifest_path):
            in_memory = frozenset({name}) if location is locations[0] else frozenset()
            try:
                return _Found(run, {name: location.read_manifest().created}, True, node, in_memory)
            except FormatError:
                return _Found(run, {name: 0.0}, True, node, frozenset())
    run = url.rstrip("/")
    found = {c.name: c.created
             for c in catalog.list_checkpoints(tiers.memory_run(run), session=session)}
    in_memory = frozenset(found)
    if lists_durable:
        found.update(_durable_checkpoints(session, run, storage_options, known=in_memory))
    return _Found(run, found, False, node, in_memory)


def _durable_checkpoints(session: Runtime, run: str, storage_options: dict[str, Any] | None,
                         known: Iterable[str]) -> dict[str, float]:
    """{name: created} of the durable run's committed checkpoints that are not in
    ``known`` (a name this node's memory holds is the same checkpoint, persisted: its
    time is known). An unreadable manifest is logged and left out, as ``ckptturbo ls``
    does."""
    found = {}
    for url, manifest in catalog.committed(run, storage_options, session, skip=known):
        if isinstance(manifest, FormatError):
            log.warning("checkpoint %s is unreadable: %s", url, manifest)
        else:
            found[posixpath.basename(url)] = manifest.created
    return found


def newest_first(found: list[dict[str, float]]) -> list[str]:
    """The names any rank found (``found``: each rank's {name: created}), newest first by
    the latest creation time a rank saw."""
    created: dict[str, float] = {}
    for names in found:
        for name, when in names.items():
            created[name] = max(when, created.get(name, when))
    return sorted(created, key=lambda n: (created[n], n), reverse=True)
