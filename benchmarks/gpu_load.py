"""Load a checkpoint into GPU tensors: ckptturbo vs DCP's FileSystemReader followed by `.to()`.

Run on a CUDA machine: `python -m benchmarks.gpu_load [--size-mb 1024] [--reps 3]`. Both
sides load the same state (saved once by each writer, page cache warm) from local disk:
ckptturbo with `ct.load` straight into CUDA tensors (host bytes go through the pinned ring,
copied on a side stream while the next chunks are read), DCP with `dcp.load` into CPU
tensors and then `.to(device)` (what users do, since DCP fills destinations in place).
On CUDA it also times a bare pinned ``copy_`` of the same bytes into the same device
tensors (the host-to-device limit) and, in one profiled extra load, the device time of
ckptturbo's own host-to-device copies. Prints the times and ratios (targets: <= 0.7x DCP;
load throughput >= 0.7x the bare pinned copy's) and writes `gpu-load.json`. `--device cpu`
runs the DCP comparison without a GPU (a check of the script, not a GPU figure).
"""
from __future__ import annotations

import tempfile
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

import ckptturbo as ct

from .measure import alternate, device_args, now, sync
from .report import Report
from .states import MiB, digests, mismatches, tensor_nbytes, transformer_state, zero_, zeros_like


def _pinned_copy(on_device: dict[str, Any], device: torch.device, reps: int) -> float:
    """Best seconds of a bare pinned host-to-device ``copy_`` into the same tensors."""
    pinned = {k: torch.empty_like(v, device="cpu").pin_memory() for k, v in on_device.items()
              if isinstance(v, torch.Tensor)}
    best = float("inf")
    for _ in range(reps + 1):
        sync(device)
        t = now()
        for k, host in pinned.items():
            on_device[k].copy_(host, non_blocking=True)
        sync(device)
        best = min(best, now() - t)
    return best


def _profiled_copies(load: Any) -> dict[str, float]:
    """Device seconds and count of the host-to-device copies one load makes, by kind
    (pinned or pageable source), from the CUDA profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        load()
    out: dict[str, float] = {}
    for event in prof.key_averages():
        if "HtoD" in event.key:
            kind = "pageable" if "Pageable" in event.key else "pinned"
            out[f"{kind}_seconds"] = out.get(f"{kind}_seconds", 0.0) + event.device_time_total / 1e6
            out[f"{kind}_count"] = out.get(f"{kind}_count", 0) + event.count
    return out


def main() -> None:
    args, device = device_args(__doc__.split("\n")[0])
    report = Report("gpu-load", {"size_mb": args.size_mb, "reps": args.reps, "device": str(device)})
    sd = transformer_state(args.size_mb * MiB)
    expected = digests(sd)
    with tempfile.TemporaryDirectory(prefix="ckptturbo-gpu-load-") as work:
        ct_url, dcp_dir = f"{work}/run/ckpt", f"{work}/dcp"
        ct.save(sd, ct_url).wait()
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(dcp_dir), no_dist=True)
        on_device = {k: v.to(device) for k, v in zeros_like(sd).items()}
        on_host = zeros_like(sd)

        def ckptturbo(rep: int) -> dict[str, Any]:
            zero_(on_device)
            sync(device)
            t = now()
            ct.load(on_device, ct_url)
            sync(device)
            return {"seconds": now() - t, "correct": not mismatches(on_device, expected)}

        def dcp_then_to(rep: int) -> dict[str, Any]:
            zero_(on_host)
            sync(device)
            t = now()
            dcp.load(on_host, storage_reader=dcp.FileSystemReader(dcp_dir), no_dist=True)
            moved = {k: v.to(device) for k, v in on_host.items()}
            sync(device)
            return {"seconds": now() - t, "correct": not mismatches(moved, expected)}

        loads = alternate(args.reps, {"ckptturbo": ckptturbo, "DCP + .to()": dcp_then_to})
        if device.type == "cuda":
            copy = _pinned_copy(on_device, device, args.reps)
            try:
                report.raw["profiled_h2d"] = _profiled_copies(lambda: ckptturbo(-1))
            except Exception as exc:  # noqa: BLE001 - the profiler is a diagnostic
                report.note(f"profiler failed: {exc!r}")
    report.raw["loads"] = loads
    report.check("bit-exact", all(s["correct"] for side in loads.values() for s in side["samples"]))
    ours = loads["ckptturbo"]["best"]["seconds"]
    report.compare(f"load into {device.type} tensors (page cache warm)", ours,
                   loads["DCP + .to()"]["best"]["seconds"], "s",
                   peer_name="FileSystemReader + .to()", target=0.7)
    if device.type == "cuda":
        nbytes = tensor_nbytes(sd)
        report.raw["pinned_copy_seconds"] = copy
        report.compare("throughput vs a bare pinned copy_ (GB/s)", nbytes / ours / 1e9,
                       nbytes / copy / 1e9, "GB/s", peer_name="pinned copy_", target=0.7, op=">=")
        h2d = report.raw.get("profiled_h2d", {})
        if h2d.get("pinned_seconds"):
            pinned_gbps = nbytes / h2d["pinned_seconds"] / 1e9
            report.note(f"profiled: ckptturbo's pinned H2D copies moved {pinned_gbps:.1f} "
                        f"GB/s of device time ({h2d}); bare pinned copy_ "
                        f"{nbytes / copy / 1e9:.1f} GB/s")
    report.finish(args.out)


if __name__ == "__main__":
    main()
