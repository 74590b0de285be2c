"""The checkpoints of a run across this node's tiers: its memory tier and the durable store.

A tiered save persists only every Nth checkpoint, so a framework that lists, probes or
rotates the checkpoints of a run by their durable URLs (transformers' ``checkpoint-<step>``
rotation and resume, Lightning's top-k removal) would not see the others. These are the
catalog's list, exists and delete over both places at once, under the durable names: a
checkpoint is one name whichever tier holds it.

Only this node's memory tier is looked at. Other nodes' memory tiers hold copies of the
manifest and replicas of chunks; a checkpoint deleted here stays there until their own
budgets evict it, and a tiered load by the run's URL takes the newest checkpoint any node
holds, so a rotation that deletes the oldest ones never brings one back.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any

from .catalog import (
    CheckpointInfo,
    collect_garbage,
    delete_checkpoint,
    is_committed,
    list_checkpoints,
)
from .errors import CheckpointNotFound, CkptTurboError
from .runtime import wait_for_saves
from .tiers import Tiers
from .urls import split_checkpoint

if TYPE_CHECKING:
    from .runtime import Runtime

log = logging.getLogger(__name__)

MEMORY, DURABLE = "memory", "durable"


def list_tiered(run_url: str, storage_options: dict[str, Any] | None, tiers: Tiers, *,
                include_unreadable: bool = False, wait: bool = True,
                session: Runtime | None = None) -> list[CheckpointInfo]:
    """Committed checkpoints of a run in this node's memory tier or the durable store, oldest
    first, each once, with its durable URL and ``tiers`` saying which of the two hold it (a
    checkpoint only in memory is not durable). Saves in flight in this process are waited
    for, or with ``wait=False`` listed last with ``pending=True`` and no tier."""
    run = run_url.rstrip("/")
    if wait:  # before either listing: a save's memory commit lands before its persist
        wait_for_saves(run, under=True)
    held: dict[str, list[str]] = {}
    infos: dict[str, CheckpointInfo] = {}
    for tier, where, options in ((MEMORY, tiers.memory_run(run), None),
                                 (DURABLE, run, storage_options)):
        for c in list_checkpoints(where, options, include_unreadable=include_unreadable,
                                  wait=False, session=session):
            if c.pending:  # only the durable listing has them: saves are tracked by durable URLs
                infos.setdefault(c.name, c)
                continue
            held.setdefault(c.name, []).append(tier if not c.error else f"{tier}(UNREADABLE)")
            if not c.error or c.name not in infos or infos[c.name].pending:
                infos[c.name] = c
    listed = [dataclasses.replace(c, url=f"{run}/{c.name}", tiers=tuple(held.get(c.name, ())),
                                  pending=c.pending and c.name not in held)
              for c in infos.values()]
    return sorted(listed, key=lambda c: (c.pending, c.error is None, c.created, c.name))


def exists_tiered(url: str, storage_options: dict[str, Any] | None, tiers: Tiers, *,
                  session: Runtime | None = None) -> bool:
    """Whether a committed checkpoint is at ``url`` in this node's memory tier or the durable
    store, once a save of it in flight in this process has ended."""
    wait_for_saves(url)
    return any(is_committed(where, options, session=session)
               for where, options in _places(url, storage_options, tiers))


def delete_tiered(url: str, storage_options: dict[str, Any] | None, tiers: Tiers, *,
                  session: Runtime | None = None) -> None:
    """Delete a checkpoint from this node's memory tier and from the durable store, from
    each that holds it (a save of it in flight is waited for first), and free the memory
    tier's chunks it alone named; raises CheckpointNotFound when neither holds it."""
    wait_for_saves(url)  # tracked by its durable URL: the memory copy's delete would not wait
    found = False
    for where, options in _places(url, storage_options, tiers):
        try:
            delete_checkpoint(where, options, session=session)
        except CheckpointNotFound:
            continue
        found = True
        if options is None:  # host memory is scarce: free its chunks now, not at an eviction
            _free_memory(tiers.memory_run(split_checkpoint(url)[0]), session)
    if not found:
        raise CheckpointNotFound(f"no checkpoint at {url} nor at {tiers.memory_url(url)} "
                                 "(its copy in this node's memory tier)")


def _places(url: str, storage_options: dict[str, Any] | None,
            tiers: Tiers) -> tuple[tuple[str, dict[str, Any] | None], ...]:
    """(location, its storage options) of a checkpoint: this node's memory tier first."""
    return (tiers.memory_url(url), None), (url, storage_options)


def _free_memory(memory_run: str, session: Runtime | None) -> None:
    """Free the memory tier's chunks no checkpoint names; with a save of the run in flight
    gc must leave them, and the eviction after that save's commit frees them."""
    try:
        collect_garbage(memory_run, session=session)
    except CkptTurboError as exc:
        log.debug("memory tier %s: chunks freed at the next eviction (%s)", memory_run, exc)
