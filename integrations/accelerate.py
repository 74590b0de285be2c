"""Accelerate: ``save_state(accelerator, url)`` / ``load_state(accelerator, url)`` through
ckptturbo.

``Accelerator.save_state`` writes local files only, synchronously, and under FSDP hard-codes
``FileSystemWriter``. These two functions cover what it covers (models, optimizers,
schedulers, the grad scaler, every rank's RNG states (Python, NumPy, torch, CUDA), objects
registered with ``register_for_checkpointing``, stateful dataloaders and sampler epochs,
``accelerator.step``) in one ckptturbo checkpoint, local or ``s3://``. Model and optimizer
state go through ``torch.distributed.checkpoint.state_dict`` (plain, DDP and FSDP alike:
sharded models save their shards), and every rank takes part: replicated weights are
uploaded once, split over the ranks. ``save_state`` returns once the state is staged in host memory.

What follows ``Accelerator.save_state``/``load_state``: hooks registered with
``register_save_state_pre_hook`` (called with the models, their state dicts, which a hook
may shorten, and the URL) and ``register_load_state_pre_hook`` (the models, which a hook
may shorten, and the URL); ``accelerator.save_iteration`` counts saves; the RNG states of a
process the checkpoint has none for (more processes than saved) are left as they are, with
a warning. Stricter: every count of prepared objects (models, optimizers, schedulers,
registered objects) and the grad scaler must match the checkpoint, and errors are
ckptturbo's (``CkptTurboError``, naming the URL, the original as ``__cause__``).

The Accelerator keeps what it prepared in ``_models``/``_optimizers``/... and the hooks in
``_save_model_state_pre_hook``/``_load_model_state_pre_hook`` (no public accessor exists);
they are read here as ``Accelerator.save_state`` reads them.
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

import ckptturbo as ct
from ckptturbo.adapter_support import SKELETON_KEY, flatten

from ._core import all_ranks, ckptturbo_errors, rank_and_world, rng_state, save_tree, set_rng_state

log = logging.getLogger(__name__)


def _prepared(accelerator: Any, name: str) -> list[Any]:
    return list(getattr(accelerator, name, []) or [])


def _pairs(accelerator: Any) -> list[tuple[Any, Any]]:
    """(model, optimizer) pairs, as Accelerate pairs them for FSDP: i-th with i-th."""
    models = _prepared(accelerator, "_models")
    return [(models[min(i, len(models) - 1)], getattr(opt, "optimizer", opt))
            for i, opt in enumerate(_prepared(accelerator, "_optimizers"))]


def _loader_state(loader: Any) -> dict[str, Any]:
    state: dict[str, Any] = {}
    if getattr(loader, "use_stateful_dataloader", False):
        state["state_dict"] = loader.state_dict()
    sampler = getattr(loader, "sampler", None)
    if sampler is not None and hasattr(sampler, "epoch"):
        state["sampler_epoch"] = int(sampler.epoch)
    return state


def _hooks(accelerator: Any, name: str) -> list[Any]:
    return list((getattr(accelerator, name, None) or {}).values())


def _optim_state(accelerator: Any) -> list[Any]:
    return [get_optimizer_state_dict(m, o) for m, o in _pairs(accelerator)]


def save_state(accelerator: Any, url: str, *, storage_options: dict[str, Any] | None = None,
               wait_staged: bool = True, **writer_options: Any) -> ct.SaveHandle:
    """Save everything ``Accelerator.save_state`` saves to ``url``; every process calls it.

    Returns a SaveHandle (``staged``, ``durable``, ``wait()``); with ``wait_staged`` (the
    default) it returns once staged, so training may go on at once.
    """
    url = str(url)
    with ckptturbo_errors("saving", url):
        models = _prepared(accelerator, "_models")
        weights = [get_model_state_dict(m) for m in models]
        for hook in _hooks(accelerator, "_save_model_state_pre_hook"):
            hook(models, weights, url)  # may drop entries of weights (it saved them itself)
        scaler = getattr(accelerator, "scaler", None)
        state = {
            "models": weights,
            "optimizers": _optim_state(accelerator),
            "schedulers": [s.state_dict() for s in _prepared(accelerator, "_schedulers")],
            "dataloaders": [_loader_state(d) for d in _prepared(accelerator, "_dataloaders")],
            "scaler": scaler.state_dict() if scaler is not None else None,
            "custom": [o.state_dict() for o in _prepared(accelerator, "_custom_objects")],
            "rng": all_ranks(rng_state()),
            "step": int(accelerator.step),
        }
        handle = save_tree(state, url, storage_options=storage_options, collective=True,
                           **writer_options)
        if wait_staged:
            handle.staged.result()
    accelerator.project_configuration.iteration += 1  # accelerator.save_iteration, as save_state
    return handle


def load_state(accelerator: Any, url: str, *, storage_options: dict[str, Any] | None = None,
               allow_pickle: bool = False, strict: bool = True, **reader_options: Any) -> None:
    """Restore what ``save_state`` saved; every process calls it (storage is read once).

    Model and optimizer tensors load straight into the prepared objects' own layout
    (shards under FSDP); the rest is rebuilt from the checkpoint without a template.
    ``strict`` is ``load_state_dict``'s, for the models (``load_state(..., strict=False)``
    of Accelerate). Objects registered for checkpointing whose state holds more than
    tensors and plain Python values need ``allow_pickle=True`` (trusted checkpoints only).
    """
    url = str(url)
    with ckptturbo_errors("loading", url):
        models = _prepared(accelerator, "_models")
        for hook in _hooks(accelerator, "_load_model_state_pre_hook"):
            hook(models, url)  # may take models out of the list (it loaded them itself)
        templates = flatten({"models": [get_model_state_dict(m) for m in models],
                             "optimizers": _optim_state(accelerator)})
        templates.pop(SKELETON_KEY)
        tree = ct.load_state_dict(url, storage_options=storage_options, templates=templates,
                                  allow_pickle=allow_pickle, **reader_options)
        _check_counts(url, tree, "models", models)
        _check_counts(url, tree, "optimizers", _prepared(accelerator, "_optimizers"))
        _check_counts(url, tree, "schedulers", _prepared(accelerator, "_schedulers"))
        _check_counts(url, tree, "custom", _prepared(accelerator, "_custom_objects"))
        options = StateDictOptions(strict=strict)
        # the counts of each list were checked above
        for i, (model, sd) in enumerate(zip(models, tree["models"], strict=True)):
            with _fitting(url, f"model {i}"):
                set_model_state_dict(model, sd, options=options)
        # the scaler before the optimizers, as Accelerate does (FSDP2)
        _load_scaler(accelerator, url, tree["scaler"])
        pairs = _pairs(accelerator)  # one per optimizer
        for i, ((model, opt), sd) in enumerate(zip(pairs, tree["optimizers"], strict=True)):
            with _fitting(url, f"optimizer {i}"):
                set_optimizer_state_dict(model, opt, sd)
        schedulers = _prepared(accelerator, "_schedulers")
        for i, (sched, sd) in enumerate(zip(schedulers, tree["schedulers"], strict=True)):
            with _fitting(url, f"scheduler {i}"):
                sched.load_state_dict(sd)
        loaders = _prepared(accelerator, "_dataloaders")
        # the dataloaders are not counted: those both sides have are restored
        for loader, sd in zip(loaders, tree["dataloaders"], strict=False):
            if "state_dict" in sd:
                loader.load_state_dict(sd["state_dict"])
            if "sampler_epoch" in sd and hasattr(getattr(loader, "sampler", None), "set_epoch"):
                loader.sampler.set_epoch(sd["sampler_epoch"])
        custom = _prepared(accelerator, "_custom_objects")
        for i, (obj, sd) in enumerate(zip(custom, tree["custom"], strict=True)):
            with _fitting(url, f"registered object {i}"):
                obj.load_state_dict(sd)
        rank, _ = rank_and_world()
        if rank < len(tree["rng"]):
            set_rng_state(tree["rng"][rank])
        else:  # Accelerate, too, goes on without them ("Could not load random states")
            log.warning("%s holds the RNG states of %d processes; those of process %d are left "
                        "as they are", url, len(tree["rng"]), rank)
        accelerator.step = tree["step"]


_WHAT = {"models": "models", "optimizers": "optimizers", "schedulers": "schedulers",
         "custom": "objects registered for checkpointing"}


def _check_counts(url: str, tree: dict[str, Any], key: str, have: list[Any]) -> None:
    if len(tree[key]) != len(have):
        raise ct.MismatchError(f"{url} holds {len(tree[key])} {_WHAT[key]}; the Accelerator has "
                               f"{len(have)}")


def _load_scaler(accelerator: Any, url: str, saved: Any) -> None:
    scaler = getattr(accelerator, "scaler", None)
    if (scaler is None) != (saved is None):
        raise ct.MismatchError(
            f"{url} holds {'a' if saved is not None else 'no'} grad scaler state; the "
            f"Accelerator has {'one' if scaler is not None else 'none'}")
    if scaler is not None:
        scaler.load_state_dict(saved)


@contextlib.contextmanager
def _fitting(url: str, what: str) -> Iterator[None]:
    """A state that does not fit the prepared object is a MismatchError naming both."""
    try:
        yield
    except ct.CkptTurboError:
        raise
    except Exception as exc:  # noqa: BLE001 - converted, not swallowed
        raise ct.MismatchError(f"{url}: the checkpoint's state of {what} does not fit the "
                               f"Accelerator's: {type(exc).__name__}: {exc}") from exc
