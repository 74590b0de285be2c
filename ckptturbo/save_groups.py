"""The writer's coordinator plan for grouped local plans: each distinct plan once.

``TurboSavePlanner`` sends the coordinator one whole plan per digest (from the first rank
that has it) and a digest from every other rank (``plan.digests``). This module assigns
every rank its byte ranges from those: the items, sizes and positions of each distinct
plan are read once, an item's holders are the ranks of the plans that hold it (one tuple
per distinct set of plans, shared by its items), and each rank gets back only its own
``Assignment``, as ``save_plan.assign`` makes them for whole plans. Work:
O(world + distinct plans x items), not O(world x items). Pure: no I/O, no collectives.
"""
from __future__ import annotations

from itertools import chain

import numpy as np
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, WriteItemType

from .errors import CkptTurboError
from .plan import PlanItem, plan_writes
from .plan.digests import ranks_by_digest
from .save_plan import WHOLE, Assignment, Holdings


class _Distinct:
    """Every distinct plan's items, numbered once: per item its bytes, whether it is an
    object, and the plans (by number) that hold it; per plan, each item's position."""

    def __init__(self, held: list[Holdings]) -> None:
        self.ids: dict[MetadataIndex, int] = {}
        self.index: list[MetadataIndex] = []
        self.nbytes: list[int] = []
        self.is_object: list[bool] = []
        self.plans_of: list[list[int]] = []
        self.positions: list[dict[int, int]] = []
        for g, h in enumerate(held):
            sizes = np.frombuffer(h.nbytes, dtype=np.int64).tolist()
            mine: dict[int, int] = {}
            for pos, item in enumerate(h.items):
                i = self.ids.get(item.index)
                if i is None:
                    i = self.ids[item.index] = len(self.index)
                    self.index.append(item.index)
                    self.nbytes.append(sizes[pos])
                    self.is_object.append(item.type == WriteItemType.BYTE_IO)
                    self.plans_of.append([])
                self.plans_of[i].append(g)
                mine[i] = pos
            self.positions.append(mine)


def assign_grouped(plans: list[SavePlan], *, balance: bool, chunk_size: int,
                   weights: list[float] | None, check_replicas: bool,
                   save_id: str) -> list[Assignment]:
    """Every rank's byte ranges from grouped plans: balanced over all holders, or where
    the planner's dedup left each item (the sender of the plan that kept it)."""
    world = len(plans)
    groups = ranks_by_digest([p.planner_data.digest for p in plans])
    members = list(groups.values())
    held = [plans[ranks[0]].storage_data for ranks in members]
    if not all(isinstance(h, Holdings) for h in held):
        raise CkptTurboError("TurboWriter.prepare_global_plan: a grouped plan came without the "
                             "holdings of its first rank (a plan this writer did not prepare)")
    table = _Distinct(held)
    group_of = np.empty(world, dtype=np.int64)
    for g, ranks in enumerate(members):
        group_of[ranks] = g
    rows: list[list[tuple[int, int, int]]] = [[] for _ in range(world)]
    # Objects (and, without balancing, every item) go to the sender that kept them.
    for g, ranks in enumerate(members):
        for item in plans[ranks[0]].items:
            i = table.ids.get(item.index)
            if i is None:
                raise CkptTurboError(f"TurboWriter.prepare_global_plan: rank {ranks[0]}'s plan "
                                     f"has {item.index.fqn!r}, which no rank reported holding")
            if table.is_object[i]:
                rows[ranks[0]].append((table.positions[g][i], 0, WHOLE))
            elif not balance:
                rows[ranks[0]].append((table.positions[g][i], 0, table.nbytes[i]))
    holders_of: dict[tuple[int, ...], tuple[int, ...]] = {}
    if balance:
        keys: dict[str, int] = {}
        items = []
        for i, index in enumerate(table.index):
            if table.is_object[i]:
                continue
            plans_key = tuple(table.plans_of[i])
            holders = holders_of.get(plans_key)
            if holders is None:
                holders = holders_of[plans_key] = tuple(sorted(
                    chain.from_iterable(members[g] for g in plans_key)))
            key = f"{index.fqn}@{','.join(map(str, index.offset or ()))}"
            keys[key] = i
            items.append(PlanItem(key, table.nbytes[i], holders))
        for rank, ranges in enumerate(plan_writes(items, world, chunk_size=chunk_size,
                                                  weights=weights)):
            mine = table.positions[group_of[rank]]
            for r in ranges:
                rows[rank].append((mine[keys[r.key]], r.start, r.end))
    flags = [b""] * len(members)
    if check_replicas:
        for g in range(len(members)):
            shared = [not table.is_object[i] and
                      (len(table.plans_of[i]) > 1 or len(members[g]) > 1)
                      for i in table.positions[g]]  # in position order
            flags[g] = np.packbits(np.asarray(shared, dtype=bool)).tobytes()
    return [Assignment(np.asarray(rows[rank], dtype=np.int64).reshape(-1, 3).tobytes(),
                       flags[group_of[rank]], held[group_of[rank]].signature, save_id)
            for rank in range(world)]
