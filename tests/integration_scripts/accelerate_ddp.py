"""Accelerate on 2 CPU processes (torchrun, gloo): train, save_state via ckptturbo, load, compare.

Run by tests/test_integration_accelerate.py. Each rank writes what it observed to
``--out``.rank<N>.pt: the state right after saving, and the state after loading it into a
freshly built Accelerator whose model, optimizer and RNG were moved on first. With
``--single URL`` (a checkpoint saved by one process), each rank also loads that one and
records its model, ``step`` and whether its RNG was left as it was (rank 1 has none saved).
"""
from __future__ import annotations

import argparse
import copy
import json
import random

import numpy as np
import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset

from ckptturbo.integrations.accelerate import load_state, save_state


class Counter:
    """An object registered with register_for_checkpointing."""

    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, sd: dict) -> None:
        self.n = sd["n"]


def build(seed: int):
    torch.manual_seed(seed)
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(0))
    loader = DataLoader(TensorDataset(x, x[:, :4] * 2), batch_size=8, shuffle=True)
    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    return accelerator, model, opt, sched, loader, counter


def train(accelerator, model, opt, sched, loader, counter, steps: int) -> None:
    for i, (x, y) in enumerate(loader):
        if i == steps:
            break
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
        counter.n += 1
        accelerator.step += 1


def snapshot(accelerator, model, opt, sched, counter) -> dict:
    weights = accelerator.unwrap_model(model).state_dict()
    return {"model": {k: v.clone() for k, v in weights.items()},
            "optim": copy.deepcopy(opt.optimizer.state_dict()), "sched": sched.state_dict(),
            "counter": counter.n,
            "step": accelerator.step, "torch_rng": torch.get_rng_state(), "py_rng": random.random(),
            "np_rng": float(np.random.rand())}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--storage-options", default=None)
    p.add_argument("--single", default=None)
    args = p.parse_args()
    opts = json.loads(args.storage_options) if args.storage_options else None
    parts = build(seed=0)
    accelerator = parts[0]
    train(*parts, steps=3)
    random.seed(accelerator.process_index)
    np.random.seed(accelerator.process_index)
    torch.manual_seed(100 + accelerator.process_index)
    handle = save_state(accelerator, args.url, storage_options=opts)
    assert handle.staged.done()
    handle.wait(timeout=120)
    saved = snapshot(accelerator, parts[1], parts[2], parts[3], parts[5])
    fresh = build(seed=1)
    train(*fresh, steps=1)  # move everything away from the saved state first
    load_state(fresh[0], args.url, storage_options=opts)
    loaded = snapshot(fresh[0], fresh[1], fresh[2], fresh[3], fresh[5])
    observed = {"saved": saved, "loaded": loaded}
    if args.single:
        rng_before = torch.get_rng_state()
        load_state(fresh[0], args.single)
        observed["single"] = {"model": snapshot(*fresh[:4], fresh[5])["model"],
                              "step": fresh[0].step,
                              "rng_kept": torch.equal(rng_before, torch.get_rng_state())}
    torch.save(observed, f"{args.out}.rank{accelerator.process_index}.pt")
    accelerator.end_training()


if __name__ == "__main__":
    main()
