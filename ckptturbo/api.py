"""ct.save / ct.load / ct.load_state_dict / ct.delete / ct.exists / ct.list_checkpoints:
the methods of the process's default session (``ckptturbo.session``), as functions."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .session import default_session

if TYPE_CHECKING:
    from .catalog import CheckpointInfo
    from .recovery import Recovered
    from .staging import SaveHandle
    from .tiers import Tiers


def save(state_dict: dict[str, Any], url: Any, *, process_group: Any = None,
         collective: bool = True, storage_options: dict[str, Any] | None = None,
         planner: Any = None, wait_previous: bool = True, tiers: Tiers | None = None,
         persist: bool = False, **writer_options: Any) -> SaveHandle:
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
    """
    return default_session().save(state_dict, url, process_group=process_group,
                                  collective=collective, storage_options=storage_options,
                                  planner=planner, wait_previous=wait_previous, tiers=tiers,
                                  persist=persist, **writer_options)


def load(state_dict: dict[str, Any], url: Any, *, process_group: Any = None,
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
    return default_session().load(state_dict, url, process_group=process_group,
                                  storage_options=storage_options, planner=planner, strict=strict,
                                  tiers=tiers, **reader_options)


def load_state_dict(url: Any, *, storage_options: dict[str, Any] | None = None,
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
    return default_session().load_state_dict(
        url, storage_options=storage_options, device=device, process_group=process_group,
        grouped=grouped, allow_pickle=allow_pickle, templates=templates, tiers=tiers,
        **reader_options)


def delete(url: Any, *, storage_options: dict[str, Any] | None = None,
           tiers: Tiers | None = None) -> None:
    """Make a checkpoint cease to exist; ``ckptturbo gc`` later frees its unshared chunks.
    A save of it in flight in this process is waited for first; a missing one raises
    CheckpointNotFound. ``tiers=``: from this node's memory tier too."""
    default_session().delete(url, storage_options=storage_options, tiers=tiers)


def exists(url: Any, *, storage_options: dict[str, Any] | None = None,
           tiers: Tiers | None = None) -> bool:
    """Whether a committed checkpoint is at ``url`` (a save of it in flight is waited for);
    ``tiers=``: at ``url`` or in this node's memory tier."""
    return default_session().exists(url, storage_options=storage_options, tiers=tiers)


def list_checkpoints(run_url: Any, *, storage_options: dict[str, Any] | None = None,
                     wait: bool = True, tiers: Tiers | None = None) -> list[CheckpointInfo]:
    """Committed checkpoints directly under a run, oldest first; saves in flight in this
    process under it are waited for, or with ``wait=False`` listed last as ``pending``.
    ``tiers=``: those only in this node's memory tier too, each with the tiers that hold it."""
    return default_session().list_checkpoints(run_url, storage_options=storage_options,
                                              wait=wait, tiers=tiers)
