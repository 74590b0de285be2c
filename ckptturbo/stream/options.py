"""The options of a stream, in one object, and the settings they resolve to."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from .format import DEFAULT_MAX_HEADER_SIZE
from .profiles import StreamProfile, endpoint_key_for, resolve


@dataclass(frozen=True)
class StreamOptions:
    """Everything :func:`~ckptturbo.stream.stream_safetensors` takes besides the location.

    Settings left as None come from ``profile`` ("model-load", "small-files", a dict, or
    None for the profile calibrated for this endpoint, else "model-load"); explicit ones
    win. ``memory_limit`` bounds the bytes the streamer holds (ranges in flight or
    waiting, pinned staging buffers); yielded tensors belong to the caller. ``dtype``
    casts floating-point tensors (not FP8); ``names`` restricts the tensors (and the
    bytes read); ``lookahead`` caps how many files ahead reads go (None: as far as
    ``memory_limit`` allows); ``views`` yields views of the read ranges where a
    tensor lies in one (no copy: for consumers that copy each tensor at once; a kept view
    pins its range); ``process_group`` (gloo or NCCL) reads once across its ranks; ``cache_dir``
    enables the local-disk cache, ``cache_validate`` re-lists the files to catch changed
    objects; ``profiles_file`` overrides where calibrated profiles are looked up.
    """

    device: str | torch.device = "cpu"
    dtype: torch.dtype | None = None
    lookahead: int | None = None
    streams: int | None = None
    chunk_size: int | None = None
    memory_limit: int | None = None
    storage_options: dict[str, Any] | None = None
    process_group: Any = None
    names: Sequence[str] | None = None
    profile: str | StreamProfile | dict[str, Any] | None = None
    cache_dir: str | None = None
    cache_max_bytes: int | None = None
    cache_validate: bool = False
    max_header_size: int = DEFAULT_MAX_HEADER_SIZE
    profiles_file: str | None = None
    views: bool = False

    def settings(self, url: str) -> StreamProfile:
        """The profile for ``url``'s endpoint with the explicit settings applied, checked."""
        endpoint = endpoint_key_for(url, self.storage_options)
        prof = resolve(self.profile, endpoint, self.profiles_file)
        explicit = dict(chunk_size=self.chunk_size, streams=self.streams, lookahead=self.lookahead,
                        memory_limit=self.memory_limit)
        prof = replace(prof, **{k: v for k, v in explicit.items() if v is not None})
        if (min(prof.chunk_size, prof.streams, 1 if prof.lookahead is None else prof.lookahead) < 1
                or prof.memory_limit < 4096):
            raise ValueError(f"invalid stream settings {prof} (memory_limit must be >= 4096)")
        return prof
