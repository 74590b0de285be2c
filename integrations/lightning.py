"""Lightning: ``Trainer(plugins=[TurboCheckpointIO()])`` makes every checkpoint async and
deduplicated.

Lightning calls ``CheckpointIO.save_checkpoint`` on global rank 0 only, so the save runs in
this process alone (no collective) and returns once the checkpoint dict is copied to host
memory; hashing, upload and the manifest commit run behind training. A failed save is
raised by the next ``save_checkpoint`` or by ``teardown()``, which also closes the plugin's
own ``ckptturbo.Session`` (no thread is left). Each ``.ckpt`` path becomes a
self-contained ckptturbo checkpoint directory holding its own chunks, as Lightning's
contract has it: ``dirpath`` lists only checkpoints, and a ``.ckpt`` copied or moved
elsewhere loads. ``store="run"`` shares one chunk store among the checkpoints of a
``dirpath`` instead, so unchanged tensors (frozen layers) are written once; the
checkpoints then load only beside that store. ``load_checkpoint`` needs no template: it rebuilds
Lightning's whole dict from the manifest, and when every rank loads (``fit(ckpt_path=...)``)
storage is read once and forwarded between ranks.
"""
from __future__ import annotations

import contextlib
import io
import logging
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import fsspec
import torch
from lightning.pytorch.plugins import TorchCheckpointIO

import ckptturbo as ct
from ckptturbo.adapter_support import SKELETON_KEY, flatten

from ._core import (
    DeferredGC,
    chunk_store,
    ckptturbo_errors,
    remove,
    run_of,
    save_tree,
    shared_store,
    tiered_store,
)

if TYPE_CHECKING:
    from lightning.pytorch import LightningModule
    from lightning.pytorch.strategies import ParallelStrategy

    # the sharded-checkpoint mixin is typed as the strategies it is mixed into
    _StrategyBase = ParallelStrategy
else:
    _StrategyBase = object

log = logging.getLogger(__name__)

class TurboCheckpointIO(TorchCheckpointIO):
    """CheckpointIO writing ckptturbo checkpoints to a local path or any fsspec URL (``s3://``).

    A drop-in for Lightning's default ``TorchCheckpointIO`` (hence a subclass of it), keeping
    its contract: removing a missing path does nothing, a plain torch ``.ckpt`` file (written
    before the plugin was added) still loads and can be removed, and the plugin accepts
    ``storage_options``. Only ckptturbo errors leave its methods (the original as
    ``__cause__``).

    Args:
        storage_options: fsspec options for the checkpoint location (endpoint, keys, ...);
            Lightning's per-call ``storage_options`` are merged over them.
        grouped_load: when ranks load inside a process group, read each chunk once and
            forward it (every rank must then call ``load_checkpoint``, as Lightning does).
        store: where a checkpoint's chunks go. "checkpoint" (default): inside its own
            ``.ckpt`` directory, which is then self-contained (copy, move or upload it
            alone; ``remove_checkpoint`` deletes it whole). "run": one chunk store
            ``.ckptturbo/`` beside the checkpoints of a ``dirpath``, shared by them, so
            tensors unchanged between checkpoints (frozen weights) are stored once. A URL:
            that chunk store.
        gc: with a shared store, after ``remove_checkpoint`` (``ModelCheckpoint(save_top_k=...)``)
            free the chunks no kept checkpoint uses, in the background once the saves in
            flight are durable. A self-contained checkpoint's chunks go with it.
        tiers: a ``ckptturbo.Tiers``: each checkpoint commits to this node's host memory
            and only every ``persist_every``-th goes to its path (docs/tiers.md). A
            checkpoint only in memory keeps its path: on a local disk its directory exists
            (empty), ``load_checkpoint`` finds it in memory, ``remove_checkpoint`` removes
            it from both places. Needs ``store="run"`` (the default with tiers). Lightning
            saves from global rank 0 alone, so there are no other nodes to replicate to.
        writer_options: passed to ``ckptturbo.TurboWriter`` (``chunk_size``, ...).
    """

    def __init__(self, storage_options: dict[str, Any] | None = None, *, grouped_load: bool = True,
                 store: str | None = None, gc: bool = True, tiers: ct.Tiers | None = None,
                 **writer_options: Any) -> None:
        super().__init__()
        self.storage_options = storage_options
        self.grouped_load = grouped_load
        self.store = tiered_store(store, tiers)
        self.gc = gc
        self.tiers = tiers
        self.writer_options = writer_options
        self._handles: list[ct.SaveHandle] = []
        self._session: ct.Session | None = None
        self._gc: DeferredGC | None = None

    @property
    def session(self) -> ct.Session:
        """The plugin's own session, made on first use (so a new plugin stays picklable, as
        ``ddp_spawn`` needs); ``teardown`` closes it and the next use starts it again."""
        if self._session is None:
            self._session = ct.Session()
            self._gc = DeferredGC(self.storage_options, session=self._session)
        return self._session

    def _options(self, extra: Any = None) -> dict[str, Any] | None:
        """The plugin's fsspec options with a call's ``storage_options`` over them."""
        if not extra:
            return self.storage_options
        if not isinstance(extra, Mapping):
            raise TypeError(f"storage_options must be a mapping of fsspec options (endpoint, "
                            f"keys, ...), got {type(extra).__name__} {extra!r:.60}")
        return {**(self.storage_options or {}), **dict(extra)}

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any,
                        storage_options: Any = None) -> None:
        """Return once ``checkpoint`` is staged in host memory; the upload continues behind.

        On a local disk the checkpoint's directory exists when this returns, as a file
        written by ``TorchCheckpointIO`` would: ``ModelCheckpoint`` probes names with its own
        filesystem (collision check, HPC numbering). Without its manifest the directory is
        not a checkpoint to ckptturbo; a failed save removes it again.
        """
        url = str(path)
        with ckptturbo_errors("saving", url):
            self._raise_failed()
            options = self._options(storage_options)
            reserved = _reserve(url)
            handle = save_tree(checkpoint, url, storage_options=options,
                               collective=False, session=self.session,
                               store=chunk_store(self.store), tiers=self.tiers,
                               **self.writer_options)
            if reserved:
                handle.durable.add_done_callback(lambda done: _unreserve_failed(done, url))
            self._handles.append(handle)
            handle.staged.result()

    def load_checkpoint(self, path: Any, map_location: Any = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """Lightning's whole checkpoint dict; objects need full unpickling only if
        weights_only=False.

        A save of ``path`` in flight anywhere in this process (another Trainer's too) is
        waited for. A plain torch file at ``path`` loads as ``TorchCheckpointIO`` loads it
        (``torch.load`` with the same ``map_location`` and ``weights_only``). A missing
        checkpoint raises ``ckptturbo.CheckpointNotFound`` (a ``FileNotFoundError``) with
        ``TorchCheckpointIO``'s message, ``Checkpoint file not found: <path>``. Unless saves of
        the plugin are in flight, the load leaves no thread running (Lightning may load without
        ever calling ``teardown``: ``_CheckpointConnector.resume_start``).
        """
        url = str(path)
        with ckptturbo_errors("loading", url):
            fs, fs_path = fsspec.core.url_to_fs(url, **(self.storage_options or {}))
            if fs.isfile(fs_path):
                with fs.open(fs_path, "rb") as f:
                    return torch.load(f, map_location=map_location, weights_only=weights_only)
            device = map_location if isinstance(map_location, (str, torch.device)) else "cpu"
            try:
                return self.session.load_state_dict(url, storage_options=self.storage_options,
                                                    grouped=self.grouped_load, device=device,
                                                    allow_pickle=weights_only is False,
                                                    tiers=self.tiers)
            except ct.CheckpointNotFound as exc:
                raise ct.CheckpointNotFound(f"Checkpoint file not found: {url} ({exc})") from exc
            finally:
                self._close_if_idle()

    def remove_checkpoint(self, path: Any) -> None:
        """Drop the checkpoint now; nothing if there is none (or only an uncommitted one). A
        save of it in flight is waited for first, so it cannot come back. A self-contained
        checkpoint goes whole; in a shared store its unshared chunks are freed in the
        background. A plain file or a link (``save_last="link"``) is removed as
        ``TorchCheckpointIO`` removes it."""
        url = str(path)
        with ckptturbo_errors("removing", url):
            fs, fs_path = fsspec.core.url_to_fs(url, **(self.storage_options or {}))
            if _is_local(url) and os.path.islink(fs_path) or fs.isfile(fs_path):
                fs.rm(fs_path)
                return
            remove(url, self.storage_options, session=self.session,  # an empty directory goes too
                   tiers=self.tiers)
            if self.gc and shared_store(self.store):
                assert self._gc is not None
                self._gc.schedule(run_of(url), self._handles)

    def _close_if_idle(self) -> None:
        """Stop the session's threads when none of the plugin's saves or gc passes is running;
        the session starts them again on its next use."""
        if self._session is None or any(not h.done() for h in self._handles):
            return
        if self._gc is not None and self._gc.running:
            return
        self._session.close()

    def _raise_failed(self) -> None:
        """Raise the first failure of an earlier save; forget the saves that finished."""
        for handle in [h for h in self._handles if h.done()]:
            self._handles.remove(handle)
            exc = handle.durable.exception()
            if exc is not None:
                raise exc

    def teardown(self) -> None:
        """Wait until every checkpoint is durable, free unused chunks, raise a failed save, and
        close the plugin's session: no thread of ckptturbo's is left running."""
        with ckptturbo_errors("finishing", "the plugin's checkpoints"):
            try:
                for handle in list(self._handles):
                    with contextlib.suppress(Exception):  # raised just below
                        handle.durable.result()
                self._raise_failed()
            finally:
                self._handles.clear()
                if self._session is not None:
                    assert self._gc is not None
                    self._gc.finish()
                    self._session.close()

    def __getstate__(self) -> dict[str, Any]:
        """Settings only: saves in flight and the session belong to this process."""
        return {**self.__dict__, "_handles": [], "_session": None, "_gc": None}


def load_from_checkpoint(cls: type[LightningModule], path: Any, *,
                         storage_options: dict[str, Any] | None = None,
                         map_location: Any = None, weights_only: bool | None = None,
                         **kwargs: Any) -> Any:
    """``cls.load_from_checkpoint`` for a ckptturbo checkpoint (local or ``s3://``), no
    Trainer needed.

    ``LightningModule.load_from_checkpoint`` reads its path with ``torch.load`` and accepts
    no CheckpointIO, but it accepts a file-like object: the checkpoint is loaded through
    ``TurboCheckpointIO`` and handed over as an in-memory torch file, so Lightning's own
    code restores hyper-parameters, state and ``on_load_checkpoint`` hooks. Holds the
    checkpoint twice in host memory while it runs. ``kwargs`` go to
    ``cls.load_from_checkpoint`` (``hparams_file``, ``strict``, overridden hyper-parameters).
    """
    plugin = TurboCheckpointIO(storage_options)
    try:
        checkpoint = plugin.load_checkpoint(path, map_location=map_location,
                                            weights_only=weights_only)
    finally:
        plugin.teardown()
    buffer = io.BytesIO()
    torch.save(checkpoint, buffer)
    buffer.seek(0)
    return cls.load_from_checkpoint(buffer, map_location=map_location,
                                    weights_only=weights_only, **kwargs)


def _is_local(url: str) -> bool:
    return fsspec.utils.get_protocol(url) in ("file", "local")


def _reserve(url: str) -> bool:
    """Create a local checkpoint's directory ahead of its manifest; False on object stores."""
    if not _is_local(url):
        return False
    os.makedirs(fsspec.core.url_to_fs(url)[1], exist_ok=True)
    return True


def _unreserve(url: str) -> None:
    """Remove a local checkpoint directory left empty (removed, or its save failed)."""
    if _is_local(url):
        with contextlib.suppress(OSError):  # not empty or already gone: leave it
            os.rmdir(fsspec.core.url_to_fs(url)[1])


def _unreserve_failed(durable: Any, url: str) -> None:
    if durable.exception() is not None:
        _unreserve(url)


class _TurboShardedCheckpoints(_StrategyBase):
    """Sharded save/load for strategies that bypass CheckpointIO, through their public methods.

    Every rank saves its own shards collectively (``ckptturbo.save``), asynchronously; on
    load the model's and optimizers' own sharded state dicts are the templates, so each
    rank reads its shards (any resharding DCP supports), and the rest of Lightning's dict
    is rebuilt without a template. Paths are plain strings, so ``s3://`` stays intact.
    ``turbo_store`` is ``TurboCheckpointIO``'s ``store``: self-contained checkpoints by
    default; ``turbo_tiers`` its ``tiers`` (then the run's store), every rank's shards
    replicated to other nodes' memory.
    """

    turbo_storage_options: dict[str, Any] | None = None
    turbo_store: str = "checkpoint"
    turbo_tiers: ct.Tiers | None = None

    def _turbo_handles(self) -> list[Any]:
        if not hasattr(self, "_turbo_inflight"):
            self._turbo_inflight: list[Any] = []
        return self._turbo_inflight

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any,
                        storage_options: Any = None) -> None:
        url = str(self.broadcast(str(filepath)))
        handles = self._turbo_handles()
        for handle in [h for h in handles if h.done()]:
            handles.remove(handle)
            if handle.durable.exception() is not None:
                raise handle.durable.exception()
        opts = {**(self.turbo_storage_options or {}), **dict(storage_options or {})} or None
        handle = save_tree(checkpoint, url, storage_options=opts, collective=True,
                           store=chunk_store(self.turbo_store), tiers=self.turbo_tiers)
        handles.append(handle)
        handle.staged.result()

    def load_checkpoint(self, checkpoint_path: Any,
                        weights_only: bool | None = None) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        url = str(self.broadcast(str(checkpoint_path)))
        for handle in self._turbo_handles():
            handle.durable.result()
        optimizers = list(self.optimizers)
        model = self.model
        assert model is not None, "Lightning loads a checkpoint into a set-up strategy's model"
        templates = flatten({"state_dict": get_model_state_dict(model),
                             "optimizer_states": [get_optimizer_state_dict(model, o)
                                                  for o in optimizers]})
        templates.pop(SKELETON_KEY)
        tree = ct.load_state_dict(url, storage_options=self.turbo_storage_options,
                                  templates=templates, allow_pickle=weights_only is False,
                                  tiers=self.turbo_tiers)
        set_model_state_dict(model, tree["state_dict"])
        # a checkpoint saved without optimizer states has none to restore
        for opt, sd in zip(optimizers, tree.get("optimizer_states", []), strict=False):
            set_optimizer_state_dict(model, opt, sd)
        return tree

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        pass  # loaded into the sharded model by load_checkpoint

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        pass  # loaded into the sharded optimizers by load_checkpoint

    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            remove(str(filepath), self.turbo_storage_options, tiers=self.turbo_tiers)
            if not shared_store(self.turbo_store):
                return  # its chunks went with it
            if not hasattr(self, "_turbo_gc"):
                self._turbo_gc = DeferredGC(self.turbo_storage_options)
            self._turbo_gc.schedule(run_of(str(filepath)), self._turbo_handles())

    def teardown(self) -> None:
        try:
            for handle in self._turbo_handles():
                handle.wait()
        finally:
            self._turbo_handles().clear()
            if hasattr(self, "_turbo_gc"):
                self._turbo_gc.finish()
            super().teardown()


def _strategy(base: type) -> type:
    class Turbo(_TurboShardedCheckpoints, base):
        __doc__ = (f"``{base.__name__}`` saving sharded ckptturbo checkpoints (local or "
                   "``s3://``). Pass ``turbo_storage_options=`` for the object store, "
                   "``turbo_store=\"run\"`` to share one chunk store among the checkpoints "
                   "of a directory, "
                   "``turbo_tiers=`` for tiered checkpoints (docs/tiers.md).")

        def __init__(self, *args: Any, turbo_storage_options: dict[str, Any] | None = None,
                     turbo_store: str | None = None, turbo_tiers: ct.Tiers | None = None,
                     **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.turbo_storage_options = turbo_storage_options
            self.turbo_store = tiered_store(turbo_store, turbo_tiers)
            self.turbo_tiers = turbo_tiers

    Turbo.__name__ = Turbo.__qualname__ = f"Turbo{base.__name__}"
    return Turbo


def __getattr__(name: str) -> type:
    """``TurboFSDPStrategy`` / ``TurboModelParallelStrategy``, built on first use."""
    from lightning.pytorch import strategies

    bases = {"TurboFSDPStrategy": "FSDPStrategy",
             "TurboModelParallelStrategy": "ModelParallelStrategy"}
    if name not in bases:
        raise AttributeError(name)
    cls = _strategy(getattr(strategies, bases[name]))
    globals()[name] = cls
    return cls
