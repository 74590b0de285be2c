"""Named streaming presets, and which one a stream uses (pure table and resolution).

No single setting is right everywhere: many parallel streams of large chunks per file are
what loads one big model fast from an object store (SkyPilot measured 6.8-7.9x over
defaults), and the same settings waste memory and requests on many small files. So the
streamer takes a named ``profile`` and, when none is named, uses the settings that
:func:`~ckptturbo.stream.calibrate.calibrate` measured for the same endpoint on this machine
(saved in ``~/.cache/ckptturbo/profiles.json``, or ``$CKPTTURBO_PROFILES``), falling back to
``model-load``. Explicit keyword arguments always win over the profile.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import fsspec

from ..store import Store

log = logging.getLogger(__name__)
MiB = 1 << 20


@dataclass(frozen=True)
class StreamProfile:
    """How the streamer reads: request size, parallel requests, memory bound, and an
    optional cap on files ahead (None: reads go as far ahead as the memory bound allows)."""

    chunk_size: int = 32 * MiB
    streams: int = 32
    lookahead: int | None = None
    memory_limit: int = 2 << 30


PROFILES: dict[str, StreamProfile] = {
    # few large files: big ranged GETs, many at once, ahead as far as memory allows
    "model-load": StreamProfile(chunk_size=32 * MiB, streams=32, memory_limit=2 << 30),
    # many small files: small requests, so per-file latency overlaps within less memory
    "small-files": StreamProfile(chunk_size=4 * MiB, streams=16, memory_limit=512 * MiB),
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


def save_profile(key: str, result: dict[str, Any],
                 path: str | os.PathLike[str] | None = None) -> Path:
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


__all__ = ["StreamProfile", "PROFILES", "DEFAULT_PROFILE", "resolve",
           "endpoint_key", "endpoint_key_for", "load_saved", "save_profile", "profiles_path"]
