"""The public operations, each written once: ``Session``'s methods and ``ct.*`` forward to
these (their first argument is the session that runs them).

Saves start in the background (``async_save``; with tiers, ``tiered_save``) so the caller
waits only for ``handle.staged``. Loads wait for a save of the same checkpoint in flight
in this process first (read-your-writes), check that the state fits before any byte is
read, and raise only ckptturbo's errors. Deletes, ``exists`` and listings wait for saves
in flight too, and with ``tiers=`` cover this node's memory tier (``tiered_catalog``).
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from . import catalog, changes, dcp_protocol, tiered_catalog
from .async_save import run_save
from .errors import CkptTurboError, MismatchError
from .failures import ckptturbo_errors
from .planner import TurboLoadPlanner, on_group
from .reader import TurboReader
from .recovery import recover
from .results import SaveSummary
from .runtime import Runtime, single_process, wait_for_saves
from .staging import SaveHandle
from .tiered_save import save as tiered_save
from .tree import unflatten

if TYPE_CHECKING:
    from .catalog import CheckpointInfo, GcReport
    from .changes import Change
    from .manifest_delta import TensorVersion
    from .recovery import Recovered
    from .tiers import Tiers

log = logging.getLogger(__name__)
T = TypeVar("T")


def save(session: Runtime, state_dict: dict[str, Any], url: Any, *, process_group: Any = None,
         collective: bool = True, storage_options: dict[str, Any] | None = None,
         planner: Any = None, wait_previous: bool = True, tiers: Tiers | None = None,
         persist: bool = False, delta_from: Any = None, **writer_options: Any) -> SaveHandle:
    """Save asynchronously; returns at once with ``handle.staged`` / ``handle.durable``.

    Every rank of the group calls it. ``collective=False``: this process saves alone,
    whatever the other ranks do (the ``if rank == 0: torch.save(...)`` pattern, which is
    how Lightning checkpoints DDP); a collective save there would wait for ranks that
    never join. Mutating the state is safe once ``staged`` resolves. A save started while
    the same writer's previous one is not durable waits for it (``wait_previous=False``:
    raise SaveInProgress instead). The process may exit right after ``staged``: exit waits
    for the save to be committed. Failures are ckptturbo errors, delivered by the futures.

    ``tiers=ct.Tiers(...)``: commit to this node's host memory first (``handle.local``) and
    persist to ``url`` only every ``persist_every``-th save of the run, or with
    ``persist=True``; ``handle.durable`` then resolves with None for a save that was not
    persisted (``handle.persisted`` says which). A tiered save waits only for the previous
    one's ``local``: persists run behind the next saves. See docs/tiers.md.

    ``delta_from=<url of a committed checkpoint in the same chunk store>``: each tensor
    whose base there has its shape and dtype is stored as the elements that changed (a
    bitmask and their values) when that is smaller, unchanged ones as the base's own
    chunks; the base is read (verified) on the save's thread before staging. One process
    saves (``collective=False`` or no group of more). See docs/format.md.
    """
    url = str(url)
    if delta_from is not None and tiers is not None:
        raise CkptTurboError(f"saving {url}: delta_from does not combine with tiers=")
    if tiers is not None:
        with ckptturbo_errors("saving", url):  # a URL without a run, a bad tier setting
            return tiered_save(session, state_dict, url, tiers, persist=persist,
                               process_group=process_group, collective=collective,
                               storage_options=storage_options, planner=planner,
                               wait_previous=wait_previous, writer_options=writer_options)
    if persist:
        raise CkptTurboError(f"saving {url}: persist=True needs tiers= (without tiers every "
                             "save goes to the durable URL)")
    handle = SaveHandle[SaveSummary](url)
    return run_save(session, state_dict, url, url, handle, process_group=process_group,
                    collective=collective, storage_options=storage_options, planner=planner,
                    wait_previous=wait_previous, writer_options=writer_options,
                    delta_from=None if delta_from is None else str(delta_from))


def load(session: Runtime, state_dict: dict[str, Any], url: Any, *, process_group: Any = None,
         storage_options: dict[str, Any] | None = None, planner: Any = None, strict: bool = True,
         tiers: Tiers | None = None, **reader_options: Any) -> Recovered | None:
    """Load in place, like ``dcp.load`` with a TurboReader, after checking the state fits.

    strict=True (as in ``nn.Module.load_state_dict``) makes keys missing on either side an
    error; strict=False loads what both have in common. Shapes must match; dtypes need not:
    values are cast into the state dict's tensors, as ``dcp.load`` and
    ``nn.Module.load_state_dict`` do. A save of ``url`` in flight in this process is
    waited for first.

    ``tiers=ct.Tiers(...)``: ``url`` is a checkpoint or a run; the newest checkpoint that
    this node's memory tier and the durable store can assemble is loaded, each chunk from
    the nearest holder, and a ``Recovered`` says which one (docs/tiers.md).
    """
    url = str(url)

    def attempt(reader: TurboReader) -> None:
        manifest = reader.read_manifest()
        check_fits(state_dict, manifest.items, reader.url, strict)
        with ckptturbo_errors("loading", reader.url), single_process(not dist.is_initialized()):
            group = _load_group(process_group)
            chosen = on_group(planner if planner is not None else
                              TurboLoadPlanner(allow_partial_load=not strict), group, "load")
            dcp_protocol.load(state_dict, reader, chosen, group)

    if tiers is None:
        attempt(_reader(session, url, storage_options, process_group=process_group,
                        **reader_options))
        return None
    group = session.gloo_group(process_group, "tiers") if dist.is_initialized() else None
    return _recover(session, url, tiers, storage_options, group, attempt, reader_options)[1]


def load_state_dict(session: Runtime, url: Any, *, storage_options: dict[str, Any] | None = None,
                    device: Any = "cpu", process_group: Any = None, grouped: bool = True,
                    allow_pickle: bool = False, templates: dict[str, Any] | None = None,
                    tiers: Tiers | None = None, **reader_options: Any) -> dict[str, Any]:
    """The whole state dict of a checkpoint, nested as it was saved; no template needed.

    Tensors are allocated on ``device`` from the manifest's shapes and dtypes; objects load
    with torch's restricted unpickler unless ``allow_pickle`` (trusted checkpoints only).
    Inside a process group with ``grouped=True`` every rank of it must call this, and each
    chunk is read from storage once and forwarded; ``grouped=False`` reads from this
    process alone. ``templates`` maps flat keys (as ``ckptturbo inspect`` lists them) to
    tensors to fill in place, such as a sharded model's own DTensors, so that each rank
    reads only its shards. ``tiers=``: as for :func:`load` (the newest checkpoint the tiers
    can assemble when ``url`` is a run).
    """
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
        load_group = _load_group(group) if use_group else None
        planner = on_group(TurboLoadPlanner(flatten_state_dict=False,
                                            flatten_sharded_tensors=False), load_group, "load")
        with ckptturbo_errors("loading", reader.url), single_process(not use_group):
            dcp_protocol.load(flat, reader, planner, load_group)
        return unflatten(flat, metadata.planner_data, reader.url)

    if tiers is None:
        return attempt(_reader(session, url, storage_options, process_group=group,
                               allow_pickle=allow_pickle, **reader_options))
    agree = session.gloo_group(group, "tiers") if use_group else None
    return _recover(session, url, tiers, storage_options, agree, attempt,
                    dict(reader_options, process_group=group, allow_pickle=allow_pickle))[0]


def tensor_versions(session: Runtime, url: Any, *,
                    storage_options: dict[str, Any] | None = None) -> dict[str, TensorVersion]:
    """Every tensor of a checkpoint by content, from its manifest alone (no tensor bytes are
    read): ``{name: TensorVersion(key, chain, dtype, shape, nbytes)}``. Equal keys mean
    equal values; ``chain`` lists the keys of the versions a delta was built from, oldest
    first. A location holding safetensors raises CheckpointKindError."""
    return changes.versions(session, str(url), storage_options)


def load_changes(session: Runtime, url: Any, served: Mapping[str, str], *, names: Any = None,
                 process_group: Any = None, storage_options: dict[str, Any] | None = None,
                 memory_limit: int | None = None, cache_dir: str | None = None) -> Iterator[Change]:
    """The tensors of a checkpoint whose ``TensorVersion.key`` differs from ``served[name]``
    (only ``names``, if given), as ``Change``s: ``kind="delta"`` (``mask`` and ``values``
    of the elements changed since the served version, read from its delta payloads alone)
    when the served key is in the tensor's chain, else ``kind="full"`` (``tensor``).
    With ``process_group`` every member calls with the same arguments, gets every Change,
    and each chunk is read from storage once across the group. At most ``memory_limit``
    bytes (default 2 GiB) are in flight; each Change is yielded once its bytes are
    verified, and failures are ckptturbo errors raised from the iterator. ``cache_dir``:
    the node's cache tier (see TurboReader), which the processes of a node share so that
    each chunk leaves storage once per node."""
    return changes.load_changes(session, str(url), served, names=names,
                                process_group=process_group, storage_options=storage_options,
                                memory_limit=memory_limit, cache_dir=cache_dir)


def delete(session: Runtime, url: Any, *, storage_options: dict[str, Any] | None = None,
           tiers: Tiers | None = None) -> None:
    """Make a checkpoint cease to exist; ``ckptturbo gc`` later frees its unshared chunks.
    A save of it in flight in this process is waited for first; a missing one raises
    CheckpointNotFound. ``tiers=``: from this node's memory tier too."""
    if tiers is not None:
        tiered_catalog.delete_tiered(str(url), storage_options, tiers, session=session)
        return
    catalog.delete_checkpoint(str(url), storage_options, session=session)


def exists(session: Runtime, url: Any, *, storage_options: dict[str, Any] | None = None,
           tiers: Tiers | None = None) -> bool:
    """Whether a committed checkpoint is at ``url`` (a save of it in flight is waited for);
    ``tiers=``: at ``url`` or in this node's memory tier."""
    if tiers is not None:
        return tiered_catalog.exists_tiered(str(url), storage_options, tiers, session=session)
    wait_for_saves(url)
    return catalog.is_committed(str(url), storage_options, session=session)


def list_checkpoints(session: Runtime, run_url: Any, *,
                     storage_options: dict[str, Any] | None = None, wait: bool = True,
                     tiers: Tiers | None = None) -> list[CheckpointInfo]:
    """Committed checkpoints directly under a run, oldest first; saves in flight in this
    process under it are waited for, or with ``wait=False`` listed last as ``pending``.
    ``tiers=``: those only in this node's memory tier too, each with the tiers that hold it."""
    if tiers is not None:
        return tiered_catalog.list_tiered(str(run_url), storage_options, tiers, wait=wait,
                                          session=session)
    return catalog.list_checkpoints(str(run_url), storage_options, wait=wait, session=session)


def collect_garbage(session: Runtime, run_url: Any, *,
                    storage_options: dict[str, Any] | None = None, dry_run: bool = False,
                    grace_seconds: float = 0.0) -> GcReport:
    """Free the run's chunks that no committed checkpoint names (``ckptturbo gc``), and
    those of self-contained checkpoints that their manifest does not name; returns a
    ``GcReport``. Raises SaveInProgress while a save of the run holds its marker (a later
    gc frees them), FormatError while a manifest of the run is unreadable."""
    return catalog.collect_garbage(str(run_url), storage_options, dry_run=dry_run,
                                   grace_seconds=grace_seconds, session=session)


def _load_group(process_group: Any) -> Any:
    """The group dcp.load runs on (its default: the world), for ckptturbo's load planner;
    None without one (the planner then plans as DCP's)."""
    if not dist.is_initialized():
        return None
    return process_group if process_group is not None else dist.group.WORLD


def _recover(session: Runtime, url: str, tiers: Tiers, storage_options: dict[str, Any] | None,
             group: Any, attempt: Callable[[Any], T], reader_options: dict[str, Any]
             ) -> tuple[T, Recovered]:
    """A tiered load: the newest checkpoint the tiers can assemble (``recovery``)."""
    with ckptturbo_errors("loading", url):
        result, recovered = recover(session, url, tiers, storage_options=storage_options,
                                    group=group, attempt=attempt, reader_options=reader_options)
    log.info("loaded %s (manifest from %s; %d bytes from memory, %d from the durable store)",
             recovered.url, recovered.manifest_tier, recovered.bytes_from_memory,
             recovered.bytes_from_durable)
    return result, recovered


def _reader(session: Runtime, url: str, storage_options: dict[str, Any] | None,
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

    plain = {k: (v.state_dict()
                 if hasattr(v, "state_dict") and not isinstance(v, torch.Tensor) else v)
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
    more = f"; and {len(problems) - 10} more" if len(problems) > 10 else ""
    shown = "; ".join(problems[:10]) + more
    return MismatchError(f"{subject} not fit checkpoint {url}: {shown}")
