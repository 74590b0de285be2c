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

import logging
from typing import Any

import torch
from lightning.pytorch.plugins import CheckpointIO

from ._core import DeferredGC, load_tree, remove, run_of, save_tree

log = logging.getLogger(__name__)


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
        return load_tree(str(path), storage_options=self.storage_options, grouped=self.grouped_load,
                         device=device, allow_pickle=weights_only is False)

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
