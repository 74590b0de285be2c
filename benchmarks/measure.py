"""Measuring: alternating repetitions, clocks across ranks, resident memory, and the
benchmark's own setup of every rank process (logging, quiet DCP warnings)."""
from __future__ import annotations

import argparse
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from .report import brief

log = logging.getLogger("benchmarks")


def rank_options(world: int) -> dict[str, Any]:
    """The launcher's keywords for benchmark ranks (``run_distributed(fn, world, *args,
    **rank_options(world))``): the CPUs shared out, logging with the rank, 15 minutes at most."""
    return {"timeout": 900, "threads": max(1, (os.cpu_count() or 2) // world), "setup": rank_setup}


def rank_setup(rank: int) -> None:
    """Run first in every benchmark process (``setup=`` of the launcher): log with the rank."""
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s [rank {rank}] %(message)s",
                        datefmt="%H:%M:%S")
    logging.getLogger("benchmarks").setLevel(logging.INFO)
    quiet()


def quiet() -> None:
    """Silence DCP's per-call warnings that would drown the report."""
    import warnings

    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
    warnings.filterwarnings("ignore", message=".*TypedStorage is deprecated.*")
    warnings.filterwarnings("ignore", category=FutureWarning)


def now() -> float:
    return time.perf_counter()


def device_args(description: str) -> tuple[argparse.Namespace, torch.device]:
    """The options of a load benchmark that runs on a GPU, or on the CPU as a check of the
    script (``--size-mb``, ``--reps``, ``--device``, ``--out``); sets up logging."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--size-mb", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default="bench-out")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    quiet()
    return args, torch.device(args.device)


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (nothing on the CPU), before reading a clock."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def alternate(reps: int, variants: dict[str, Callable[[int], dict[str, Any]]],
              key: str = "seconds", between: Callable[[], None] | None = None) -> dict[str, dict]:
    """Run each variant ``reps`` times, alternating which goes first; keep every sample and
    the best (lowest ``key``). A variant returns a dict of metrics that includes ``key``."""
    names = list(variants)
    samples: dict[str, list[dict]] = {n: [] for n in names}
    for rep in range(reps):
        order = names if rep % 2 == 0 else list(reversed(names))
        for name in order:
            if between is not None:
                between()
            result = variants[name](rep)
            samples[name].append(result)
            log.info("  %-28s rep %d: %s", name, rep, brief(result))
    return {n: {"best": min(s, key=lambda r: r[key]), "samples": s} for n, s in samples.items()}


class RssSampler:
    """Samples this process's resident set size every ``interval`` seconds on a thread;
    ``peak_extra`` is the highest RSS seen minus the RSS when sampling started."""

    def __init__(self, interval: float = 0.002) -> None:
        self.interval = interval
        self.base = rss()
        self.peak = self.base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="rss-sampler")

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss())
            self._stop.wait(self.interval)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss())

    @property
    def peak_extra(self) -> int:
        return self.peak - self.base


_PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


def barrier_time() -> float:
    """All ranks meet, then read the clock (the start or end of a group-wide measurement)."""
    import torch.distributed as dist

    dist.barrier()
    return now()


def gather(value: Any) -> list[Any]:
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out
