"""Lightning: ``Trainer(plugins=[TurboCheckpointIO()])`` makes every checkpoint async and deduplicated.

Lightning calls ``CheckpointIO.save_checkpoint`` on global rank 0 only, so the save runs in
this process alone (no collective) and returns once the checkpoint dict is copied to host
memory; hashing, upload and the manifest commit run behind training. A failed save is
raised by the next ``save_checkpoint`` or by ``teardown()``. Each ``.ckpt`` path becomes a
ckptturbo checkpoint directory; checkpoints of one ``dirpath`` share its chunk store, so
unchanged tensors are written once. ``load_checkpoint`` needs no template: it rebuilds
Lightning's whole dict from the manifest, and when every rank loads (``fit(ckpt_path=...)``)
storage is read once and forwarded between ranks.
"""
from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.plugins import CheckpointIO

import ckptturbo as ct
from ckptturbo.tree import SKELETON_KEY, flatten

from ._core import DeferredGC, remove, run_of, save_tree


class TurboCheckpointIO(CheckpointIO):
    """CheckpointIO writing ckptturbo checkpoints to a local path or any fsspec URL (``s3://``).

    Args:
        storage_options: fsspec options for the checkpoint location (endpoint, keys, ...);
            Lightning's per-call ``storage_options`` are merged over them.
        grouped_load: when ranks load inside a process group, read each chunk once and
            forward it (every rank must then call ``load_checkpoint``, as Lightning does).
        gc: after ``remove_checkpoint`` (``ModelCheckpoint(save_top_k=...)``), free the
            chunks no kept checkpoint uses, in the background once the saves in flight are
            durable.
        writer_options: passed to ``ckptturbo.TurboWriter`` (``chunk_size``, ...).
    """

    def __init__(self, storage_options: dict[str, Any] | None = None, *, grouped_load: bool = True,
                 gc: bool = True, **writer_options: Any) -> None:
        super().__init__()
        self.storage_options = storage_options
        self.grouped_load = grouped_load
        self.gc = gc
        self.writer_options = writer_options
        self._handles: list[Any] = []
        self._gc = DeferredGC(storage_options)

    def _options(self, extra: Any = None) -> dict[str, Any] | None:
        if not extra:
            return self.storage_options
        return {**(self.storage_options or {}), **dict(extra)}

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        """Return once ``checkpoint`` is staged in host memory; the upload continues behind."""
        self._raise_failed()
        handle = save_tree(checkpoint, str(path), storage_options=self._options(storage_options),
                           collective=False, **self.writer_options)
        self._handles.append(handle)
        handle.staged.result()

    def load_checkpoint(self, path: Any, map_location: Any = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """Lightning's whole checkpoint dict; objects need full unpickling only if weights_only=False."""
        self._wait(raise_errors=False)
        device = map_location if isinstance(map_location, (str, torch.device)) else "cpu"
        return ct.load_state_dict(str(path), storage_options=self.storage_options,
                                  grouped=self.grouped_load, device=device,
                                  allow_pickle=weights_only is False)

    def remove_checkpoint(self, path: Any) -> None:
        """Drop the checkpoint now; its unshared chunks are freed once in-flight saves are durable."""
        remove(str(path), self.storage_options)
        if self.gc:
            self._gc.schedule(run_of(str(path)), self._handles)

    def _raise_failed(self) -> None:
        """Raise the first failure of an earlier save; forget the saves that finished."""
        for handle in [h for h in self._handles if h.done()]:
            self._handles.remove(handle)
            exc = handle.durable.exception()
            if exc is not None:
                raise exc

    def _wait(self, raise_errors: bool = True) -> None:
        first: BaseException | None = None
        for handle in self._handles:
            try:
                handle.durable.result()
            except Exception as exc:  # noqa: BLE001
                first = first or exc
        if first is not None and raise_errors:
            self._handles.clear()
            raise first

    def teardown(self) -> None:
        """Wait until every checkpoint is durable, free unused chunks, raise a failed save."""
        try:
            self._wait()
        finally:
            self._handles.clear()
            self._gc.finish()


class _TurboShardedCheckpoints:
    """Sharded save/load for strategies that bypass CheckpointIO, through their public methods.

    Every rank saves its own shards collectively (``ckptturbo.save``), asynchronously; on
    load the model's and optimizers' own sharded state dicts are the templates, so each
    rank reads its shards (any resharding DCP supports), and the rest of Lightning's dict
    is rebuilt without a template. Paths are plain strings, so ``s3://`` stays intact.
    """

    turbo_storage_options: dict[str, Any] | None = None

    def _turbo_handles(self) -> list[Any]:
        if not hasattr(self, "_turbo_inflight"):
            self._turbo_inflight: list[Any] = []
        return self._turbo_inflight

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        url = str(self.broadcast(str(filepath)))
        handles = self._turbo_handles()
        for handle in [h for h in handles if h.done()]:
            handles.remove(handle)
            if handle.durable.exception() is not None:
                raise handle.durable.exception()
        opts = {**(self.turbo_storage_options or {}), **dict(storage_options or {})} or None
        handle = save_tree(checkpoint, url, storage_options=opts, collective=True)
        handles.append(handle)
        handle.staged.result()

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict, get_optimizer_state_dict, set_model_state_dict, set_optimizer_state_dict)

        url = str(self.broadcast(str(checkpoint_path)))
        for handle in self._turbo_handles():
            handle.durable.result()
        optimizers = list(self.optimizers)
        templates = flatten({"state_dict": get_model_state_dict(self.model),
                             "optimizer_states": [get_optimizer_state_dict(self.model, o) for o in optimizers]})
        templates.pop(SKELETON_KEY)
        tree = ct.load_state_dict(url, storage_options=self.turbo_storage_options,
                                  templates=templates, allow_pickle=weights_only is False)
        set_model_state_dict(self.model, tree["state_dict"])
        for opt, sd in zip(optimizers, tree.get("optimizer_states", [])):
            set_optimizer_state_dict(self.model, opt, sd)
        return tree

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        pass  # loaded into the sharded model by load_checkpoint

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        pass  # loaded into the sharded optimizers by load_checkpoint

    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            remove(str(filepath), self.turbo_storage_options)
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
    class Turbo(_TurboShardedCheckpoints, base):  # type: ignore[valid-type, misc]
        __doc__ = (f"``{base.__name__}`` saving sharded ckptturbo checkpoints (local or ``s3://``). "
                   "Pass ``turbo_storage_options=`` for the object store.")

        def __init__(self, *args: Any, turbo_storage_options: dict[str, Any] | None = None,
                     **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.turbo_storage_options = turbo_storage_options

    Turbo.__name__ = Turbo.__qualname__ = f"Turbo{base.__name__}"
    return Turbo


def __getattr__(name: str) -> type:
    """``TurboFSDPStrategy`` / ``TurboModelParallelStrategy``, built on first use."""
    from lightning.pytorch import strategies

    bases = {"TurboFSDPStrategy": "FSDPStrategy", "TurboModelParallelStrategy": "ModelParallelStrategy"}
    if name not in bases:
        raise AttributeError(name)
    cls = _strategy(getattr(strategies, bases[name]))
    globals()[name] = cls
    return cls
