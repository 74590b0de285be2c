"""How long training waits on a checkpoint: ``ct.save`` until ``staged``, three ways at once.

    python -m benchmarks.save_stall [--reps 7] [--latency-ms 30] [--json out.json]

One process saves 256 MiB (16 tensors of 16 MiB) and reports the median over ``--reps`` of

(a) the stall of ``ct.save`` to S3 (SeaweedFS on loopback behind ckptturbo.testing's fault proxy,
    which adds ``--latency-ms`` before every request),
(b) the stall of the same save to a local directory,
(c) a bare copy of the state into preallocated host buffers (the floor: what staging is),

and the stall of ``dcp.async_save(..., storage_writer=TurboWriter(...))`` to both stores.
The variants run interleaved, each on the steady state (pool allocated, run known), and
every repetition changes the state so that each save uploads new chunks. Targets from
issue 9: (a) <= 1.3 x (b) and (a) <= 2 x (c).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

import ckptturbo as ct
from ckptturbo.testing import embedded_s3
from ckptturbo.testing.proxy_process import ProxyProcess

log = logging.getLogger("benchmarks.save_stall")
MiB = 1 << 20


def build_state(tensors: int, tensor_mib: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.randn(tensor_mib * MiB // 4, generator=g)
            for i in range(tensors)}


def ct_save_stall(sd: dict[str, torch.Tensor], url: str, opts: dict[str, Any] | None) -> float:
    """Seconds from the call to ``staged``; then waits for ``durable`` outside the timing."""
    t0 = time.perf_counter()
    handle = ct.save(sd, url, storage_options=opts)
    handle.staged.result()
    stall = time.perf_counter() - t0
    handle.wait()
    return stall


def async_save_stall(sd: dict[str, torch.Tensor], url: str, opts: dict[str, Any] | None) -> float:
    """Seconds until ``dcp.async_save``'s staging completes (a fresh writer, as documented)."""
    t0 = time.perf_counter()
    response = dcp.async_save(sd, storage_writer=ct.TurboWriter(url, opts))
    response.staging_completion.result()
    stall = time.perf_counter() - t0
    response.upload_completion.result()
    return stall


def copy_stall(sd: dict[str, torch.Tensor], dest: dict[str, torch.Tensor]) -> float:
    t0 = time.perf_counter()
    for k, v in sd.items():
        dest[k].copy_(v)
    return time.perf_counter() - t0


def measure(reps: int, variants: dict[str, Callable[[int], float]],
            perturb: Callable[[], None], settle: float) -> dict[str, list[float]]:
    """Every variant once per repetition, in rotating order; warm-up runs are not kept.
    Before each sample dirty pages are flushed (``os.sync``) and ``settle`` seconds pass,
    so the disk writeback and server work of the last upload do not land on the next copy
    (the machine may be small)."""
    names = list(variants)
    for name in names:
        variants[name](-1)
    out: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(reps):
        perturb()
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            os.sync()
            time.sleep(settle)
            out[name].append(variants[name](rep))
            log.info("  rep %d %-24s %.4f s", rep, name, out[name][-1])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--tensors", type=int, default=16)
    p.add_argument("--tensor-mib", type=int, default=16)
    p.add_argument("--latency-ms", type=float, default=30.0)
    p.add_argument("--conn-mbps", type=float, default=1000.0, help="per-connection cap, MB/s")
    p.add_argument("--settle", type=float, default=1.0, help="pause before each sample (s)")
    p.add_argument("--workdir", default=None)
    p.add_argument("--json", default=None, help="write the samples and medians here")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("ckptturbo").setLevel(logging.WARNING)

    work = tempfile.mkdtemp(prefix="ckptturbo-stall-", dir=args.workdir)
    server = embedded_s3.start(os.path.join(work, "s3"))
    proxy = None
    try:
        proxy = ProxyProcess(server.endpoint, latency_s=args.latency_ms / 1000,
                             conn_rate=args.conn_mbps * 1e6)
        s3_opts = proxy.storage_options(server.storage_options)
        s3_run, local_run = server.url("stall"), os.path.join(work, "local", "run")
        sd = build_state(args.tensors, args.tensor_mib)
        dest = {k: torch.empty_like(v) for k, v in sd.items()}
        total = sum(v.numel() * v.element_size() for v in sd.values())
        log.info("state: %d tensors, %d MiB; S3 +%.0f ms per request", len(sd), total // MiB,
                 args.latency_ms)

        def perturb() -> None:  # new content each repetition: every save uploads
            for v in sd.values():
                v[0] += 1.0

        variants = {
            "ct.save S3": lambda r: ct_save_stall(sd, f"{s3_run}/ct-{r}", s3_opts),
            "ct.save local": lambda r: ct_save_stall(sd, f"{local_run}/ct-{r}", None),
            "bare copy": lambda r: copy_stall(sd, dest),
            "dcp.async_save S3": lambda r: async_save_stall(sd, f"{s3_run}/async-{r}", s3_opts),
            "dcp.async_save local": lambda r: async_save_stall(sd, f"{local_run}/async-{r}", None),
        }
        samples = measure(args.reps, variants, perturb, args.settle)
    finally:
        if proxy is not None:
            proxy.stop()
        server.stop()
        shutil.rmtree(work, ignore_errors=True)

    med = {k: statistics.median(v) for k, v in samples.items()}
    s3, local, copy = med["ct.save S3"], med["ct.save local"], med["bare copy"]
    print(f"\nmedian of {args.reps}, {total // MiB} MiB in {len(sd)} tensors")
    for name, value in med.items():
        print(f"  {name:24s} {value * 1000:8.1f} ms")
    print(f"  (a) S3 / (b) local   {s3 / local:6.2f}  (target <= 1.3)")
    print(f"  (a) S3 / (c) copy    {s3 / copy:6.2f}  (target <= 2.0)")
    print(f"  (b) local / (c) copy {local / copy:6.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"params": vars(args), "samples": samples, "median": med,
                       "ratios": {"s3_over_local": s3 / local, "s3_over_copy": s3 / copy}},
                      f, indent=1)


if __name__ == "__main__":
    main()
