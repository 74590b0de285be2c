"""ckptturbo vs torch DCP, side by side: ``python -m benchmarks.run <scenario> [options]``.

Scenarios (see docs/benchmarks.md for what each compares and the targets):

    local-1p            1 process, local disk: TurboWriter/Reader vs FileSystemWriter/Reader
    s3-1p               1 process, SeaweedFS: TurboWriter/Reader vs FsspecWriter/Reader
    ddp-4r-local        4 ranks, replicated state: bytes per rank, time to durable (local)
    ddp-4r-s3           the same on SeaweedFS
    one-big-replicated  4 ranks, one big replicated tensor: max bytes per rank
    incremental         second save after 1/8 of the tensors changed, same run
    async-stall         ct.save stall vs bare copy, dcp.async_save, dcp.save; memory
    grouped-load        4 ranks load the same state: bytes served, time, 2 vs 4 ranks
    coordinator-scale   simulated 256-4,096-rank saves and loads in one process: CPU of the
                        coordinator path and bytes per rank (--worlds, --workloads)
    tiers               --ranks/2 "nodes" of 2 ranks: recovery of a lost node from its peers'
                        memory vs a load from S3 behind a 20 ms, 50 MB/s proxy; the stall of
                        a memory-tier save every step; host memory per node
    live-update         a running vLLM engine (CPU) moved to new checkpoints: a tenth of the
                        tensors changed, all, dense 10% deltas; bytes from storage vs the
                        changed chunks and a full reload, time vs vLLM's reload_weights
    cluster             a cluster in miniature (root: network namespaces, shaped links, the
                        store behind its own link): every result as time / physical limit and
                        against DCP fsspec, s3torchconnector, Run:ai (--nodes, --parts, --scale)
    all                 every scenario, each in a fresh process, then a summary of ratios

Each scenario prints a table, and writes <out>/<scenario>.json (raw numbers, ratios,
checks) and <out>/<scenario>.png. The exit status is 1 when a correctness check failed
(a missed performance target is reported, not an error).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from .measure import quiet
from .report import Report

SIZE_MB = {"local-1p": 1024, "s3-1p": 1024, "ddp-4r-local": 1024, "ddp-4r-s3": 1024,
           "one-big-replicated": 1024, "incremental": 1024, "async-stall": 1024,
           "grouped-load": 1024, "coordinator-scale": 0, "tiers": 1024, "live-update": 160,
           "cluster": 64}
REPS = {"local-1p": 3, "s3-1p": 2, "ddp-4r-local": 2, "ddp-4r-s3": 2, "one-big-replicated": 2,
        "incremental": 2, "async-stall": 2, "grouped-load": 2, "coordinator-scale": 1, "tiers": 2,
        "live-update": 3, "cluster": 5}


def _scenarios() -> dict[str, Callable[[Any], Report]]:
    from . import (
        cluster,
        coordinator_scale,
        live_update,
        scenarios_dist,
        scenarios_single,
        tiers_recovery,
    )

    return {
        "local-1p": scenarios_single.local_1p,
        "s3-1p": scenarios_single.s3_1p,
        "ddp-4r-local": scenarios_dist.ddp_local,
        "ddp-4r-s3": scenarios_dist.ddp_s3,
        "one-big-replicated": scenarios_dist.one_big_replicated,
        "incremental": scenarios_single.incremental,
        "async-stall": scenarios_single.async_stall,
        "grouped-load": scenarios_dist.grouped_load,
        "coordinator-scale": coordinator_scale.scenario,
        "tiers": tiers_recovery.scenario,
        "live-update": live_update.scenario,
        "cluster": cluster.scenario,
    }


NAMES = list(SIZE_MB)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("scenario", choices=NAMES + ["all"])
    p.add_argument("--size-mb", type=int, default=None,
                   help="state size in MiB (default: 1024 for every scenario)")
    p.add_argument("--ranks", type=int, default=4, help="ranks of the multi-rank scenarios")
    p.add_argument("--reps", type=int, default=None, help="repetitions, best of (default 2-3)")
    p.add_argument("--out", default="bench-out", help="directory for the JSON and PNG files")
    p.add_argument("--workdir", default=None,
                   help="scratch directory for local checkpoints and SeaweedFS (default: $TMPDIR)")
    p.add_argument("--storage", action="append", choices=["local", "s3"],
                   help="incremental: storage to run on (repeatable; default both)")
    p.add_argument("--pool-mb", type=int, default=None,
                   help="async-stall: ct.save staging pool size (default: ckptturbo's default)")
    p.add_argument("--conn-mbps", type=float, default=0.0,
                   help="S3 scenarios: cap every connection to SeaweedFS at this many MB/s "
                        "(10^6 bytes/s) each way, like a remote object store's per-stream limit "
                        "(default: no cap; give it its own --out); cluster: the miniature's "
                        "cap instead of the profile's")
    p.add_argument("--verify", choices=["storage", "all"], default="storage",
                   help="grouped-load: TurboReader(verify=...): chunks hashed by the rank that "
                        "read them (default), or again by every rank that receives them")
    p.add_argument("--worlds", default="256,512,1024",
                   help="coordinator-scale: simulated world sizes (4096 takes hours and ~20 GiB)")
    p.add_argument("--workloads", default="hsdp-72b,ddp-3b", help="coordinator-scale: workloads")
    p.add_argument("--layers", type=int, default=None,
                   help="coordinator-scale: fewer model layers (a quick check)")
    p.add_argument("--shard-group", type=int, default=None,
                   help="coordinator-scale: HSDP ranks per shard group (default 64)")
    p.add_argument("--nodes", type=int, default=4, help="cluster: nodes of 2 ranks each")
    p.add_argument("--parts", default=None,
                   help="cluster: comma-separated parts (default ddp,growth,recovery,stream,"
                        "stream-dist)")
    p.add_argument("--vllm-tp", default="1,2",
                   help="cluster: tensor-parallel sizes of part vllm, comma-separated (each a "
                        "scenario of its own; default 1,2)")
    p.add_argument("--scale", type=float, default=None,
                   help="cluster: factor on the profile's link rates (default 1/400; the "
                        "per-connection cap gets 10x it)")
    p.add_argument("--skip", action="append", default=[], help="all: scenarios to leave out")
    p.add_argument("-v", "--verbose", action="store_true")
    return p.parse_args(argv)


def run_one(args: argparse.Namespace) -> dict[str, Any]:
    if args.size_mb is None:
        args.size_mb = SIZE_MB[args.scenario]
    if args.reps is None:
        args.reps = REPS[args.scenario]
    report = _scenarios()[args.scenario](args)
    if args.conn_mbps:
        report.params["conn_mbps"] = args.conn_mbps
    report.raw["command"] = "python -m benchmarks.run " + " ".join(sys.argv[1:])
    return report.finish(args.out)


def run_all(args: argparse.Namespace) -> int:
    """Each scenario in a fresh interpreter (memory, fsspec caches and ckptturbo's writer
    cache start clean), then one summary of every ratio against its target."""
    failed = []
    started = time.time()
    for name in NAMES:
        if name in args.skip:
            continue
        cmd = [sys.executable, "-m", "benchmarks.run", name, "--out", args.out,
               "--ranks", str(args.ranks)]
        for opt, value in (("--size-mb", args.size_mb), ("--reps", args.reps),
                           ("--workdir", args.workdir), ("--pool-mb", args.pool_mb),
                           ("--conn-mbps", args.conn_mbps or None), ("--verify", args.verify)):
            if value is not None:
                cmd += [opt, str(value)]
        for s in args.storage or []:
            cmd += ["--storage", s]
        print(f"\n### {' '.join(cmd[1:])}", flush=True)
        t = time.time()
        rc = subprocess.call(cmd)
        print(f"### {name}: exit {rc} after {time.time() - t:.0f} s", flush=True)
        if rc:
            failed.append(name)
    print(summary(args.out, [n for n in NAMES if n not in args.skip]))
    print(f"total {time.time() - started:.0f} s")
    return 1 if failed else 0


def summary(out: str, names: list[str]) -> str:
    lines = ["", "== summary: ratio = ckptturbo / peer (lower is better unless the target says >=)",
             f"{'scenario':<20} {'measure':<42} {'vs':<26} {'ratio':>7}  target"]
    for name in names:
        path = os.path.join(out, f"{name}.json")
        if not os.path.exists(path):
            lines.append(f"{name:<20} (no result)")
            continue
        with open(path) as f:
            doc = json.load(f)
        for c in doc["comparisons"]:
            target = "" if c["target"] is None else \
                f"{c['op']} {c['target']:g}  {'ok' if c['met'] else 'MISSED'}"
            lines.append(f"{name:<20} {c['name']:<42} {c['peer_name']:<26} "
                         f"{c['ratio']:>7.3f}  {target}")
        checks = "passed" if doc["checks_passed"] else "FAILED: " + ", ".join(
            k for k, v in doc["checks"].items() if not v)
        lines.append(f"{name:<20} correctness checks {checks}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    for noisy in ("ckptturbo", "s3fs", "botocore", "aiobotocore", "fsspec", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.DEBUG if args.verbose else logging.WARNING)
    quiet()
    if args.scenario == "all":
        return run_all(args)
    doc = run_one(args)
    return 0 if doc["checks_passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
