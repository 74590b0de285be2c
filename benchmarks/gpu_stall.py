"""Training stall of ct.save from GPU memory vs the pinned copy limit and dcp.async_save.

Run on a CUDA machine: `python -m benchmarks.gpu_stall [--size-mb 1024] [--dtype bf16]`.
Prints, for the steady state (pools already allocated), the time until `handle.staged`,
the time of a bare copy of the same tensors into preallocated pinned buffers, the time
`dcp.async_save` (FileSystemWriter, torch's default stager) blocks the caller, and the
ratios (targets: <= 1.2x the copy, <= 0.3x `dcp.async_save`); writes `gpu-stall.json`.
"""
from __future__ import annotations

import argparse
import tempfile
import time

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

import ckptturbo as ct

from .report import Report

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


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
    parser = argparse.ArgumentParser()
    parser.add_argument("--size-mb", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--out", default="bench-out")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs CUDA")
    dtype = DTYPES[args.dtype]
    n = args.size_mb // 64
    numel = (64 << 20) // dtype.itemsize
    sd = {f"w{i}": torch.randn(numel, device="cuda").to(dtype) for i in range(n)}  # 64 MiB each
    pinned = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=True) for k, v in sd.items()}
    report = Report("gpu-stall", {"size_mb": args.size_mb, "reps": args.reps, "dtype": args.dtype,
                                  "device": torch.cuda.get_device_name()})
    with tempfile.TemporaryDirectory(prefix="ckptturbo-gpu-stall-") as run:
        copies, stalls, async_saves = _measure(sd, pinned, run, args.reps)
        back = {k: torch.empty_like(v) for k, v in sd.items()}
        ct.load(back, f"{run}/step-{args.reps - 1}")
        exact = all(torch.equal(back[k], v) for k, v in sd.items())
    report.raw.update(copies=copies, stalls=stalls, async_saves=async_saves)
    report.compare("stall until staged vs a pinned D2H copy_", min(stalls), min(copies), "s",
                   peer_name="pinned copy_", target=1.2)
    report.compare("stall until staged vs dcp.async_save", min(stalls), min(async_saves), "s",
                   peer_name="dcp.async_save blocks", target=0.3)
    report.check("the last checkpoint loads bit-exact", exact)
    report.finish(args.out)


def _measure(sd: dict[str, torch.Tensor], pinned: dict[str, torch.Tensor], run: str,
             reps: int) -> tuple[list[float], list[float], list[float]]:
    """Seconds of each repetition, alternating: the bare pinned copy, ``ct.save`` until
    ``staged`` (then waited for), ``dcp.async_save`` until it returns."""
    ct.save(sd, f"{run}/warm").wait()
    _async_save_blocks(sd, f"{run}/dcp-warm")
    copies, stalls, async_saves = [], [], []
    for rep in range(reps):
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
    return copies, stalls, async_saves


if __name__ == "__main__":
    main()
