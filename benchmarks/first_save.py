"""The first ``ct.save`` of a fresh process: does its stall stay the copy?

    python -m benchmarks.first_save [--procs 7] [--json out.json]

Each of ``--procs`` fresh processes imports torch and ckptturbo (as a training script
does), then saves a small state three times to S3 (SeaweedFS on loopback), timing each
save until ``staged``. The first save of a process is the one that opens the store
(client, imports, bucket check); that must happen after the copy, off the stall. Prints the
medians of the first and of the later saves, and their ratio (issue 22's target: <= 1.5).
"""
from __future__ import annotations

import argparse
import json
import logging
import statistics
import subprocess
import sys
import tempfile
import time

from ckptturbo.testing import embedded_s3

log = logging.getLogger("benchmarks.first_save")


def child(run: str, options: dict) -> list[float]:
    """Three saves in this (fresh) process; seconds until each one's ``staged``."""
    import torch

    import ckptturbo as ct

    stalls = []
    for step in range(3):
        state = {"w": torch.randn(10), "step": step}
        t0 = time.perf_counter()
        handle = ct.save(state, f"{run}/step-{step}", storage_options=options)
        handle.staged.result()
        stalls.append(time.perf_counter() - t0)
        handle.wait()
    return stalls


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--procs", type=int, default=7)
    parser.add_argument("--json", default=None)
    parser.add_argument("--child", nargs=2, metavar=("RUN", "OPTIONS"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child[0], json.loads(args.child[1]))))
        return
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    server = embedded_s3.start(tempfile.mkdtemp(prefix="ckptturbo-bench-first-"))
    try:
        samples = []
        for _ in range(args.procs):
            out = subprocess.run([sys.executable, "-m", "benchmarks.first_save", "--child",
                                  server.url(), json.dumps(server.storage_options)],
                                 capture_output=True, text=True, check=True, timeout=300)
            samples.append(json.loads(out.stdout.strip().splitlines()[-1]))
            log.info("stalls (ms): %s", ", ".join(f"{s * 1000:.1f}" for s in samples[-1]))
    finally:
        server.stop()
    first = statistics.median(s[0] for s in samples)
    later = statistics.median(x for s in samples for x in s[1:])
    result = {"procs": args.procs, "first_stall_s": first, "later_stall_s": later,
              "ratio": first / later, "target": 1.5, "samples": samples}
    print(f"first save: {first * 1000:.1f} ms, later saves: {later * 1000:.1f} ms (medians), "
          f"ratio {first / later:.2f} (target <= 1.5)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
