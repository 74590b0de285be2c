"""Steps every rank runs together, whose outcome every rank must share.

After DCP's own collectives (a tiered save's commit, a tiered load's choice of checkpoint)
ranks do local I/O and then meet again. A rank that raised alone would leave the others
waiting in the next collective until a timeout, so each such step ends with the ranks
exchanging their outcome: every rank gets every result, or every rank raises.
"""
from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from .errors import CkptTurboError

T = TypeVar("T")


SMALL_GROUP = 64  # ranks: up to this many, objects travel through the group's rank 0
SLOT_BYTES = 4096  # what each rank sends first; larger objects take a second round
TABLE_BYTES = 64 << 20  # beyond this (ranks x largest object), the ring's all_gather_object
_HEADER = 8  # a slot begins with its value's length, an int64


def gather(group: Any, value: Any) -> list[Any]:
    """Every rank's ``value``, in rank order (``group`` None: this process alone).

    On a small gloo group, rank 0 gathers each rank's pickled value in a fixed slot and
    broadcasts them all: two hops, where ``all_gather_object``'s two ring all-gathers
    (the sizes, then the padded values) take 2 x (ranks - 1). On the cluster in miniature
    (8 ranks over 4 namespaces on 2 cores) that is 1.7 ms against 24 ms a round, and a
    tiered load makes five such rounds of its own. A value larger than the slot
    takes a second round sized for the largest; larger groups, other backends and tables
    over ``TABLE_BYTES`` take ``all_gather_object``, which never funnels through one rank."""
    if group is None:
        return [value]
    world = dist.get_world_size(group)
    if not _small(group, world):
        return _ring(group, world, value)
    blob = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    table = _through_rank_0(group, world, _slot(blob, SLOT_BYTES))
    sizes = table[:, :_HEADER].contiguous().view(torch.int64).flatten().tolist()
    largest = max(sizes)
    if largest > SLOT_BYTES - _HEADER:
        if world * (largest + _HEADER) > TABLE_BYTES:
            return _ring(group, world, value)
        table = _through_rank_0(group, world, _slot(blob, largest + _HEADER))
    rows = table.numpy()
    return [pickle.loads(rows[rank, _HEADER:_HEADER + n].tobytes())
            for rank, n in enumerate(sizes)]


def decide(group: Any, value: Any, rule: Callable[[list[Any]], T]) -> T:
    """``rule`` applied to every rank's ``value`` (in rank order), its outcome on every
    rank. On a small gloo group every rank gathers every value (``gather``: two hops) and
    applies ``rule`` itself, so it must be deterministic; on a larger group rank 0 alone
    gathers the values and broadcasts the outcome, and no other rank handles them all."""
    if group is None:
        return rule([value])
    world = dist.get_world_size(group)
    if _small(group, world):
        return rule(gather(group, value))
    first = dist.get_rank(group) == 0
    gathered: list[Any] | None = [None] * world if first else None
    dist.gather_object(value, gathered, group=group, group_dst=0)
    box: list[Any] = [rule(gathered) if gathered is not None else None]
    dist.broadcast_object_list(box, group=group, group_src=0)
    return box[0]


def _small(group: Any, world: int) -> bool:
    """Whether ``gather`` sends the group's values through its rank 0."""
    return world <= SMALL_GROUP and dist.get_backend(group) == "gloo"


def _slot(blob: bytes, nbytes: int) -> torch.Tensor:
    """A slot of ``nbytes``: ``blob``'s length, then as much of ``blob`` as fits (all of it
    when the round is sized for the largest)."""
    slot = torch.zeros(nbytes, dtype=torch.uint8)
    slot[:_HEADER] = torch.tensor([len(blob)], dtype=torch.int64).view(torch.uint8)
    body = blob[:nbytes - _HEADER]
    if body:
        slot[_HEADER:_HEADER + len(body)] = torch.frombuffer(bytearray(body), dtype=torch.uint8)
    return slot


def _through_rank_0(group: Any, world: int, slot: torch.Tensor) -> torch.Tensor:
    """Every rank's ``slot`` as the rows of one table on every rank: gathered on the
    group's rank 0, broadcast from it."""
    table = torch.empty(world, slot.numel(), dtype=torch.uint8)
    rows = list(table.unbind(0)) if dist.get_rank(group) == 0 else None
    dist.gather(slot, rows, group=group, group_dst=0)
    dist.broadcast(table, group=group, group_src=0)
    return table


def _ring(group: Any, world: int, value: Any) -> list[Any]:
    """``gather`` by torch's ring all-gather: no rank carries more than its share."""
    out: list[Any] = [None] * world
    dist.all_gather_object(out, value, group=group)
    return out


def agree(group: Any, action: str, step: Callable[[], T]) -> list[T]:
    """Run ``step`` here and return every rank's result. A failure on any rank is raised on
    every rank: as itself where it happened, elsewhere as a CkptTurboError naming
    ``action``, the rank and the cause (errors travel as text: not every one pickles)."""
    mine_error: Exception | None = None
    try:
        mine: tuple[Any, str | None] = (step(), None)
    except Exception as exc:  # noqa: BLE001 - shared with the other ranks, raised below
        mine_error, mine = exc, (None, f"{type(exc).__name__}: {exc}")
    everyone = gather(group, mine)
    for rank, (_, problem) in enumerate(everyone):
        if problem is not None:
            if mine_error is not None:
                raise mine_error
            raise CkptTurboError(f"{action} failed on rank {rank}: {problem}")
    return [result for result, _ in everyone]


def settle(group: Any, action: str, step: Callable[[], T]) -> T:
    """``agree`` for a step whose result stays here (tensors, mappings): only the outcome
    travels; a failure on any rank is raised on every rank, as in ``agree``."""
    mine: list[T] = []
    agree(group, action, lambda: mine.append(step()))
    return mine[0]
