"""The schedule of a chain broadcast: who sends which piece of which transfer to whom, and
when. Pure and deterministic (no torch, no communication), so every rank, or one
coordinator for all of them, computes the same plan; ``broadcast`` runs it.

A chunk is read once, by the head of a *chain* of ranks, and forwarded hop by hop in
pieces. Time is cut into *steps*. A transfer that starts at step ``s0`` sends piece ``i``
over hop ``j`` (``chain[j] -> chain[j+1]``) at step ``s0 + i + j``: the receiver gets the
piece in the step before it forwards it. Start steps are assigned greedily in tid order so
that no rank ever holds more than ``max_inflight`` assembly buffers (see
:func:`plan_schedule`). A rank needs only its own :class:`Part` of each transfer it belongs
to (the step it sends piece 0, its predecessor and successor): a coordinator computes the
start steps once, from chains given as rotations of their needers
(:func:`schedule_rotations`), and sends the ranks that need the same chunks their transfers
in a form each of them computes its own parts from (:class:`RotatedChains`), so no rank
holds the schedule of the whole job; :func:`own_parts` extracts one rank's parts from the full list,
for callers that have it on every rank.
"""
from __future__ import annotations

import hashlib
import pickle
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from .errors import PlanError


@dataclass(frozen=True)
class Transfer:
    """One byte range to deliver from ``chain[0]`` to every other rank of ``chain``.

    ``tid`` is unique and identical on every rank; it orders all processing. Ranks are
    ranks within the broadcaster's process group.
    """

    tid: int
    nbytes: int
    chain: tuple[int, ...]


def npieces(nbytes: int, piece_size: int) -> int:
    """Number of ``piece_size`` pieces (the last one shorter) that carry ``nbytes``."""
    return -(-nbytes // piece_size)


def needs_communication(t: Transfer) -> bool:
    """Whether a transfer moves bytes between ranks (else every member works alone)."""
    return len(t.chain) > 1 and t.nbytes > 0


def last_step(start: int, n: int, pos: int, length: int) -> int:
    """Last step in which the member at ``pos`` of a chain of ``length`` has an operation.

    The member receives piece i at ``start + pos - 1 + i`` and forwards it one step later,
    except the tail, which only receives.
    """
    return start + n - 1 + pos - (1 if pos == length - 1 else 0)


def alloc_step(start: int, pos: int) -> int:
    """Step in which the member at ``pos`` allocates its buffer.

    The head does so in the local phase of the step before it sends piece 0 (to prefill
    it); the others just before posting their first receive.
    """
    return start - 1 if pos == 0 else start + pos - 1


def _earliest_start(free_step: int, pos: int) -> int:
    """First start step at which a member at ``pos`` may take a buffer slot.

    The slot's previous buffer is handed to its sink, then dropped, in the local phase of
    ``free_step``. The head allocates in a local phase after that phase's sinks, so step
    ``free_step`` itself is fine; the others allocate before a step's local phase, so
    they need the step after.
    """
    return free_step + 1 if pos == 0 else free_step + 2 - pos


def plan_schedule(transfers: Sequence[Transfer], piece_size: int,
                  max_inflight: int) -> dict[int, int]:
    """Start step of every transfer that communicates, keyed by tid.

    Greedy in tid order: a transfer starts as soon as every member has a free buffer slot
    (each rank has ``max_inflight``). Transfers with disjoint members overlap freely, so
    independent chains run side by side. Pure and deterministic: all ranks agree.

    Each rank's slots are a row of free steps; a transfer takes, on each member, the slot
    that frees first (its smallest entry) and holds it until its last step. The members
    of one transfer are distinct ranks, so each transfer is a handful of array operations
    over its chain: a whole-state load of thousands of ranks chains every rank through
    every chunk, and a Python step per member made this the coordinator's largest cost.
    """
    ordered = sorted(filter(needs_communication, transfers), key=lambda t: t.tid)
    if not ordered:
        return {}
    world = 1 + max(max(t.chain) for t in ordered)
    slots = np.full((world, max_inflight), -1, dtype=np.int64)  # each slot's free step
    longest = max(len(t.chain) for t in ordered)
    positions = np.arange(longest, dtype=np.int64)
    wait = np.where(positions == 0, 1, 2 - positions)  # _earliest_start's offset per position
    starts: dict[int, int] = {}
    for t in ordered:
        chain = np.asarray(t.chain, dtype=np.int64)
        length = len(chain)
        held = slots[chain]
        slot = held.argmin(axis=1)
        free = held[np.arange(length), slot]
        start = max(0, int((free + wait[:length]).max()))
        last = start + npieces(t.nbytes, piece_size) - 1 + positions[:length]
        last[-1] -= 1  # the tail only receives (last_step)
        slots[chain, slot] = last + 1
        starts[t.tid] = start
    return starts


class Part(NamedTuple):
    """One rank's part in one transfer: everything it needs to take part, nothing more.

    ``step`` is the step in which this member sends piece 0 (it receives piece ``i`` at
    ``step - 1 + i``), or ``LOCAL`` for a transfer without communication; ``prev`` and
    ``next`` are the ranks it receives from and forwards to (``NONE`` for the head and the
    tail).
    """

    tid: int
    nbytes: int
    step: int
    prev: int
    next: int

    @property
    def is_head(self) -> bool:
        return self.prev == NONE


LOCAL = -1  # Part.step of a transfer that moves nothing between ranks
NONE = -1  # Part.prev of a head, Part.next of a tail


class RotatedChains(NamedTuple):
    """Transfers whose chains are rotations of one ascending list of ranks, as
    ``plan.reads`` makes them (each chunk read by one of the ranks that need it and
    forwarded round the others), with their start steps: enough for each of those ranks
    to compute its own parts (:func:`rotated_parts`). A coordinator sends every group of
    ranks that need the same chunks one of these instead of building each rank's parts:
    where every rank needs every chunk (a whole-state load) that is world x chunks rows
    it neither builds nor sends.

    ``needers``: the ranks, an int array, or ``(first, stride, count)`` where they are
    evenly spaced (every rank of a DDP job, the replicas of an HSDP shard). Per transfer:
    ``tids``, ``starts`` (``LOCAL``: it moves nothing between ranks) and ``heads`` (the
    index in the needers of the rank that heads it).
    """

    needers: np.ndarray | tuple[int, int, int]
    tids: np.ndarray
    starts: np.ndarray
    heads: np.ndarray

    def ranks(self) -> np.ndarray:
        if isinstance(self.needers, tuple):
            first, stride, count = self.needers
            return np.arange(first, first + stride * count, stride, dtype=np.int64)
        return self.needers


class PackedChains:
    """Groups of transfers (``RotatedChains``) pickled once, where the read plan is made.
    DCP's scatter of the plans (and ckptturbo's own round) pickles each rank's plan on its
    own, so a group shared by thousands of ranks (every rank of a DDP job) was pickled for
    each of them: its arrays were most of each rank's plan (15 KiB and 12 us of the
    coordinator's time a rank of a simulated DDP load of Qwen2.5-3B, 5 us packed). A bytes
    object pickles as one copy; each rank unpacks its own."""

    __slots__ = ("blob",)

    def __init__(self, blob: bytes) -> None:
        self.blob = blob

    @classmethod
    def of(cls, chains: tuple[RotatedChains, ...]) -> PackedChains:
        return cls(pickle.dumps(chains, protocol=pickle.HIGHEST_PROTOCOL))

    def unpack(self) -> tuple[RotatedChains, ...]:
        chains: tuple[RotatedChains, ...] = pickle.loads(self.blob)
        return chains

    def __reduce__(self) -> tuple[type[PackedChains], tuple[bytes]]:
        return PackedChains, (self.blob,)


class Rotations(NamedTuple):
    """Transfers whose chains are rotations of one list of ranks, before scheduling:
    ``needers`` (ascending, distinct), and per transfer its ``tids``, ``nbytes`` and
    ``heads`` (the index in the needers of the rank that reads it and heads its chain,
    which then goes round the others in order). What a read plan is when chunks are
    needed by the same ranks (``plan.plan_readers``), without a chain of world_size
    ranks per chunk."""

    needers: np.ndarray
    tids: np.ndarray
    nbytes: np.ndarray
    heads: np.ndarray


def schedule_rotations(sets: Sequence[Rotations], world_size: int, piece_size: int,
                       max_inflight: int) -> list[RotatedChains]:
    """:func:`plan_schedule` for transfers given as rotations, with the result in the form
    the ranks take it (:class:`RotatedChains`, one per set): the same greedy in tid order
    over all sets, the same start steps, and the same checks as :func:`validate`. A
    member's position in a rotation is arithmetic on its index among the needers, so no
    chain is built and evenly spaced needers (every rank of a DDP job) address their
    ranks' buffer slots as a view: at 4,096 ranks a whole-state load's 1,200 chains were
    5 million chain places to build, check and gather."""
    for s in sets:
        _check_rotations(s, world_size)
    tids = np.concatenate([s.tids for s in sets]) if sets else np.empty(0, np.int64)
    if len(np.unique(tids)) != len(tids):
        values, counts = np.unique(tids, return_counts=True)
        raise PlanError(f"transfer {int(values[counts > 1][0])}: duplicate tid")
    starts = [np.full(len(s.tids), LOCAL, dtype=np.int64) for s in sets]
    which = np.concatenate([np.full(len(s.tids), i, dtype=np.int64)
                            for i, s in enumerate(sets)]) if sets else np.empty(0, np.int64)
    at = np.concatenate([np.arange(len(s.tids)) for s in sets]) if sets else which
    slots = np.full((world_size, max_inflight), -1, dtype=np.int64)  # each slot's free step
    views = [_slot_view(slots, s.needers) for s in sets]
    ramps = [_ramps(len(s.needers)) for s in sets]
    for k in np.argsort(tids, kind="stable").tolist():
        i, j = int(which[k]), int(at[k])
        s = sets[i]
        length, nbytes = len(s.needers), int(s.nbytes[j])
        if length < 2 or nbytes == 0:
            continue  # moves nothing between ranks
        head, view = int(s.heads[j]), views[i]
        held = view if view is not None else slots[s.needers]
        slot = held.argmin(axis=1)
        members, wait, tail_end = ramps[i]
        free = held[members, slot]
        start = max(0, int((free + np.roll(wait, head)).max()))
        last = start + npieces(nbytes, piece_size) - 1 + np.roll(tail_end, head)
        if view is not None:
            view[members, slot] = last + 1
        else:
            slots[s.needers, slot] = last + 1
        starts[i][j] = start
    return [RotatedChains(_compact(s.needers), s.tids.astype(np.int32),
                          begin.astype(np.int32), s.heads.astype(np.int32))
            for s, begin in zip(sets, starts, strict=True)]


def _check_rotations(s: Rotations, world_size: int) -> None:
    """What :func:`validate` refuses, checked once per set of needers."""
    needers = np.asarray(s.needers)
    first = int(s.tids[0]) if len(s.tids) else None
    if not len(needers):
        raise PlanError(f"transfer {first}: needs a non-empty chain")
    if (np.diff(needers) <= 0).any() or needers[0] < 0 or needers[-1] >= world_size:
        raise PlanError(f"transfer {first}: chain {needers[:8].tolist()} must list distinct "
                        f"ranks of a group of {world_size}, ascending")
    if len(s.nbytes) and int(s.nbytes.min()) < 0:
        raise PlanError(f"transfer {int(s.tids[int(s.nbytes.argmin())])}: needs nbytes >= 0")
    if len(s.heads) and (int(s.heads.min()) < 0 or int(s.heads.max()) >= len(needers)):
        raise PlanError(f"transfer {first}: a head outside its {len(needers)} ranks")


def _slot_view(slots: np.ndarray, needers: np.ndarray) -> np.ndarray | None:
    """The rows of ``slots`` of evenly spaced needers as a view (written through in
    place), or None for others (gathered per transfer)."""
    compact = _compact(needers)
    if not isinstance(compact, tuple):
        return None
    first, stride, count = compact
    return slots[first:first + stride * (count - 1) + 1:stride]


def _ramps(length: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For a chain of ``length`` headed by its first needer: the needers' indices, each
    position's wait (:func:`_earliest_start`'s offset) and its last step after the start
    minus the pieces (:func:`last_step`); :func:`np.roll` by the head gives any rotation's."""
    positions = np.arange(length, dtype=np.int64)
    wait = np.where(positions == 0, 1, 2 - positions)
    tail_end = positions.copy()
    tail_end[-1] -= 1  # the tail only receives
    return positions, wait, tail_end


def _compact(ranks: Sequence[int] | np.ndarray) -> np.ndarray | tuple[int, int, int]:
    """Evenly spaced ranks as ``(first, stride, count)``, any others as an array."""
    array = np.asarray(ranks, dtype=np.int64)
    if len(array) == 1:
        return (int(array[0]), 1, 1)
    steps = np.diff(array)
    if (steps == steps[0]).all():
        return (int(array[0]), int(steps[0]), len(array))
    return array.astype(np.int32)


def rotated_parts(groups: Sequence[RotatedChains], rank: int) -> np.ndarray:
    """``rank``'s parts of every transfer of ``groups`` it takes part in, as rows (tid,
    step, prev, next), in tid order: what the whole transfer list gives it
    (:func:`own_parts`)."""
    rows = []
    for group in groups:
        ranks = group.ranks()
        i = int(np.searchsorted(ranks, rank))
        if i == len(ranks) or ranks[i] != rank:
            continue
        length = len(ranks)
        pos = (i - group.heads) % length
        local = group.starts == LOCAL
        step = np.where(local, LOCAL, group.starts.astype(np.int64) + pos)
        # a member of a transfer that moves nothing takes an empty sink from its head
        prev = np.where(pos == 0, NONE,
                        np.where(local, ranks[group.heads], ranks[(i - 1) % length]))
        nxt = np.where(local | (pos == length - 1), NONE, ranks[(i + 1) % length])
        rows.append(np.stack([group.tids.astype(np.int64), step, prev, nxt], axis=1))
    if not rows:
        return np.empty((0, 4), dtype=np.int64)
    out = np.concatenate(rows)
    return out[np.argsort(out[:, 0], kind="stable")]


def own_parts(transfers: Sequence[Transfer], rank: int, piece_size: int,
              max_inflight: int) -> list[Part]:
    """``rank``'s parts, from the whole transfer list (what :meth:`ChainBroadcaster.run`
    does on every rank; a coordinator that plans for all ranks sends :class:`RotatedChains`)."""
    starts = plan_schedule(transfers, piece_size, max_inflight)
    out = []
    for t in sorted(transfers, key=lambda t: t.tid):
        if rank not in t.chain:
            continue
        pos, chain = t.chain.index(rank), t.chain
        prev = chain[pos - 1] if pos else NONE
        if t.tid not in starts:
            out.append(Part(t.tid, t.nbytes, LOCAL, chain[0] if pos else NONE, NONE))
        else:
            nxt = chain[pos + 1] if pos + 1 < len(chain) else NONE
            out.append(Part(t.tid, t.nbytes, starts[t.tid] + pos, prev, nxt))
    return out


def source_order_of(parts: Sequence[Part]) -> list[int]:
    """The tids a rank heads, in the order :meth:`ChainBroadcaster.run_parts` pulls their
    sources: chains by start step (then tid), then transfers without communication by tid.
    A prefetcher that reads in this order always has the next source's bytes coming first.
    """
    chained = sorted((p.step, p.tid) for p in parts if p.is_head and p.step != LOCAL)
    local = sorted(p.tid for p in parts if p.is_head and p.step == LOCAL)
    return [tid for _, tid in chained] + local


def source_order(transfers: Sequence[Transfer], rank: int, piece_size: int,
                 max_inflight: int) -> list[int]:
    """:func:`source_order_of` the parts ``rank`` has in ``transfers``."""
    return source_order_of(own_parts(transfers, rank, piece_size, max_inflight))


def plan_digest(transfers: Sequence[Transfer]) -> int:
    """A 56-bit digest of a whole transfer list (the same on every rank that has it)."""
    plan = sorted((t.tid, t.nbytes, t.chain) for t in transfers)
    return int.from_bytes(hashlib.blake2b(repr(plan).encode(), digest_size=7).digest(), "little")


def validate(transfers: Sequence[Transfer], world_size: int) -> None:
    """Reject a transfer list that no schedule can serve, before any rank communicates."""
    seen: set[int] = set()
    for t in transfers:
        if t.tid in seen:
            raise PlanError(f"transfer {t.tid}: duplicate tid")
        seen.add(t.tid)
        if t.nbytes < 0 or not t.chain:
            raise PlanError(f"transfer {t.tid}: needs nbytes >= 0 and a non-empty chain, got {t}")
        if len(set(t.chain)) != len(t.chain) or min(t.chain) < 0 or max(t.chain) >= world_size:
            raise PlanError(f"transfer {t.tid}: chain {t.chain} must list distinct ranks "
                            f"of a group of {world_size}")


def validate_parts(parts: Sequence[Part], world_size: int) -> None:
    """Reject parts no schedule produced (what a rank can check of its own share)."""
    seen: set[int] = set()
    for p in parts:
        if p.tid in seen:
            raise PlanError(f"transfer {p.tid}: this rank has two parts in it")
        seen.add(p.tid)
        if p.nbytes < 0 or not (NONE <= p.prev < world_size and NONE <= p.next < world_size):
            raise PlanError(f"transfer {p.tid}: malformed part {tuple(p)} "
                            f"for a group of {world_size}")

