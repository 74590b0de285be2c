"""A save run in the background: DCP's save through a writer the runtime keeps, on a
thread the runtime tracks, resolving the handle's futures.

``operations.save`` (a plain save) and ``tiered_save`` (whose target is the memory tier,
with its replication and persist after the commit) both start their saves here, so neither
imports the other. The save runs on a dedicated gloo group (created once per runtime), so
the caller waits only for ``handle.staged``; training collectives and checkpoint
collectives never share a group, which is what makes DCP's own async save hang when they
interleave.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from . import dcp_protocol, delta_save, shutdown
from .errors import CkptTurboError, SaveInProgress
from .failures import as_ckptturbo_error, ckptturbo_errors
from .planner import TurboSavePlanner, on_group
from .results import SaveSummary
from .runtime import Runtime, single_process
from .staging import SaveHandle
from .urls import options_key, parent_url, url_key
from .writer import TurboWriter

# A save in flight outlives the script: exit and destroy_process_group wait for it.
shutdown.guard_saves_in_flight()


def kept_writer(runtime: Runtime, url: str, storage_options: dict[str, Any] | None,
                options: dict[str, Any], collective: bool) -> TurboWriter:
    """One writer per run and settings, kept by the runtime so that its pool and plan
    cache are reused (``Runtime.kept``)."""
    run = parent_url(url_key(url))
    key = (run, collective, options_key(storage_options), options_key(options))
    return runtime.kept(key, lambda: TurboWriter(url, storage_options, snapshot=True,
                                                 session=runtime, **options))


def run_save(session: Runtime, state_dict: dict[str, Any], url: str, target: str,
             handle: SaveHandle, *, process_group: Any, collective: bool,
             storage_options: dict[str, Any] | None, planner: Any, wait_previous: bool,
             writer_options: dict[str, Any],
             after_commit: Callable[[Any, SaveSummary], None] | None = None,
             delta_from: str | None = None) -> SaveHandle:
    """Run DCP's save of ``state_dict`` to ``target`` on a thread the session tracks as a
    save of ``url``. Without ``after_commit`` the commit resolves ``durable``; with it (a
    tiered save, whose target is the memory tier) ``after_commit(group, summary)`` runs on
    the same thread and resolves the handle's futures. A failure resolves every future
    not yet resolved with the same ckptturbo error. ``delta_from``: a delta save over
    that checkpoint (``delta_save``; one process saves)."""
    with ckptturbo_errors("saving", url):  # options the writer does not take
        writer = kept_writer(session, target, storage_options, writer_options, collective)
    previous = [h for h in session.saves_of(writer) if not _gate(h).done()]
    if previous:
        if not wait_previous:
            where = "in host memory" if hasattr(previous[-1], "local") else "durable"
            raise SaveInProgress(f"the previous save to {previous[-1].url} is not {where} yet")
        with contextlib.suppress(Exception):  # its failure belongs to its own handle
            _gate(previous[-1]).exception()
    grouped = collective and dist.is_initialized()
    if delta_from is not None and grouped and dist.get_world_size(process_group) > 1:
        raise CkptTurboError(f"saving {url} with delta_from: a delta save is made by one "
                             "process (collective=False, or a group of one); save the full "
                             "state from one rank")
    group = session.gloo_group(process_group, "save") if grouped else None
    planner = on_group(planner if planner is not None else TurboSavePlanner(), group, "save")
    started = time.monotonic()

    def staged() -> None:
        if not handle.staged.done():
            handle.staged.set_result(None)

    def run() -> None:
        writer.reset(target)
        writer.on_staged = staged
        try:
            try:
                to_save = state_dict
                if delta_from is not None:
                    where = writer.location
                    to_save, writer.delta = delta_save.prepare(
                        session, state_dict, delta_from,
                        where.chunk_store.url_of(where.chunks_root), storage_options)
                with single_process(group is None):
                    dcp_protocol.save(to_save, writer, planner, group)
                if writer.delta is not None and writer.delta.committed:
                    session.keep_delta_base(url, writer.delta.kept())
            finally:  # before after_commit: once it resolves `local`, the next save sets its own
                writer.on_staged = None
                writer.delta = None
            stats = writer.last_stats
            summary = SaveSummary.of(
                url, stats, stats.bytes_written + stats.bytes_reused,
                {"stage": stats.seconds_stage, "durable": time.monotonic() - started})
            staged()
            if after_commit is None:
                handle.durable.set_result(summary)
            else:
                after_commit(group, summary)
        except BaseException as exc:  # noqa: BLE001 - delivered through the futures
            error = as_ckptturbo_error(exc, url, "saving")
            for future in (handle.staged, getattr(handle, "local", None),
                           getattr(handle, "replicated", None), handle.durable):
                if future is not None and not future.done():
                    future.set_exception(error)

    session.track(url, handle, writer, run)
    return handle


def _gate(handle: SaveHandle) -> Any:
    """The future a save's successor through the same writer waits for: its commit to the
    writer's target (``durable``; for a tiered save ``local``, its persist runs behind)."""
    return getattr(handle, "local", handle.durable)
