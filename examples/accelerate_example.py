"""Accelerate with ckptturbo:
``python examples/accelerate_example.py [--url DIR|s3://...] [--cuda]``
(or under ``accelerate launch`` / ``torchrun`` with several processes).

``save_state(accelerator, url)`` replaces ``accelerator.save_state(dir)`` and returns once
the state is in host memory; ``load_state(accelerator, url)`` replaces ``load_state(dir)``.
"""
import argparse

import torch
from accelerate import Accelerator

from ckptturbo.integrations.accelerate import load_state, save_state


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--url", default=".demo/accelerate/step-10")
    p.add_argument("--cuda", action="store_true")
    args = p.parse_args()
    accelerator = Accelerator(cpu=not args.cuda)
    model = torch.nn.Linear(32, 32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = accelerator.prepare(model, opt)
    for _ in range(10):
        x = torch.randn(8, 32, device=accelerator.device)
        accelerator.backward(model(x).square().mean())
        opt.step()
        opt.zero_grad()
    handle = save_state(accelerator, args.url)  # <- instead of accelerator.save_state(dir)
    # training may continue here while the checkpoint is written
    handle.wait()
    load_state(accelerator, args.url)  # <- instead of accelerator.load_state(dir)
    accelerator.print("saved and restored", args.url)


if __name__ == "__main__":
    main()
