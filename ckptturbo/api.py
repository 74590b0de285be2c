"""ct.save / ct.load / ct.delete: thin functions over TurboWriter and TurboReader.

``save`` runs DCP's save in a background thread on a dedicated gloo group (created once),
so the caller waits only for ``handle.staged``: the copy of its state into host memory.
Training collectives and checkpoint collectives never share a group, which is what makes
DCP's own async save hang when they interleave.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from . import catalog
from .errors import CkptTurboError, CommunicationError, MismatchError, SaveInProgress
from .reader import TurboReader
from .staging import SaveHandle, SaveSummary
from .writer import TurboWriter

log = logging.getLogger(__name__)

_writers: dict[tuple, TurboWriter] = {}
_inflight: dict[int, SaveHandle] = {}
_side_groups: dict[Any, Any] = {}
_lock = threading.Lock()


def _side_group(group: Any) -> Any:
    """A gloo group over the same ranks, created once (a collective: every rank calls it)."""
    if not dist.is_initialized():
        return None
    key = group or dist.group.WORLD
    if key not in _side_groups:
        ranks = dist.get_process_group_ranks(key)
        _side_groups[key] = dist.new_group(ranks=ranks, backend="gloo")
    return _side_groups[key]


def _writer_for(url: str, storage_options: dict[str, Any] | None, options: dict[str, Any]) -> TurboWriter:
    """One writer per run and settings, so its pool, plan cache and chunk index are reused."""
    run = url.rstrip("/").rsplit("/", 1)[0]
    key = (run, repr(sorted((storage_options or {}).items())), repr(sorted(options.items())))
    with _lock:
        writer = _writers.get(key)
        if writer is None:
            writer = _writers[key] = TurboWriter(url, storage_options, snapshot=True, **options)
    return writer


def save(state_dict: dict[str, Any], url: str, *, process_group: Any = None,
         storage_options: dict[str, Any] | None = None, planner: Any = None,
         wait_previous: bool = True, **writer_options: Any) -> SaveHandle:
    """Save asynchronously; returns at once with ``handle.staged`` / ``handle.durable``.

    Every rank of the group calls it. Mutating the state is safe once ``staged`` resolves.
    A save started while the same writer's previous one is not durable waits for it
    (``wait_previous=False``: raise SaveInProgress instead).
    """
    writer = _writer_for(str(url), storage_options, writer_options)
    previous = _inflight.get(id(writer))
    if previous is not None and not previous.done():
        if not wait_previous:
            raise SaveInProgress(f"the previous save to {previous.url} is not durable yet")
        try:
            previous.durable.result()
        except Exception:  # noqa: BLE001 - its failure belongs to its own handle
            pass
    group = _side_group(process_group)
    handle = SaveHandle(str(url))
    _inflight[id(writer)] = handle
    started = time.monotonic()

    def staged() -> None:
        if not handle.staged.done():
            handle.staged.set_result(None)

    def run() -> None:
        writer.reset(str(url))
        writer.on_staged = staged
        try:
            dcp.save(state_dict, storage_writer=writer, process_group=group, planner=planner)
            stats = writer.last_stats
            summary = SaveSummary(
                url=str(url), bytes_total=stats.get("bytes_written", 0) + stats.get("bytes_reused", 0),
                bytes_staged=stats.get("bytes_staged", 0), bytes_written=stats.get("bytes_written", 0),
                bytes_reused=stats.get("bytes_reused", 0), chunks_written=stats.get("chunks_written", 0),
                chunks_reused=stats.get("chunks_reused", 0),
                seconds={"stage": stats.get("seconds_stage", 0.0),
                         "durable": time.monotonic() - started})
            staged()
            handle.durable.set_result(summary)
        except BaseException as exc:  # noqa: BLE001 - delivered through the futures
            exc = _unwrap(exc, str(url))
            if not handle.staged.done():
                handle.staged.set_exception(exc)
            handle.durable.set_exception(exc)
        finally:
            writer.on_staged = None

    threading.Thread(target=run, name="ckptturbo-save", daemon=True).start()
    return handle


def load(state_dict: dict[str, Any], url: str, *, process_group: Any = None,
         storage_options: dict[str, Any] | None = None, planner: Any = None, strict: bool = True,
         **reader_options: Any) -> None:
    """Load in place, like ``dcp.load`` with a TurboReader, after checking the state fits.

    strict=True (as in ``nn.Module.load_state_dict``) makes keys missing on either side an
    error; strict=False loads what both have in common.
    """
    reader = TurboReader(str(url), storage_options, process_group=process_group, **reader_options)
    manifest = reader.read_manifest()
    check_fits(state_dict, manifest.items, str(url), strict)
    planner = planner or DefaultLoadPlanner(allow_partial_load=not strict)
    try:
        dcp.load(state_dict, storage_reader=reader, process_group=process_group, planner=planner)
    except BaseException as exc:  # DCP's CheckpointException derives from BaseException
        inner = _unwrap(exc, str(url))
        if inner is exc:
            raise
        raise inner from exc


def _unwrap(exc: BaseException, url: str = "") -> BaseException:
    """DCP wraps every rank's failure in a CheckpointException; surface ours directly.

    A collective that fails because a peer died surfaces from torch.distributed as a bare
    RuntimeError; it becomes a CommunicationError that says so.
    """
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict):
        for _, wrapped in sorted(failures.items()):
            inner = wrapped[0] if isinstance(wrapped, tuple) else wrapped
            if isinstance(inner, CkptTurboError):
                return inner
    if isinstance(exc, RuntimeError) and dist.is_initialized() and any(
            m in str(exc).lower() for m in ("connection", "gloo", "nccl", "timed out", "peer")):
        return CommunicationError(f"a peer rank failed or disconnected during the checkpoint "
                                  f"operation on {url}: {exc}")
    return exc


def delete(url: str, *, storage_options: dict[str, Any] | None = None) -> None:
    """Make a checkpoint cease to exist; ``ckptturbo gc`` later frees its unshared chunks."""
    catalog.delete_checkpoint(str(url), storage_options)


def check_fits(state_dict: dict[str, Any], items: dict[str, Any], url: str, strict: bool) -> None:
    """Name every key, shape and dtype that does not match, before any byte is read."""
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
            if value.dtype != record.dtype:
                problems.append(f"{key!r}: dtype {value.dtype} in the state dict, {record.dtype} "
                                "in the checkpoint")
    if strict:
        extra = sorted(set(items) - set(flat))
        problems += [f"{k!r} is in the checkpoint but not in the state dict" for k in extra]
    if problems:
        shown = "; ".join(problems[:10]) + (f"; and {len(problems) - 10} more" if len(problems) > 10 else "")
        raise MismatchError(f"state dict does not fit checkpoint {url}: {shown}")

