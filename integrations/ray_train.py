"""Ray Train (v2) checkpoints written by ckptturbo straight into the run's storage.

Ray's standard pattern writes every worker's state to a local directory and then copies
that directory to ``RunConfig.storage_path`` while the training loop waits. Here every
worker of the ``TorchTrainer`` calls :func:`save` instead: ckptturbo writes the state
directly into the experiment directory (a local path or ``s3://``), replicated
data-parallel state once across workers, and the loop waits only until the state is
copied into host memory (``handle.staged``). The checkpoint is reported to Ray with
``CheckpointUploadMode.ASYNC`` and a ``checkpoint_upload_fn`` that waits for
``handle.durable`` in Ray's upload thread: nothing is copied, and Ray registers the
checkpoint only once its manifest is committed.

Ray's ``CheckpointConfig(num_to_keep=...)`` deletes old checkpoint directories, which
removes their manifests; their chunks are shared with other checkpoints of the run, so
rank 0 collects the unreferenced ones after each durable save (see :func:`collect_garbage`).

Ray is imported lazily: importing this module costs nothing without the ``ray`` extra.
"""
from __future__ import annotations

import logging
import posixpath
import time
from typing import Any

import torch.distributed as dist

import ckptturbo as ct
from ckptturbo.errors import CkptTurboError, SaveInProgress

log = logging.getLogger(__name__)

def collect_garbage(run_url: str, storage_options: dict[str, Any] | None = None) -> int:
    """Delete chunks that no committed checkpoint of the run names; returns bytes freed.

    ``ct.collect_garbage`` on the default session, as a number of bytes.
    """
    return ct.collect_garbage(run_url, storage_options=storage_options).deleted_bytes


def storage_url(filesystem: Any, path: str) -> str:
    """The fsspec URL of ``path`` on a pyarrow filesystem as Ray holds it.

    Ray keeps paths without their scheme next to a pyarrow filesystem (``S3FileSystem``,
    ``LocalFileSystem``, or an fsspec filesystem wrapped in ``PyFileSystem``).
    """
    kind = getattr(filesystem, "type_name", "local")
    if kind == "local":
        return path
    if kind in ("s3", "gcs"):
        return f"{'gs' if kind == 'gcs' else 's3'}://{path.lstrip('/')}"
    handler_fs = getattr(getattr(filesystem, "handler", None), "fs", None)
    protocol = getattr(handler_fs, "protocol", None)
    if protocol:
        scheme = protocol if isinstance(protocol, str) else protocol[0]
        return path if scheme in ("file", "local") else f"{scheme}://{path.lstrip('/')}"
    raise CkptTurboError(f"Ray storage filesystem {kind!r} (path {path}) has no fsspec "
                         "equivalent known to ckptturbo; use a local path, s3:// or gs://")


def _experiment() -> tuple[Any, str]:
    import ray.train

    storage = ray.train.get_context().get_storage()
    return storage, storage.experiment_fs_path


def run_url() -> str:
    """The fsspec URL of the current Ray Train experiment directory (the ckptturbo run)."""
    storage, path = _experiment()
    return storage_url(storage.storage_filesystem, path)


def _agreed_name(name: str | None) -> str:
    """One checkpoint directory name on every worker: rank 0's timestamp, broadcast.

    The broadcast runs on a gloo group of its own (created once, by every worker), so it
    never interleaves with the training collectives.
    """
    if name is not None:
        return name
    stamp = time.strftime("%Y-%m-%d_%H-%M-%S", time.gmtime())
    proposal = [f"checkpoint_{stamp}_{time.time_ns() % 10**6:06d}"]
    if dist.is_initialized() and dist.get_world_size() > 1:
        group = ct.default_session().gloo_group(dist.group.WORLD, "names")
        dist.broadcast_object_list(proposal, src=0, group=group)
    return proposal[0]


def save(state_dict: dict[str, Any], metrics: dict[str, Any] | None = None, *,
         checkpoint_dir_name: str | None = None, storage_options: dict[str, Any] | None = None,
         process_group: Any = None, gc: bool = True, tiers: ct.Tiers | None = None,
         **save_options: Any) -> ct.SaveHandle:
    """Save this worker's state and report it to Ray once durable; every worker calls it.

    Returns after ``handle.staged``: the state may be mutated from then on while the
    upload runs. ``ray.train.report`` is called here with ``CheckpointUploadMode.ASYNC``
    (so it keeps Ray's rule that every worker reports the same number of times) and the
    report reaches Ray's controller once ``handle.durable`` resolves; a failed save is
    raised in the training loop by Ray, as for its own uploads. ``storage_options`` are
    the fsspec options that reach ``RunConfig.storage_path`` (S3 endpoint and keys).
    With ``gc=True`` rank 0 frees chunks that deleted checkpoints alone used.

    ``tiers``: a tiered save (docs/tiers.md). Ray registers checkpoints by their storage
    paths, so only the persisted ones (every ``persist_every``-th) are reported with a
    checkpoint; the others are reported as metrics alone and live in host memory, within
    its budget (``num_to_keep`` does not count them). :func:`load` with the same tiers
    restores the newest of either kind.
    """
    import ray.train
    from ray.train import Checkpoint, CheckpointUploadMode

    storage, experiment = _experiment()
    name = _agreed_name(checkpoint_dir_name)
    path = posixpath.join(experiment, name)
    run = storage_url(storage.storage_filesystem, experiment)
    url = storage_url(storage.storage_filesystem, path)
    handle = ct.save(state_dict, url, process_group=process_group,
                     storage_options=storage_options, tiers=tiers, **save_options)
    handle.staged.result()
    if tiers is not None and not handle.persisted:  # in memory only: not a path Ray can hold
        ray.train.report(dict(metrics or {}))
        return handle
    rank = ray.train.get_context().get_world_rank()
    checkpoint = Checkpoint(path, filesystem=storage.storage_filesystem)

    def committed(_: Checkpoint, dir_name: str) -> Checkpoint:
        summary = handle.durable.result()
        log.info("checkpoint %s durable on rank %d: %d bytes written, %d reused", dir_name, rank,
                 summary.bytes_written, summary.bytes_reused)
        if gc and rank == 0:
            _collect_quietly(run, storage_options)
        return checkpoint

    ray.train.report(dict(metrics or {}), checkpoint=checkpoint, checkpoint_dir_name=name,
                     checkpoint_upload_mode=CheckpointUploadMode.ASYNC,
                     checkpoint_upload_fn=committed, delete_local_checkpoint_after_upload=False)
    return handle


def _collect_quietly(run: str, storage_options: dict[str, Any] | None) -> None:
    """gc after a save; it never fails training, a gc that cannot run now runs next time.

    A save already in flight defers it, and so does Ray deleting a checkpoint while the gc
    reads the manifests (the gc stops before deleting anything then).
    """
    try:
        freed = collect_garbage(run, storage_options)
        if freed:
            log.info("freed %d bytes of chunks no kept checkpoint of %s uses", freed, run)
    except SaveInProgress:
        log.debug("gc of %s deferred: a save is in progress", run)
    except CkptTurboError as exc:
        log.warning("gc of %s deferred to the next checkpoint: %s", run, exc)


def checkpoint_url(checkpoint: Any) -> str:
    """The fsspec URL of a ``ray.train.Checkpoint`` written by :func:`save`."""
    return storage_url(checkpoint.filesystem, checkpoint.path)


def load(state_dict: dict[str, Any], checkpoint: Any = None, *,
         storage_options: dict[str, Any] | None = None, process_group: Any = None,
         tiers: ct.Tiers | None = None, **load_options: Any) -> str | None:
    """Load ``ray.train.get_checkpoint()`` (or ``checkpoint``) into ``state_dict`` in place.

    Every worker calls it; each chunk is read from storage by one worker and forwarded to
    the others that need it (ckptturbo's grouped load). Returns the checkpoint's URL, or
    None (state untouched) when the run has no checkpoint yet.

    ``tiers``: without ``checkpoint``, the newest checkpoint of the run that the tiers can
    assemble, which may be newer than Ray's (one only in memory), each chunk from the
    nearest holder; with it, that checkpoint from the nearest holder.
    """
    if checkpoint is None:
        import ray.train

        reported = ray.train.get_checkpoint()
        if tiers is not None:  # the run: its newest checkpoint may be newer than Ray's
            try:
                return ct.load(state_dict, run_url(), process_group=process_group,
                               storage_options=storage_options, tiers=tiers, **load_options).url
            except ct.CheckpointNotFound:
                if reported is not None:
                    raise
                return None  # a first start: neither Ray nor the tiers hold a checkpoint
        checkpoint = reported
    if checkpoint is None:
        return None
    url = checkpoint_url(checkpoint)
    ct.load(state_dict, url, process_group=process_group, storage_options=storage_options,
            tiers=tiers, **load_options)
    return url

