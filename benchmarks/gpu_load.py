"""Load a checkpoint into GPU tensors: ckptturbo vs DCP's FileSystemReader followed by `.to()`.

Run on a CUDA machine: `python -m benchmarks.gpu_load [--size-mb 1024] [--reps 3]`. Both
sides load the same state (saved once by each writer, page cache warm) from local disk:
ckptturbo with `ct.load` straight into CUDA tensors (host bytes go through the pinned ring,
copied on a side stream while the next chunks are read), DCP with `dcp.load` into CPU
tensors and then `.to(device)` (what users do, since DCP fills destinations in place).
Prints both times and their ratio (ckptturbo / DCP; lower is better) and writes
`gpu-load.json`. `--device cpu` runs the same comparison without a GPU (a check of the
script, not a GPU figure).
"""
from __future__ import annotations

import argparse
import logging
import tempfile
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

import ckptturbo as ct

from .measure import alternate, now, quiet
from .report import Report
from .states import MiB, digests, mismatches, transformer_state, zero_, zeros_like

log = logging.getLogger("benchmarks")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-mb", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default="bench-out")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    quiet()
    device = torch.device(args.device)
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
            _sync(device)
            t = now()
            ct.load(on_device, ct_url)
            _sync(device)
            return {"seconds": now() - t, "correct": not mismatches(on_device, expected)}

        def dcp_then_to(rep: int) -> dict[str, Any]:
            zero_(on_host)
            _sync(device)
            t = now()
            dcp.load(on_host, storage_reader=dcp.FileSystemReader(dcp_dir), no_dist=True)
            moved = {k: v.to(device) for k, v in on_host.items()}
            _sync(device)
            return {"seconds": now() - t, "correct": not mismatches(moved, expected)}

        loads = alternate(args.reps, {"ckptturbo": ckptturbo, "DCP + .to()": dcp_then_to})
    report.raw["loads"] = loads
    report.check("bit-exact", all(s["correct"] for side in loads.values() for s in side["samples"]))
    report.compare(f"load into {device.type} tensors (page cache warm)",
                   loads["ckptturbo"]["best"]["seconds"], loads["DCP + .to()"]["best"]["seconds"],
                   "s", peer_name="FileSystemReader + .to()", target=1.0)
    report.finish(args.out)


if __name__ == "__main__":
    main()
