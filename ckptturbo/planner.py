"""TurboSavePlanner: DCP's default save planner, with each distinct local plan sent once.

DCP gathers every rank's whole local plan on the coordinator, which then walks world x
items entries, although most ranks' plans are copies of each other (every DDP rank; every
replica of an HSDP shard group). This planner names its local plan by a digest and agrees
with the other ranks, in one small gather and broadcast on the save's process group, which
rank is the first with each digest: that rank sends its plan, the others an empty plan and
the digest (``plan.digests.PlanDigest``). The coordinator plans the distinct plans once
(DCP's dedup and metadata, over them only) and hands each rank back its own part; with
``TurboWriter`` the byte ranges come from ``save_groups``, O(world + distinct x items).

A DCP planner: ``dcp.save`` takes it with any storage writer (another writer gets every
item on the first rank of each group, written once). Without a ``process_group`` it
plans exactly as ``DefaultSavePlanner`` does (no collective of its own): ``ct.save`` binds
its save group to it.
"""
from __future__ import annotations

import bisect
import copy
import dataclasses
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan

from .errors import CkptTurboError
from .plan.digests import PlanDigest, first_ranks, plan_digest, ranks_by_digest


class TurboSavePlanner(DefaultSavePlanner):
    """DCP's ``DefaultSavePlanner`` with ranks of equal plans recognised by digest.

    Args:
        process_group: the group the save runs on (what ``dcp.save`` is given; pass
            ``dist.group.WORLD`` for its default). None: plan as ``DefaultSavePlanner``.
        flatten_state_dict, flatten_sharded_tensors, dedup_save_to_lowest_rank: as for
            ``DefaultSavePlanner``. DCP's plan caching is left out: ``TurboWriter`` keeps
            the coordinator's plan itself, keyed by the ranks' digests.
    """

    def __init__(self, process_group: Any = None, *, flatten_state_dict: bool = True,
                 flatten_sharded_tensors: bool = True,
                 dedup_save_to_lowest_rank: bool = False) -> None:
        super().__init__(flatten_state_dict=flatten_state_dict,
                         flatten_sharded_tensors=flatten_sharded_tensors,
                         dedup_save_to_lowest_rank=dedup_save_to_lowest_rank)
        self.process_group = process_group

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        if self.process_group is None:
            return plan
        digest = plan_digest(plan.items, plan.planner_data)
        sender = self._is_first(digest)
        data = PlanDigest(digest, sender, plan.planner_data, local=plan)
        return SavePlan(plan.items if sender else [], planner_data=data)

    def _is_first(self, digest: str) -> bool:
        """Whether this rank is the first of its group with ``digest``: the coordinator
        gathers the digests and broadcasts the first rank of each (the one collective)."""
        group = self.process_group
        world = dist.get_world_size(group)
        if world == 1:
            return True
        me = dist.get_rank(group)
        gathered: list[Any] | None = [None] * world if me == 0 else None
        dist.gather_object(digest, gathered, group=group, group_dst=0)
        box: list[Any] = [sorted(first_ranks(gathered).values()) if gathered else None]
        dist.broadcast_object_list(box, group=group, group_src=0)
        firsts = box[0]
        at = bisect.bisect_left(firsts, me)
        return at < len(firsts) and firsts[at] == me

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        """DCP's dedup, metadata and validation over the distinct plans only; a sender gets
        back its deduplicated plan, every other rank its own empty plan."""
        if not all(isinstance(p.planner_data, PlanDigest) for p in all_plans):
            return super().create_global_plan(all_plans)
        groups = ranks_by_digest([p.planner_data.digest for p in all_plans])
        distinct = []
        for digest, ranks in groups.items():
            first = all_plans[ranks[0]]
            if not first.planner_data.sender:
                raise CkptTurboError(f"TurboSavePlanner: no rank sent the plan of digest {digest} "
                                     f"(ranks {ranks[:8]}); the ranks disagreed on who sends it")
            distinct.append(dataclasses.replace(first, planner_data=first.planner_data.mappings))
        planned, metadata = self._create_global_plan(distinct)
        out = list(all_plans)
        for (digest, ranks), plan in zip(groups.items(), planned):
            out[ranks[0]] = dataclasses.replace(plan, planner_data=PlanDigest(digest, False))
        self.global_plan = out
        self.metadata = metadata
        return out, metadata


def on_group(planner: Any, group: Any) -> Any:
    """The planner a ``ct.save`` on ``group`` runs: ckptturbo's own by default, and a
    ``TurboSavePlanner`` without a group bound to it (a copy: the caller's stays as it is).
    Without a group (one process saving alone) every planner runs as given."""
    if planner is None:
        return TurboSavePlanner(group)
    if group is not None and isinstance(planner, TurboSavePlanner) and planner.process_group is None:
        planner = copy.copy(planner)
        planner.process_group = group
    return planner
