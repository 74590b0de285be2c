"""What every adapter needs from ckptturbo, built only on its public surface.

* ``save_tree``: save a nested checkpoint dict asynchronously with its exact nesting,
  either collectively (every rank of the group calls it) or from this process alone
  (Lightning saves on global rank 0 only, while the other ranks train on). It loads back
  with ``ct.load_state_dict``.
* ``remove`` / ``collect_garbage``: drop a checkpoint and free the chunks no kept one uses.
* ``ckptturbo_errors``: around an adapter's public method, lets only ckptturbo's errors out.
* ``chunk_store`` / ``shared_store`` / ``tiered_store``: the adapters' one ``store=`` option.
"""
from __future__ import annotations

import logging
import random
import threading
from collections.abc import Mapping
from typing import Any, cast

import numpy as np
import torch
import torch.distributed as dist

import ckptturbo as ct
from ckptturbo.adapter_support import (
    OWN_STORE,
    RUN_STORE,
    ckptturbo_errors,  # noqa: F401 - the adapters' one error wrapper
    flatten,
    gather,
)
from ckptturbo.adapter_support import parent_url as run_of  # noqa: F401 - lightning's gc

log = logging.getLogger(__name__)


# ``store=`` of the adapters, as the core's ``TurboWriter(store=...)`` names it
STORES = {"checkpoint": OWN_STORE, "run": RUN_STORE}


def chunk_store(store: str) -> str:
    """The core's ``store=`` for an adapter's: "checkpoint" (each checkpoint holds its own
    chunks), "run" (the checkpoints of a directory share one store), or a URL."""
    return STORES.get(store, store)


def shared_store(store: str) -> bool:
    """Whether checkpoints share a chunk store, freed by gc, rather than each holding its own."""
    return chunk_store(store) != OWN_STORE


def tiered_store(store: str | None, tiers: ct.Tiers | None) -> str:
    """The adapter's ``store``: by default "checkpoint", or "run" with tiers, which keep the
    chunks of a directory in one store per tier (replication and persists copy between them)."""
    if tiers is not None and store not in (None, "run"):
        raise ct.CkptTurboError(f"tiers= keeps the chunks of a directory in one store per tier: "
                                f"store={store!r} cannot be combined with it (leave store out, "
                                "or pass \"run\")")
    return store or ("run" if tiers is not None else "checkpoint")


def _flat_planner() -> ct.TurboSavePlanner:
    # The tree is flattened already (with its skeleton); DCP must not flatten it again.
    # ckptturbo's own planner, as ct.save's default (ct.save binds its group to it).
    return ct.TurboSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False)


def _session(session: ct.Session | None) -> ct.Session:
    return session if session is not None else ct.default_session()


def save_tree(state: Mapping[str, Any], url: str, *, storage_options: dict[str, Any] | None = None,
              collective: bool = True, process_group: Any = None, session: ct.Session | None = None,
              **writer_options: Any) -> ct.SaveHandle:
    """Start an async save of a nested dict; returns a handle with ``staged``/``durable``.

    collective=True: every rank of ``process_group`` calls it (``ct.save``). False: this
    process alone saves, whatever the process group is doing. ``session``: the
    ``ckptturbo.Session`` that owns the save (default: the process's default session).
    """
    return _session(session).save(flatten(state), str(url), process_group=process_group,
                                  collective=collective, storage_options=storage_options,
                                  planner=_flat_planner(), **writer_options)


def exists(url: str, storage_options: dict[str, Any] | None = None, *,
           session: ct.Session | None = None, tiers: ct.Tiers | None = None) -> bool:
    """Whether a committed checkpoint is at ``url`` (a save of it in flight is waited for);
    with ``tiers``, at ``url`` or in this node's memory tier."""
    return _session(session).exists(str(url), storage_options=storage_options, tiers=tiers)


def remove(url: str, storage_options: dict[str, Any] | None = None, *,
           session: ct.Session | None = None, tiers: ct.Tiers | None = None) -> None:
    """Make a checkpoint cease to exist (its manifest goes; chunks in a shared store wait for
    gc, a self-contained checkpoint's go with it); a save of it in flight is waited for
    first, and a missing one is left as it is. With ``tiers``, from this node's memory tier
    too."""
    try:
        _session(session).delete(str(url), storage_options=storage_options, tiers=tiers)
    except ct.CheckpointNotFound:
        log.debug("%s: nothing to remove", url)


def list_checkpoints(run_url: str, storage_options: dict[str, Any] | None = None, *,
                     wait: bool = True, session: ct.Session | None = None,
                     tiers: ct.Tiers | None = None) -> list[Any]:
    """Committed checkpoints of a run, oldest first (catalog entries with ``name``, ``url``);
    saves in flight in this process under the run are waited for, or with ``wait=False``
    listed last with ``pending=True``. With ``tiers``, those only in this node's memory
    tier too, under their durable URLs."""
    return _session(session).list_checkpoints(str(run_url), storage_options=storage_options,
                                              wait=wait, tiers=tiers)


def collect_garbage(run_url: str, storage_options: dict[str, Any] | None = None, *,
                    session: ct.Session | None = None) -> bool:
    """Free the run's chunks that no kept checkpoint names (``ct.collect_garbage`` on
    ``session``); False if a save was in progress (a later pass frees them)."""
    try:
        _session(session).collect_garbage(str(run_url), storage_options=storage_options)
    except ct.SaveInProgress as exc:
        log.info("gc of %s postponed: %s", run_url, exc)
        return False
    return True


class DeferredGC:
    """Frees a run's unreferenced chunks off the training thread, once saves in flight are durable.

    gc refuses to run while a save of the run is pending, so it waits for the handles it
    was given; a run it could not collect is retried by the next ``schedule`` or ``finish``.
    A run scheduled again while a pass collects it stays due: that pass may have listed the
    run before the newly removed checkpoint went.
    """

    def __init__(self, storage_options: dict[str, Any] | None = None, *,
                 session: ct.Session | None = None) -> None:
        self.storage_options = storage_options
        self.session = session
        self._due: dict[str, int] = {}  # run URL -> how many times it was scheduled
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def schedule(self, run_url: str, inflight: list[ct.SaveHandle]) -> None:
        with self._lock:
            self._due[run_url] = self._due.get(run_url, 0) + 1
        if self._thread is not None and self._thread.is_alive():
            return  # the running pass picks up runs added meanwhile, or finish() does
        self._thread = threading.Thread(target=self._collect, args=(list(inflight),),
                                        name="ckptturbo-adapter-gc", daemon=True)
        self._thread.start()

    def _collect(self, inflight: list[ct.SaveHandle]) -> None:
        for handle in inflight:
            try:
                handle.durable.result()
            except Exception:  # noqa: BLE001 - the handle's owner reports it
                pass
        with self._lock:
            due = sorted(self._due.items())
        for url, scheduled in due:
            if collect_garbage(url, self.storage_options, session=self.session):
                with self._lock:
                    if self._due.get(url) == scheduled:  # not scheduled again meanwhile
                        del self._due[url]

    @property
    def running(self) -> bool:
        """Whether a gc pass is under way (it uses the session's threads)."""
        return self._thread is not None and self._thread.is_alive()

    def finish(self) -> None:
        """Wait for a running pass, then collect what is still due (call once saves are durable)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._collect([])


def rng_state() -> dict[str, Any]:
    """This process's RNG states; NumPy's key array as a tensor, so no full unpickling is needed."""
    legacy = cast(tuple[str, np.ndarray, int, int, float], np.random.get_state())
    kind, keys, pos, has_gauss, cached = legacy
    state = {"python": random.getstate(), "numpy": (kind, torch.from_numpy(keys.astype(np.int64)),
                                                     pos, has_gauss, cached),
             "cpu": torch.random.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.random.get_rng_state_all()
    return state


def native_rng_state(saved: dict[str, Any]) -> dict[str, Any]:
    """A saved ``rng_state()`` in the form ``random``/``np.random`` setters take."""
    kind, keys, pos, has_gauss, cached = saved["numpy"]
    return {**saved, "python": _tuples(saved["python"]),
            "numpy": (kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached)}


def set_rng_state(saved: dict[str, Any]) -> None:
    state = native_rng_state(saved)
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.random.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.random.set_rng_state_all(state["cuda"])


def _tuples(value: Any) -> Any:
    return tuple(_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value


def rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def all_ranks(value: Any) -> list[Any]:
    """Every rank's value on every rank, so that every rank saves the same tree."""
    _, world = rank_and_world()
    return gather(dist.group.WORLD if world > 1 else None, value)
