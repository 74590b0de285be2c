"""Ray Train checkpoints and vLLM model loads: ckptturbo beside the engines' own ways.

Standalone (``python -m benchmarks.ray_vllm ray|vllm|all``); SeaweedFS runs on loopback.

* ``ray``: a 2-worker DDP TorchTrainer whose state (weights + Adam moments) is >= 256 MiB
  checkpoints a few times to S3, once with ckptturbo.integrations.ray_train and once with
  Ray's standard pattern (``torch.save`` into a local directory, then
  ``ray.train.report(checkpoint=Checkpoint.from_directory(...))``, uploaded synchronously,
  by rank 0 alone as Ray's DDP examples do, and by every worker). Reported: seconds the
  training loop is blocked per checkpoint and bytes uploaded, with ratios.
* ``vllm``: a Llama of a few hundred MB in safetensors on S3 behind
  :mod:`benchmarks.latency_proxy` (20 ms per request): time to load the model into vLLM
  (CPU) with ``load_format="ckptturbo"``, with ``runai_streamer`` when it is installed,
  and by downloading the files then ``load_format="safetensors"``; peak host memory
  (max RSS) of each engine process.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Iterator

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class Proxy:
    """A running benchmarks.latency_proxy: its endpoint and its response-byte counter."""

    endpoint: str
    stats_file: str
    interval: float

    def stats(self) -> dict[str, Any]:
        time.sleep(3 * self.interval)  # the proxy writes its counters every interval
        with open(self.stats_file) as f:
            return json.load(f)


@contextlib.contextmanager
def counting_proxy(upstream: str, stats_file: str, latency_ms: float = 0.0,
                   conn_mbps: float = 100000.0, interval: float = 0.05) -> Iterator[Proxy]:
    """A loopback proxy in front of ``upstream`` (``http://127.0.0.1:PORT``), stopped on exit."""
    hostport = upstream.split("://", 1)[-1].rstrip("/")
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.latency_proxy", "--upstream", hostport,
                             "--latency-ms", str(latency_ms), "--conn-mbps", str(conn_mbps),
                             "--stats-file", stats_file, "--stats-interval", str(interval)],
                            cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline().split()
        if len(line) != 2 or line[0] != "PORT":
            raise RuntimeError(f"latency proxy did not start: {line}")
        yield Proxy(f"http://127.0.0.1:{line[1]}", stats_file, interval)
    finally:
        proc.terminate()
        proc.wait(10)
