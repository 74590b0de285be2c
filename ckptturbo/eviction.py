"""Keeping a node's memory tier within its byte budget: evict the oldest checkpoints.

Host memory is small next to an object store, so the memory tier holds the newest few
checkpoints of a run: after each commit to it, the oldest are evicted (their manifests
first, so they cease to exist before any of their chunks go; then the chunks no remaining
manifest names, by the run's ordinary gc, which respects saves in flight). The newest
checkpoint is never evicted, whatever the budget: it is the one a crash recovers from.
The choice is a pure function of what the tier holds; the deletes are separate.
"""
from __future__ import annotations

import logging
import posixpath
from collections.abc import Iterable
from dataclasses import dataclass

from . import catalog
from .errors import CkptTurboError, FormatError, SaveInProgress
from .runs import RunStore
from .runtime import Runtime, gc_turn, resolve
from .store import TEMP_PREFIX

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Held:
    """One committed checkpoint of a memory-tier run: its name, age and chunks."""

    name: str
    created: float
    chunks: dict[str, int]


def held_bytes(checkpoints: Iterable[Held]) -> int:
    """Bytes of the distinct chunks these checkpoints name (shared chunks count once)."""
    sizes: dict[str, int] = {}
    for c in checkpoints:
        sizes.update(c.chunks)
    return sum(sizes.values())


def plan_eviction(checkpoints: list[Held], budget: int,
                  keep: frozenset[str] = frozenset()) -> list[str]:
    """The checkpoints to evict, oldest first, until what the others name fits ``budget``.

    The newest checkpoint and those in ``keep`` (a persist in flight reads them) stay even
    when the budget is then still exceeded: a tier over budget is better than one without
    the checkpoint a crash would recover from.
    """
    order = sorted(checkpoints, key=lambda c: (c.created, c.name))
    kept = list(order)
    evicted = []
    for candidate in order[:-1]:
        if held_bytes(kept) <= budget:
            break
        if candidate.name in keep:
            continue
        kept.remove(candidate)
        evicted.append(candidate.name)
    return evicted


@dataclass(frozen=True)
class Eviction:
    """What an eviction did: the checkpoints it evicted, and whether the run is still over
    its budget because of checkpoints it had to keep (the newest, saves in flight)."""

    evicted: list[str]
    over_budget: bool


def evict(run_url: str, budget: int, *, keep: frozenset[str] = frozenset(),
          session: Runtime | None = None) -> Eviction:
    """Bring a memory-tier run within ``budget`` bytes, as far as ``keep`` allows.

    An unreadable manifest (a tier damaged at rest) is removed as well: the memory tier is
    a cache, and a manifest that cannot be verified can never be loaded. A gc that finds a
    save in flight frees nothing now; the next eviction frees it. Evictions of one run in
    this process take turns with each other and with its gcs (a save's eviction after its
    commit and an earlier save's after its replication run on different threads): two at
    once would choose the same checkpoints and the second would find them gone.
    """
    session = resolve(session)
    run = RunStore.for_run(run_url, session=session)
    with gc_turn(run.store.url_of(run.gc_lock)):
        return _evict(run, run_url, budget, keep, session)


def _evict(run: RunStore, run_url: str, budget: int, keep: frozenset[str],
           session: Runtime) -> Eviction:
    present = run.chunk_ids()
    held, bad = [], []
    for url, manifest in catalog.committed(run_url, None, session):
        name = posixpath.basename(url)
        if isinstance(manifest, FormatError):
            log.warning("memory tier: evicting unreadable checkpoint %s (%s)", url, manifest)
            bad.append(name)
        else:  # what this node holds of it: its ranks' chunks and its peers' replicas
            held.append(Held(name, manifest.created,
                             {c: n for c, n in manifest.chunks.items() if c in present}))
    doomed = bad + plan_eviction(held, budget, keep)
    for name in doomed:
        catalog.delete_checkpoint(f"{run_url}/{name}", session=session)
    # chunks no manifest names: those of the doomed, or of checkpoints deleted since (an
    # adapter's rotation deletes while a save is in flight, when gc must leave them)
    named = set().union(*(h.chunks for h in held))
    if doomed or any(c not in named and not c.startswith(TEMP_PREFIX) for c in present):
        try:
            catalog.collect_garbage(run_url, session=session)
        except SaveInProgress as exc:  # the normal state of a tiered run: not a warning
            log.info("memory tier %s: chunks no checkpoint names stay until a later eviction "
                     "(%s)", run_url, exc)
        except CkptTurboError as exc:
            log.warning("memory tier %s: chunks not freed yet: %s", run_url, exc)
    if doomed:
        log.info("memory tier %s: evicted %s to stay within %d bytes", run_url, doomed, budget)
    return Eviction(doomed, held_bytes(h for h in held if h.name not in doomed) > budget)
