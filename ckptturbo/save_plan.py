"""DCP save plans in and out of ``plan.plan_writes``: what the writer's coordinator decides.

DCP's planner already removes replicated items from all but one rank, whole. That keeps
one rank busy writing a replicated embedding while its peers idle. So each rank reports
everything it holds (``Holdings``, before DCP's dedup), and the coordinator splits
replicated items into chunk-aligned byte ranges balanced over their holders
(``assign``); each rank gets an ``Assignment``. Pure: no I/O, no collectives.
"""
from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass

from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

from .chunks import chunk_id
from .plan import PlanItem, plan_writes


@dataclass(frozen=True)
class Holdings:
    """A rank's tensor items before DCP's dedup: (index, nbytes), in plan order."""

    rank: int
    items: tuple[tuple[MetadataIndex, int], ...]
    signature: str | None = None  # equal to the previous save's => the cached plan applies


@dataclass(frozen=True)
class Assignment:
    """What the coordinator tells one rank: its byte ranges, and the save it belongs to."""

    ranges: dict[MetadataIndex, tuple[tuple[int, int], ...]]
    replicated: frozenset[MetadataIndex]
    save_id: str = ""


def item_nbytes(item: WriteItem) -> int:
    td = item.tensor_data
    n = 1
    for s in td.chunk.sizes:
        n *= s
    return n * td.properties.dtype.itemsize


def holdings(rank: int, plan: SavePlan, last_signature: str | None) -> Holdings:
    """This rank's holdings; with the same layout as last time, only their signature."""
    items = tuple((item.index, item_nbytes(item)) for item in plan.items
                  if item.type != WriteItemType.BYTE_IO)
    sig = signature(items)
    return Holdings(rank, () if sig == last_signature else items, sig)


def signature(items: tuple[tuple[MetadataIndex, int], ...]) -> str:
    doc = [(i.fqn, list(i.offset or ()), n) for i, n in items]
    return chunk_id(json.dumps(doc).encode())


def assign(plans: list[SavePlan], held: list[Holdings], *, balance: bool, chunk_size: int,
           weights: list[float] | None) -> list[Assignment]:
    """Every rank's byte ranges: balanced over holders, or DCP's own whole-item choice."""
    world = len(plans)
    holders: dict[MetadataIndex, list[int]] = defaultdict(list)
    sizes: dict[MetadataIndex, int] = {}
    for h in held:
        for idx, nbytes in h.items:
            holders[idx].append(h.rank if world > 1 else 0)
            sizes[idx] = nbytes
    if not balance:
        # DCP's own dedup already chose one rank per item: keep its choice.
        ranges_by_rank = [{i.index: ((0, item_nbytes(i)),) for i in p.items
                           if i.type != WriteItemType.BYTE_IO} for p in plans]
    else:
        keys = {idx: f"{idx.fqn}@{','.join(map(str, idx.offset or ()))}" for idx in holders}
        back = {v: k for k, v in keys.items()}
        items = [PlanItem(keys[idx], sizes[idx], tuple(sorted(set(r))))
                 for idx, r in holders.items()]
        ranges_by_rank = []
        for ranges in plan_writes(items, world, chunk_size=chunk_size, weights=weights):
            mine: dict[MetadataIndex, list[tuple[int, int]]] = defaultdict(list)
            for r in ranges:
                mine[back[r.key]].append((r.start, r.end))
            ranges_by_rank.append({k: tuple(v) for k, v in mine.items()})
    replicated = frozenset(idx for idx, r in holders.items() if len(set(r)) > 1)
    return [Assignment(ranges_by_rank[rank], frozenset(replicated & {i for i, _ in held[rank].items}))
            for rank in range(world)]
