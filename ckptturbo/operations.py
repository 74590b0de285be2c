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
import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from .errors import MismatchError, SaveInProgress
from .failures import as_ckptturbo_error, ckptturbo_errors
from .reader import TurboReader
from .session import single_process
from .staging import SaveHandle, SaveSummary
from .tree import unflatten

if TYPE_CHECKING:
    from .session import Session


def save(session: Session, state_dict: dict[str, Any], url: Any, *, process_group: Any = None,
         collective: bool = True, storage_options: dict[str, Any] | None = None,
         planner: Any = None, wait_previous: bool = True, **writer_options: Any) -> SaveHandle:
    url = str(url)
    with ckptturbo_errors("saving", url):  # options the writer does not take
        writer = session.writer(url, storage_options, writer_options, collective)
    previous = session.saves_of(writer)
    if previous:
        if not wait_previous:
            raise SaveInProgress(f"the previous save to {previous[-1].url} is not durable yet")
        with contextlib.suppress(Exception):  # its failure belongs to its own handle
            previous[-1].durable.exception()
    group = session.gloo_group(process_group, "save") if collective and dist.is_initialized() else None
    handle = SaveHandle(url)
    started = time.monotonic()

    def staged() -> None:
        if not handle.staged.done():
            handle.staged.set_result(None)

    def run() -> None:
        writer.reset(url)
        writer.on_staged = staged
        try:
            with single_process(group is None):
                dcp.save(state_dict, storage_writer=writer, process_group=group,
                         planner=planner, no_dist=group is None)
            stats = writer.last_stats
            summary = SaveSummary(
                url=url, bytes_total=stats.bytes_written + stats.bytes_reused,
                bytes_staged=stats.bytes_staged, bytes_written=stats.bytes_written,
                bytes_reused=stats.bytes_reused, chunks_written=stats.chunks_written,
                chunks_reused=stats.chunks_reused,
                seconds={"stage": stats.seconds_stage, "durable": time.monotonic() - started})
            staged()
            handle.durable.set_result(summary)
        except BaseException as exc:  # noqa: BLE001 - delivered through the futures
            error = as_ckptturbo_error(exc, url, "saving")
            if not handle.staged.done():
                handle.staged.set_exception(error)
            handle.durable.set_exception(error)
        finally:
            writer.on_staged = None

    session.track(url, handle, writer, run)
    return handle


def load(session: Session, state_dict: dict[str, Any], url: Any, *, process_group: Any = None,
         storage_options: dict[str, Any] | None = None, planner: Any = None, strict: bool = True,
         **reader_options: Any) -> None:
    url = str(url)
    reader = _reader(session, url, storage_options, process_group=process_group, **reader_options)
    manifest = reader.read_manifest()
    check_fits(state_dict, manifest.items, url, strict)
    planner = planner or DefaultLoadPlanner(allow_partial_load=not strict)
    with ckptturbo_errors("loading", url), single_process(not dist.is_initialized()):
        dcp.load(state_dict, storage_reader=reader, process_group=process_group,
                 planner=planner, no_dist=not dist.is_initialized())


def load_state_dict(session: Session, url: Any, *, storage_options: dict[str, Any] | None = None,
                    device: Any = "cpu", process_group: Any = None, grouped: bool = True,
                    allow_pickle: bool = False, templates: dict[str, Any] | None = None,
                    **reader_options: Any) -> dict[str, Any]:
    url = str(url)
    use_group = grouped and dist.is_available() and dist.is_initialized()
    group = process_group if use_group else None
    reader = _reader(session, url, storage_options, process_group=group,
                     allow_pickle=allow_pickle, **reader_options)
    metadata = reader.read_metadata()
    check_templates(templates or {}, metadata.state_dict_metadata, url)
    flat: dict[str, Any] = {}
    for key, md in metadata.state_dict_metadata.items():
        if templates and key in templates:
            flat[key] = templates[key]
        elif isinstance(md, TensorStorageMetadata):
            flat[key] = torch.empty(md.size, dtype=md.properties.dtype, device=device)
        else:
            flat[key] = None
    planner = DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
    with ckptturbo_errors("loading", url), single_process(not use_group):
        dcp.load(flat, storage_reader=reader, planner=planner, process_group=group,
                 no_dist=not use_group)
    return unflatten(flat, metadata.planner_data, url)


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
