"""Accelerate: ``save_state(accelerator, url)`` / ``load_state(accelerator, url)`` through ckptturbo.

``Accelerator.save_state`` writes local files only, synchronously, and under FSDP hard-codes
``FileSystemWriter``. These two functions cover what it covers (models, optimizers,
schedulers, the grad scaler, every rank's RNG states (Python, NumPy, torch, CUDA), objects registered with
``register_for_checkpointing``, stateful dataloaders and sampler epochs, ``accelerator.step``)
in one ckptturbo checkpoint, local or ``s3://``. Model and optimizer state go through
``torch.distributed.checkpoint.state_dict`` (plain, DDP and FSDP alike: sharded models
save their shards), and every rank takes part: replicated weights are uploaded once,
split over the ranks. ``save_state`` returns once the state is staged in host memory.

The Accelerator keeps what it prepared in ``_models``/``_optimizers``/... (no public
accessor exists); they are read here as ``Accelerator.save_state`` reads them.
"""
from __future__ import annotations

from typing import Any

from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

import ckptturbo as ct
from ckptturbo.tree import SKELETON_KEY, flatten

from ._core import all_ranks, rank_and_world, rng_state, save_tree, set_rng_state


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
    if hasattr(sampler, "epoch"):
        state["sampler_epoch"] = int(sampler.epoch)
    return state


def _model_and_optim_state(accelerator: Any) -> dict[str, Any]:
    return {"models": [get_model_state_dict(m) for m in _prepared(accelerator, "_models")],
            "optimizers": [get_optimizer_state_dict(m, o) for m, o in _pairs(accelerator)]}


def save_state(accelerator: Any, url: str, *, storage_options: dict[str, Any] | None = None,
               wait_staged: bool = True, **writer_options: Any) -> ct.SaveHandle:
    """Save everything ``Accelerator.save_state`` saves to ``url``; every process calls it.

    Returns a SaveHandle (``staged``, ``durable``, ``wait()``); with ``wait_staged`` (the
    default) it returns once staged, so training may go on at once.
    """
    scaler = getattr(accelerator, "scaler", None)
    state = {
        **_model_and_optim_state(accelerator),
        "schedulers": [s.state_dict() for s in _prepared(accelerator, "_schedulers")],
        "dataloaders": [_loader_state(d) for d in _prepared(accelerator, "_dataloaders")],
        "scaler": scaler.state_dict() if scaler is not None else None,
        "custom": [o.state_dict() for o in _prepared(accelerator, "_custom_objects")],
        "rng": all_ranks(rng_state()),
        "step": int(accelerator.step),
    }
    handle = save_tree(state, str(url), storage_options=storage_options, collective=True,
                       **writer_options)
    if wait_staged:
        handle.staged.result()
    return handle


def load_state(accelerator: Any, url: str, *, storage_options: dict[str, Any] | None = None,
               allow_pickle: bool = False, **reader_options: Any) -> None:
    """Restore what ``save_state`` saved; every process calls it (storage is read once).

    Model and optimizer tensors load straight into the prepared objects' own layout
    (shards under FSDP); the rest is rebuilt from the checkpoint without a template.
    """
    templates = flatten(_model_and_optim_state(accelerator))
    templates.pop(SKELETON_KEY)
    tree = ct.load_state_dict(str(url), storage_options=storage_options, templates=templates,
                              allow_pickle=allow_pickle, **reader_options)
    models = _prepared(accelerator, "_models")
    _check_counts(url, "models", tree["models"], models)
    for model, sd in zip(models, tree["models"]):
        set_model_state_dict(model, sd)
    _check_counts(url, "optimizers", tree["optimizers"], _prepared(accelerator, "_optimizers"))
    for (model, opt), sd in zip(_pairs(accelerator), tree["optimizers"]):
        set_optimizer_state_dict(model, opt, sd)
    for sched, sd in zip(_prepared(accelerator, "_schedulers"), tree["schedulers"]):
        sched.load_state_dict(sd)
    for loader, sd in zip(_prepared(accelerator, "_dataloaders"), tree["dataloaders"]):
        if "state_dict" in sd:
            loader.load_state_dict(sd["state_dict"])
        if "sampler_epoch" in sd and hasattr(getattr(loader, "sampler", None), "set_epoch"):
            loader.sampler.set_epoch(sd["sampler_epoch"])
    scaler = getattr(accelerator, "scaler", None)
    if scaler is not None and tree["scaler"] is not None:
        scaler.load_state_dict(tree["scaler"])
    custom = _prepared(accelerator, "_custom_objects")
    _check_counts(url, "registered objects", tree["custom"], custom)
    for obj, sd in zip(custom, tree["custom"]):
        obj.load_state_dict(sd)
    rank, _ = rank_and_world()
    if rank >= len(tree["rng"]):
        raise ct.MismatchError(f"{url} holds RNG states of {len(tree['rng'])} processes; "
                               f"this is process {rank}")
    set_rng_state(tree["rng"][rank])
    accelerator.step = tree["step"]


def _check_counts(url: str, what: str, saved: list[Any], have: list[Any]) -> None:
    if len(saved) != len(have):
        raise ct.MismatchError(f"{url} holds {len(saved)} {what}; the Accelerator has {len(have)}")
