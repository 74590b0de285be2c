"""The writer's coordinator plan for grouped local plans: each distinct plan once.

``TurboSavePlanner`` sends the coordinator one whole plan per digest (from the first rank
that has it) and a digest from every other rank (``plan.digests``). This module assigns
every rank its byte ranges from those: the items, sizes and positions of each distinct
plan are read once, an item's holders are the ranks of the plans that hold it (one tuple
per distinct set of plans, shared by its items), and each rank gets back only its own
``Assignment``, as ``save_plan.assign`` makes them for whole plans. Work:
O(world + distinct plans x items), not O(world x items). Pure: no I/O, no collectives.

Two parts: ``DistinctPlans`` depends only on which distinct plans a save has, and
``assign_grouped`` adds what depends on the world (which ranks hold each plan, the
balancing, each rank's rows). A writer keeps the first across saves: a save with the same
distinct plans in another world (a subgroup, a group re-formed with fewer or more ranks
and the same shard shapes) plans from it without reading any plan's items again.
"""
from __future__ import annotations

from collections.abc import Sequence
from itertools import chain

import numpy as np
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, WriteItemType

from .errors import CkptTurboError
from .plan import PlanItem, plan_writes
from .plan.digests import ranks_by_digest
from .save_plan import WHOLE, Assignment, Holdings


class DistinctPlans:
    """Everything of a grouped save's plan that depends only on its distinct local plans,
    neither on the world nor on the writer's settings (chunk size, balancing, the replica
    check: ``assign_grouped`` applies them): every distinct plan's items numbered once
    (per item its bytes, whether it is an object, the key the balancer knows it by), per
    plan each item's position, the tensors grouped by the set of plans that hold them, and
    each plan's replica flags for both cases the world decides (the plan on one rank or on
    several). ``order``: the distinct plans' digests by plan number; ``digests``: the same
    as a set, the key a writer keeps it by."""

    def __init__(self, digests: Sequence[str], held: Sequence[Holdings]) -> None:
        self.order = list(digests)
        self.digests = frozenset(self.order)
        self.signatures = [h.signature for h in held]
        self.ids: dict[MetadataIndex, int] = {}
        self.nbytes: list[int] = []
        self.is_object: list[bool] = []
        self.positions: list[dict[int, int]] = []
        index: list[MetadataIndex] = []
        plans_of: list[list[int]] = []  # per item, the plans that hold it
        for g, h in enumerate(held):
            sizes = np.frombuffer(h.nbytes, dtype=np.int64).tolist()
            mine: dict[int, int] = {}
            for pos, item in enumerate(h.items):
                i = self.ids.get(item.index)
                if i is None:
                    i = self.ids[item.index] = len(index)
                    index.append(item.index)
                    self.nbytes.append(sizes[pos])
                    self.is_object.append(item.type == WriteItemType.BYTE_IO)
                    plans_of.append([])
                plans_of[i].append(g)
                mine[i] = pos
            self.positions.append(mine)
        # tensors by the plans that hold them, and the keys plan_writes names them by
        self.sets: dict[tuple[int, ...], list[int]] = {}
        self.key_of: dict[str, int] = {}
        self.keys: list[str] = [""] * len(index)
        for i, idx in enumerate(index):
            if not self.is_object[i]:
                key = self.keys[i] = f"{idx.fqn}@{','.join(map(str, idx.offset or ()))}"
                self.key_of[key] = i
                self.sets.setdefault(tuple(plans_of[i]), []).append(i)
        # per plan, (flags if it is on one rank, flags if on several): an item is replicated
        # where another rank holds it too; in position order
        self.flags: list[tuple[bytes, bytes]] = []
        for mine in self.positions:
            tensor = np.asarray([not self.is_object[i] for i in mine], dtype=bool)
            shared = np.asarray([len(plans_of[i]) > 1 for i in mine], dtype=bool)
            self.flags.append((np.packbits(tensor & shared).tobytes(),
                               np.packbits(tensor).tobytes()))


def distinct_plans(plans: list[SavePlan]) -> DistinctPlans:
    """The world-independent part of grouped plans' assignment (see ``DistinctPlans``)."""
    return _distinct(plans, ranks_by_digest([p.planner_data.digest for p in plans]))


def _distinct(plans: list[SavePlan], groups: dict[str, list[int]]) -> DistinctPlans:
    held = [plans[ranks[0]].storage_data for ranks in groups.values()]
    if not all(isinstance(h, Holdings) for h in held):
        raise CkptTurboError("TurboWriter.prepare_global_plan: a grouped plan came without the "
                             "holdings of its first rank (a plan this writer did not prepare)")
    return DistinctPlans(list(groups), held)


def assign_grouped(plans: list[SavePlan], *, balance: bool, chunk_size: int,
                   weights: list[float] | None, check_replicas: bool, save_id: str,
                   distinct: DistinctPlans | None = None) -> list[Assignment]:
    """Every rank's byte ranges from grouped plans: balanced over all holders, or where
    the planner's dedup left each item (the sender of the plan that kept it). ``distinct``:
    the same plans' world-independent part, kept from an earlier save (made here if None;
    the result is the same either way); it must have exactly this save's digests."""
    world = len(plans)
    groups = ranks_by_digest([p.planner_data.digest for p in plans])
    if distinct is None:
        distinct = _distinct(plans, groups)
    elif distinct.digests != groups.keys():
        raise CkptTurboError("TurboWriter.prepare_global_plan: the kept plan of the distinct "
                             "local plans was made for other plans than this save's")
    members = [groups[digest] for digest in distinct.order]  # by plan number
    group_of = np.empty(world, dtype=np.int64)
    for g, ranks in enumerate(members):
        group_of[ranks] = g
    rows: list[list[tuple[int, int, int]]] = [[] for _ in range(world)]
    # Objects (and, without balancing, every item) go to the sender that kept them.
    for g, ranks in enumerate(members):
        for item in plans[ranks[0]].items:
            i = distinct.ids.get(item.index)
            if i is None:
                raise CkptTurboError(f"TurboWriter.prepare_global_plan: rank {ranks[0]}'s plan "
                                     f"has {item.index.fqn!r}, which no rank reported holding")
            if distinct.is_object[i]:
                rows[ranks[0]].append((distinct.positions[g][i], 0, WHOLE))
            elif not balance:
                rows[ranks[0]].append((distinct.positions[g][i], 0, distinct.nbytes[i]))
    if balance:
        items = []
        for plans_key, ids in distinct.sets.items():
            holders = tuple(sorted(chain.from_iterable(members[g] for g in plans_key)))
            items += [PlanItem(distinct.keys[i], distinct.nbytes[i], holders) for i in ids]
        for rank, ranges in enumerate(plan_writes(items, world, chunk_size=chunk_size,
                                                  weights=weights)):
            mine = distinct.positions[group_of[rank]]
            for r in ranges:
                rows[rank].append((mine[distinct.key_of[r.key]], r.start, r.end))
    flags = [distinct.flags[g][len(members[g]) > 1] if check_replicas else b""
             for g in range(len(members))]
    return [Assignment(np.asarray(rows[rank], dtype=np.int64).reshape(-1, 3).tobytes(),
                       flags[group_of[rank]], distinct.signatures[group_of[rank]], save_id)
            for rank in range(world)]
