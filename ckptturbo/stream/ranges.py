"""Which byte ranges of which files a stream reads, in the order it yields them. Pure.

(Named apart from :func:`ckptturbo.plan.plan_reads`, which assigns DCP chunks to ranks.)
"""
from __future__ import annotations

from collections.abc import Sequence

from ..prefetch import Read
from .format import TensorInfo
from .headers import StreamFile

MiB = 1 << 20
MIN_PIECE = 4 * MiB  # smallest read worth a round trip when files are cut for parallelism
GAP_MERGE = 1 * MiB  # with names=, read through gaps up to this size rather than split a range
# the stream's first reads: this size, doubling every two reads up to the grid's
RAMP_START = 1 * MiB


def cut_reads(files: Sequence[StreamFile], wanted: Sequence[Sequence[TensorInfo]],
              piece: int, probe: int, streams: int = 1,
              whole_stream: bool = True) -> list[list[Read]]:
    """Cut each file's needed bytes into reads on a fixed grid: [0, probe), then steps.

    A fixed grid (rather than tensor-aligned ranges) keeps every read at most ``piece``
    bytes, lets tensors of any size span reads, and makes read ranges (hence cache keys)
    the same on every load with the same settings. The stream's first reads ramp up from
    ``RAMP_START``: all ``streams`` requests start together and share the link, so the
    first tensor arrives after ~``streams`` times its read's size; small first reads let
    the consumer start early, and the grid goes on from where they end. A sliver under a
    quarter step left at the end of a span joins the read before it (within ``piece``):
    a request of its own would cost a round trip for almost nothing.

    The step spreads the bytes that can be in flight at once over the ``streams``
    requests (:func:`grid_step`): with ``whole_stream`` (no file window: reads run ahead
    into later files) the bytes of the whole stream, else each file's own. Every request
    costs milliseconds of CPU in the client, the proxy and the server (~4 ms per request
    on the benchmark's 2-core machine), so a 512 MiB model in 4 files reads in ~16 MiB
    ranges rather than each file's 4 MiB: a third of the requests, as many in flight.
    """
    out: list[list[Read]] = []
    index = 0
    ramp: list[int] | None = None  # the ramp's cut points, in the stream's first file with data
    spans = [intervals(tensors) for tensors in wanted]
    total = sum(b - a for file_spans in spans for a, b in file_spans)
    for fi, (f, file_spans) in enumerate(zip(files, spans, strict=True)):
        in_flight = total if whole_stream else sum(b - a for a, b in file_spans)
        step = grid_step(in_flight, piece, streams)
        origin = probe  # the grid's first point; in the first file, where the ramp ends
        reads: list[Read] = []
        for a, b in file_spans:
            pos = a
            while pos < b:
                if ramp is None:
                    ramp = _ramp(max(pos, probe), step)
                    origin = ramp[-1] if ramp else probe
                if index and not reads:
                    ramp = []  # a later file: the stream is already under way
                while ramp and ramp[0] <= pos:
                    ramp.pop(0)
                if pos < probe:
                    end = min(b, probe)
                elif ramp:
                    end = min(b, ramp[0])
                else:
                    end = cut_end(pos, origin + ((pos - origin) // step + 1) * step, b, step, piece)
                reads.append(Read(index, fi, f.entry.path, pos, end))
                index += 1
                pos = end
        out.append(reads)
    return out


def cut_end(pos: int, grid_end: int, b: int, step: int, piece: int) -> int:
    """Where a read from ``pos`` in a span ending at ``b`` ends: at ``grid_end`` (or ``b``),
    unless that leaves a sliver under a quarter step, which joins this read (within
    ``piece``): a request of its own would cost a round trip for almost nothing."""
    end = min(b, grid_end)
    return b if b - end < step // 4 and b - pos <= piece else end


def grid_step(in_flight: int, piece: int, streams: int) -> int:
    """The read size that spreads ``in_flight`` bytes over ``streams`` requests, within
    [MIN_PIECE, piece]: smaller reads would pay a round trip and a request's CPU for too
    few bytes, larger ones would exceed the memory-derived maximum."""
    return max(min(piece, MIN_PIECE), min(piece, -(-in_flight // max(1, streams))))


def _ramp(pos: int, step: int) -> list[int]:
    """Cut points from ``pos`` on for reads of 1, 1, 2, 2, 4, 4 MiB ... while below ``step``."""
    cuts, size, n = [], RAMP_START, 0
    while size < step:
        pos += size
        cuts.append(pos)
        n += 1
        if n % 2 == 0:
            size *= 2
    return cuts


def intervals(tensors: Sequence[TensorInfo]) -> list[tuple[int, int]]:
    """The byte spans of ``tensors`` (any order; empty ones left out), by offset, reading
    through gaps up to GAP_MERGE: a GET for the gap's bytes costs less than a round trip."""
    merged: list[list[int]] = []
    for t in sorted((t for t in tensors if t.nbytes), key=lambda t: t.start):
        if merged and t.start - merged[-1][1] <= GAP_MERGE:
            merged[-1][1] = max(merged[-1][1], t.end)
        else:
            merged.append([t.start, t.end])
    return [(a, b) for a, b in merged]
