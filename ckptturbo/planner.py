"""ckptturbo's DCP planners: DCP's default ones, with each distinct local plan sent once.

DCP gathers every rank's whole local plan on the coordinator, which then walks world x
items entries, although most ranks' plans are copies of each other (every DDP rank; every
replica of an HSDP shard group). These planners name a local plan by a digest and agree
with the other ranks, in one small gather and broadcast on the save's or load's process
group, which rank is the first with each digest: that rank sends its plan, the others an
empty plan and the digest (``plan.digests.PlanDigest``). The coordinator plans the
distinct plans once (a save: DCP's dedup and metadata over them only) and hands each rank
back its own part; with ``TurboWriter`` the byte ranges come from ``save_groups``,
O(world + distinct x items); with ``TurboReader`` the read-once chains from the needs
each distinct plan's first rank sent.

DCP planners: ``dcp.save``/``dcp.load`` take them with any storage writer or reader
(another writer gets every item of a group on its first rank, written once; a load
planner puts each rank's items back in ``finish_plan``). Without a ``process_group`` they
plan exactly as DCP's defaults (no collective of their own): ``ct.save``/``ct.load`` plan
with them by default and bind their group to them (``on_group``). The exchange carries
each rank's planner kind: a caller's planner of another kind joins it there
(``KindChecked``), so ranks that mix kinds all raise ``PlanError`` before any plan is
sent instead of waiting for the group's timeout in mismatched collectives.
"""
from __future__ import annotations

import bisect
import contextlib
import copy
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem, SavePlan, WriteItem
from torch.distributed.checkpoint.planner_helpers import _init_state_dict

from .agreement import decide
from .errors import CkptTurboError, PlanError
from .plan.digests import (
    PlanDigest,
    first_ranks,
    kind_conflict,
    plan_digest,
    ranks_by_digest,
)
from .plan.flatten import Flattened, flatten
from .plan.local import local_load_plan, local_save_plan, materialise_meta


class TurboSavePlanner(DefaultSavePlanner):
    """DCP's ``DefaultSavePlanner`` with ranks of equal plans recognised by digest.

    Args:
        process_group: the group the save runs on (what ``dcp.save`` is given; pass
            ``dist.group.WORLD`` for its default). None: plan as ``DefaultSavePlanner``.
        flatten_state_dict, flatten_sharded_tensors, dedup_save_to_lowest_rank: as for
            ``DefaultSavePlanner``. DCP's plan caching is left out: ``TurboWriter`` keeps
            the coordinator's plan itself, keyed by the ranks' digests.
    """

    # The coordinator's last global plan of distinct plans: their digests (in the order of
    # their first ranks) and settings, DCP's deduplicated plans and the metadata. Kept by
    # the class, as DCP keeps its plan cache, because ``ct.save`` makes a planner per save;
    # it depends on the distinct plans alone, so it also serves a changed world (a
    # subgroup, more or fewer replicas) whose ranks bring the same distinct plans.
    _last_distinct: tuple[tuple, list[SavePlan], Metadata] | None = None

    def __init__(self, process_group: Any = None, *, flatten_state_dict: bool = True,
                 flatten_sharded_tensors: bool = True,
                 dedup_save_to_lowest_rank: bool = False) -> None:
        super().__init__(flatten_state_dict=flatten_state_dict,
                         flatten_sharded_tensors=flatten_sharded_tensors,
                         dedup_save_to_lowest_rank=dedup_save_to_lowest_rank)
        self.process_group = process_group

    def set_up_planner(self, state_dict: Any, storage_meta: Any = None,
                       is_coordinator: bool = False) -> None:
        """DCP's, with both of its walks made in one (``plan.flatten``) where they can.
        On a group a failure is raised by ``create_local_plan``, after this rank has
        told the others in the digest exchange (``_planned``)."""
        with _deferred(self):
            flat = _one_walk(self, state_dict)
            if flat is None:
                super().set_up_planner(state_dict, storage_meta, is_coordinator)
                return
            self.state_dict, self.mappings = flat
            self.is_coordinator = is_coordinator

    def create_local_plan(self) -> SavePlan:
        """DCP's local plan (``plan.local`` builds a plain tensor's item faster), then,
        on a group, the digest exchange."""
        return _planned(self, "save", self._local_plan)

    def _local_plan(self) -> tuple[SavePlan, str]:
        plan = local_save_plan(self.state_dict, self.is_coordinator)
        if self.flatten_state_dict:
            plan = dataclasses.replace(plan, planner_data=self.mappings)
        self.plan = plan
        return plan, save_digest(plan) if self.process_group is not None else ""

    def _is_first(self, digest: str) -> bool:
        return first_with(digest, self.process_group, (True, type(self).__name__), "save")

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        """DCP's dedup, metadata and validation over the distinct plans only (or the last
        ones again, for the same distinct plans); a sender gets back its deduplicated plan,
        every other rank its own empty plan."""
        if not all(isinstance(p.planner_data, PlanDigest) for p in all_plans):
            return super().create_global_plan(all_plans)
        groups = _groups(all_plans, "TurboSavePlanner")
        key = (tuple(groups), self.dedup_save_to_lowest_rank, self.flatten_state_dict)
        kept = TurboSavePlanner._last_distinct
        if kept is not None and kept[0] == key:
            planned, metadata = kept[1], kept[2]
        else:
            distinct = []
            for ranks in groups.values():
                first = all_plans[ranks[0]]
                distinct.append(dataclasses.replace(first,
                                                    planner_data=first.planner_data.mappings))
            planned, metadata = self._create_global_plan(distinct)
            TurboSavePlanner._last_distinct = (key, planned, metadata)
        out = list(all_plans)
        for (digest, ranks), plan in zip(groups.items(), planned, strict=True):
            # the storage layer's data of this save's sender (a kept plan has its last one)
            out[ranks[0]] = dataclasses.replace(plan, planner_data=PlanDigest(digest, False),
                                                storage_data=all_plans[ranks[0]].storage_data)
        self.global_plan = out
        self.metadata = metadata
        return out, metadata


class TurboLoadPlanner(DefaultLoadPlanner):
    """DCP's ``DefaultLoadPlanner`` with ranks of equal plans recognised by digest: the
    first rank with each digest sends its plan, the others the digest, and each rank's
    ``finish_plan`` puts its own items back (so any storage reader gets whole plans).
    ``TurboReader`` schedules its read-once chains from the distinct plans' needs.

    Args:
        process_group: the group the load runs on (None: plan as ``DefaultLoadPlanner``).
        flatten_state_dict, flatten_sharded_tensors, allow_partial_load: as for
            ``DefaultLoadPlanner``.
    """

    def __init__(self, process_group: Any = None, *, flatten_state_dict: bool = True,
                 flatten_sharded_tensors: bool = True, allow_partial_load: bool = False) -> None:
        super().__init__(flatten_state_dict=flatten_state_dict,
                         flatten_sharded_tensors=flatten_sharded_tensors,
                         allow_partial_load=allow_partial_load)
        self.process_group = process_group
        self._local: LoadPlan | None = None

    def set_up_planner(self, state_dict: Any, metadata: Metadata | None = None,
                       is_coordinator: bool = False) -> None:
        """DCP's, with tensors on the meta device materialised faster first, and DCP's
        walks made in one (``plan.flatten``) where they can (DCP's set-up then finds
        nothing left to materialise)."""
        with _deferred(self):
            materialise_meta(state_dict, _materialised)
            flat = _one_walk(self, state_dict)
            if flat is None:
                super().set_up_planner(state_dict, metadata, is_coordinator)
                return
            self.original_state_dict = state_dict
            self.state_dict, self.mappings = flat
            self.metadata = metadata
            self.is_coordinator = is_coordinator

    def create_local_plan(self) -> LoadPlan:
        """DCP's local plan (``plan.local`` builds a plain tensor's item faster; a state
        dict missing keys of the checkpoint takes DCP's path, which tells an old
        checkpoint's keys apart), then, on a group, the digest exchange."""
        return _planned(self, "load", self._local_plan)

    def _local_plan(self) -> tuple[LoadPlan, str]:
        if self.metadata is None:
            raise CkptTurboError("TurboLoadPlanner.create_local_plan before set_up_planner")
        stored = self.metadata.state_dict_metadata
        if self.flatten_state_dict and not stored.keys() <= self.state_dict.keys():
            plan = super().create_local_plan()
        else:
            plan = local_load_plan(self.state_dict, self.metadata, not self.allow_partial_load)
        self._local = plan
        if self.process_group is None:
            return plan, ""
        return plan, plan_digest(map(_read_key, plan.items), None)

    def _is_first(self, digest: str) -> bool:
        return first_with(digest, self.process_group, (True, type(self).__name__), "load")

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        if all(isinstance(p.planner_data, PlanDigest) for p in global_plan):
            _groups(global_plan, "TurboLoadPlanner")  # every digest has its sender
            return global_plan
        return super().create_global_plan(global_plan)

    def finish_plan(self, new_plan: LoadPlan) -> LoadPlan:
        """A grouped plan comes back without items (the rank has them): put them back."""
        if isinstance(new_plan.planner_data, PlanDigest) and not new_plan.items:
            if self._local is None:
                raise CkptTurboError("TurboLoadPlanner.finish_plan got a grouped plan before "
                                     "this planner made a local plan")
            return dataclasses.replace(new_plan, items=self._local.items)
        return new_plan


def _one_walk(planner: Any, state_dict: Any) -> Flattened | None:
    """``plan.flatten``'s one walk where the planner flattens as DCP's defaults do (both
    of DCP's walks on), else None: DCP's set-up runs."""
    if planner.flatten_state_dict and planner.flatten_sharded_tensors:
        return flatten(state_dict)
    return None


def _materialised(tensor: Any) -> Any:
    """A meta tensor materialised as DCP's load planner does it (on the device DCP picks)."""
    box = {"t": tensor}
    _init_state_dict(box)
    return box["t"]


def save_digest(plan: SavePlan) -> str:
    """The digest of a local save plan: its items and DCP's flattening mappings."""
    return plan_digest(map(_write_key, plan.items), plan.planner_data)


def _write_key(item: WriteItem) -> tuple[tuple, tuple]:
    """A write item's own names, and the key of everything else of it that planning and
    metadata use (see ``plan_digest``)."""
    td = item.tensor_data
    if td is None:
        return (item.index.fqn, item.type.value), (item.index.offset,)
    c, p = td.chunk, td.properties
    return (item.index.fqn, item.type.value), (
        item.index.offset, c.offsets, c.sizes, td.size, p.dtype, p.layout, p.requires_grad,
        p.memory_format, p.pin_memory)


def _read_key(item: ReadItem) -> tuple[tuple, tuple]:
    """A read item's own names, and the key of the rest of it."""
    d, s = item.dest_index, item.storage_index
    return (item.type.value, d.fqn, s.fqn), (d.offset, item.dest_offsets, s.offset,
                                             item.storage_offsets, item.lengths)


def first_with(digest: str, group: Any, kind: tuple[bool, str], what: str,
               failure: str | None = None) -> bool:
    """Whether this rank is the first in ``group`` with ``digest``: every rank's planner
    ``kind`` (one of ours or not, and its class) and digest decide the first rank of each
    digest (the planners' one collective, ``agreement.decide``: on a large group only rank
    0 sees the digests and the others receive the list of first ranks), or, where ours and
    others mix or a rank could not plan (its ``failure``), why: then every rank raises
    ``PlanError``."""
    world = dist.get_world_size(group)
    if world == 1:
        return True
    me = dist.get_rank(group)
    firsts = decide(group, (kind, digest, failure), lambda gathered: _agree(gathered, what))
    if isinstance(firsts, str):
        raise PlanError(f"rank {me}: {firsts}")
    at = bisect.bisect_left(firsts, me)
    return at < len(firsts) and firsts[at] == me


def _agree(gathered: list[tuple[tuple[bool, str], str, str | None]], what: str
           ) -> list[int] | str:
    """The sorted first rank of each digest, or why the ranks cannot plan together."""
    for rank, (_, _, failure) in enumerate(gathered):
        if failure is not None:
            return f"rank {rank} could not make its local {what} plan: {failure}"
    conflict = kind_conflict([kind for kind, _, _ in gathered], what)
    if conflict is not None:
        return conflict
    return sorted(first_ranks([digest for _, digest, _ in gathered]).values())


@contextlib.contextmanager
def _deferred(planner: Any) -> Iterator[None]:
    """A set-up failure of a planner on a group, kept for ``_planned`` to raise after the
    digest exchange (DCP calls ``create_local_plan`` next); without a group, raised."""
    planner._set_up_failure = None
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - raised by create_local_plan
        if planner.process_group is None:
            raise
        planner._set_up_failure = exc


def _planned(planner: Any, what: str, local_plan: Callable[[], tuple[Any, str]]) -> Any:
    """What the rank sends for ``local_plan()``'s plan and digest: the plan itself without
    a group, else the grouped plan after the digest exchange. Where set-up or planning
    fails on a group, this rank still takes part in the exchange, with its failure,
    before raising it: the other ranks raise ``PlanError`` naming it at once, instead of
    waiting in collectives that no longer match (this rank's next is the plans' round)."""
    try:
        failure = getattr(planner, "_set_up_failure", None)
        if failure is not None:
            raise failure
        plan, digest = local_plan()
    except Exception as exc:
        if planner.process_group is not None:
            with contextlib.suppress(PlanError):  # the others' error names this one
                first_with("", planner.process_group, (True, type(planner).__name__), what,
                           f"{type(exc).__name__}: {exc}")
        raise
    if planner.process_group is None:
        return plan
    return grouped_plan(plan, digest, planner._is_first(digest))


class KindChecked:
    """A caller's save or load planner of another kind than ours, on a group of
    ``ct.save``/``ct.load``: it takes part in the planners' exchange with its kind and no
    digest before it plans, so a group where some ranks plan with ours fails on every rank
    with ``PlanError`` instead of hanging (ranks with different planners of DCP's kind plan
    together, as in ``dcp.save``). Everything else is the caller's planner's."""

    def __init__(self, planner: Any, group: Any, what: str) -> None:
        self._planner = planner
        self._group = group
        self._what = what

    def __getattr__(self, name: str) -> Any:
        if name == "_planner":  # not set yet (a copy or unpickling): no forwarding loop
            raise AttributeError(name)
        return getattr(self._planner, name)

    def create_local_plan(self) -> Any:
        first_with("", self._group, (False, type(self._planner).__name__), self._what)
        return self._planner.create_local_plan()


def _groups(plans: list[Any], who: str) -> dict[str, list[int]]:
    """Each digest's ranks; the first of each must have sent its plan."""
    groups = ranks_by_digest([p.planner_data.digest for p in plans])
    for digest, ranks in groups.items():
        if not plans[ranks[0]].planner_data.sender:
            raise CkptTurboError(f"{who}: no rank sent the plan of digest {digest} (ranks "
                                 f"{ranks[:8]}); the ranks disagreed on who sends it")
    return groups


def grouped_plan(plan: Any, digest: str, sender: bool) -> Any:
    """What a rank sends for its local save or load ``plan``: the plan itself from the
    first rank with its digest, an empty plan naming the digest from every other (the
    plan stays on the rank)."""
    data = PlanDigest(digest, sender, plan.planner_data, local=plan)
    return dataclasses.replace(plan, items=plan.items if sender else [], planner_data=data)


def on_group(planner: Any, group: Any, what: str) -> Any:
    """The planner a ``ct.save`` or ``ct.load`` on ``group`` runs, given the caller's or
    the default (one of ours): a planner of ours without a group is bound to ``group`` (a
    copy: the caller's stays as it is); any other planner joins the kind check
    (``KindChecked``; ``what``: "save" or "load", for its error). Without a group (one
    process alone) every planner runs as given."""
    if group is None:
        return planner
    if isinstance(planner, (TurboSavePlanner, TurboLoadPlanner)):
        if planner.process_group is None:
            planner = copy.copy(planner)
            planner.process_group = group
        return planner
    return KindChecked(planner, group, what)
