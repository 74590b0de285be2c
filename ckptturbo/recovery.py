"""Loading from tiers: the newest checkpoint that can be assembled, each chunk from the
nearest holder.

A tiered load looks for checkpoints in this node's memory tier and in the durable store.
A manifest in memory that was never persisted is as trustworthy as a durable one: it
carries its own checksum and names its chunks by their hashes. Candidates are tried
newest first; the ranks agree on the candidates (a checkpoint counts only when every
rank finds its manifest in one of its tiers) and on each outcome, so they all load the
same one. A rank reads each chunk from its own node's memory when it is there, else from
the durable store; a checkpoint where some rank needs a chunk that neither holds (it was
only in another node's memory, or evicted) is skipped for the next older one. When the
memory tier is gone (the node was lost) only durable checkpoints are candidates.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, TypeVar

import torch.distributed as dist

from . import catalog
from .chunk_source import ChunkSource
from .agreement import agree
from .errors import CheckpointNotFound, ChunksUnavailable, CkptTurboError, FormatError, names_preview
from .failures import as_ckptturbo_error
from .layout import Location, Manifest
from .reader import TurboReader
from .session import wait_for_saves
from .tiers import Tiers, split_checkpoint

if TYPE_CHECKING:
    from .session import Session

log = logging.getLogger(__name__)
T = TypeVar("T")

MEMORY, DURABLE = "memory", "durable"


@dataclass(frozen=True)
class Recovered:
    """What a tiered load loaded: the checkpoint's durable URL, the tier its manifest came
    from on this rank, and the chunk bytes this rank read from each tier."""

    url: str
    manifest_tier: str
    bytes_from_memory: int
    bytes_from_durable: int


class TieredChunkSource(ChunkSource):
    """Chunks of one checkpoint from this node's memory tier when it holds them, else from
    the durable run's store; verified alike. ``bytes_from_durable`` counts the latter."""

    def __init__(self, location: Location, manifest: Manifest, url: str, verify: str,
                 memory: Location | None, durable: Location) -> None:
        super().__init__(location, manifest, url, verify)
        self.memory = memory
        self.durable = durable
        self.in_memory = memory.run.chunk_ids() & manifest.chunks.keys() if memory is not None else set()
        self._in_durable: set[str] | None = None
        self.bytes_from_durable = 0

    def holder(self, cid: str) -> Location:
        return self.memory if cid in self.in_memory and self.memory is not None else self.durable

    def require(self, cids: list[str]) -> None:
        """Raise ChunksUnavailable unless each of ``cids`` is in one of this rank's tiers
        (the durable store is listed only when memory lacks some)."""
        lacking = [cid for cid in cids if cid not in self.in_memory]
        if not lacking:
            return
        if self._in_durable is None:
            self._in_durable = self.durable.run.chunk_ids()
        missing = [cid for cid in lacking if cid not in self._in_durable]
        if missing:
            raise ChunksUnavailable(
                f"checkpoint {self.url}: {len(missing)} chunks this rank needs are neither in "
                f"this node's memory tier nor in {self.durable.run.store.url_of(self.durable.chunks_root)} "
                f"({names_preview(missing, 3)})")

    def _read_checked(self, cid: str, view: memoryview) -> None:
        super()._read_checked(cid, view)
        if self.holder(cid) is self.durable:
            with self._lock:
                self.bytes_from_durable += len(view)


class TieredReader(TurboReader):
    """A TurboReader over one checkpoint in the tiers: the manifest from this node's memory
    tier when it is there (else the durable one), chunks from the nearest holder. Chunks
    are not forwarded between ranks (the chain schedule knows nothing of holders), and a
    rank checks before any byte is read that it can reach every chunk its items need."""

    def __init__(self, memory_url: str, url: str, storage_options: dict[str, Any] | None = None,
                 **options: Any) -> None:
        options["broadcast"] = False
        super().__init__(url, storage_options, **options)
        self.memory_url = memory_url
        self.manifest_tier: str | None = None

    def read_manifest(self) -> Manifest:
        if self._manifest is None:
            wait_for_saves(self.url)
            try:
                self._manifest = Location(self.memory_url, session=self._session).read_manifest()
                self.manifest_tier = MEMORY
            except (CheckpointNotFound, FormatError) as exc:
                if isinstance(exc, FormatError):  # damaged at rest: its checksum refused it
                    log.warning("%s; reading the durable copy of %s instead", exc, self.url)
                durable = Location(self.url, self.storage_options, session=self._session)
                self._manifest = durable.read_manifest()
                self.manifest_tier = DURABLE
            # the durable side of the checkpoint: where chunks memory lacks are read
            self._location = Location.for_manifest(self.url, self.storage_options, self._manifest,
                                                   session=self._session)
        return self._manifest

    @property
    def chunks(self) -> TieredChunkSource:
        if self._source is None:
            memory = Location(self.memory_url, session=self._session)
            self._source = TieredChunkSource(self.location, self.read_manifest(), self.url,
                                             self.verify_mode, memory, self.location)
        return self._source  # type: ignore[return-value]

    @property
    def bytes_from_durable(self) -> int:
        return self._source.bytes_from_durable if self._source is not None else 0

    def prepare_local_plan(self, plan: Any) -> Any:
        self.chunks.require(self._chunks_of(plan.items))
        return super().prepare_local_plan(plan)


def recover(session: Session, url: str, tiers: Tiers, *, storage_options: dict[str, Any] | None,
            group: Any, attempt: Callable[[TieredReader], T], reader_options: dict[str, Any]
            ) -> tuple[T, Recovered]:
    """Run ``attempt`` (a load through a reader) on the newest checkpoint every rank of
    ``group`` can assemble. ``url`` is a checkpoint (only it is tried) or a run (its
    checkpoints in memory and in the durable store are). Raises CheckpointNotFound naming
    both tiers when none can be assembled."""
    wait_for_saves(url, under=True)
    found = agree(group, f"listing the tiers of {url}",
                  lambda: _candidates(session, url, tiers, storage_options))
    run, candidates = found[0 if group is None else dist.get_rank(group)]
    for name in newest_first([names for _, names in found]):
        checkpoint = f"{run}/{name}"
        reader = TieredReader(tiers.memory_url(checkpoint), checkpoint, storage_options,
                              session=session, **reader_options)
        problems = agree(group, f"reading the manifest of {checkpoint}",
                         lambda: _manifest_problem(reader))
        if any(problems):
            log.warning("skipping %s: %s", checkpoint, "; ".join(p for p in problems if p))
            continue
        try:
            result = attempt(reader)
        except BaseException as exc:  # noqa: BLE001 - one kind is skipped, the rest raised
            error = as_ckptturbo_error(exc, checkpoint, "loading")
            if not isinstance(error, ChunksUnavailable):
                raise
            log.info("skipping %s: %s", checkpoint, error)
            continue
        return result, Recovered(checkpoint, reader.manifest_tier or DURABLE,
                                 reader.bytes_from_storage - reader.bytes_from_durable,
                                 reader.bytes_from_durable)
    raise CheckpointNotFound(
        f"no checkpoint of {run} can be assembled from the memory tier {tiers.memory_run(run)} "
        f"(node {tiers.node_name}) or the durable store ({len(candidates)} found on this rank)")


def _manifest_problem(reader: TieredReader) -> str | None:
    try:
        reader.read_manifest()
    except (CheckpointNotFound, FormatError) as exc:
        return str(exc)
    return None


def _candidates(session: Session, url: str, tiers: Tiers, storage_options: dict[str, Any] | None
                ) -> tuple[str, dict[str, float]]:
    """(run, {name: created}) of what this rank can find: ``url`` alone when a tier holds a
    manifest there (readable or not: the load decides), else every checkpoint of the run
    ``url`` in either tier."""
    try:
        run, name = split_checkpoint(url)
        locations = [Location(tiers.memory_url(url), session=session),
                     Location(url, storage_options, session=session)]
    except CkptTurboError:
        locations = []  # no parent to hold a chunk store: a run
    for location in locations:
        if location.store.exists(location.manifest_path):
            try:
                return run, {name: location.read_manifest().created}
            except FormatError:
                return run, {name: 0.0}
    run = url.rstrip("/")
    found = {c.name: c.created for c in catalog.list_checkpoints(run, storage_options, session=session)}
    memory = catalog.list_checkpoints(tiers.memory_run(run), session=session)
    found.update({c.name: c.created for c in memory})
    return run, found


def newest_first(found: list[dict[str, float]]) -> list[str]:
    """The names every rank found (``found``: each rank's {name: created}), newest first by
    the first rank's creation times."""
    common = set(found[0]).intersection(*found[1:])
    return sorted(common, key=lambda n: (found[0][n], n), reverse=True)
