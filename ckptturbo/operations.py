"""Save and load as a session runs them: DCP with ckptturbo's writer/reader and its rules.

``save`` runs DCP's save on a thread the session tracks, on a dedicated gloo group (created
once per session), so the caller waits only for ``handle.staged``: the copy of its state
into host memory. Training collectives and checkpoint collectives never share a group,
which is what makes DCP's own async save hang when they interleave. Loads wait for a save
of the same checkpoint in flight in this process first (read-your-writes), check that the
state fits before any byte is read, and raise only ckptturbo's errors.
"""
from __future__ import annotations

import contextlib
import logging
import time
from typing import TYPE_CHECKING, Any, Callable, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from .errors import CkptTurboError, MismatchError, SaveInProgress
from .failures import as_ckptturbo_error, ckptturbo_errors
from .planner import TurboLoadPlanner, on_group
from .reader import TurboReader
from .session import single_process
from .staging import SaveHandle, SaveSummary
from .tree import unflatten

if TYPE_CHECKING:
    from .recovery import Recovered
    from .session import Session
    from .tiers import Tiers

log = logging.getLogger(__name__)
T = TypeVar("T")


def save(session: Session, state_dict: dict[str, Any], url: Any, *, process_group: Any = None,
         collective: bool = True, storage_options: dict[str, Any] | None = None,
         planner: Any = None, wait_previous: bool = True, tiers: Tiers | None = None,
         persist: bool = False, **writer_options: Any) -> SaveHandle:
    url = str(url)
    if tiers is not None:
        from .tiered_save import save as tiered_save

        with ckptturbo_errors("saving", url):  # a URL without a run, a bad tier setting
            return tiered_save(session, state_dict, url, tiers, persist=persist,
                               process_group=process_group, collective=collective,
                               storage_options=storage_options, planner=planner,
                               wait_previous=wait_previous, writer_options=writer_options)
    if persist:
        raise CkptTurboError(f"saving {url}: persist=True needs tiers= (without tiers every "
                             "save goes to the durable URL)")
    return run_save(session, state_dict, url, url, SaveHandle(url), process_group=process_group,
                    collective=collective, storage_options=storage_options, planner=planner,
                    wait_previous=wait_previous, writer_options=writer_options)


def run_save(session: Session, state_dict: dict[str, Any], url: str, target: str,
             handle: SaveHandle, *, process_group: Any, collective: bool,
             storage_options: dict[str, Any] | None, planner: Any, wait_previous: bool,
             writer_options: dict[str, Any],
             after_commit: Callable[[Any, SaveSummary], None] | None = None) -> SaveHandle:
    """Run DCP's save of ``state_dict`` to ``target`` on a thread the session tracks as a
    save of ``url``. Without ``after_commit`` the commit resolves ``durable``; with it (a
    tiered save, whose target is the memory tier) ``after_commit(group, summary)`` runs on
    the same thread and resolves the handle's futures. A failure resolves every future
    not yet resolved with the same ckptturbo error."""
    with ckptturbo_errors("saving", url):  # options the writer does not take
        writer = session.writer(target, storage_options, writer_options, collective)
    previous = [h for h in session.saves_of(writer) if not _gate(h).done()]
    if previous:
        if not wait_previous:
            where = "in host memory" if hasattr(previous[-1], "local") else "durable"
            raise SaveInProgress(f"the previous save to {previous[-1].url} is not {where} yet")
        with contextlib.suppress(Exception):  # its failure belongs to its own handle
            _gate(previous[-1]).exception()
    group = session.gloo_group(process_group, "save") if collective and dist.is_initialized() else None
    planner = on_group(planner, group)
    started = time.monotonic()

    def staged() -> None:
        if not handle.staged.done():
            handle.staged.set_result(None)

    def run() -> None:
        writer.reset(target)
        writer.on_staged = staged
        try:
            try:
                with single_process(group is None):
                    dcp.save(state_dict, storage_writer=writer, process_group=group,
                             planner=planner, no_dist=group is None)
            finally:  # before after_commit: once it resolves `local`, the next save sets its own
                writer.on_staged = None
            stats = writer.last_stats
            summary = SaveSummary(
                url=url, bytes_total=stats.bytes_written + stats.bytes_reused,
                bytes_staged=stats.bytes_staged, bytes_written=stats.bytes_written,
                bytes_reused=stats.bytes_reused, chunks_written=stats.chunks_written,
                chunks_reused=stats.chunks_reused,
                seconds={"stage": stats.seconds_stage, "durable": time.monotonic() - started})
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


def load(session: Session, state_dict: dict[str, Any], url: Any, *, process_group: Any = None,
         storage_options: dict[str, Any] | None = None, planner: Any = None, strict: bool = True,
         tiers: Tiers | None = None, **reader_options: Any) -> Recovered | None:
    url = str(url)

    def attempt(reader: TurboReader) -> None:
        manifest = reader.read_manifest()
        check_fits(state_dict, manifest.items, reader.url, strict)
        with ckptturbo_errors("loading", reader.url), single_process(not dist.is_initialized()):
            dcp.load(state_dict, storage_reader=reader, process_group=process_group,
                     planner=on_group(planner, _load_group(process_group))
                     if planner is not None else TurboLoadPlanner(_load_group(process_group),
                                           allow_partial_load=not strict),
                     no_dist=not dist.is_initialized())

    if tiers is None:
        attempt(_reader(session, url, storage_options, process_group=process_group, **reader_options))
        return None
    group = session.gloo_group(process_group, "tiers") if dist.is_initialized() else None
    return _recover(session, url, tiers, storage_options, group, attempt, reader_options)[1]


def load_state_dict(session: Session, url: Any, *, storage_options: dict[str, Any] | None = None,
                    device: Any = "cpu", process_group: Any = None, grouped: bool = True,
                    allow_pickle: bool = False, templates: dict[str, Any] | None = None,
                    tiers: Tiers | None = None, **reader_options: Any) -> dict[str, Any]:
    url = str(url)
    use_group = grouped and dist.is_available() and dist.is_initialized()
    group = process_group if use_group else None

    def attempt(reader: TurboReader) -> dict[str, Any]:
        metadata = reader.read_metadata()
        check_templates(templates or {}, metadata.state_dict_metadata, reader.url)
        flat: dict[str, Any] = {}
        for key, md in metadata.state_dict_metadata.items():
            if templates and key in templates:
                flat[key] = templates[key]
            elif isinstance(md, TensorStorageMetadata):
                flat[key] = torch.empty(md.size, dtype=md.properties.dtype, device=device)
            else:
                flat[key] = None
        planner = TurboLoadPlanner(_load_group(group) if use_group else None,
                                   flatten_state_dict=False, flatten_sharded_tensors=False)
        with ckptturbo_errors("loading", reader.url), single_process(not use_group):
            dcp.load(flat, storage_reader=reader, planner=planner, process_group=group,
                     no_dist=not use_group)
        return unflatten(flat, metadata.planner_data, reader.url)

    if tiers is None:
        return attempt(_reader(session, url, storage_options, process_group=group,
                               allow_pickle=allow_pickle, **reader_options))
    agree = session.gloo_group(group, "tiers") if use_group else None
    return _recover(session, url, tiers, storage_options, agree, attempt,
                    dict(reader_options, process_group=group, allow_pickle=allow_pickle))[0]


def _load_group(process_group: Any) -> Any:
    """The group dcp.load runs on (its default: the world), for ckptturbo's load planner;
    None without one (the planner then plans as DCP's)."""
    if not dist.is_initialized():
        return None
    return process_group if process_group is not None else dist.group.WORLD


def _recover(session: Session, url: str, tiers: Tiers, storage_options: dict[str, Any] | None,
             group: Any, attempt: Callable[[Any], T], reader_options: dict[str, Any]
             ) -> tuple[T, Recovered]:
    """A tiered load: the newest checkpoint the tiers can assemble (``recovery``)."""
    from .recovery import recover

    with ckptturbo_errors("loading", url):
        result, recovered = recover(session, url, tiers, storage_options=storage_options,
                                    group=group, attempt=attempt, reader_options=reader_options)
    log.info("loaded %s (manifest from %s; %d bytes from memory, %d from the durable store)",
             recovered.url, recovered.manifest_tier, recovered.bytes_from_memory,
             recovered.bytes_from_durable)
    return result, recovered


def _reader(session: Session, url: str, storage_options: dict[str, Any] | None,
            **options: Any) -> TurboReader:
    with ckptturbo_errors("loading", url):  # options the reader does not take
        return TurboReader(url, storage_options, session=session, **options)


def check_templates(templates: dict[str, Any], items: dict[str, Any], url: str) -> None:
    """Templates of ``load_state_dict`` must name entries of the checkpoint, tensors of its
    global shapes; every one that does not is named in one MismatchError."""
    problems = [f"{key!r} is not in the checkpoint" for key in sorted(set(templates) - set(items))]
    for key, template in templates.items():
        md = items.get(key)
        if md is None or not isinstance(template, torch.Tensor):
            continue
        if not isinstance(md, TensorStorageMetadata):
            problems.append(f"{key!r}: checkpoint holds an object, the template a tensor")
        elif tuple(template.shape) != tuple(md.size):
            problems.append(f"{key!r}: shape {tuple(template.shape)} in the template, "
                            f"{tuple(md.size)} in the checkpoint")
    if problems:
        raise _mismatch("the templates do", url, problems)


def check_fits(state_dict: dict[str, Any], items: dict[str, Any], url: str, strict: bool) -> None:
    """Name every key and shape that does not match, before any byte is read (dtypes are
    cast on load, as DCP does)."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    plain = {k: (v.state_dict() if hasattr(v, "state_dict") and not isinstance(v, torch.Tensor) else v)
             for k, v in state_dict.items()}
    flat, _ = flatten_state_dict(plain)
    problems = []
    for key, value in flat.items():
        record = items.get(key)
        if record is None:
            if strict:
                problems.append(f"{key!r} is in the state dict but not in the checkpoint")
            continue
        if isinstance(value, torch.Tensor):
            if record.kind != "tensor":
                problems.append(f"{key!r}: checkpoint holds an object, the state dict a tensor")
                continue
            shape = tuple(value.shape)  # a DTensor's shape is already the global one
            if shape != tuple(record.size):
                problems.append(f"{key!r}: shape {shape} in the state dict, {tuple(record.size)} "
                                "in the checkpoint")
    if strict:
        extra = sorted(set(items) - set(flat))
        problems += [f"{k!r} is in the checkpoint but not in the state dict" for k in extra]
    if problems:
        raise _mismatch("the state dict does", url, problems)


def _mismatch(subject: str, url: str, problems: list[str]) -> MismatchError:
    """One error naming every problem (the first ten, and how many more)."""
    shown = "; ".join(problems[:10]) + (f"; and {len(problems) - 10} more" if len(problems) > 10 else "")
    return MismatchError(f"{subject} not fit checkpoint {url}: {shown}")
