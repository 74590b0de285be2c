"""DCP save plans in and out of ``plan.plan_writes``: what the writer's coordinator decides.

DCP's planner already removes replicated items from all but one rank, whole. That keeps
one rank busy writing a replicated embedding while its peers idle. So each rank reports
everything it holds (``Holdings``: a reference to its plan's own item list, which DCP has
already pickled, so it costs nothing on the wire, and the byte size of each item), and the
coordinator splits replicated items into chunk-aligned byte ranges balanced over their
holders (``assign``). Each rank gets back only its own ``Assignment``: rows of (position in
the item list it sent, start, end) and a bitmap of its replicated items, never anyone
else's items. Pure: no I/O, no collectives.

Results travel back the same way: one ``RankResults`` per rank, plain tuples and byte
arrays (``encode_results``/``decode_results``), and fingerprints only when the replica
check is on (``replicas``).
"""
from __future__ import annotations

import json
from bisect import bisect_left
from collections import defaultdict
from typing import Any, NamedTuple

import numpy as np
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

from .chunks import chunk_id
from .errors import CkptTurboError
from .manifest import ShardPart
from .manifest_records import StoredPiece
from .plan import PlanItem, plan_writes

WHOLE = -1  # Assignment row end: the whole object (a BYTE_IO item, written as DCP serialises it)


class Holdings(NamedTuple):
    """What a rank adds to its local save plan: ``items`` is the plan's own list, ``nbytes``
    an int64 per item (0 for objects), ``signature`` names the layout (a coordinator that
    planned the same signatures last time reuses that plan)."""

    items: list[WriteItem]
    nbytes: bytes
    signature: str


class Assignment:
    """What the coordinator tells one rank: the byte ranges it writes (int64 rows of
    (position in its item list, start, end), end ``WHOLE`` for an object), a bitmap of the
    items it holds that other ranks hold too (empty when the replica check is off), the
    signature of the item list the positions refer to, and the id of the plan's save.

    ``held`` is that item list on the rank itself; it never travels. It is filled in by
    the writer at the first ``write_data`` and stays with the assignment, so DCP's plan
    cache (which hands the same assignment back on later saves) brings it along.
    """

    __slots__ = ("rows", "replicated", "signature", "save_id", "held")

    def __init__(self, rows: bytes, replicated: bytes, signature: str, save_id: str = "") -> None:
        self.rows = rows
        self.replicated = replicated
        self.signature = signature
        self.save_id = save_id
        self.held: list[WriteItem] | None = None

    def __reduce__(self) -> tuple:
        return (Assignment, (self.rows, self.replicated, self.signature, self.save_id))

    def marker_id(self, url: str) -> str:
        """The pending-marker id of a save with this plan to ``url``: the same on every
        rank without a word exchanged, and new for every checkpoint even when DCP's plan
        cache hands the same assignment back."""
        return chunk_id(f"{self.save_id}|{url}".encode())[:32]

    def writes(self, items: list[WriteItem]
               ) -> list[tuple[WriteItem, list[tuple[int, int]] | None]]:
        """(item, ranges) for every item this rank writes, ranges None for a whole object."""
        out: dict[int, list[tuple[int, int]] | None] = {}
        for pos, start, end in np.frombuffer(self.rows, dtype=np.int64).reshape(-1, 3).tolist():
            if end == WHOLE:
                out[pos] = None
            else:
                out.setdefault(pos, []).append((start, end))  # type: ignore[union-attr]
        return [(items[pos], ranges) for pos, ranges in out.items()]

    def replicated_items(self, items: list[WriteItem]) -> list[WriteItem]:
        """The items this rank holds with other ranks (what the replica check compares)."""
        if not self.replicated:
            return []
        flags = np.unpackbits(np.frombuffer(self.replicated, dtype=np.uint8), count=len(items))
        return [items[i] for i in np.flatnonzero(flags).tolist()]


def item_nbytes(item: WriteItem) -> int:
    td = item.tensor_data
    assert td is not None, "a tensor's WriteItem carries its tensor_data (BYTE_IO items have none)"
    n = 1
    for s in td.chunk.sizes:
        n *= s
    return n * td.properties.dtype.itemsize


def holdings(plan: SavePlan) -> Holdings:
    """This rank's holdings: its item list (by reference) and the bytes of each item."""
    nbytes = [0 if item.type == WriteItemType.BYTE_IO else item_nbytes(item)
              for item in plan.items]
    return Holdings(plan.items, np.asarray(nbytes, dtype=np.int64).tobytes(),
                    signature(plan.items, nbytes))


def signature(items: list[WriteItem], nbytes: list[int]) -> str:
    doc = [(i.index.fqn, list(i.index.offset or ()), n)
           for i, n in zip(items, nbytes, strict=True)]  # one size per item (holdings)
    return chunk_id(json.dumps(doc).encode())


class _Held:
    """Every rank's items, numbered: item id per (rank, position), holders and positions
    per item id. One pass over all ranks' lists; the rest is array arithmetic."""

    def __init__(self, held: list[Holdings]) -> None:
        ids: dict[MetadataIndex, int] = {}
        self.index: list[MetadataIndex] = []
        self.nbytes: list[int] = []
        self.is_object: list[bool] = []
        self.ids: list[np.ndarray] = []
        for h in held:
            mine = []
            for item in h.items:
                i = ids.get(item.index)
                if i is None:
                    i = ids[item.index] = len(self.index)
                    self.index.append(item.index)
                    self.is_object.append(item.type == WriteItemType.BYTE_IO)
                mine.append(i)
            self.ids.append(np.asarray(mine, dtype=np.int64))
        sizes = np.zeros(len(self.index), dtype=np.int64)
        for rank_ids, h in zip(self.ids, held, strict=True):  # one id array per rank
            sizes[rank_ids] = np.frombuffer(h.nbytes, dtype=np.int64)
        self.nbytes = sizes.tolist()
        counts = np.fromiter((len(m) for m in self.ids), dtype=np.int64, count=len(self.ids))
        flat = np.concatenate(self.ids) if self.ids else np.empty(0, np.int64)
        ranks = np.repeat(np.arange(len(held), dtype=np.int64), counts)
        starts = np.repeat(np.cumsum(counts) - counts, counts)  # each rank's first row in flat
        positions = np.arange(len(flat), dtype=np.int64) - starts
        order = np.argsort(flat, kind="stable")  # by item, then rank
        self.count = np.bincount(flat, minlength=len(self.index))
        bounds = np.cumsum(self.count)[:-1]
        self.holders = [r.tolist() for r in np.split(ranks[order], bounds)]
        self.positions = [p.tolist() for p in np.split(positions[order], bounds)]
        self.key_of = ids

    def position(self, item: int, rank: int) -> int:
        """Where ``item`` is in ``rank``'s list."""
        holders = self.holders[item]
        return self.positions[item][bisect_left(holders, rank)]


def assign(plans: list[SavePlan], held: list[Holdings], *, balance: bool, chunk_size: int,
           weights: list[float] | None, check_replicas: bool, save_id: str) -> list[Assignment]:
    """Every rank's byte ranges: balanced over holders, or DCP's own whole-item choice."""
    world = len(plans)
    table = _Held(held)
    rows: list[list[tuple[int, int, int]]] = [[] for _ in range(world)]
    # Objects (and, without balancing, every item) go where DCP's dedup left them.
    for rank, plan in enumerate(plans):
        for item in plan.items:
            i = table.key_of.get(item.index)
            if i is None:
                raise CkptTurboError(f"TurboWriter.prepare_global_plan: rank {rank}'s plan has "
                                     f"{item.index.fqn!r}, which no rank reported holding")
            if table.is_object[i]:
                rows[rank].append((table.position(i, rank), 0, WHOLE))
            elif not balance:
                rows[rank].append((table.position(i, rank), 0, table.nbytes[i]))
    if balance:
        tensors = [i for i in range(len(table.index)) if not table.is_object[i]]
        keys = {f"{table.index[i].fqn}@{','.join(map(str, table.index[i].offset or ()))}": i
                for i in tensors}
        items = [PlanItem(k, table.nbytes[i], tuple(table.holders[i]) if world > 1 else (0,))
                 for k, i in keys.items()]
        planned = plan_writes(items, world, chunk_size=chunk_size, weights=weights)
        for rank, ranges in enumerate(planned):
            for r in ranges:
                rows[rank].append((table.position(keys[r.key], rank), r.start, r.end))
    out = []
    shared = (table.count > 1) & ~np.asarray(table.is_object, dtype=bool)
    for rank in range(world):
        flags = b""
        if check_replicas:
            flags = np.packbits(shared[table.ids[rank]]).tobytes()
        out.append(Assignment(np.asarray(rows[rank], dtype=np.int64).reshape(-1, 3).tobytes(),
                              flags, held[rank].signature, save_id))
    return out


def held_items(assignment: Assignment,
               stash: tuple[str, list[WriteItem]] | None) -> list[WriteItem]:
    """The item list an assignment's positions refer to, on the rank: the one kept with it
    (DCP's plan cache), or this writer's last local plan when its signature matches."""
    if assignment.held is None:
        if stash is None or stash[0] != assignment.signature:
            raise CkptTurboError(
                "TurboWriter.write_data got a plan made for other items than this rank holds "
                "(a plan cached by another writer object, or the state changed after planning)")
        assignment.held = stash[1]
    return assignment.held


class RankResults(NamedTuple):
    """One rank's write results, in one object: ``parts`` holds, per item it stored,
    (fqn, offsets, kind, nbytes, written, reused, pieces) with pieces int64 rows of
    (start, length, chunk number, offset in chunk) into ``chunks`` (ids) and ``sizes``
    (int64 bytes of each); ``prints`` int64 (key, fingerprint) pairs for the replica check;
    ``save_id`` names this rank's pending marker."""

    rank: int
    save_id: str
    chunks: tuple[str, ...]
    sizes: bytes
    parts: tuple[tuple[str, tuple[int, ...], str, int, int, int, bytes], ...]
    prints: bytes


RESULTS_FQN = "__ckptturbo_results__"  # the one WriteResult a rank returns carries them


def encode_results(rank: int, save_id: str, entries: list[Any], sizes: dict[str, int],
                   prints: bytes) -> RankResults:
    """``entries`` (``upload.Entry``, pieces filled in) as one compact RankResults."""
    number: dict[str, int] = {}
    parts = []
    for e in entries:
        rows = [(p.start, p.length, number.setdefault(p.chunk, len(number)), p.offset)
                for p in e.pieces]
        packed = np.asarray(rows, dtype=np.int64).reshape(-1, 4).tobytes()
        parts.append((e.index.fqn, tuple(e.index.offset or ()), e.kind, int(e.flat.numel()),
                      e.written, e.reused, packed))
    chunk_sizes = np.asarray([sizes[c] for c in number], dtype=np.int64).tobytes()
    return RankResults(rank, save_id, tuple(number), chunk_sizes, tuple(parts), prints)


def decode_results(sent: list[RankResults]) -> dict[MetadataIndex, list[ShardPart]]:
    """What every rank stored of each item, from their RankResults (for the manifest)."""
    parts: dict[MetadataIndex, list[ShardPart]] = defaultdict(list)
    for r in sent:
        sizes = np.frombuffer(r.sizes, dtype=np.int64).tolist()
        for fqn, offsets, kind, nbytes, written, reused, rows in r.parts:
            pieces, used = [], {}
            piece_rows = np.frombuffer(rows, dtype=np.int64).reshape(-1, 4).tolist()
            for start, length, c, offset in piece_rows:
                pieces.append(StoredPiece(start, length, r.chunks[c], offset))
                used[r.chunks[c]] = sizes[c]
            index = MetadataIndex(fqn, offsets) if kind == "tensor" else MetadataIndex(fqn)
            parts[index].append(ShardPart(kind, nbytes, pieces, used, written, reused))
    return parts
