"""Read once across ranks: each range is read from storage by one rank and chain-broadcast.

When N ranks load the same model, reading it N times makes storage the bottleneck and
multiplies the bill. Here rank 0 lists the files and fetches the headers (once), and
sends the description to the others; every rank then computes the same read plan, each
range gets one reader (balanced by bytes within each batch, so all ranks read at once),
and :class:`~ckptturbo.broadcast.ChainBroadcaster` forwards it along a chain of all ranks
in pipelined pieces. Every rank yields every tensor, in the same order, while storage
serves each byte once (ranges inside rank 0's header GETs are forwarded from its bytes).

Ranges move in batches of about an eighth of ``memory_limit``: a background thread on
each rank reserves a batch's bytes in the memory budget (waiting for its consumer to free
earlier ranges), starts this rank's reads of the batch in parallel, and runs the
broadcaster for the batch; delivered ranges wait for the consumer like prefetched ones.
The broadcaster's own two assembly buffers are reserved once, up front.

All ranks must pass the same arguments and consume the whole stream: a rank that stops
early leaves the others waiting in the broadcast until its ``timeout`` (CommunicationError).
"""
from __future__ import annotations

import logging
import threading
import warnings
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import torch
import torch.distributed as dist

from . import errors
from .broadcast import ChainBroadcaster, Transfer
from .prefetch import Read
from .safetensors_format import parse_header
from .stream_source import FileEntry

if TYPE_CHECKING:
    from .stream import SafetensorsStream, StreamFile

log = logging.getLogger(__name__)
BROADCAST_INFLIGHT = 2
BROADCAST_TIMEOUT = 300.0


def describe_collectively(stream: SafetensorsStream, spec: str | Sequence[str], cache_validate: bool,
                          max_header_size: int) -> list[StreamFile]:
    """Rank 0 lists and reads headers; the others get its result (or its error)."""
    from .stream import StreamFile

    group = stream._group
    payload: dict[str, Any]
    files: list[StreamFile] = []
    if dist.get_rank(group) == 0:
        try:
            files = stream._describe(spec, cache_validate, max_header_size)
            payload = {"files": [(f.entry.path, f.entry.size, f.entry.mtime, f.raw) for f in files]}
        except Exception as exc:  # noqa: BLE001 - sent to the other ranks, then re-raised
            payload = {"error": (type(exc).__name__, str(exc))}
            obj = [payload]
            dist.broadcast_object_list(obj, group_src=0, group=group)
            raise
    else:
        payload = {}
    obj = [payload]
    dist.broadcast_object_list(obj, group_src=0, group=group)
    payload = obj[0]
    if "error" in payload:
        name, message = payload["error"]
        cls = getattr(errors, name, errors.CkptTurboError)
        if not (isinstance(cls, type) and issubclass(cls, errors.CkptTurboError)):
            cls = errors.CkptTurboError
        raise cls(f"rank 0 failed to describe the model: {message}")
    if files:
        return files
    source = stream.source
    out = []
    for path, size, mtime, raw in payload["files"]:
        entry = FileEntry(path, size, mtime)
        out.append(StreamFile(entry, parse_header(raw, source.url_of(entry), file_size=size), raw))
    source.register([f.entry for f in out])
    return out


def _as_tensor(data: bytes | bytearray | memoryview) -> torch.Tensor:
    """A uint8 tensor over read-only bytes without copying (it is only ever read)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(data, dtype=torch.uint8)


class Feeder:
    """Fills every rank's reads: its own from storage, the others' through the broadcaster."""

    def __init__(self, stream: SafetensorsStream, reads: list[Read]) -> None:
        self.stream = stream
        self.group = stream._group
        self.rank = dist.get_rank(self.group)
        self.world = dist.get_world_size(self.group)
        self.budget = stream.budget
        self.reads = {r.index: r for r in reads}
        self.tails: dict[int, bytes] = {}
        if self.rank == 0:
            self._keep_tails()
        self.static = BROADCAST_INFLIGHT * stream.piece  # the broadcaster's assembly buffers
        # limit = tails (1/4) + broadcaster (2 pieces = 1/4) + CUDA staging (<= 1/4)
        #         + one batch delivered and its own reads raw (<= 2 x 1/8)
        self.batch_bytes = max(stream.piece, stream.budget.limit // 8)
        self.batches = self._batches(reads)
        self.broadcaster = ChainBroadcaster(self.group, piece_size=min(8 << 20, stream.piece),
                                            max_inflight=BROADCAST_INFLIGHT,
                                            timeout=BROADCAST_TIMEOUT)
        self._closed = False
        self._raw: dict[int, Any] = {}
        self._thread = threading.Thread(target=self._run, name="ckptturbo-stream-feeder", daemon=True)

    def _keep_tails(self) -> None:
        """Rank 0 heads the reads inside its header GETs and serves them from those bytes."""
        stream = self.stream
        for f, reads in zip(stream.files, stream._reads):
            for r, data in stream.tail_slices(f, reads):
                self.tails[r.index] = data  # reserved with the tail

    def _batches(self, reads: list[Read]) -> list[list[tuple[Read, int]]]:
        """Consecutive reads of about ``batch_bytes``, each with its reader rank.

        The same on every rank: only rank 0 knows which reads it serves from its header
        GETs (it must head those), so it broadcasts that choice first.
        """
        heads = self._tail_heads()
        batches: list[list[tuple[Read, int]]] = []
        size, load = self.batch_bytes, [0] * self.world
        for r in reads:
            if size + r.size > self.batch_bytes:
                batches.append([])
                size, load = 0, [0] * self.world
            reader = 0 if r.index in heads else min(range(self.world), key=lambda k: (load[k], k))
            load[reader] += r.size
            batches[-1].append((r, reader))
            size += r.size
        return batches

    def _tail_heads(self) -> set[int]:
        obj = [sorted(self.tails)]
        dist.broadcast_object_list(obj, group_src=0, group=self.group)
        return set(obj[0])

    def start(self) -> None:
        self.budget.acquire(self.static)
        self._thread.start()

    def at_file(self, file_index: int) -> None:
        """Batches, not files, bound what is in flight here."""

    def wait(self, read: Read) -> bytes | bytearray | memoryview:
        return read.result()

    def release(self, read: Read) -> None:
        if not read.released:
            read.released = True
            read.data = None
            if read.reserved:
                self.budget.release(read.size)

    def close(self) -> None:
        self._closed = True
        self._thread.join(timeout=5.0)
        if self._thread.is_alive():
            log.warning("stream feeder still waiting on peers after close")
            return
        for read in self.reads.values():
            self.release(read)
        for index in list(self.tails):
            self.budget.release(len(self.tails.pop(index)))
        if self.static:
            self.budget.release(self.static)
            self.static = 0

    def _run(self) -> None:
        try:
            for batch in self.batches:
                if not self._run_batch(batch):
                    return
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            log.debug("stream feeder failed: %s", exc)
            for read in self.reads.values():
                if not read.done.is_set():
                    read.fail(exc)

    def _run_batch(self, batch: list[tuple[Read, int]]) -> bool:
        mine = [r for r, head in batch if head == self.rank and r.index not in self.tails]
        need = sum(r.size for r, _ in batch) + sum(r.size for r in mine)
        if not self.budget.acquire(need, cancelled=lambda: self._closed):
            return False
        for r, _ in batch:
            r.reserved = True
        source = self.stream.source
        for r in mine:
            self._raw[r.index] = source.store.submit(source.fetch, r)
        chain = {r.index: tuple((head + k) % self.world for k in range(self.world))
                 for r, head in batch}
        transfers = [Transfer(r.index, r.size, chain[r.index]) for r, _ in batch]
        self.broadcaster.run(transfers, self._source, self._sink)
        return True

    def _source(self, t: Transfer) -> Iterator[torch.Tensor]:
        if t.tid in self.tails:
            data = self.tails.pop(t.tid)
        else:
            data = self._raw.pop(t.tid).result()
        try:
            yield _as_tensor(data)
        finally:
            self.budget.release(t.nbytes)

    def _sink(self, t: Transfer, buffer: torch.Tensor) -> None:
        copy = buffer.clone()  # the broadcaster's buffer is only valid during this call
        self.reads[t.tid].fill(memoryview(copy.numpy()))
