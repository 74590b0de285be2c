"""A vLLM CPU worker that times its own weights phase, for benchmarks.ray_vllm's engines.

vLLM's CPU platform starts tensor-parallel workers with ``spawn``, so nothing patched in
the engine's process reaches them; a worker class named by its import path
(``LLM(worker_cls=...)``) is imported in every worker, the in-process one at
tensor-parallel 1 included.
"""
from __future__ import annotations

import os
import time
from typing import Any

from vllm.v1.worker.cpu_worker import CPUWorker

TIMED_WORKER = f"{__name__}.TimedCPUWorker"


class TimedCPUWorker(CPUWorker):
    """The CPU worker, its ``load_model`` (vLLM's ``get_model``: the loader's whole
    ``load_model``, building the model and loading its weights, with what the loader does
    before and after) timed with ``time.perf_counter``, on Linux CLOCK_MONOTONIC, which
    every process of the machine shares: the spans of one engine's workers join into one
    phase, from the first start to the last end, on the benchmarks' own clock
    (``benchmarks.measure.now``)."""

    load_span: tuple[float, float] | None = None

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        began = time.perf_counter()
        try:
            super().load_model(*args, **kwargs)
        finally:
            self.load_span = (began, time.perf_counter())

    def timed_load(self) -> dict[str, Any]:
        """For ``collective_rpc``: the span, and the name that prefixes this engine's
        shared-memory segments in /dev/shm (vLLM's CPU all-reduce leaves them behind when
        it kills workers that did not exit in time at shutdown)."""
        return {"span": self.load_span, "ident": os.environ.get("VLLM_DIST_IDENT")}
