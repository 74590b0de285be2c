"""Soak: many consecutive async saves of a changing state, with periodic gc, then proof.

What it answers (issue 13, item 8): after hundreds of saves does incremental dedup still
write only what changed, does gc keep the store at "last N checkpoints", does every
checkpoint that was ever committed load bit-exact, and does the process's memory stay
flat? The state is ``tensors`` float32 tensors; each step a quarter of them change (the
others are untouched, as frozen layers or slowly-updated shards are), so the bytes that
must be written per save are a quarter of the state. Each tensor's value at a step is a
pure function of (tensor, last step it changed), so any checkpoint can be checked without
keeping copies. Every checkpoint is verified once: just before the keep-last-N pruning
deletes it, or at the end.

Memory: the process's RSS is sampled after every save. Over the last ``--fit`` saves
(after the warm-up, when pools and caches are built) it "grows" when the peak RSS of the
window's last third exceeds the peak of its first third by more than max(16 MiB, 10% of
the state). Peaks, because RSS is a step pattern set by the gc/verify cycle (the
allocator keeps the freed verify buffers for a while, for a varying number of saves), and
a least-squares slope or a median reads where the window's ends fall in that pattern as
growth; a leak raises the peaks. The slope is reported too.

    python -m benchmarks.soak --out bench-out/soak [--saves 200] [--stores local,s3]
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import shutil
import tempfile
import time
from contextlib import ExitStack
from typing import Any

import torch

import ckptturbo as ct
from ckptturbo import catalog
from ckptturbo.runs import RunStore
from ckptturbo.testing import embedded_s3

log = logging.getLogger("benchmarks.soak")
MiB = 1 << 20
PERIOD = 4  # tensor i changes at the steps s with (s - i) % PERIOD == 0


def tensor_at(i: int, step: int, numel: int) -> torch.Tensor:
    """Tensor i as of a step: the value written the last time it changed."""
    last = step - ((step - i) % PERIOD) if step >= i else -1
    return torch.randn(numel, generator=torch.Generator().manual_seed(1_000_003 * (last + 1) + i))


def state_at(step: int, tensors: int, numel: int) -> dict[str, Any]:
    return {**{f"w{i}": tensor_at(i, step, numel) for i in range(tensors)}, "step": step}


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def slope_per_save(ys: list[float]) -> float:
    """Least-squares slope of ys against their index."""
    n = len(ys)
    if n < 2:
        return 0.0
    mx, my = (n - 1) / 2, sum(ys) / n
    return sum((x - mx) * (y - my) for x, y in enumerate(ys)) / sum((x - mx) ** 2 for x in range(n))


def verify(url: str, step: int, tensors: int, numel: int, options: dict | None) -> None:
    expected = state_at(step, tensors, numel)
    out = {k: (torch.empty_like(v) if isinstance(v, torch.Tensor) else 0)
           for k, v in expected.items()}
    ct.load(out, url, storage_options=options)
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            same = torch.equal(out[key], value)
        else:
            same = out[key] == value
        if not same:
            raise AssertionError(f"{url}: {key} differs from what step {step} saved")


def soak(run: str, options: dict | None, args: argparse.Namespace) -> dict[str, Any]:
    numel = args.tensor_mib * MiB // 4
    state = state_at(0, args.tensors, numel)
    logical = written = gcs = verified = 0
    rss: list[int] = []
    live: list[tuple[int, str]] = []
    handle = None
    started = time.monotonic()
    for step in range(args.saves):
        url = f"{run}/step-{step}"
        handle = ct.save(state, url, storage_options=options, chunk_size=args.chunk_mib * MiB)
        handle.staged.result()
        live.append((step, url))
        # "training": a quarter of the tensors change in place while the save uploads
        for i in range(args.tensors):
            if (step + 1 - i) % PERIOD == 0:
                state[f"w{i}"].copy_(tensor_at(i, step + 1, numel))
        state["step"] = step + 1
        summary = handle.wait()
        logical += summary.bytes_total
        written += summary.bytes_written
        if (step + 1) % args.gc_every == 0:
            for old_step, old_url in live[:-args.keep]:
                verify(old_url, old_step, args.tensors, numel, options)
                verified += 1
                ct.delete(old_url, storage_options=options)
            live = live[-args.keep:]
            catalog.collect_garbage(run, options)
            gcs += 1
        rss.append(rss_bytes())
        if (step + 1) % 20 == 0:
            log.info("%s: %d saves, rss %.0f MiB", run, step + 1, rss[-1] / MiB)
    seconds = time.monotonic() - started
    for old_step, old_url in live:
        verify(old_url, old_step, args.tensors, numel, options)
        verified += 1
    fit = rss[-args.fit:]
    slope = slope_per_save([float(r) for r in fit])
    third = max(1, len(fit) // 3)
    growth = max(fit[-third:]) - max(fit[:third])
    state_bytes = args.tensors * numel * 4
    limit = max(16 * MiB, 0.1 * state_bytes)
    return {
        "saves": args.saves, "seconds": seconds, "gc_runs": gcs, "verified": verified,
        "state_bytes": state_bytes, "logical_bytes": logical, "bytes_written": written,
        "written_over_logical": written / logical, "expected_ratio": 1 / PERIOD,
        "store_bytes_at_end": stored_bytes(run, options), "kept": args.keep,
        "rss_bytes": rss, "rss_first": rss[0], "rss_last": rss[-1], "rss_max": max(rss),
        "rss_slope_bytes_per_save": slope, "rss_fit_window": len(fit),
        "rss_growth_over_window": growth, "rss_growth_limit": limit,
        "memory_grows": growth > limit,
    }


def plot(results: dict[str, dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    for name, r in results.items():
        ax.plot(range(1, len(r["rss_bytes"]) + 1), [b / MiB for b in r["rss_bytes"]],
                label=f"{name} (peak growth {r['rss_growth_over_window'] / MiB:+.1f} MiB "
                      f"over the last {r['rss_fit_window']} saves)")
    ax.set_xlabel("save")
    ax.set_ylabel("RSS (MiB)")
    ax.set_title("ckptturbo soak: process RSS after each async save (gc every few saves)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench-out/soak")
    p.add_argument("--saves", type=int, default=200)
    p.add_argument("--tensors", type=int, default=8)
    p.add_argument("--tensor-mib", type=int, default=4)
    p.add_argument("--chunk-mib", type=int, default=1)
    p.add_argument("--gc-every", type=int, default=10)
    p.add_argument("--keep", type=int, default=3)
    p.add_argument("--fit", type=int, default=150,
                   help="saves at the end the RSS slope is fitted on")
    p.add_argument("--stores", default="local,s3")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    os.makedirs(args.out, exist_ok=True)
    results: dict[str, dict[str, Any]] = {}
    with ExitStack() as stack:
        scratch = tempfile.mkdtemp(prefix="ckptturbo-soak-")
        stack.callback(shutil.rmtree, scratch, True)
        for name in args.stores.split(","):
            if name == "local":
                results[name] = soak(os.path.join(scratch, "run"), None, args)
            elif name == "s3":
                server = stack.enter_context(embedded_s3.running(os.path.join(scratch, "s3")))
                results[name] = soak(server.url("soak"), server.storage_options, args)
            else:
                raise SystemExit(f"unknown store {name!r}: local or s3")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    for name, r in results.items():
        print(f"{name}: {r['saves']} saves in {r['seconds']:.0f}s, {r['gc_runs']} gc runs, "
              f"{r['verified']} checkpoints verified bit-exact; written/logical = "
              f"{r['written_over_logical']:.3f} (changed fraction {r['expected_ratio']:.3f}); "
              f"RSS {r['rss_first'] / MiB:.0f} -> {r['rss_last'] / MiB:.0f} MiB (max "
              f"{r['rss_max'] / MiB:.0f}); over the last {r['rss_fit_window']} saves: peak "
              f"growth {r['rss_growth_over_window'] / MiB:+.1f} MiB (limit "
              f"{r['rss_growth_limit'] / MiB:.0f}), "
              f"slope {r['rss_slope_bytes_per_save'] / 1024:.1f} "
              f"KiB/save -> memory grows: {r['memory_grows']}; store at end "
              f"{r['store_bytes_at_end'] / MiB:.0f} MiB")
    print(f"peak RSS of the process: {peak / MiB:.0f} MiB")
    with open(os.path.join(args.out, "soak.json"), "w") as f:
        json.dump({"args": vars(args), "peak_rss_bytes": peak, "results": results}, f, indent=1)
    plot(results, os.path.join(args.out, "soak_rss.png"))
    return 1 if any(r["memory_grows"] for r in results.values()) else 0


def stored_bytes(run: str, options: dict | None) -> int:
    """Every object under the run: chunks, manifests and control records."""
    store = RunStore.for_run(run, options).store
    return sum(info.size for info in store.list_files(store.root))


if __name__ == "__main__":
    raise SystemExit(main())
