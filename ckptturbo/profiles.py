"""Named streaming presets, and a calibration that measures the best one for a store.

No single setting is right everywhere: many parallel streams of large chunks per file are
what loads one big model fast from an object store (SkyPilot measured 6.8-7.9x over
defaults), and the same settings waste memory and requests on many small files. So the
streamer takes a named ``profile`` and, when none is named, uses the settings that
:func:`calibrate` measured for the same endpoint on this machine (saved in
``~/.cache/ckptturbo/profiles.json``, or ``$CKPTTURBO_PROFILES``), falling back to
``model-load``. Explicit keyword arguments always win over the profile.
"""
from __future__ import annotations

import json
import logging
import os
import time
from concurrent.futures import FIRST_COMPLETED, wait
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterable

import fsspec

from .errors import CheckpointNotFound
from .store import Store

log = logging.getLogger(__name__)
MiB = 1 << 20


@dataclass(frozen=True)
class StreamProfile:
    """How the streamer reads: request size, parallel requests, files ahead, memory bound."""

    chunk_size: int = 32 * MiB
    streams: int = 32
    lookahead: int = 2
    memory_limit: int = 2 << 30


PROFILES: dict[str, StreamProfile] = {
    # few large files: big ranged GETs, many at once, the next file already on its way
    "model-load": StreamProfile(chunk_size=32 * MiB, streams=32, lookahead=2, memory_limit=2 << 30),
    # many small files: small requests, many files ahead so per-file latency overlaps
    "small-files": StreamProfile(chunk_size=4 * MiB, streams=16, lookahead=16, memory_limit=512 * MiB),
}
DEFAULT_PROFILE = "model-load"


def endpoint_key(store: Store) -> str:
    """What identifies "the same storage" for saved profiles and cache keys."""
    return endpoint_key_for(store.url, store.storage_options)


def endpoint_key_for(url: str, storage_options: dict[str, Any] | None) -> str:
    """:func:`endpoint_key` from a URL and options, without opening the storage."""
    protocol = fsspec.utils.get_protocol(url)
    if protocol in ("file", "local"):
        return "file"
    options = storage_options or {}
    client = options.get("client_kwargs") or {}
    endpoint = (client.get("endpoint_url") or options.get("endpoint_url")
                or os.environ.get("AWS_ENDPOINT_URL") or "default")
    return f"{protocol}:{endpoint}"


def profiles_path(path: str | os.PathLike[str] | None = None) -> Path:
    if path is not None:
        return Path(path).expanduser()
    env = os.environ.get("CKPTTURBO_PROFILES")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "ckptturbo" / "profiles.json"


def load_saved(key: str, path: str | os.PathLike[str] | None = None) -> StreamProfile | None:
    """The calibrated profile saved for ``key``, if any (a broken file is ignored, logged)."""
    file = profiles_path(path)
    try:
        saved = json.loads(file.read_text())[key]
        return replace(StreamProfile(), chunk_size=int(saved["chunk_size"]),
                       streams=int(saved["streams"]))
    except FileNotFoundError:
        return None
    except (KeyError, ValueError, TypeError, OSError) as exc:
        if not isinstance(exc, KeyError):
            log.warning("ignoring unreadable profiles file %s: %s", file, exc)
        return None


def save_profile(key: str, result: dict[str, Any], path: str | os.PathLike[str] | None = None) -> Path:
    file = profiles_path(path)
    file.parent.mkdir(parents=True, exist_ok=True)
    try:
        data = json.loads(file.read_text())
    except (FileNotFoundError, ValueError):
        data = {}
    data[key] = {k: result[k] for k in ("chunk_size", "streams", "gbps", "measured_at")}
    tmp = file.with_suffix(f".tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True))
    os.replace(tmp, file)
    return file


def resolve(profile: str | StreamProfile | dict[str, Any] | None, key: str,
            path: str | os.PathLike[str] | None = None) -> StreamProfile:
    """The profile to use: the one named, else the calibrated one for ``key``, else the default."""
    if isinstance(profile, StreamProfile):
        return profile
    if isinstance(profile, dict):
        return replace(PROFILES[DEFAULT_PROFILE], **profile)
    if profile is None:
        return load_saved(key, path) or PROFILES[DEFAULT_PROFILE]
    if profile not in PROFILES:
        raise ValueError(f"unknown profile {profile!r}; known: {sorted(PROFILES)}")
    return PROFILES[profile]


def calibrate(url: str, storage_options: dict[str, Any] | None = None, *,
              streams: Iterable[int] = (4, 8, 16, 32),
              chunk_sizes: Iterable[int] = (4 * MiB, 16 * MiB, 64 * MiB),
              sample_bytes: int = 256 * MiB, save: bool | str | os.PathLike[str] = False) -> dict[str, Any]:
    """Time parallel ranged reads of one object at ``url`` for each (streams, chunk size).

    ``url`` is a file or a directory/prefix (its largest ``*.safetensors`` is used). Each
    combination reads the first ``sample_bytes`` of the object. Returns the fastest as
    ``{"endpoint", "streams", "chunk_size", "gbps", "results": [...]}``; with ``save``
    (True for the default file, or a path) it is stored where the streamer looks it up.
    """
    stream_list, chunk_list = list(streams), list(chunk_sizes)
    store = Store(url, storage_options, max_workers=max(stream_list))
    try:
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
        result = {"endpoint": endpoint_key(store), "object": store.url_of(path), "sample_bytes": nbytes,
                  "streams": best["streams"], "chunk_size": best["chunk_size"], "gbps": best["gbps"],
                  "measured_at": time.time(), "results": results}
        if save:
            result["saved_to"] = str(save_profile(result["endpoint"], result,
                                                  None if save is True else save))
        return result
    finally:
        store.close()


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


__all__ = ["StreamProfile", "PROFILES", "DEFAULT_PROFILE", "calibrate", "resolve",
           "endpoint_key", "endpoint_key_for", "load_saved", "save_profile", "profiles_path"]
