"""Where a load's bytes go: each DCP read item filled from verified chunks as they arrive.

Chunks arrive in whatever order storage or peers deliver them; an item may need bytes
of many chunks and a chunk may feed many items. Each item becomes a :class:`Job` that
knows its byte span of the stored shard and where those bytes land: straight in the
destination tensor when that is a contiguous tensor receiving the whole shard (no
buffer; a chunk that is exactly one slice of it is even read or received in place), else a
staging buffer on the destination's device, copied out with the shard's strides once the
item is complete.

Chunks arrive as uint8 tensors: host buffers read from storage or forwarded over gloo, or
CUDA buffers forwarded over NCCL. Host bytes bound for a CUDA tensor go through the pinned
ring of :class:`~ckptturbo.staging.DeviceCopier` and are copied asynchronously on a side
stream, so the copy of one chunk overlaps the GETs of the next; the caller's stream waits
for them before an item is handed to the planner. The same code runs on the CPU, where
every copy is a plain one.

A delta shard (``ct.save(..., delta_from=...)``) is read whole, its base and payloads,
into a staging buffer; once complete, its payloads are applied to the base there
(``delta_codec``) before the requested box is copied out, so every load path reconstructs
it without knowing.

Dtypes follow DCP's ``FileSystemReader``: bytes are read as the stored dtype and
``copy_``-ed into the destination, so a bf16 target of an fp32 checkpoint is cast. Objects
reach the planner only in a form proven safe to unpickle (see :func:`safe_object`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import threading
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlanner, ReadItem

from . import delta_codec
from .errors import CkptTurboError, FormatError, MismatchError
from .manifest_records import ShardRecord
from .plan import box_span, overlapping, row_major_strides
from .staging import DeviceCopier


@dataclass(eq=False)
class Job:
    """One read item: its byte span [start, end) of ``shard`` and where those bytes go."""

    item: ReadItem
    shard: ShardRecord
    start: int
    end: int
    target: torch.Tensor | None
    dest: torch.Tensor  # uint8, the span's bytes: the target's own memory, or staging
    dtype: torch.dtype | None = None  # the stored dtype, which dest's bytes hold
    direct: bool = False  # dest is the target's own memory
    missing: int = 0
    done: bool = False
    in_place: set[str] = dataclasses.field(default_factory=set)

    def pieces(self) -> list:
        return overlapping(self.shard.pieces, self.start, self.end)

    def fill(self, cid: str, data: torch.Tensor, copier: DeviceCopier) -> None:
        """Copy this job's bytes of chunk ``cid`` (a uint8 tensor on any device) into dest."""
        for p in self.pieces():
            if p.chunk != cid:
                continue
            lo, hi = max(p.start, self.start), min(p.start + p.length, self.end)
            if cid not in self.in_place:  # else the chunk was read into the destination itself
                src = data[p.offset + lo - p.start: p.offset + hi - p.start]
                dst = self.dest[lo - self.start: hi - self.start]
                if dst.is_cuda and not src.is_cuda:
                    if src.is_pinned():
                        copier.upload(src, dst)
                    else:
                        copier.to_device(src.numpy().data, dst, 0)
                else:
                    dst.copy_(src)
            self.missing -= 1


def item_span(shard: ShardRecord, item: ReadItem) -> tuple[int, int]:
    """The byte range of the shard that holds the requested box (all of it for bytes and for
    a delta shard, whose base and payloads are all needed)."""
    if item.type == LoadItemType.BYTE_IO or shard.deltas:
        return 0, shard.stored_bytes
    return box_span(shard.sizes, shard.nbytes, item.storage_offsets, item.lengths)


def make_job(item: ReadItem, shard: ShardRecord, stored_dtype: torch.dtype | None,
             planner: LoadPlanner) -> Job:
    """A job for one item; refuses a destination whose box differs from the stored one.

    A destination of another dtype gets a staging buffer and is cast when copied into."""
    start, end = item_span(shard, item)
    fqn = item.dest_index.fqn
    if item.type == LoadItemType.BYTE_IO:
        return Job(item, shard, start, end, None, torch.empty(end - start, dtype=torch.uint8))
    target = planner.resolve_tensor(item)
    stored = stored_dtype or target.dtype
    if tuple(target.shape) != tuple(item.lengths):
        raise MismatchError(f"{fqn!r}: destination box {tuple(target.shape)} does not match "
                            f"the stored box {tuple(item.lengths)}")
    full = ((start, end) == (0, shard.nbytes) and tuple(item.lengths) == tuple(shard.sizes)
            and not shard.deltas)
    if full and target.dtype == stored and target.is_contiguous():
        dest = target.reshape(-1).view(torch.uint8)
        return Job(item, shard, start, end, target, dest, stored, direct=True)
    dest = torch.empty(end - start, dtype=torch.uint8, device=target.device)
    return Job(item, shard, start, end, target, dest, stored)


def device_bound(jobs: list[Job]) -> set[str]:
    """Chunks that hold bytes of a job whose destination is on an accelerator."""
    return {p.chunk for job in jobs if job.dest.device.type != "cpu" for p in job.pieces()}


def in_place_targets(jobs: list[Job], chunk_sizes: dict[str, int],
                     device: torch.device) -> dict[str, torch.Tensor]:
    """Chunks that are exactly one slice of one destination tensor on ``device``: their
    bytes land straight in the tensor's memory (read there, or received there from a peer)
    and are verified there, with no buffer or copy. Returns the uint8 slices by chunk."""
    users: dict[str, int] = defaultdict(int)
    for job in jobs:
        for p in job.pieces():
            users[p.chunk] += 1
    targets: dict[str, torch.Tensor] = {}
    for job in jobs:
        if not job.direct or job.dest.device != device or not job.dest.numel():
            continue
        for p in job.shard.pieces:
            if users[p.chunk] == 1 and p.offset == 0 and p.length == chunk_sizes[p.chunk]:
                targets[p.chunk] = job.dest[p.start:p.start + p.length]
                job.in_place.add(p.chunk)
    return targets


def consume(jobs: list[Job], chunks: Iterable[tuple[str, torch.Tensor]],
            finish: Callable[[Job], None], release: Callable[[str], None],
            copier: DeviceCopier) -> None:
    """Copy each verified chunk's bytes into every job that needs them; ``finish`` a job
    once all its bytes are in; ``release`` each chunk as soon as it has been consumed
    (host bytes bound for a device are in the copier's pinned ring by then, or their copy
    is queued from pinned memory that torch's pinned-memory cache keeps until it has run)."""
    waiting: dict[str, list[Job]] = defaultdict(list)
    for job in jobs:
        for p in job.pieces():
            if job not in waiting[p.chunk]:
                waiting[p.chunk].append(job)
            job.missing += 1
        if job.missing == 0:
            finish(job)
    for cid, data in chunks:
        for job in waiting.pop(cid, ()):
            job.fill(cid, data, copier)
            if job.missing == 0:
                finish(job)
        release(cid)
    unfinished = [j.item.dest_index.fqn for j in jobs if not j.done]
    if unfinished:
        raise CkptTurboError(f"load incomplete: no bytes arrived for {unfinished[:5]}")


def finish_job(job: Job, planner: LoadPlanner, allow_pickle: bool, url: str,
               copier: DeviceCopier) -> None:
    """Hand a complete item to DCP's planner (objects only in a form proven safe to unpickle)."""
    job.done = True
    item = job.item
    if item.type == LoadItemType.BYTE_IO:
        data = job.dest.numpy().tobytes()
        payload = io.BytesIO(data) if allow_pickle else safe_object(data, item.dest_index.fqn, url)
        planner.load_bytes(item, payload)
        return
    target = job.target
    assert target is not None
    copier.finish(target.device)  # the caller's stream waits for the copies into dest
    if not job.direct and target.numel():
        shard, first = job.shard, 0
        if shard.deltas:
            value = applied_deltas(job.dest, shard, job.dtype or target.dtype,
                                   f"{item.dest_index.fqn!r} in {url}")
            first = box_span(shard.sizes, shard.nbytes, item.storage_offsets, item.lengths)[0]
            job.dest = value.view(torch.uint8)
        flat = job.dest.view(job.dtype or target.dtype)
        strides = row_major_strides(shard.sizes)
        target.copy_(torch.as_strided(flat, tuple(item.lengths), strides,
                                      first // flat.element_size()))
    planner.commit_tensor(item, target)


def applied_deltas(data: torch.Tensor, shard: ShardRecord, dtype: torch.dtype,
                   where: str) -> torch.Tensor:
    """A delta shard's value, flat: its base (the first ``nbytes`` of ``data``, its stored
    bytes) with each payload after it applied in order, in place."""
    value = data[:shard.nbytes].view(dtype)
    pos = shard.nbytes
    for length in shard.deltas:
        mask, values = delta_codec.split(data[pos:pos + length], value.numel(), dtype, where)
        delta_codec.apply(value, mask, values)
        pos += length
    return value


_SAFE_GLOBALS_LOCK = threading.Lock()


def safe_object(data: bytes, fqn: str, url: str) -> io.BytesIO:
    """The stored object, re-serialised by us after torch's restricted unpickler built it.

    DCP's planner unpickles objects with ``weights_only=False``. The stored bytes are
    loaded here with ``weights_only=True`` (tensors, containers, numbers, strings, whatever
    ``torch.serialization.add_safe_globals`` allows, and ``io.BytesIO``: DCP torch.saves a
    state-dict value that is a BytesIO as the BytesIO object, and rebuilding a byte buffer
    runs no code); then the object is saved again and those bytes go to the planner, so the
    full unpickler never parses a byte that came from storage.
    """
    try:
        with _SAFE_GLOBALS_LOCK:  # safe_globals edits a process-wide list: one at a time
            allowed = torch.serialization.get_safe_globals()
            extra = contextlib.nullcontext() if io.BytesIO in allowed else \
                torch.serialization.safe_globals([io.BytesIO])
            with extra:
                obj = torch.load(io.BytesIO(data), weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any refusal means: not provably safe
        raise FormatError(
            f"object {fqn!r} in {url} needs full unpickling, which can run arbitrary code; "
            f"pass allow_pickle=True to TurboReader only for checkpoints you trust, or "
            f"register its classes with torch.serialization.add_safe_globals ({exc})") from exc
    out = io.BytesIO()
    torch.save(obj, out)
    out.seek(0)
    return out
