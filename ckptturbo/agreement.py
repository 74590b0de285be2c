"""Steps every rank runs together, whose outcome every rank must share.

After DCP's own collectives (a tiered save's commit, a tiered load's choice of checkpoint)
ranks do local I/O and then meet again. A rank that raised alone would leave the others
waiting in the next collective until a timeout, so each such step ends with the ranks
exchanging their outcome: every rank gets every result, or every rank raises.
"""
from __future__ import annotations

import pickle
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from .errors import CkptTurboError

T = TypeVar("T")
R = TypeVar("R")


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


def small(group: Any) -> bool:
    """Whether ``gather`` sends ``group``'s values through its rank 0 (and
    ``reduce_scatter`` serves it)."""
    return _small(group, dist.get_world_size(group))


def _small(group: Any, world: int) -> bool:
    return world <= SMALL_GROUP and dist.get_backend(group) == "gloo"


def reduce_scatter(group: Any, step: str, local: Callable[[], T],
                   reduce: Callable[[list[T]], list[R]]) -> R:
    """DCP's plan round on a small gloo group (``small``): ``local`` on every rank,
    ``reduce`` of all their results on rank 0, and each rank's own part of its outcome
    back to that rank. A failure anywhere raises DCP's ``CheckpointException(step,
    {rank: (exception, traceback)})`` on every rank, as ``dcp.load``'s own round does.

    Three transfers where DCP's ``gather_object`` and ``scatter_object_list`` make an
    all-gather ring of the sizes, a gather, a broadcast and a scatter: the results
    gathered on rank 0 in fixed slots, one broadcast saying each part's size (or that a
    result overflowed its slot, which takes a second gather sized for the largest), and
    the parts scattered, each rank receiving only its own."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    first = rank == 0  # asked before the transfers: the groups may be gone once they end
    blob = _travelling(_outcome(local))
    rows = _gather_on_rank_0(group, world, _slot(blob, SLOT_BYTES), first)
    control = torch.zeros(world + 1, dtype=torch.int64)  # [second slot's size, parts' sizes]
    parts: list[bytes] = []
    if rows is not None:
        largest = max(_length(row) for row in rows)
        if largest > SLOT_BYTES - _HEADER:
            control[0] = largest + _HEADER
        else:
            parts = _parts(step, world, rows, reduce)
            control[1:] = torch.tensor([len(part) for part in parts])
    dist.broadcast(control, group=group, group_src=0)
    if int(control[0]):
        rows = _gather_on_rank_0(group, world, _slot(blob, int(control[0])), first)
        sizes = torch.zeros(world, dtype=torch.int64)
        if rows is not None:
            parts = _parts(step, world, rows, reduce)
            sizes[:] = torch.tensor([len(part) for part in parts])
        dist.broadcast(sizes, group=group, group_src=0)
    else:
        sizes = control[1:]
    width = int(sizes.max())
    mine = torch.empty(width, dtype=torch.uint8)
    padded = [_slot_body(part, width) for part in parts] if first else None
    dist.scatter(mine, padded, group=group, group_src=0)
    kind, value = pickle.loads(mine[:int(sizes[rank])].numpy().tobytes())
    if kind == "failed":
        raise value
    return value


def all_succeed(group: Any, step: str, local: Callable[[], None]) -> None:
    """DCP's closing round on a small gloo group: ``local`` on every rank, then the
    outcomes exchanged (``gather``: two hops, where ``all_gather_object`` makes two rings);
    a failure anywhere raises ``CheckpointException(step, failures)`` on every rank."""
    failures = _failures(gather(group, _outcome(local)))
    if failures:
        raise CheckpointException(step, failures)


def _outcome(step: Callable[[], T]) -> tuple[str, Any]:
    """("ok", what ``step`` returned) or ("failed", its exception as DCP wraps one)."""
    try:
        return "ok", step()
    except BaseException as exc:  # noqa: BLE001 - as DCP's rounds: travels to every rank
        return "failed", _wrapped(exc)


def _failures(outcomes: list[tuple[str, Any]]) -> dict[int, Any]:
    """{rank: its wrapped failure} of every rank's ``_outcome``."""
    return {rank: wrapped for rank, (kind, wrapped) in enumerate(outcomes) if kind == "failed"}


def _wrapped(exc: BaseException) -> tuple[BaseException, traceback.StackSummary]:
    """``exc`` and where it was raised, DCP's form of a rank's failure. An exception that
    does not pickle travels as a CkptTurboError carrying its type and message."""
    summary = traceback.extract_tb(exc.__traceback__)
    try:
        pickle.dumps(exc, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # noqa: BLE001 - replaced by what can travel
        exc = CkptTurboError(f"{type(exc).__name__}: {exc}")
    return exc, summary


def _travelling(outcome: tuple[str, Any]) -> bytes:
    """``outcome`` pickled; a result that does not pickle becomes this rank's failure."""
    try:
        return pickle.dumps(outcome, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:  # noqa: BLE001 - a failure like any other
        return pickle.dumps(("failed", _wrapped(exc)), protocol=pickle.HIGHEST_PROTOCOL)


def _parts(step: str, world: int, rows: list[torch.Tensor],
           reduce: Callable[[list[Any]], list[Any]]) -> list[bytes]:
    """On rank 0: each rank's pickled part of ``reduce``'s outcome, or of the failure."""
    outcomes = [pickle.loads(row[_HEADER:_HEADER + _length(row)].numpy().tobytes())
                for row in rows]
    failures = _failures(outcomes)
    if not failures:
        try:
            replies = reduce([value for _, value in outcomes])
            if len(replies) != world:
                raise CkptTurboError(f"the {step} round's reduction gave {len(replies)} "
                                     f"parts for {world} ranks")
            return [_travelling(("ok", part)) for part in replies]
        except BaseException as exc:  # noqa: BLE001 - the coordinator's failure, on every rank
            failures = {0: _wrapped(exc)}
    failed = pickle.dumps(("failed", CheckpointException(step, failures)),
                          protocol=pickle.HIGHEST_PROTOCOL)
    return [failed] * world


def _gather_on_rank_0(group: Any, world: int, slot: torch.Tensor,
                      first: bool) -> list[torch.Tensor] | None:
    """Every rank's ``slot``, as rows on the group's rank 0 (None elsewhere)."""
    rows = [torch.empty_like(slot) for _ in range(world)] if first else None
    dist.gather(slot, rows, group=group, group_dst=0)
    return rows


def _length(row: torch.Tensor) -> int:
    """The length of the value a slot carries (its header)."""
    return int(row[:_HEADER].view(torch.int64)[0])


def _slot_body(blob: bytes, nbytes: int) -> torch.Tensor:
    """``blob`` padded to ``nbytes``, without a header (the sizes travel apart)."""
    body = torch.zeros(nbytes, dtype=torch.uint8)
    if blob:
        body[:len(blob)] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    return body


def _slot(blob: bytes, nbytes: int) -> torch.Tensor:
    """A slot of ``nbytes``: ``blob``'s length, then as much of ``blob`` as fits (all of it
    when the round is sized for the largest)."""
    header = torch.tensor([len(blob)], dtype=torch.int64).view(torch.uint8)
    return torch.cat([header, _slot_body(blob[:nbytes - _HEADER], nbytes - _HEADER)])


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
