"""transformers ``Trainer``: async ckptturbo checkpoints, resume, rotation and best model.

Saving: with ``TurboTrainerMixin`` (or ``TurboTrainer``) the Trainer's own save decision
(``_save_checkpoint``, reached after evaluation, so the saved ``TrainerState`` holds that
step's metrics and best-model fields) starts an async ckptturbo save of model, optimizer,
scheduler, grad scaler, every rank's RNG and the ``TrainerState``; ``on_save`` callbacks
run as usual. Training continues once the state is staged in host memory. The callback
alone (``callbacks=[TurboCheckpointCallback(...)]`` on any Trainer) intercepts the same
decision one hook earlier: ``DefaultFlowCallback`` sets ``control.should_save`` in
``on_step_end``/``on_epoch_end``, this callback saves and clears it.

Rotation (``save_total_limit``) is decided, like the Trainer's own rotation of its output
directory, from what storage holds under the run (plus this process's saves in flight),
never from a list kept in memory, so it keeps working after a resume; the newest and the
best checkpoint are never removed. ``load_best_model_at_end`` loads the best checkpoint's
model from storage.

Resuming: ``Trainer.train(resume_from_checkpoint=...)`` only reads a local directory in
its own layout, through private loaders. ``TurboTrainerMixin.train`` accepts a ckptturbo
checkpoint URL (local or ``s3://``, or ``True`` for the newest under the callback's root),
loads it (read once across ranks) and lays it out as the Trainer's own files in a
temporary directory, then resumes through the Trainer's unchanged code path: same model,
optimizer, scheduler, RNG, ``global_step`` and data position.

Where the Trainer's contract names an error, it is the Trainer's: ``train(
resume_from_checkpoint=True)`` with no checkpoint anywhere raises its ``ValueError``.
Otherwise only ckptturbo errors (``CkptTurboError``, the original as ``__cause__``) leave
the callback's hooks and the mixin's methods, except the user's own code's errors raised
inside ``Trainer.train``.

Each checkpoint holds its own chunks by default (``store="checkpoint"``), so the output
directory lists only ``checkpoint-<step>`` directories, as the Trainer's does, and a
rotated checkpoint goes whole; ``store="run"`` shares one chunk store among them
(docs/integrations.md says why and when).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
import tempfile
from typing import TYPE_CHECKING, Any, cast

import torch
from transformers import Trainer, TrainerCallback
from transformers.trainer_callback import CallbackHandler, ExportableState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, SaveStrategy

import ckptturbo as ct

from ._core import (
    DeferredGC,
    all_ranks,
    chunk_store,
    ckptturbo_errors,
    exists,
    list_checkpoints,
    native_rng_state,
    rank_and_world,
    remove,
    rng_state,
    save_tree,
    tiered_store,
)

if TYPE_CHECKING:
    # the mixin is typed as the Trainer it is mixed into
    _TrainerBase = Trainer
else:
    _TrainerBase = object

log = logging.getLogger(__name__)

_STEP = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")


class TurboCheckpointCallback(TrainerCallback):
    """Makes the Trainer's checkpoints async ckptturbo checkpoints.

    Args:
        url: run root for ``checkpoint-<step>`` checkpoints, a path or ``s3://`` URL;
            default: ``args.output_dir``.
        storage_options: fsspec options for ``url`` (endpoint, keys, ...).
        store: where a checkpoint's chunks go. "checkpoint" (default): inside its own
            ``checkpoint-<step>`` directory, so the run's directory lists only checkpoints,
            as the Trainer's, and rotation deletes a checkpoint whole. "run": one chunk
            store ``<url>/.ckptturbo`` shared by the run's checkpoints, so tensors unchanged
            between checkpoints (frozen layers) are stored once. A URL: that chunk store.
            "run" is the default with tiers, which need it.
        tiers: a ``ckptturbo.Tiers``: each checkpoint commits to host memory (and the
            other nodes' memory) first, and only every ``persist_every``-th goes to ``url``
            (docs/tiers.md). Rotation, resume (``True``: the newest in either place) and the
            best model see both places; a rotated checkpoint leaves both.
        writer_options: passed to ``ckptturbo.TurboWriter``.

    ``intercept`` (default True) makes ``on_step_end``/``on_epoch_end`` take over the
    save that ``control.should_save`` asks for; ``TurboTrainerMixin`` sets it False and
    routes the Trainer's own ``_save_checkpoint`` to ``save`` instead.
    """

    def __init__(self, url: str | None = None, storage_options: dict[str, Any] | None = None,
                 *, store: str | None = None, tiers: ct.Tiers | None = None,
                 **writer_options: Any) -> None:
        self.url = url
        self.storage_options = storage_options
        self.store = tiered_store(store, tiers)
        self.tiers = tiers
        self.writer_options = writer_options
        self.intercept = True
        self.best: str | None = None  # URL of the best checkpoint, as state.best_model_checkpoint
        self.handles: list[ct.SaveHandle] = []
        self._gc = DeferredGC(storage_options)

    def root(self, args: Any) -> str:
        return str(self.url or args.output_dir).rstrip("/")

    def url_of(self, args: Any, step: int) -> str:
        return f"{self.root(args)}/{PREFIX_CHECKPOINT_DIR}-{step}"

    def checkpoints(self, args: Any, *, wait: bool = True) -> dict[int, str]:
        """``{step: url}`` of the committed ``checkpoint-<step>`` checkpoints under the root.

        Saves of this process still in flight under the root are waited for first
        (read-your-writes), or with ``wait=False`` listed as they are.
        """
        root = self.root(args)
        found = {}
        for info in list_checkpoints(root, storage_options=self.storage_options, wait=wait,
                                     tiers=self.tiers):
            match = _STEP.match(info.name)
            if match:
                found[int(match.group(1))] = f"{root}/{info.name}"
        return found

    # -- hooks -------------------------------------------------------------------------

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        with ckptturbo_errors("checking the best checkpoint of", self.root(args)):
            recorded = self.best or state.best_model_checkpoint
            self.best = recorded if recorded and self.exists(recorded) else None
            if not self.intercept:
                state.best_model_checkpoint = self.best
        return control

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        return self._maybe_save(args, state, control, **kwargs)

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        return self._maybe_save(args, state, control, **kwargs)

    def _maybe_save(self, args: Any, state: Any, control: Any, *, model: Any = None,
                    optimizer: Any = None, lr_scheduler: Any = None, **_: Any) -> Any:
        if not (self.intercept and control.should_save):
            return control
        control.should_save = False  # the Trainer's synchronous checkpoint is replaced by ours
        self.save(args, state, model=model, optimizer=optimizer, lr_scheduler=lr_scheduler)
        return control

    def on_train_end(self, args: Any, state: Any, control: Any, *, model: Any = None,
                     **kwargs: Any) -> Any:
        self.wait()
        with ckptturbo_errors("finishing the checkpoints of", self.root(args)):
            self._update_best(args, state, saving=None)
            if self.intercept and args.load_best_model_at_end and self.best is not None:
                self.load_model(self.best, model)  # the Trainer could not: not its own files
                state.best_model_checkpoint = self.best
            if args.should_save and self.best is not None and args.save_total_limit == 1:
                for url in self.checkpoints(args).values():  # the Trainer keeps only the best
                    if url != self.best:
                        remove(url, self.storage_options, tiers=self.tiers)
                self._gc.schedule(self.root(args), [])
                self._gc.finish()
        return control

    # -- saving ------------------------------------------------------------------------

    def save(self, args: Any, state: Any, *, model: Any, optimizer: Any = None,
             lr_scheduler: Any = None, scaler: Any = None) -> ct.SaveHandle:
        """Start the save of ``checkpoint-<global_step>``; return once it is staged.

        Every rank calls it (the save is collective). Raises the failure of an earlier
        save, if one failed meanwhile.
        """
        url = self.url_of(args, state.global_step)
        with ckptturbo_errors("saving", url):
            self._raise_failed()
            self._update_best(args, state, saving=url)
            if not self.intercept:
                state.best_model_checkpoint = self.best
            tree: dict[str, Any] = {
                "model": _unwrap(model).state_dict(),
                "rng": all_ranks(rng_state()),
                "trainer_state": json.dumps(dataclasses.asdict(state), sort_keys=True),
            }
            if not args.save_only_model:
                tree["optimizer"] = optimizer.state_dict() if optimizer is not None else None
                tree["scheduler"] = lr_scheduler.state_dict() if lr_scheduler is not None else None
                tree["scaler"] = scaler.state_dict() if scaler is not None else None
            handle = save_tree(tree, url, storage_options=self.storage_options, collective=True,
                               store=chunk_store(self.store), tiers=self.tiers,
                               **self.writer_options)
            handle.staged.result()
            self.handles.append(handle)
            if args.should_save:
                self._rotate(args, newest=url)
        return handle

    def _update_best(self, args: Any, state: Any, saving: str | None) -> None:
        """As the Trainer: the checkpoint of ``best_global_step``, once that one exists."""
        if args.save_strategy not in (SaveStrategy.STEPS, SaveStrategy.EPOCH, SaveStrategy.BEST):
            return
        if not state.best_global_step:
            return
        url = self.url_of(args, state.best_global_step)
        if url == saving or (url != self.best and self.exists(url)):
            self.best = url

    def _rotate(self, args: Any, newest: str) -> None:
        """Keep ``save_total_limit`` checkpoints of what storage holds, as the Trainer's own
        rotation: the oldest go first; the newest (to resume from) and the best never go."""
        limit = args.save_total_limit
        if limit is None or limit <= 0:
            return
        # the save just started is listed (pending), not waited for
        ordered = [url for _, url in sorted(self.checkpoints(args, wait=False).items())]
        if len(ordered) <= limit:
            return
        protected = {ordered[-1], newest} | ({self.best} if self.best else set())
        excess = len(ordered) - max(limit, len(protected))
        doomed = [url for url in ordered if url not in protected][:max(excess, 0)]
        for url in doomed:  # older saves are committed: each save of a run waits for the one before
            remove(url, self.storage_options, tiers=self.tiers)
        if doomed:
            self._gc.schedule(self.root(args), self.handles)

    def _raise_failed(self) -> None:
        for handle in [h for h in self.handles if h.done()]:
            self.handles.remove(handle)
            handle.wait()  # raises the save's failure

    def wait(self) -> None:
        """Block until every checkpoint is durable; raise the first failed save."""
        pending, self.handles = self.handles, []
        with ckptturbo_errors("waiting for the checkpoints of", self.url or "the Trainer"):
            for handle in pending:
                handle.wait()
            self._gc.finish()

    def exists(self, url: str) -> bool:
        """Whether checkpoint ``url`` is committed (with tiers: here or in this node's memory)."""
        return exists(url, self.storage_options, tiers=self.tiers)

    def load_model(self, url: str, model: Any) -> None:
        """Load the model weights of checkpoint ``url`` into ``model`` in place (the rest
        of the checkpoint is not read); every rank calls it."""
        with ckptturbo_errors("loading the model of", url):
            module = _unwrap(model)
            state = module.state_dict()
            ct.load({f"model.{k}": v for k, v in state.items()}, url,
                    storage_options=self.storage_options, strict=False, tiers=self.tiers)
            module.load_state_dict(state)
            log.info("loaded the model of %s", url)


class _TurboCallbackHandler(CallbackHandler):
    """The Trainer's callback handler that also calls the adapter's callback, after the
    visible ones (where ``add_callback`` would have put it), without listing it: code that
    inspects, pops or removes ``callback_handler.callbacks`` sees a plain Trainer's list."""

    def __init__(self, handler: CallbackHandler, turbo: TurboCheckpointCallback) -> None:
        vars(self).update(vars(handler))  # the same list, model, optimizer, dataloaders
        self.turbo = turbo

    def call_event(self, event: str, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        control = super().call_event(event, args, state, control, **kwargs)
        visible, self.callbacks = self.callbacks, [self.turbo]
        try:
            return super().call_event(event, args, state, control, **kwargs)
        finally:
            self.callbacks = visible


def _unwrap(model: Any) -> Any:
    while hasattr(model, "module"):
        model = model.module
    return model


class TurboTrainerMixin(_TrainerBase):
    """Mix in before ``Trainer``: its checkpoints become ckptturbo checkpoints, and it resumes
    from them and loads the best one from them.

    ``class MyTrainer(TurboTrainerMixin, Trainer)``; ``turbo_url`` / ``turbo_storage_options``
    / ``turbo_store`` / ``turbo_tiers`` keyword arguments configure the callback (its ``url``,
    ``storage_options``, ``store``, ``tiers``). It takes the place of the Trainer's private
    ``_save_checkpoint`` and ``_load_best_model`` (transformers as pinned in pyproject.toml).
    The callback runs after the Trainer's callbacks without being listed among them.
    """

    def __init__(self, *args: Any, turbo_url: str | None = None,
                 turbo_storage_options: dict[str, Any] | None = None,
                 turbo_store: str | None = None, turbo_tiers: ct.Tiers | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.turbo = TurboCheckpointCallback(turbo_url, turbo_storage_options, store=turbo_store,
                                             tiers=turbo_tiers)
        self.turbo.intercept = False
        self.callback_handler = _TurboCallbackHandler(self.callback_handler, self.turbo)

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any,
              **kwargs: Any) -> Any:
        """``Trainer.train``, resuming from a ckptturbo checkpoint: ``True`` takes the newest
        under the callback's root, and without one the Trainer's own resume goes on (its
        newest in ``output_dir``, or its ``ValueError`` when there is none)."""
        with ckptturbo_errors("resuming from", resume_from_checkpoint):
            url = self._turbo_resolve(resume_from_checkpoint)
        if url is None:
            return super().train(resume_from_checkpoint, *args, **kwargs)
        local = tempfile.mkdtemp(prefix="ckptturbo-resume-")
        try:
            with ckptturbo_errors("resuming from", url):
                self._turbo_materialize(url, local)
            return super().train(local, *args, **kwargs)
        finally:
            shutil.rmtree(local, ignore_errors=True)

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """The Trainer's save, as a ckptturbo checkpoint (its own files are not written)."""
        if trial is None:
            self.store_flos()
        self._turbo_export_callback_states()
        self.turbo.save(self.args, self.state, model=self.model, optimizer=self.optimizer,
                        lr_scheduler=self.lr_scheduler,
                        scaler=getattr(self.accelerator, "scaler", None))

    def _turbo_export_callback_states(self) -> None:
        """Record ``ExportableState`` callbacks in the state, as the Trainer does before saving."""
        # TrainerState.__post_init__ turns the list it is annotated with into this dict
        states = cast(dict[str, Any], self.state.stateful_callbacks)
        for cb in (*self.callback_handler.callbacks, self.control):
            if not isinstance(cb, ExportableState):
                continue
            name = type(cb).__name__
            slot = states.get(name)
            if isinstance(slot, list):
                slot.append(cb.state())
            else:
                states[name] = cb.state()

    def _load_best_model(self) -> None:
        """Load the best checkpoint's model from storage (the Trainer's own loader reads only
        its own files); a checkpoint not written by ckptturbo goes to the Trainer's loader."""
        best = self.state.best_model_checkpoint
        assert best is not None, "the Trainer loads the best model only when it has one"
        self.turbo.wait()
        with ckptturbo_errors("loading the best model from", best):
            if not self.turbo.exists(best):
                return super()._load_best_model()
        log.info("loading best model from %s (score: %s)", best, self.state.best_metric)
        self.turbo.load_model(best, self.model)
        return None

    def _turbo_resolve(self, resume: str | bool | None) -> str | None:
        if resume is True:
            found = self.turbo.checkpoints(self.args)
            return found[max(found)] if found else None
        if isinstance(resume, (str, os.PathLike)):
            resume = os.fspath(resume)
            if self.turbo.exists(resume):
                return resume
            if "://" in resume and not resume.startswith("file://"):
                raise ct.CheckpointNotFound(f"no committed ckptturbo checkpoint at {resume}")
        return None  # a local directory in the Trainer's own layout: its own code reads it

    def _turbo_materialize(self, url: str, local: str) -> None:
        """Write the checkpoint as the Trainer's own files, which its resume path reads."""
        tree = ct.load_state_dict(url, storage_options=self.turbo.storage_options,
                                  tiers=self.turbo.tiers)
        rank, world = rank_and_world()
        torch.save(tree["model"], os.path.join(local, "pytorch_model.bin"))
        for key, name in (("optimizer", "optimizer.pt"), ("scheduler", "scheduler.pt"),
                          ("scaler", "scaler.pt")):
            if tree.get(key) is not None:
                torch.save(tree[key], os.path.join(local, name))
        if rank < len(tree["rng"]):
            rng = native_rng_state(tree["rng"][rank])
            name = "rng_state.pth" if world == 1 else f"rng_state_{rank}.pth"
            torch.save(rng, os.path.join(local, name))
        state = json.loads(tree["trainer_state"])
        # The Trainer drops a best checkpoint that is not a local directory; the callback
        # checks it in storage instead (on_train_begin).
        self.turbo.best = state.get("best_model_checkpoint")
        state["best_model_checkpoint"] = None
        with open(os.path.join(local, "trainer_state.json"), "w") as f:
            json.dump(state, f, sort_keys=True)
        log.info("resuming from %s (laid out in %s)", url, local)


class TurboTrainer(TurboTrainerMixin, Trainer):
    """``Trainer`` with async ckptturbo checkpoints and resume from them."""


__all__ = ["TurboCheckpointCallback", "TurboTrainerMixin", "TurboTrainer"]
