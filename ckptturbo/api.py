"""ct.save / ct.load / ct.load_state_dict / ct.delete: thin functions over TurboWriter and
TurboReader.

``save`` runs DCP's save in a background thread on a dedicated gloo group (created once),
so the caller waits only for ``handle.staged``: the copy of its state into host memory.
Training collectives and checkpoint collectives never share a group, which is what makes
DCP's own async save hang when they interleave.
"""
from __future__ import annotations

import collections
import contextlib
import threading
import time
import traceback
import warnings
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed import distributed_c10d
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from . import catalog
from .errors import CkptTurboError, CommunicationError, MismatchError, SaveInProgress
from .groups import dedicated_gloo_group
from .reader import TurboReader
from .staging import SaveHandle, SaveSummary
from .tree import unflatten
from .writer import TurboWriter

MAX_WRITERS = 8  # kept for reuse (pool, plan cache); the least recently used is closed

_writers: collections.OrderedDict[tuple, TurboWriter] = collections.OrderedDict()
_inflight: dict[tuple, SaveHandle] = {}
_lock = threading.Lock()
_SINGLE_PROCESS_WARNING = (r"torch\.distributed is disabled, unavailable or uninitialized, "
                           r"assuming the intent is to (save|load) in a single process")
_quiet_users = 0


@contextlib.contextmanager
def _single_process(no_dist: bool) -> Iterator[None]:
    """Keep DCP's single-process warning out of ckptturbo's own group-less calls.

    DCP warns on every call without a process group, even when told ``no_dist=True``; a
    ct.save / ct.load without one means exactly that. One "ignore" filter is shared by
    the calls in flight (threads) and removed after the last; catch_warnings is not used
    because it would restore other threads' filters when a background save ends.
    """
    global _quiet_users
    if not no_dist:
        yield
        return
    with _lock:
        if _quiet_users == 0:
            warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_WARNING, category=UserWarning)
        _quiet_users += 1
    try:
        yield
    finally:
        with _lock:
            _quiet_users -= 1
            if _quiet_users == 0:
                warnings.filters[:] = [f for f in warnings.filters
                                       if not (f[0] == "ignore" and f[1] is not None
                                               and f[1].pattern == _SINGLE_PROCESS_WARNING)]


def _writer_for(url: str, storage_options: dict[str, Any] | None, options: dict[str, Any],
                collective: bool) -> tuple[tuple, TurboWriter]:
    """One writer per run and settings, so its pool and plan cache are reused; at most
    MAX_WRITERS are kept, and an evicted one is closed once its save is durable."""
    run = url.rstrip("/").rsplit("/", 1)[0]
    key = (run, collective, repr(sorted((storage_options or {}).items())),
           repr(sorted(options.items())))
    with _lock:
        writer = _writers.get(key)
        if writer is not None:
            _writers.move_to_end(key)
            return key, writer
        writer = _writers[key] = TurboWriter(url, storage_options, snapshot=True, **options)
        while len(_writers) > MAX_WRITERS:
            old_key, old = _writers.popitem(last=False)
            handle = _inflight.get(old_key)
            if handle is None or handle.done():
                _inflight.pop(old_key, None)
                old.close()
            else:  # a later save to that run still waits for it (wait_previous)
                handle.durable.add_done_callback(lambda _, w=old: w.close())
    return key, writer


def save(state_dict: dict[str, Any], url: str, *, process_group: Any = None,
         collective: bool = True, storage_options: dict[str, Any] | None = None,
         planner: Any = None, wait_previous: bool = True, **writer_options: Any) -> SaveHandle:
    """Save asynchronously; returns at once with ``handle.staged`` / ``handle.durable``.

    Every rank of the group calls it. ``collective=False``: this process saves alone,
    whatever the other ranks do (the ``if rank == 0: torch.save(...)`` pattern, which is
    how Lightning checkpoints DDP); a collective save there would wait for ranks that
    never join. Mutating the state is safe once ``staged`` resolves. A save started while
    the same writer's previous one is not durable waits for it (``wait_previous=False``:
    raise SaveInProgress instead).
    """
    key, writer = _writer_for(str(url), storage_options, writer_options, collective)
    previous = _inflight.get(key)
    if previous is not None and not previous.done():
        if not wait_previous:
            raise SaveInProgress(f"the previous save to {previous.url} is not durable yet")
        try:
            previous.durable.result()
        except Exception:  # noqa: BLE001 - its failure belongs to its own handle
            pass
    group = dedicated_gloo_group(process_group, "save") if collective else None
    handle = SaveHandle(str(url))
    _inflight[key] = handle
    started = time.monotonic()

    def staged() -> None:
        if not handle.staged.done():
            handle.staged.set_result(None)

    def run() -> None:
        writer.reset(str(url))
        writer.on_staged = staged
        try:
            with _single_process(group is None):
                dcp.save(state_dict, storage_writer=writer, process_group=group,
                         planner=planner, no_dist=group is None)
            stats = writer.last_stats
            summary = SaveSummary(
                url=str(url), bytes_total=stats.bytes_written + stats.bytes_reused,
                bytes_staged=stats.bytes_staged, bytes_written=stats.bytes_written,
                bytes_reused=stats.bytes_reused, chunks_written=stats.chunks_written,
                chunks_reused=stats.chunks_reused,
                seconds={"stage": stats.seconds_stage, "durable": time.monotonic() - started})
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
    error; strict=False loads what both have in common. Shapes must match; dtypes need not:
    values are cast into the state dict's tensors, as ``dcp.load`` and
    ``nn.Module.load_state_dict`` do.
    """
    reader = TurboReader(str(url), storage_options, process_group=process_group, **reader_options)
    manifest = reader.read_manifest()
    check_fits(state_dict, manifest.items, str(url), strict)
    planner = planner or DefaultLoadPlanner(allow_partial_load=not strict)
    try:
        with _single_process(not dist.is_initialized()):
            dcp.load(state_dict, storage_reader=reader, process_group=process_group,
                     planner=planner, no_dist=not dist.is_initialized())
    except BaseException as exc:  # DCP's CheckpointException derives from BaseException
        inner = _unwrap(exc, str(url))
        if inner is exc:
            raise
        raise inner from exc


def load_state_dict(url: str, *, storage_options: dict[str, Any] | None = None,
                    device: Any = "cpu", process_group: Any = None, grouped: bool = True,
                    allow_pickle: bool = False, templates: dict[str, Any] | None = None,
                    **reader_options: Any) -> dict[str, Any]:
    """The whole state dict of a checkpoint, nested as it was saved; no template needed.

    Tensors are allocated on ``device`` from the manifest's shapes and dtypes; objects load
    with torch's restricted unpickler unless ``allow_pickle`` (trusted checkpoints only).
    Inside a process group with ``grouped=True`` every rank of it must call this, and each
    chunk is read from storage once and forwarded; ``grouped=False`` reads from this
    process alone. ``templates`` maps flat keys (as ``ckptturbo inspect`` lists them) to
    tensors to fill in place, such as a sharded model's own DTensors, so that each rank
    reads only its shards.
    """
    use_group = grouped and dist.is_available() and dist.is_initialized()
    group = process_group if use_group else None
    reader = TurboReader(str(url), storage_options, process_group=group,
                         allow_pickle=allow_pickle, **reader_options)
    metadata = reader.read_metadata()
    missing = sorted(set(templates or ()) - set(metadata.state_dict_metadata))
    if missing:
        raise MismatchError(f"checkpoint {url} lacks {len(missing)} entries the caller holds, "
                            f"e.g. {missing[:5]}")
    flat: dict[str, Any] = {}
    for key, md in metadata.state_dict_metadata.items():
        if templates and key in templates:
            flat[key] = templates[key]
        elif isinstance(md, TensorStorageMetadata):
            flat[key] = torch.empty(md.size, dtype=md.properties.dtype, device=device)
        else:
            flat[key] = None
    planner = DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
    try:
        with _single_process(not use_group):
            dcp.load(flat, storage_reader=reader, planner=planner, process_group=group,
                     no_dist=not use_group)
    except BaseException as exc:  # DCP's CheckpointException derives from BaseException
        inner = _unwrap(exc, str(url))
        if inner is exc:
            raise
        raise inner from exc
    return unflatten(flat, metadata.planner_data, str(url))


def _unwrap(exc: BaseException, url: str = "") -> BaseException:
    """DCP wraps every rank's failure in a CheckpointException; surface ours directly.

    The first of our own errors found in the exception, its causes, or the ranks' failures
    is returned; failing that, an error raised by a torch.distributed collective (a peer
    died or disconnected; gloo reports it as a plain RuntimeError) becomes a
    CommunicationError that says so. Classified by type and origin, never by message.
    """
    found = list(_related(exc))
    for candidate, _ in found:
        if isinstance(candidate, CkptTurboError):
            return candidate
    for candidate, origin in found:
        if isinstance(candidate, dist.DistError) or origin == _C10D_FILE:
            error = CommunicationError(f"a peer rank failed or disconnected during the checkpoint "
                                       f"operation on {url}: {candidate}")
            error.__cause__ = candidate
            return error
    return exc


_C10D_FILE = distributed_c10d.__file__


def _related(exc: BaseException) -> Iterator[tuple[BaseException, str | None]]:
    """(exception, file of its innermost frame): exc, then (depth first) each rank's
    failure and each cause or context, once each."""
    seen: set[int] = set()
    stack: list[tuple[BaseException, str | None]] = [(exc, _origin(exc))]
    while stack:
        current, origin = stack.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current, origin
        nested: list[tuple[BaseException, str | None]] = []
        if isinstance(current, CheckpointException):
            for _, wrapped in sorted(current.failures.items()):
                inner, summary = wrapped if isinstance(wrapped, tuple) else (wrapped, None)
                nested.append((inner, summary[-1].filename if summary else _origin(inner)))
        nested += [(e, _origin(e)) for e in (current.__cause__, current.__context__) if e is not None]
        stack.extend(reversed(nested))


def _origin(exc: BaseException) -> str | None:
    frames = list(traceback.walk_tb(exc.__traceback__))
    return frames[-1][0].f_code.co_filename if frames else None


def delete(url: str, *, storage_options: dict[str, Any] | None = None) -> None:
    """Make a checkpoint cease to exist; ``ckptturbo gc`` later frees its unshared chunks."""
    catalog.delete_checkpoint(str(url), storage_options)


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
        shown = "; ".join(problems[:10]) + (f"; and {len(problems) - 10} more" if len(problems) > 10 else "")
        raise MismatchError(f"state dict does not fit checkpoint {url}: {shown}")

