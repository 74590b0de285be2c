"""A training job that checkpoints every step until it is killed (crash-consistency tests).

Run under torch.distributed.run with a gloo group, or alone. The state of step N is a pure
function of N, so whoever finds a committed checkpoint can check it bit for bit without
having seen the job. Usage: save_loop.py RUN_URL STEPS [STORAGE_OPTIONS_JSON]
"""
from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

import ckptturbo as ct


def state_of(step: int) -> dict:
    """Mostly unchanged between steps (so saves dedup), one tensor new every step."""
    g = torch.Generator().manual_seed(1000 + step)
    base = torch.Generator().manual_seed(7)
    return {
        "frozen": torch.randn(256, 1024, generator=base),        # 1 MiB, same every step
        "moving": torch.randn(512, 1024, generator=g),           # 2 MiB, new every step
        "small": torch.arange(100, dtype=torch.int64) + step,
        "step": step,
    }


def main() -> None:
    run, steps = sys.argv[1], int(sys.argv[2])
    options = json.loads(sys.argv[3]) if len(sys.argv) > 3 else None
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    for step in range(1, steps + 1):
        ct.save(state_of(step), f"{run}/step-{step}", storage_options=options,
                chunk_size=256 << 10, pack_threshold=64 << 10).wait(timeout=300)
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(f"committed step-{step}", flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
