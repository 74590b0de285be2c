"""What a save did: one rank's counts (``SaveStats``) and the whole save's (``SaveSummary``).

Every path that saves (a plain save, a tiered save's commit to memory, its persist to the
durable store) reports through these two: one rank's or one node's counts as a
``SaveStats``, the checkpoint's as the ``SaveSummary`` its handle resolves with, made from
counts by :meth:`SaveSummary.of` and nowhere else.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SaveStats(Mapping):
    """What one rank's save (or one node's part of a persist) did; also readable as a
    mapping (``stats["bytes_written"]``)."""

    bytes_staged: int = 0
    bytes_written: int = 0
    bytes_reused: int = 0
    chunks_written: int = 0
    chunks_reused: int = 0
    seconds_stage: float = 0.0
    seconds_upload: float = 0.0  # from the start of staging to the last upload
    seconds_write: float = 0.0  # all of write_data (set by the writer)

    def __getitem__(self, key: str) -> float:
        if key not in _STAT_NAMES:
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self) -> Iterator[str]:
        return iter(_STAT_NAMES)

    def __len__(self) -> int:
        return len(_STAT_NAMES)


_STAT_NAMES = tuple(f.name for f in dataclasses.fields(SaveStats))


@dataclass
class SaveSummary:
    """What a save did, for logs and for ``ckptturbo inspect``-style reporting."""

    url: str
    bytes_total: int = 0
    bytes_staged: int = 0
    bytes_written: int = 0
    bytes_reused: int = 0
    chunks_written: int = 0
    chunks_reused: int = 0
    seconds: dict[str, float] = field(default_factory=dict)

    @classmethod
    def of(cls, url: str, stats: SaveStats, bytes_total: int,
           seconds: dict[str, float]) -> SaveSummary:
        """The summary of a save of ``url`` that did what ``stats`` counts."""
        return cls(url=url, bytes_total=bytes_total, bytes_staged=stats.bytes_staged,
                   bytes_written=stats.bytes_written, bytes_reused=stats.bytes_reused,
                   chunks_written=stats.chunks_written, chunks_reused=stats.chunks_reused,
                   seconds=seconds)
