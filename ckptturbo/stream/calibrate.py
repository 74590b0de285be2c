"""Calibration: measure which streams x request size reads fastest from a store.

A small benchmark, kept apart from the pure profile table in ``profiles``: it times
parallel ranged reads of one object and saves the best setting where the streamer
looks it up for that endpoint (``ckptturbo bench --calibrate`` runs it).
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable
from concurrent.futures import FIRST_COMPLETED, wait
from typing import Any

from ..errors import CheckpointNotFound
from ..runtime import default_runtime
from ..store import Store
from .profiles import MiB, endpoint_key, save_profile

log = logging.getLogger(__name__)


def calibrate(url: str, storage_options: dict[str, Any] | None = None, *,
              streams: Iterable[int] = (4, 8, 16, 32),
              chunk_sizes: Iterable[int] = (4 * MiB, 16 * MiB, 64 * MiB),
              sample_bytes: int = 256 * MiB,
              save: bool | str | os.PathLike[str] = False) -> dict[str, Any]:
    """Time parallel ranged reads of one object at ``url`` for each (streams, chunk size).

    ``url`` is a file or a directory/prefix (its largest ``*.safetensors`` is used). Each
    combination reads the first ``sample_bytes`` of the object. Returns the fastest as
    ``{"endpoint", "streams", "chunk_size", "gbps", "results": [...]}``; with ``save``
    (True for the default file, or a path) it is stored where the streamer looks it up.
    """
    stream_list, chunk_list = list(streams), list(chunk_sizes)
    store = default_runtime().open_store(url, storage_options, max_workers=max(stream_list))
    path, size = _sample_object(store)
    nbytes = min(size, sample_bytes)
    results = []
    for chunk in chunk_list:
        ranges = [(s, min(s + chunk, nbytes)) for s in range(0, nbytes, chunk)]
        for n in stream_list:
            began = time.perf_counter()
            _read_parallel(store, path, ranges, n)
            seconds = time.perf_counter() - began
            results.append({"streams": n, "chunk_size": chunk, "seconds": seconds,
                            "gbps": nbytes / seconds / 1e9})
            log.info("calibrate %s: %d streams x %d MiB: %.3f GB/s", url, n, chunk // MiB,
                     results[-1]["gbps"])
    best = max(results, key=lambda r: r["gbps"])
    result: dict[str, Any] = {
        "endpoint": endpoint_key(store), "object": store.url_of(path), "sample_bytes": nbytes,
        "streams": best["streams"], "chunk_size": best["chunk_size"], "gbps": best["gbps"],
        "measured_at": time.time(), "results": results}
    if save:
        result["saved_to"] = str(save_profile(result["endpoint"], result,
                                              None if save is True else save))
    return result


def _sample_object(store: Store) -> tuple[str, int]:
    files = [f for f in store.list_files(store.root) if f.path.endswith(".safetensors")]
    if files:
        best = max(files, key=lambda f: f.size)
        return best.path, best.size
    info = store.info(store.root)
    if info.size <= 0:
        raise CheckpointNotFound(f"calibrate: no object with data at {store.url}")
    return info.path, info.size


def _read_parallel(store: Store, path: str, ranges: list[tuple[int, int]], streams: int) -> None:
    """Read ``ranges`` with at most ``streams`` requests in flight, dropping the bytes."""
    pending: set = set()
    for r in ranges:
        if len(pending) >= streams:
            done, pending = wait(pending, return_when=FIRST_COMPLETED)
            for fut in done:
                fut.result()
        pending.add(store.submit(store.get, path, *r))
    for fut in pending:
        fut.result()
