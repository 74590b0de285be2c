"""Training stall of ct.save from GPU memory vs the pinned device-to-host copy limit.

Run on a CUDA machine: `python -m benchmarks.gpu_stall [--size-mb 1024]`. Prints the time
until `handle.staged` (steady state: the second save, pool already allocated), the time of
a bare copy of the same tensors into preallocated pinned buffers, and their ratio
(target <= 1.3).
"""
from __future__ import annotations

import argparse
import tempfile
import time

import torch

import ckptturbo as ct


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size-mb", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs CUDA")
    n = args.size_mb // 64
    sd = {f"w{i}": torch.randn(16 << 20, device="cuda") for i in range(n)}  # 64 MiB each
    pinned = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=True) for k, v in sd.items()}
    run = tempfile.mkdtemp(prefix="ckptturbo-gpu-")
    ct.save(sd, f"{run}/warm").wait()
    copies, stalls = [], []
    for rep in range(args.reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for k, v in sd.items():
            pinned[k].copy_(v, non_blocking=True)
        torch.cuda.synchronize()
        copies.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        handle = ct.save(sd, f"{run}/step-{rep}")
        handle.staged.result()
        stalls.append(time.perf_counter() - t0)
        handle.wait()
    gib = n * 64 / 1024
    copy, stall = min(copies), min(stalls)
    print(f"{gib:.2f} GiB  pinned D2H copy {copy:.3f} s ({gib / copy:.1f} GiB/s)  "
          f"ct.save staged {stall:.3f} s  ratio {stall / copy:.2f} (target <= 1.3)")


if __name__ == "__main__":
    main()
