"""Stream a safetensors model into CUDA tensors: ckptturbo vs safetensors' own loaders.

Run on a CUDA machine: `python -m benchmarks.gpu_stream [--size-mb 1024] [--reps 3]`. A
bf16 model of ``--size-mb`` in 4 shards is written to local disk (page cache warm), then
loaded onto the GPU, alternating which goes first, best of ``--reps``:

* `ct.stream_safetensors(dir, device="cuda")` (pinned ring, copies on a side stream);
* `ct.safe_open(file, device="cuda")` calling `get_tensor` for every name (the drop-in path);
* `safetensors.torch.load_file(file, device="cuda")` per shard (the peer).

Every load is checked bit-exact. Prints the ratios (ckptturbo / safetensors; lower is
better) and writes `gpu-stream.json`. `--device cpu` checks the script without a GPU.
"""
from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from typing import Any

import torch
from safetensors.torch import load_file, save_file

import ckptturbo as ct
from ckptturbo.stream import safe_open

from .measure import alternate, device_args, now, sync
from .report import Report
from .states import MiB

SHARDS = 4


def _model(size_bytes: int, work: str) -> tuple[list[str], dict[str, torch.Tensor]]:
    """A bf16 model in SHARDS files of 32 tensors each; returns the files and the tensors."""
    g = torch.Generator().manual_seed(0)
    per_tensor = size_bytes // (SHARDS * 32) // 2
    files, every = [], {}
    for s in range(SHARDS):
        shard = {f"layers.{s}.{i}.weight": torch.randn(per_tensor, generator=g).bfloat16()
                 for i in range(32)}
        path = os.path.join(work, f"model-{s + 1:05d}-of-{SHARDS:05d}.safetensors")
        save_file(shard, path)
        files.append(path)
        every.update(shard)
    return files, every


def _timed(load: Callable[[], dict[str, torch.Tensor]], device: torch.device,
           expected: dict[str, torch.Tensor]) -> dict[str, Any]:
    sync(device)
    t = now()
    got = load()
    sync(device)
    seconds = now() - t
    correct = got.keys() == expected.keys() and all(torch.equal(got[k].cpu(), v)
                                                    for k, v in expected.items())
    return {"seconds": seconds, "correct": correct}


def main() -> None:
    args, device = device_args(__doc__.split("\n")[0])
    report = Report("gpu-stream", {"size_mb": args.size_mb, "reps": args.reps,
                                   "device": str(device)})
    with tempfile.TemporaryDirectory(prefix="ckptturbo-gpu-stream-") as work:
        files, expected = _model(args.size_mb * MiB, work)

        def stream() -> dict[str, torch.Tensor]:
            return dict(ct.stream_safetensors(work, device=str(device)))

        def loop() -> dict[str, torch.Tensor]:
            out = {}
            for path in files:
                with safe_open(path, framework="pt", device=str(device)) as f:
                    out.update({name: f.get_tensor(name) for name in f.keys()})
            return out

        def peer() -> dict[str, torch.Tensor]:
            out = {}
            for path in files:
                out.update(load_file(path, device=str(device)))
            return out

        variants = {"stream_safetensors": stream, "safe_open loop": loop,
                    "safetensors load_file": peer}
        loads = alternate(args.reps, {name: (lambda rep, fn=fn: _timed(fn, device, expected))
                                      for name, fn in variants.items()})
    report.raw["loads"] = loads
    report.check("bit-exact", all(s["correct"] for side in loads.values() for s in side["samples"]))
    theirs = loads["safetensors load_file"]["best"]["seconds"]
    for name in ("stream_safetensors", "safe_open loop"):
        report.compare(f"{name} into {device.type} tensors (page cache warm)",
                       loads[name]["best"]["seconds"], theirs, "s",
                       peer_name="safetensors load_file", target=1.0)
    report.finish(args.out)


if __name__ == "__main__":
    main()
