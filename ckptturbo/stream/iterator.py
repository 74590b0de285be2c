"""Stream safetensors models from any fsspec location, fast and in bounded memory.

Reading safetensors from an object store the way local code does (mmap, then touch each
tensor) turns into thousands of small scattered reads that each pay a round trip. Here
the headers of all files are fetched first, in parallel, with one ranged GET each (sized
to hold the whole header of almost every file; a second GET only for larger ones, and the
rest of the first GET is kept as data, so no byte is read twice). The headers give the
exact order in which the consumer will want every byte, so a read plan cuts the data into
large ranges (coalescing neighbouring tensors; the stream's first ranges small, so the
first tensors come early) and :class:`~ckptturbo.prefetch.Prefetcher` keeps the next
ranges in flight, ``streams`` at a time, as far ahead as ``memory_limit`` allows (not a
number of files: a file window would stop reads while the consumer lags, far under the
budget). Tensors are yielded as soon as their bytes are in.

Yielded tensors are always fresh allocations of exactly their own size, never views of a
read buffer: the caller may keep, modify or free them independently (no buffer-reuse
corruption, and one small tensor never pins a 32 MiB range in memory). On the CPU they
are filled by the I/O threads as each range arrives (:class:`~.device.Scatter`), so the
consumer's thread only yields; for CUDA each range lands in pinned memory on its I/O
thread and the consumer's thread queues copies to the device, and across ranks it copies
out of the ranges (:class:`~.device.Destination`). Tensors larger than a range (or than the
whole memory limit) are assembled piece by piece straight into their destination.
``views=True`` (for consumers that copy each tensor at once, such as vLLM's weight
loaders) reads each range into a buffer of its own and yields views of it instead
wherever a tensor lies inside one, so each byte is copied once, by the consumer.

Order: files in index/listing order (shard names sort naturally), tensors within a file
by offset. Byte order: safetensors is little-endian, as are the hosts torch runs on.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import replace
from typing import Any, Protocol

import torch

from ..errors import MismatchError
from ..prefetch import MemoryBudget, Prefetcher, Read
from ..store import all_results
from .cache import DiskCache
from .device import Destination, Scatter, covering, land
from .distributed import ReadOnceFeed, describe_collectively, stream_group
from .format import TensorInfo, torch_dtype
from .headers import (
    GROUP_HEADER_PROBE,
    HEADER_PROBE,
    StreamFile,
    fetch_header,
    tail_heads,
    tail_slices,
)
from .options import StreamOptions
from .ranges import cut_reads
from .source import ByteSource, FileEntry, list_files, open_store

log = logging.getLogger(__name__)


class Waiter(Protocol):
    """What the iterator needs of whoever fills its reads (Prefetcher or ReadOnceFeed)."""

    def at_file(self, file_index: int) -> None: ...
    def wait(self, read: Read) -> bytes | bytearray | memoryview: ...
    def release(self, read: Read) -> None: ...
    def close(self) -> None: ...


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

    def __init__(self, spec: str | Sequence[str], options: StreamOptions | None = None,
                 **kwargs: Any) -> None:
        began = time.monotonic()
        opts = replace(options or StreamOptions(), **kwargs)
        self.options = opts
        self.device = torch.device(opts.device)
        self.dtype = opts.dtype
        self._group, world = stream_group(opts.process_group)
        self._dist = world > 1
        if not isinstance(spec, str) and not spec:
            raise ValueError(
                "stream_safetensors needs a URL, a directory or a non-empty list of URLs")
        first = spec if isinstance(spec, str) else spec[0]
        prof = opts.settings(first)
        self.profile = prof
        # Reads are at most a quarter of the budget so several fly at once; an eighth when
        # distributed, where the broadcaster holds two more (see distributed).
        self.piece = max(1, min(prof.chunk_size, prof.memory_limit // (8 if self._dist else 4)))
        self.probe = min(GROUP_HEADER_PROBE if self._dist else HEADER_PROBE, self.piece)
        self.budget = MemoryBudget(prof.memory_limit)
        store = open_store(first, opts.storage_options, prof.streams)
        cache = DiskCache(opts.cache_dir, opts.cache_max_bytes) if opts.cache_dir else None
        self.source = ByteSource(store, cache, part_helpers=prof.streams)
        self.stats: dict[str, Any] = {"memory_limit": prof.memory_limit, "streams": prof.streams,
                                      "chunk_size": self.piece, "lookahead": prof.lookahead}
        self.files: list[StreamFile] = []
        self._reads: list[list[Read]] = []
        self._waiter: Waiter | None = None
        self._scatter: Scatter | None = None
        self._started = False
        try:
            if self._dist:
                self.files, weight_map = describe_collectively(
                    self._group,
                    lambda announce: list_files(self.source, spec, opts.cache_validate, announce),
                    self._header, self.source, store.submit, self.budget)
                _check_weight_map(self.files, weight_map, self.source)
            else:
                self.files = self._describe(spec)
            self._wanted = self._select(opts.names)
            self._reads = cut_reads(self.files, self._wanted, self.piece, self.probe, prof.streams,
                                    whole_stream=prof.lookahead is None)
            if self.device.type == "cpu" and not self._dist and not opts.views:
                pairs = zip(self._wanted, self._reads, strict=True)
                self._scatter = Scatter([pair for ts, rs in pairs for pair in covering(ts, rs)])
            self._tails = self._keep_tails()
        except BaseException:
            self.close()
            raise
        self.stats["setup_seconds"] = time.monotonic() - began

    def _describe(self, spec: str | Sequence[str]) -> list[StreamFile]:
        """The files with their headers. A directory's header GETs start while its index
        is read, not after: one round trip less before data flows (20 ms of a 0.6 s
        load through the benchmark's proxy); those of files the index leaves out are
        dropped."""
        store = self.source.store
        started: dict[str, Future[StreamFile]] = {}

        def early(entries: list[FileEntry]) -> None:
            started.update((e.path, store.submit(self._header, e)) for e in entries)

        try:
            entries, weight_map = list_files(self.source, spec, self.options.cache_validate, early)
            files = all_results([started.pop(e.path) if e.path in started
                                 else store.submit(self._header, e) for e in entries])
        finally:
            _drop_unused(started.values(), self.budget)
        _check_weight_map(files, weight_map, self.source)
        return files

    def _header(self, entry: FileEntry) -> StreamFile:
        """``entry`` with its header, from one GET of ``probe`` bytes (its data tail kept)."""
        return fetch_header(self.source, entry, self.probe, self.options.max_header_size,
                            self.budget)

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
        for f, tensors in zip(self.files, selected, strict=True):
            for t in tensors:
                torch_dtype(t.dtype, f"{self.source.url_of(f.entry)}: tensor {t.name!r}")
        return selected

    def _keep_tails(self) -> dict[int, bytes]:
        """Serve the reads inside each kept header-GET tail from its bytes (see headers).

        Alone, those reads are filled now; distributed, the rank that made the header
        GET heads them and forwards these bytes (returned by read index, still reserved;
        every rank knows which rank heads each: ``tail_heads``)."""
        tails: dict[int, bytes] = {}
        data: bytes | bytearray
        for f, reads in zip(self.files, self._reads, strict=True):
            for r, data in tail_slices(f, reads, self.source, self.budget):
                if self._dist:
                    tails[r.index] = data
                else:
                    r.reserved = True  # its share of the tail's reservation
                    if self._scatter is not None:
                        data = self._scatter.deliver(r, data)
                    elif self.options.views:  # a view needs memory of its own (see _view);
                        data = bytearray(data)  # a tail is at most one header GET's probe
                    r.fill(data)
        return tails

    def start(self) -> SafetensorsStream:
        """Start reading now rather than at the first ``next()``, so that bytes arrive while
        the caller prepares where they go (vLLM builds the model meanwhile). Distributed,
        every rank must call it at the same point of the stream's life."""
        if self._waiter is None and not self._started:
            self._feed()
        return self

    def _feed(self) -> Waiter:
        """Start filling the reads: from storage alone, or once across the group's ranks."""
        if self._waiter is not None:
            return self._waiter
        flat = [r for reads in self._reads for r in reads]
        if self._dist:
            feed = ReadOnceFeed(self._group, flat, self.source, self.budget, self.piece,
                                self.profile.streams, self._tails,
                                tail_heads(self.files, self._reads))
            self._waiter = feed
            feed.start()
            return feed
        deliver = (self._scatter.deliver if self._scatter is not None
                   else land if self.device.type == "cuda" else None)
        fetch = (self.source.fetch_parts if deliver is not None
                 else self.source.fetch_writable if self.options.views else self.source.fetch)
        prefetcher = Prefetcher(flat, fetch, self.source.store.submit, self.budget,
                                streams=self.profile.streams, lookahead=self.profile.lookahead,
                                deliver=deliver)
        self._waiter = prefetcher
        prefetcher.start()
        return prefetcher

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        if self._started:
            raise RuntimeError("a SafetensorsStream can be iterated once")
        self._started = True
        return self._generate()

    def _generate(self) -> Iterator[tuple[str, torch.Tensor]]:
        began = time.monotonic()
        dest = Destination(self.device, self.budget, self.piece)
        try:
            waiter = self._feed()
            count = nbytes = 0
            for fi, (f, tensors) in enumerate(zip(self.files, self._wanted, strict=True)):
                waiter.at_file(fi)
                reads, ri = self._reads[fi], 0
                for t in tensors:
                    if self._scatter is not None:
                        ri = self._pass(t, reads, ri, waiter)
                        buf = self._scatter.take(count)
                    else:
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

    def _pass(self, t: TensorInfo, reads: list[Read], ri: int, waiter: Waiter) -> int:
        """Wait for the reads that fill ``t`` (Scatter copied them on arrival); release
        those it ends."""
        while ri < len(reads) and reads[ri].start < t.end:
            r = reads[ri]
            waiter.wait(r)
            if r.end > t.end:
                break
            waiter.release(r)
            ri += 1
        return ri

    def _assemble(self, t: TensorInfo, reads: list[Read], ri: int, waiter: Waiter,
                  dest: Destination) -> tuple[torch.Tensor, int]:
        if self.options.views and self.device.type == "cpu":
            view, ri = self._view(t, reads, ri, waiter)
            if view is not None:
                return view, ri
        buf = dest.new(t.nbytes)
        pos = t.start
        while pos < t.end:
            r = reads[ri]
            held = waiter.wait(r)
            if isinstance(held, torch.Tensor) and self.device.type != "cuda":
                held = held.numpy()  # a views=True read (fetch_writable), copied on the CPU
            data = held if isinstance(held, torch.Tensor) else memoryview(held)
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

    def _view(self, t: TensorInfo, reads: list[Read], ri: int,
              waiter: Waiter) -> tuple[torch.Tensor | None, int]:
        """``t`` as a view of the one read holding it; None if it spans reads, or if that
        read's buffer is immutable (bytes from the cache or a header GET's tail: a view
        would be a read-only tensor), to be copied instead."""
        while ri < len(reads) and reads[ri].end <= t.start:  # reads of skipped gaps only
            waiter.wait(reads[ri])
            waiter.release(reads[ri])
            ri += 1
        if not t.nbytes or ri == len(reads) or reads[ri].end < t.end:
            return None, ri
        r = reads[ri]
        held, at = waiter.wait(r), t.start - r.start
        if isinstance(held, torch.Tensor):
            view = held[at:at + t.nbytes]  # keeps the read's bytes alive
        elif memoryview(held).readonly:
            return None, ri
        else:
            view = torch.frombuffer(held, dtype=torch.uint8, count=t.nbytes, offset=at)
        if r.end == t.end:
            waiter.release(r)
            ri += 1
        return view, ri

    def close(self) -> None:
        """Stop prefetching and free buffers; safe to call more than once."""
        if self._waiter is not None:
            self._waiter.close()
        self._waiter = None
        if self._scatter is not None:
            self._scatter.close()
        self.source.close()
        self.stats.update(self.source.counters(), peak_bytes_held=self.budget.peak,
                          files=len(self.files))

    def __enter__(self) -> SafetensorsStream:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _drop_unused(futures: Iterable[Future[StreamFile]], budget: MemoryBudget) -> None:
    """Wait for header GETs whose files the stream does not read; return their kept tails."""
    for fut in futures:
        try:
            f = fut.result()
        except Exception:  # noqa: BLE001 - a file the index leaves out need not even be valid
            continue
        if f.tail:
            budget.release(len(f.tail))


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


def stream_safetensors(url_or_dir_or_list: str | Sequence[str],
                       options: StreamOptions | None = None, **kwargs: Any) -> SafetensorsStream:
    """Yield ``(name, tensor)`` for every tensor of a safetensors model, streaming.

    ``url_or_dir_or_list``: one ``.safetensors`` file, a directory/prefix (with a
    ``model.safetensors.index.json`` or just ``*.safetensors`` files), or a list of file
    URLs. Options are the fields of :class:`StreamOptions`, as keywords (``device``,
    ``dtype``, ``lookahead``, ``streams``, ``chunk_size``, ``memory_limit``,
    ``storage_options``, ``process_group``, ``names``, ``profile``, ``cache_dir``,
    ``cache_max_bytes``, ``cache_validate``, ``views``, ...) or as one ``options`` object.
    Settings left as None come from ``profile`` ("model-load", "small-files", a dict, or
    None for the profile :func:`~ckptturbo.stream.calibrate.calibrate` saved for this
    endpoint, else "model-load": 32 MiB ranges, 32 streams, memory_limit 2 GiB, reads as
    far ahead as the memory limit allows; ``lookahead=N`` also caps it at N files).
    ``process_group`` (gloo or NCCL, such as tensor-parallel workers' group): every rank
    of the group gets every tensor while storage serves each byte once, forwarded in host
    memory over gloo (see ``distributed``); all ranks must pass the same arguments
    and consume the whole stream. ``cache_dir`` enables the local-disk cache (see
    ``cache``): a later load with the same settings makes no request at all. Pickle
    checkpoints (.bin/.pt/...) are refused with FormatError.

    Listing and headers are fetched when this is called; bytes flow from ``.start()`` or
    the first ``next()``. The returned object is an iterator with ``.stats``, ``.start()``
    and ``.close()``.
    """
    return SafetensorsStream(url_or_dir_or_list, options, **kwargs)
