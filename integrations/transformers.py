"""transformers ``Trainer``: async ckptturbo checkpoints with a callback, resume with a mixin.

Saving: ``TurboCheckpointCallback`` is the public extension point that sees every save
decision. ``DefaultFlowCallback`` sets ``control.should_save`` from ``save_strategy`` /
``save_steps`` in ``on_step_end``/``on_epoch_end``; this callback runs after it, starts an
async ckptturbo save of model, optimizer, scheduler, scaler, every rank's RNG and the
``TrainerState``, and clears ``should_save`` so the Trainer skips its synchronous
``checkpoint-<step>/`` write. Training continues once the state is staged in host memory.
``save_total_limit`` keeps the newest checkpoints; older ones are dropped and their
unshared chunks freed in the background.

Resuming: ``Trainer.train(resume_from_checkpoint=...)`` only reads a local directory in
its own layout, and every loader behind it is private. ``TurboTrainerMixin.train`` accepts
a ckptturbo checkpoint URL (local or ``s3://``, or ``True`` for the newest under the
callback's root), loads it (read once across ranks) and lays it out as the Trainer's own
files in a temporary directory, then resumes through the Trainer's unchanged code path:
same model, optimizer, scheduler, RNG, ``global_step`` and data position.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import tempfile
from typing import Any

import torch
from transformers import Trainer, TrainerCallback

import ckptturbo as ct

from ._core import (DeferredGC, all_ranks, exists, list_checkpoints, native_rng_state,
                    rank_and_world, remove, rng_state, save_tree)

log = logging.getLogger(__name__)


class TurboCheckpointCallback(TrainerCallback):
    """Makes the Trainer's checkpoints async ckptturbo checkpoints.

    Args:
        url: run root for ``checkpoint-<step>`` checkpoints, a path or ``s3://`` URL;
            default: ``args.output_dir``.
        storage_options: fsspec options for ``url`` (endpoint, keys, ...).
        writer_options: passed to ``ckptturbo.TurboWriter``.
    """

    def __init__(self, url: str | None = None, storage_options: dict[str, Any] | None = None,
                 **writer_options: Any) -> None:
        self.url = url
        self.storage_options = storage_options
        self.writer_options = writer_options
        self.handles: list[ct.SaveHandle] = []
        self.saved: list[str] = []
        self._gc = DeferredGC(storage_options)

    def root(self, args: Any) -> str:
        return str(self.url or args.output_dir).rstrip("/")

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        return self._maybe_save(args, state, control, **kwargs)

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        return self._maybe_save(args, state, control, **kwargs)

    def _maybe_save(self, args: Any, state: Any, control: Any, *, model: Any = None,
                    optimizer: Any = None, lr_scheduler: Any = None, **_: Any) -> Any:
        if not control.should_save:
            return control
        control.should_save = False  # the Trainer's synchronous checkpoint is replaced by ours
        self._raise_failed()
        url = f"{self.root(args)}/checkpoint-{state.global_step}"
        tree: dict[str, Any] = {
            "model": _unwrap(model).state_dict(),
            "rng": all_ranks(rng_state()),
            "trainer_state": json.dumps(dataclasses.asdict(state), sort_keys=True),
        }
        if not args.save_only_model:
            tree["optimizer"] = optimizer.state_dict() if optimizer is not None else None
            tree["scheduler"] = lr_scheduler.state_dict() if lr_scheduler is not None else None
        handle = save_tree(tree, url, storage_options=self.storage_options, collective=True,
                           **self.writer_options)
        handle.staged.result()
        self.handles.append(handle)
        self.saved.append(url)
        self._rotate(args, state)
        return control

    def _rotate(self, args: Any, state: Any) -> None:
        limit = args.save_total_limit
        if not limit or len(self.saved) <= limit:
            return
        doomed, self.saved = self.saved[:-limit], self.saved[-limit:]
        if state.is_world_process_zero:
            for url in doomed:  # older saves are durable: each save waits for the one before
                remove(url, self.storage_options)
            self._gc.schedule(self.root(args), self.handles)

    def _raise_failed(self) -> None:
        for handle in [h for h in self.handles if h.done()]:
            self.handles.remove(handle)
            if handle.durable.exception() is not None:
                raise handle.durable.exception()

    def wait(self) -> None:
        """Block until every checkpoint is durable; raise the first failed save."""
        pending, self.handles = self.handles, []
        for handle in pending:
            handle.wait()
        self._gc.finish()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        self.wait()
        return control


def _unwrap(model: Any) -> Any:
    while hasattr(model, "module"):
        model = model.module
    return model


class TurboTrainerMixin:
    """Mix in before ``Trainer``: adds the callback and resumes from ckptturbo checkpoints.

    ``class MyTrainer(TurboTrainerMixin, Trainer)``; ``turbo_url`` / ``turbo_storage_options``
    keyword arguments configure the callback.
    """

    def __init__(self, *args: Any, turbo_url: str | None = None,
                 turbo_storage_options: dict[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.turbo = TurboCheckpointCallback(turbo_url, turbo_storage_options)
        self.add_callback(self.turbo)

    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs: Any) -> Any:
        url = self._turbo_resolve(resume_from_checkpoint)
        if url is None:
            return super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)
        local = tempfile.mkdtemp(prefix="ckptturbo-resume-")
        try:
            self._turbo_materialize(url, local)
            return super().train(resume_from_checkpoint=local, **kwargs)
        finally:
            shutil.rmtree(local, ignore_errors=True)

    def _turbo_resolve(self, resume: str | bool | None) -> str | None:
        opts = self.turbo.storage_options
        if resume is True:
            root = self.turbo.root(self.args)
            found = [c for c in list_checkpoints(root, opts) if c.name.startswith("checkpoint-")]
            if not found:
                raise ct.CheckpointNotFound(f"no committed ckptturbo checkpoint under {root}")
            return max(found, key=lambda c: int(c.name.rsplit("-", 1)[1])).url
        if isinstance(resume, str) and exists(resume, opts):
            return resume
        return None

    def _turbo_materialize(self, url: str, local: str) -> None:
        """Write the checkpoint as the Trainer's own files, which its resume path reads."""
        tree = ct.load_state_dict(url, storage_options=self.turbo.storage_options)
        rank, world = rank_and_world()
        torch.save(tree["model"], os.path.join(local, "pytorch_model.bin"))
        if tree.get("optimizer") is not None:
            torch.save(tree["optimizer"], os.path.join(local, "optimizer.pt"))
        if tree.get("scheduler") is not None:
            torch.save(tree["scheduler"], os.path.join(local, "scheduler.pt"))
        if rank < len(tree["rng"]):
            rng = native_rng_state(tree["rng"][rank])
            name = "rng_state.pth" if world == 1 else f"rng_state_{rank}.pth"
            torch.save(rng, os.path.join(local, name))
        with open(os.path.join(local, "trainer_state.json"), "w") as f:
            f.write(tree["trainer_state"])
        log.info("resuming from %s (laid out in %s)", url, local)


class TurboTrainer(TurboTrainerMixin, Trainer):
    """``Trainer`` with async ckptturbo checkpoints and resume from them."""


__all__ = ["TurboCheckpointCallback", "TurboTrainerMixin", "TurboTrainer"]
