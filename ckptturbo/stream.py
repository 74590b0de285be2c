"""Stream safetensors models from any fsspec location, fast and in bounded memory.

Reading safetensors from an object store the way local code does (mmap, then touch each
tensor) turns into thousands of small scattered reads that each pay a round trip. Here
the headers of all files are fetched first, in parallel, with one ranged GET each (sized
to hold the whole header of almost every file; a second GET only for larger ones, and the
rest of the first GET is kept as data, so no byte is read twice). The headers give the
exact order in which the consumer will want every byte, so a read plan cuts the data into
large ranges (coalescing neighbouring tensors) and :class:`~ckptturbo.prefetch.Prefetcher`
keeps the next ranges in flight, ``streams`` at a time, ``lookahead`` files ahead, within
``memory_limit``. Tensors are yielded as soon as their bytes are in, and each range is
dropped once its last tensor has been copied out.

Yielded tensors are always fresh allocations of exactly their own size, never views of a
read buffer: the caller may keep, modify or free them independently (no buffer-reuse
corruption, and one small tensor never pins a 32 MiB range in memory). The copy out of
the range buffer happens in the consumer's thread, at memory speed, while the network
keeps filling the next ranges. Tensors larger than a range (or than the whole memory
limit) are assembled piece by piece straight into their destination.

Order: files in index/listing order (shard names sort naturally), tensors within a file
by offset. Byte order: safetensors is little-endian, as are the hosts torch runs on.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from .cache import DiskCache
from .errors import FormatError, MismatchError
from .prefetch import MemoryBudget, Prefetcher, Read
from .profiles import StreamProfile, calibrate, endpoint_key_for, resolve
from .safetensors_format import (DEFAULT_MAX_HEADER_SIZE, Header, TensorInfo, header_length,
                                 parse_header, refuse_pickle_name, torch_dtype)
from .stream_source import ByteSource, FileEntry, list_files, open_store

log = logging.getLogger(__name__)

MiB = 1 << 20
HEADER_PROBE = 1 * MiB  # first GET per file: holds the whole header of almost every model
MIN_PIECE = 4 * MiB  # smallest read worth a round trip when files are cut for parallelism
GAP_MERGE = 1 * MiB  # with names=, read through gaps up to this size rather than split a range

__all__ = ["stream_safetensors", "safe_open", "calibrate", "SafetensorsStream", "SafeOpen",
           "TensorSlice", "StreamProfile"]


@dataclass
class StreamFile:
    """A file of the stream with its parsed header and, when kept, its first GET's data tail."""

    entry: FileEntry
    header: Header
    raw: bytes  # the header's JSON bytes, as stored (rank 0 sends them to the others)
    tail: bytes | None = None  # bytes [data_start, probe_end) from the header GET

    @property
    def probe_end(self) -> int:
        return self.header.data_start + len(self.tail or b"")


def fetch_header(source: ByteSource, entry: FileEntry, probe: int, max_header_size: int,
                 budget: MemoryBudget | None = None) -> StreamFile:
    """One ranged GET of the first ``probe`` bytes; a second only if the header is longer.

    Headers are cached (keyed by the object's identity) when the source has a cache, so a
    second load parses them without any request. With a ``budget``, a kept tail stays
    reserved in it: the caller serves reads from it and releases what it does not use.
    """
    cached = source.cached_header(entry)
    if cached is not None:
        return StreamFile(entry, parse_header(cached, source.url_of(entry), file_size=entry.size),
                          cached)
    first = min(probe, entry.size)
    if budget is not None:
        budget.acquire(first)
    try:
        head = source.get(entry, 0, first, cacheable=False)
        n = header_length(head[:8], source.url_of(entry), file_size=entry.size,
                          max_header_size=max_header_size)
        if 8 + n <= len(head):
            raw, tail = head[8:8 + n], head[8 + n:]
        else:
            raw, tail = head[8:] + source.get(entry, len(head), 8 + n, cacheable=False), b""
        header = parse_header(bytes(raw), source.url_of(entry), file_size=entry.size)
    finally:
        if budget is not None:
            budget.release(first)
    source.remember_header(entry, bytes(raw))
    # Keep the data tail only while all kept tails fit in a quarter of the budget (reserved
    # now, so they count like any other bytes held); otherwise drop it and read it again.
    if tail and budget is not None and (budget.held + len(tail) > budget.limit // 4
                                        or not budget.try_acquire(len(tail))):
        tail = b""
    return StreamFile(entry, header, bytes(raw), bytes(tail) if tail else None)


def plan_reads(files: Sequence[StreamFile], wanted: Sequence[Sequence[TensorInfo]],
               piece: int, probe: int, streams: int = 1) -> list[list[Read]]:
    """Cut each file's needed bytes into reads on a fixed grid: [0, probe), then ``piece``s.

    A fixed grid (rather than tensor-aligned ranges) keeps every read at most ``piece``
    bytes, lets tensors of any size span reads, and makes read ranges (hence cache keys)
    the same on every load with the same settings.
    """
    out, index = [], 0
    for fi, (f, tensors) in enumerate(zip(files, wanted)):
        # a file smaller than streams x piece is cut finer, down to MIN_PIECE, so that even
        # one small file keeps several requests in flight
        data = f.header.file_size - f.header.data_start
        step = max(min(piece, MIN_PIECE), min(piece, -(-data // max(1, streams))))
        reads = []
        for a, b in _intervals(tensors):
            pos = a
            while pos < b:
                cut = probe if pos < probe else probe + ((pos - probe) // step + 1) * step
                end = min(b, cut)
                reads.append(Read(index, fi, f.entry.path, pos, end))
                index += 1
                pos = end
        out.append(reads)
    return out


def _intervals(tensors: Sequence[TensorInfo]) -> list[tuple[int, int]]:
    merged: list[list[int]] = []
    for t in sorted((t for t in tensors if t.nbytes), key=lambda t: t.start):
        if merged and t.start - merged[-1][1] <= GAP_MERGE:
            merged[-1][1] = max(merged[-1][1], t.end)
        else:
            merged.append([t.start, t.end])
    return [(a, b) for a, b in merged]


class _Destination:
    """Allocates yielded tensors and copies range bytes into them (CPU, or CUDA via pinned)."""

    def __init__(self, device: torch.device, budget: MemoryBudget, piece: int) -> None:
        self.device = device
        self.stager = None
        if device.type == "cuda":
            from .stream_cuda import PinnedStager

            self.stager = PinnedStager(device, min(piece, 16 * MiB), budget)

    def new(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def copy(self, src: memoryview, dst: torch.Tensor, offset: int) -> None:
        if self.stager is not None:
            self.stager.copy(src, dst, offset)
        elif len(src):
            dst.numpy()[offset:offset + len(src)] = np.frombuffer(src, dtype=np.uint8)

    def finish(self) -> None:
        if self.stager is not None:
            self.stager.finish()

    def close(self) -> None:
        if self.stager is not None:
            self.stager.close()


def _convert(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """Cast floating-point weights only: integer, bool and FP8 (quantised) tensors keep theirs."""
    if dtype is None or not t.is_floating_point() or t.element_size() < 2 or t.dtype == dtype:
        return t
    return t.to(dtype)


class SafetensorsStream:
    """Iterator of ``(name, tensor)`` over safetensors files; see :func:`stream_safetensors`.

    ``stats`` reports what the stream did: ``bytes_fetched``/``requests`` from the object
    store, ``cache_hits``, ``peak_bytes_held`` (never above ``memory_limit``), and more.
    """

    def __init__(self, spec: str | Sequence[str], *, device: str | torch.device = "cpu",
                 dtype: torch.dtype | None = None, lookahead: int | None = None,
                 streams: int | None = None, chunk_size: int | None = None,
                 memory_limit: int | None = None, storage_options: dict[str, Any] | None = None,
                 process_group: Any = None, names: Sequence[str] | None = None,
                 profile: str | StreamProfile | dict[str, Any] | None = None,
                 cache_dir: str | None = None, cache_max_bytes: int | None = None,
                 cache_validate: bool = False, max_header_size: int = DEFAULT_MAX_HEADER_SIZE,
                 profiles_file: str | None = None) -> None:
        began = time.monotonic()
        self.device = torch.device(device)
        self.dtype = dtype
        self._group = process_group
        self._dist = process_group is not None and _world_size(process_group) > 1
        if not isinstance(spec, str) and not spec:
            raise ValueError("stream_safetensors needs a URL, a directory or a non-empty list of URLs")
        first = spec if isinstance(spec, str) else spec[0]
        prof = resolve(profile, endpoint_key_for(first, storage_options), profiles_file)
        prof = replace(prof, **{k: v for k, v in dict(
            chunk_size=chunk_size, streams=streams, lookahead=lookahead,
            memory_limit=memory_limit).items() if v is not None})
        if min(prof.chunk_size, prof.streams, prof.lookahead) < 1 or prof.memory_limit < 4096:
            raise ValueError(f"invalid stream settings {prof} (memory_limit must be >= 4096)")
        self.profile = prof
        # Reads are at most a quarter of the budget so several fly at once; an eighth when
        # distributed, where the broadcaster holds two more (see stream_dist).
        self.piece = max(1, min(prof.chunk_size, prof.memory_limit // (8 if self._dist else 4)))
        self.probe = min(HEADER_PROBE, self.piece)
        self.budget = MemoryBudget(prof.memory_limit)
        store = open_store(first, storage_options, prof.streams)
        cache = DiskCache(cache_dir, cache_max_bytes) if cache_dir else None
        self.source = ByteSource(store, cache)
        self.stats: dict[str, Any] = {"memory_limit": prof.memory_limit, "streams": prof.streams,
                                      "chunk_size": self.piece, "lookahead": prof.lookahead}
        self.files: list[StreamFile] = []
        self._reads: list[list[Read]] = []
        self._feeder: Any = None
        self._prefetcher: Prefetcher | None = None
        self._started = False
        try:
            if self._dist:
                from .stream_dist import describe_collectively

                self.files = describe_collectively(self, spec, cache_validate, max_header_size)
            else:
                self.files = self._describe(spec, cache_validate, max_header_size)
            self._wanted = self._select(names)
            self._reads = plan_reads(self.files, self._wanted, self.piece, self.probe,
                                     prof.streams)
            self._keep_tails()
        except BaseException:
            self.close()
            raise
        self.stats["setup_seconds"] = time.monotonic() - began

    def _describe(self, spec: str | Sequence[str], cache_validate: bool,
                  max_header_size: int) -> list[StreamFile]:
        entries, weight_map = list_files(self.source, spec, cache_validate)
        budget = self.budget
        files = self.source.store.map(
            lambda e: fetch_header(self.source, e, self.probe, max_header_size, budget), entries)
        _check_weight_map(files, weight_map, self.source)
        return files

    def _select(self, names: Sequence[str] | None) -> list[list[TensorInfo]]:
        """The tensors to yield, per file; fails before any data moves if one cannot be."""
        if names is None:
            selected = [list(f.header.tensors) for f in self.files]
        else:
            wanted = set(names)
            found = {t.name for f in self.files for t in f.header.tensors}
            missing = sorted(wanted - found)
            if missing:
                raise MismatchError(f"tensors not in the checkpoint: {missing[:10]}"
                                    f"{' ...' if len(missing) > 10 else ''}")
            selected = [[t for t in f.header.tensors if t.name in wanted] for f in self.files]
        for f, tensors in zip(self.files, selected):
            for t in tensors:
                torch_dtype(t.dtype, f"{self.source.url_of(f.entry)}: tensor {t.name!r}")
        return selected

    def _keep_tails(self) -> None:
        """Serve the reads inside each kept header-GET tail from its bytes (see fetch_header)."""
        if self._dist:
            return  # stream_dist keeps them on rank 0, which heads those reads
        for f, reads in zip(self.files, self._reads):
            for r, data in self.tail_slices(f, reads):
                r.reserved = True  # its share of the tail's reservation
                r.fill(data)

    def tail_slices(self, f: StreamFile, reads: Sequence[Read]) -> list[tuple[Read, bytes]]:
        """The leading reads of ``f`` that its header GET already holds, with their bytes.

        Those ranges go to the cache, the tail's budget reservation shrinks to what they
        use (each returned read keeps its share until it is released), and the file lets
        go of its tail.
        """
        if f.tail is None:
            return []
        served = []
        for r in reads:
            if r.end > f.probe_end:
                break
            lo = r.start - f.header.data_start
            served.append((r, f.tail[lo:lo + r.size]))
            self.source.remember_range(f.entry, r.start, served[-1][1])
        self.budget.release(len(f.tail) - sum(r.size for r, _ in served))
        f.tail = None
        return served

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        if self._started:
            raise RuntimeError("a SafetensorsStream can be iterated once")
        self._started = True
        return self._generate()

    def _generate(self) -> Iterator[tuple[str, torch.Tensor]]:
        began = time.monotonic()
        dest = _Destination(self.device, self.budget, self.piece)
        try:
            flat = [r for reads in self._reads for r in reads]
            if self._dist:
                from .stream_dist import Feeder

                self._feeder = Feeder(self, flat)
                self._feeder.start()
                waiter = self._feeder
            else:
                self._prefetcher = Prefetcher(flat, self.source.fetch, self.source.store.submit,
                                              self.budget, streams=self.profile.streams,
                                              lookahead=self.profile.lookahead)
                self._prefetcher.start()
                waiter = self._prefetcher
            count = nbytes = 0
            for fi, (f, tensors) in enumerate(zip(self.files, self._wanted)):
                waiter.at_file(fi)
                reads, ri = self._reads[fi], 0
                for t in tensors:
                    buf, ri = self._assemble(t, reads, ri, waiter, dest)
                    count, nbytes = count + 1, nbytes + t.nbytes
                    out = buf.view(torch_dtype(t.dtype, f.entry.path)).reshape(t.shape)
                    yield t.name, _convert(out, self.dtype)
                for r in reads[ri:]:
                    waiter.wait(r)
                    waiter.release(r)
            self.stats.update(tensors=count, bytes_yielded=nbytes,
                              stream_seconds=time.monotonic() - began)
            log.debug("streamed %d tensors (%d bytes) from %d files: %s", count, nbytes,
                      len(self.files), self.stats)
        finally:
            dest.close()
            self.close()

    def _assemble(self, t: TensorInfo, reads: list[Read], ri: int, waiter: Any,
                  dest: _Destination) -> tuple[torch.Tensor, int]:
        buf = dest.new(t.nbytes)
        pos = t.start
        while pos < t.end:
            r = reads[ri]
            data = memoryview(waiter.wait(r))
            if r.end <= pos:  # a read that only covers a skipped gap
                waiter.release(r)
                ri += 1
                continue
            end = min(t.end, r.end)
            dest.copy(data[pos - r.start:end - r.start], buf, pos - t.start)
            pos = end
            if r.end <= t.end:
                waiter.release(r)
                ri += 1
        dest.finish()
        return buf, ri

    def close(self) -> None:
        """Stop prefetching and free buffers; safe to call more than once."""
        for part in (self._prefetcher, self._feeder):
            if part is not None:
                part.close()
        self._prefetcher = self._feeder = None
        self.stats.update(self.source.counters(), peak_bytes_held=self.budget.peak,
                          files=len(self.files))
        self.source.close()

    def __enter__(self) -> SafetensorsStream:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _world_size(group: Any) -> int:
    """Size of the group to stream across; it must carry CPU tensors (gloo), which the
    byte forwarding uses whatever ``device`` the tensors end up on."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return 1
    backend = str(dist.get_backend(group))
    if "gloo" not in backend:
        raise ValueError(f"process_group has backend {backend!r}; streaming forwards bytes in host "
                         "memory and needs a gloo group: dist.new_group(backend='gloo')")
    return dist.get_world_size(group)


def _check_weight_map(files: Sequence[StreamFile], weight_map: dict[str, str] | None,
                      source: ByteSource) -> None:
    """An index that names a tensor its file lacks is a broken model: say so up front."""
    if not weight_map:
        return
    by_name = {f.entry.path.rsplit("/", 1)[-1]: f for f in files}
    for name, file in weight_map.items():
        f = by_name.get(file)
        if f is None or name not in f.header.by_name:
            raise MismatchError(f"{source.store.url}: the index maps {name!r} to {file}, "
                                "which does not contain it")


def stream_safetensors(url_or_dir_or_list: str | Sequence[str], *, device: str | torch.device = "cpu",
                       dtype: torch.dtype | None = None, lookahead: int | None = None,
                       streams: int | None = None, chunk_size: int | None = None,
                       memory_limit: int | None = None,
                       storage_options: dict[str, Any] | None = None, process_group: Any = None,
                       names: Sequence[str] | None = None,
                       profile: str | StreamProfile | dict[str, Any] | None = None,
                       cache_dir: str | None = None, cache_max_bytes: int | None = None,
                       **kwargs: Any) -> SafetensorsStream:
    """Yield ``(name, tensor)`` for every tensor of a safetensors model, streaming.

    ``url_or_dir_or_list``: one ``.safetensors`` file, a directory/prefix (with a
    ``model.safetensors.index.json`` or just ``*.safetensors`` files), or a list of file
    URLs. Settings left as None come from ``profile`` ("model-load", "small-files", a
    dict, or None for the profile :func:`calibrate` saved for this endpoint, else
    "model-load": 32 MiB ranges, 32 streams, lookahead 2, memory_limit 2 GiB).
    ``memory_limit`` bounds the bytes the streamer holds (ranges in flight or waiting,
    pinned staging buffers); yielded tensors belong to the caller and are not counted.
    ``dtype`` casts floating-point tensors (not FP8). ``names`` restricts the tensors
    (and the bytes read). ``process_group`` (gloo): every rank of the group gets every tensor
    while storage serves each byte once (see ``stream_dist``); all ranks must pass the
    same arguments and consume the whole stream. ``cache_dir`` enables the local-disk
    cache (see ``cache``): a later load with the same settings makes no request at all;
    ``cache_validate=True`` re-lists the files (one LIST or HEAD each) to catch changed
    objects. Pickle checkpoints (.bin/.pt/...) are refused with FormatError.

    Listing and headers are fetched when this is called; bytes flow while iterating.
    The returned object is an iterator with ``.stats`` and ``.close()``.
    """
    return SafetensorsStream(url_or_dir_or_list, device=device, dtype=dtype, lookahead=lookahead,
                             streams=streams, chunk_size=chunk_size, memory_limit=memory_limit,
                             storage_options=storage_options, process_group=process_group,
                             names=names, profile=profile, cache_dir=cache_dir,
                             cache_max_bytes=cache_max_bytes, **kwargs)

class TensorSlice:
    """Lazy view of one tensor, like safetensors' PySafeSlice: indexing along dim 0 fetches
    only the rows asked for (one ranged read); other dims are indexed after the fetch."""

    def __init__(self, owner: SafeOpen, info: TensorInfo) -> None:
        self._owner = owner
        self._info = info

    def get_shape(self) -> list[int]:
        return list(self._info.shape)

    def get_dtype(self) -> str:
        return self._info.dtype

    def __getitem__(self, index: Any) -> torch.Tensor:
        info, owner = self._info, self._owner
        idx = index if isinstance(index, tuple) else (index,)
        first = idx[0] if idx else Ellipsis
        if not info.shape or first is Ellipsis or not isinstance(first, (int, slice)) \
                or isinstance(first, bool):
            full = owner.get_tensor(info.name)
            return full[index] if idx and idx != (Ellipsis,) else full
        rows = info.shape[0]
        row_bytes = info.nbytes // rows if rows else 0
        if isinstance(first, int):
            i = first + rows if first < 0 else first
            if not 0 <= i < rows:
                raise IndexError(f"index {first} is out of bounds for dimension 0 of size {rows}")
            start, stop, lead = i, i + 1, 0
        else:
            start, stop, step = first.indices(rows)
            if step < 1:
                raise ValueError("get_slice supports only positive steps along dimension 0")
            stop = max(start, stop)
            lead = slice(None, None, step)
        rows_tensor = owner._load(info, info.start + start * row_bytes, info.start + stop * row_bytes,
                                  (stop - start, *info.shape[1:]))
        out = rows_tensor[(lead, *idx[1:])]
        if out.numel() < rows_tensor.numel():
            out = out.clone()  # do not pin the rows that were fetched but not asked for
        return out.to(owner.device)


class SafeOpen:
    """Drop-in for ``safetensors.safe_open`` on any fsspec URL: fetches only what is asked.

    Opening fetches the header (one ranged GET, two for headers over 1 MiB); each
    ``get_tensor`` is one ranged GET (parallel GETs of ``chunk_size`` for large tensors);
    ``get_slice(name)[a:b]`` fetches only rows a..b. Small tensors inside the first GET
    are served from its bytes.
    """

    def __init__(self, url: str, framework: str = "pt", device: str | torch.device = "cpu",
                 storage_options: dict[str, Any] | None = None, *, chunk_size: int = 32 * MiB,
                 streams: int = 16, max_header_size: int = DEFAULT_MAX_HEADER_SIZE) -> None:
        if framework not in ("pt", "torch"):
            raise FormatError(f"framework {framework!r} is not supported; use 'pt'")
        refuse_pickle_name(url)
        self.device = torch.device(device)
        self.chunk_size = chunk_size
        self._source = ByteSource(open_store(url, storage_options, streams), None)
        try:
            store = self._source.store
            info = store.info(store.root)
            entry = FileEntry(info.path, info.size, info.mtime)
            self._source.register([entry])
            self._file = fetch_header(self._source, entry, HEADER_PROBE, max_header_size)
        except BaseException:
            self._source.close()
            raise
        self._entry = entry

    def keys(self) -> list[str]:
        return sorted(self._file.header.by_name)

    def offset_keys(self) -> list[str]:
        return [t.name for t in self._file.header.tensors]

    def metadata(self) -> dict[str, str] | None:
        return self._file.header.metadata

    def _info(self, name: str) -> TensorInfo:
        try:
            return self._file.header.by_name[name]
        except KeyError:
            raise MismatchError(f"{self._source.url_of(self._entry)} has no tensor {name!r}") from None

    def get_tensor(self, name: str) -> torch.Tensor:
        info = self._info(name)
        return self._load(info, info.start, info.end, info.shape).to(self.device)

    def get_slice(self, name: str) -> TensorSlice:
        return TensorSlice(self, self._info(name))

    def _load(self, info: TensorInfo, start: int, end: int, shape: Sequence[int]) -> torch.Tensor:
        buf = torch.empty(end - start, dtype=torch.uint8)
        out = buf.numpy()
        f = self._file
        if f.tail is not None and end <= f.probe_end:
            lo = start - f.header.data_start
            out[:] = np.frombuffer(f.tail, dtype=np.uint8, count=end - start, offset=lo)
        elif end > start:
            def piece(a: int) -> None:
                b = min(end, a + self.chunk_size)
                out[a - start:b - start] = np.frombuffer(self._source.get(self._entry, a, b,
                                                                          cacheable=False), np.uint8)
            self._source.store.map(piece, range(start, end, self.chunk_size))
        return buf.view(torch_dtype(info.dtype, self._source.url_of(self._entry))).reshape(tuple(shape))

    @property
    def stats(self) -> dict[str, int]:
        return self._source.counters()

    def close(self) -> None:
        self._source.close()

    def __enter__(self) -> SafeOpen:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def safe_open(url: str, framework: str = "pt", device: str | torch.device = "cpu",
              storage_options: dict[str, Any] | None = None, **kwargs: Any) -> SafeOpen:
    """Open one safetensors file at a URL or path, like ``safetensors.safe_open``."""
    return SafeOpen(url, framework, device, storage_options, **kwargs)
