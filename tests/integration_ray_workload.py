"""The training function the Ray tests run in every TorchTrainer worker.

A deterministic DDP job (fixed seeds, data derived from step and rank) so that a run that
is killed and restored from its latest checkpoint must end in exactly the state of a run
that never stopped. What the test checks is written as files under ``config["out"]``.
"""
from __future__ import annotations

import json
import os
import posixpath
import time

import torch
import torch.nn as nn


def _model() -> nn.Module:
    torch.manual_seed(0)
    # 512x512 layers: large enough that each weight is its own chunk (not packed)
    return nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512))


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(16, 512, generator=g)
    return x, torch.tanh(x.flip(1))


def _wait_until_ray_registered(reported: list) -> None:
    """Block until Ray's controller has processed every report of this worker, so that the
    restart after a kill resumes from the newest checkpoint reported with a path.

    ``get_all_reported_checkpoints(COMMITTED)`` waits for exactly that, but returns what it
    has when its timeout passes: the newest one is then checked by name, so a slow
    controller fails the run here instead of restoring an older checkpoint.
    """
    import ray.train
    from ray.train import CheckpointConsistencyMode

    registered = ray.train.get_all_reported_checkpoints(
        consistency_mode=CheckpointConsistencyMode.COMMITTED, timeout_s=120)
    names = {posixpath.basename(r.checkpoint.path.rstrip("/")) for r in registered}
    newest = posixpath.basename(reported[-1].url.rstrip("/")) if reported else None
    if newest is not None and newest not in names:
        raise RuntimeError(f"Ray has not registered checkpoint {newest} after 120 s: {names}")


def train_fn(config: dict) -> None:
    import ray.train
    from ray.train.torch import prepare_model
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import ckptturbo as ct
    from ckptturbo.integrations import ray_train as rt

    ctx = ray.train.get_context()
    rank = ctx.get_world_rank()
    out = config["out"]
    options = config["storage_options"]
    model = prepare_model(_model())
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)

    msd, osd = get_state_dict(model, optim)
    state = {"model": msd, "optim": osd, "progress": {"step": torch.zeros((), dtype=torch.int64)}}
    start = 0
    tiers = ct.Tiers(**config["tiers"]) if config.get("tiers") else None
    url = rt.load(state, storage_options=options, tiers=tiers)
    if url is not None:
        set_state_dict(model, optim, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        start = int(state["progress"]["step"])
        with open(os.path.join(out, f"restored-rank{rank}.json"), "w") as f:
            json.dump({"url": url, "step": start}, f)

    handles = []
    for step in range(start + 1, config["steps"] + 1):
        x, y = _batch(step, rank)
        optim.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optim.step()
        # a training step's compute (workload, not synchronisation): it leaves the gc after
        # each durable save (on rank 0) time to run before the next save's marker defers it
        time.sleep(config.get("step_s", 0.0))
        if step % config["every"] == 0:
            msd, osd = get_state_dict(model, optim)
            state = {"model": msd, "optim": osd,
                     "progress": {"step": torch.tensor(step, dtype=torch.int64)}}
            handles.append((step, rt.save(state, {"step": step, "loss": float(loss)},
                                          storage_options=options, tiers=tiers)))
        marker = os.path.join(out, "killed")
        if step == config.get("kill_at") and rank == 1 and not os.path.exists(marker):
            handles[-1][1].wait(120)
            _wait_until_ray_registered([h for _, h in handles if getattr(h, "persisted", True)])
            open(marker, "w").close()
            os._exit(1)

    with open(os.path.join(out, f"saves-rank{rank}.jsonl"), "a") as f:
        for step, handle in handles:
            s = handle.wait(120) or handle.local.result()  # a tiered save only in memory
            f.write(json.dumps({"step": step, "url": s.url, "bytes_written": s.bytes_written,
                                "bytes_reused": s.bytes_reused,
                                "chunks_written": s.chunks_written}) + "\n")
    if rank == 0:
        final = get_state_dict(model, optim)[0]
        torch.save({k: v.detach().clone() for k, v in final.items()},
                   os.path.join(out, "final-model.pt"))
