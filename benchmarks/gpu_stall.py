"""Training stall of ct.save from GPU memory vs the pinned copy limit and dcp.async_save.

Run on a CUDA machine: `python -m benchmarks.gpu_stall [--size-mb 1024]`. Prints, for the
steady state (pools already allocated), the time until `handle.staged`, the time of a bare
copy of the same tensors into preallocated pinned buffers, the time `dcp.async_save`
(FileSystemWriter, torch's default stager) blocks the caller, and the ratios (targets:
<= 1.3x the copy, <= 0.5x `dcp.async_save`).
"""
from __future__ import annotations

import argparse
import tempfile
import time

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse


def _async_save_blocks(sd: dict[str, torch.Tensor], path: str) -> float:
    """Seconds until dcp.async_save hands control back with the state staged."""
    t0 = time.perf_counter()
    resp = dcp.async_save(sd, storage_writer=dcp.FileSystemWriter(path), no_dist=True)
    upload = resp
    if isinstance(resp, AsyncSaveResponse):
        resp.staging_completion.result()
        upload = resp.upload_completion
    blocked = time.perf_counter() - t0
    upload.result()
    return blocked


def main() -> None:
    import ckptturbo as ct

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
    _async_save_blocks(sd, f"{run}/dcp-warm")
    copies, stalls, async_saves = [], [], []
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
        async_saves.append(_async_save_blocks(sd, f"{run}/dcp-{rep}"))
    gib = n * 64 / 1024
    copy, stall, blocked = min(copies), min(stalls), min(async_saves)
    print(f"{gib:.2f} GiB  pinned D2H copy {copy:.3f} s ({gib / copy:.1f} GiB/s)  "
          f"ct.save staged {stall:.3f} s  dcp.async_save blocks {blocked:.3f} s\n"
          f"ratio vs copy {stall / copy:.2f} (target <= 1.3)  "
          f"ratio vs dcp.async_save {stall / blocked:.2f} (target <= 0.5)")


if __name__ == "__main__":
    main()
