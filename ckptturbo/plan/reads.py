"""Read plans: which rank reads each stored chunk once, and the chain that forwards it.

Pure: every rank computes the same plan from the same inputs; a chunk is an indivisible
piece for the balancing in ``balance``.
"""
from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

from ..errors import PlanError
from .balance import Group, balance
from .checks import check_size, check_weights, group_members


@dataclass(frozen=True, slots=True)
class ReadNeed:
    """A stored chunk and the ranks that need some of its bytes."""

    chunk: str
    nbytes: int
    ranks: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ChainAssignment:
    """chain[0] reads `chunk` from storage and forwards it to chain[1], which forwards on."""

    chunk: str
    nbytes: int
    chain: tuple[int, ...]


def plan_reads(
    needs: Sequence[ReadNeed],
    world_size: int,
    *,
    weights: Sequence[float] | None = None,
) -> list[ChainAssignment]:
    """Choose, for every chunk, the one rank that reads it and the chain that forwards it.

    The reader is the one :func:`plan_readers` chooses. The chain is the reader, then the
    other needers above it ascending, then those below it ascending: when many chunks
    have the same needers, readers rotate and so does the rank that ends each chain, so
    forwarding work spreads evenly. The list is sorted by chunk id, independent of the
    order of `needs`; every rank walks it in that order to post its sends and receives.
    Chunk ids must be unique: merge the needers of a chunk used in several places.
    """
    return [ChainAssignment(n.chunk, n.nbytes, _chain(reader, n.ranks))
            for n, reader in plan_readers(needs, world_size, weights=weights)]


def plan_readers(
    needs: Sequence[ReadNeed],
    world_size: int,
    *,
    weights: Sequence[float] | None = None,
) -> list[tuple[ReadNeed, int]]:
    """Every chunk with the rank that reads it, sorted by chunk id: one of the ranks that
    need it, chosen by the same balancing as `plan_writes` (a chunk is an indivisible
    piece). Apart from the chains (:func:`plan_reads`) because a chain can be world_size
    long: a coordinator that describes chains as rotations of their needers never builds
    them."""
    w = check_weights(weights, world_size)
    ordered = _sorted_needs(needs)
    load = [0] * world_size
    reader = [0] * len(ordered)
    groups = []
    ranks_of = [tuple(n.ranks) for n in ordered]
    ids = [n.chunk for n in ordered]
    for ranks, members in group_members(ranks_of, "chunk", ids, world_size).items():
        if len(ranks) == 1:
            for i in members:
                reader[i] = ranks[0]
                load[ranks[0]] += ordered[i].nbytes
        else:
            pieces = sorted(((ordered[i].nbytes, i) for i in members), key=lambda p: (-p[0], p[1]))
            groups.append(Group(ranks, members, 0, pieces, sum(p[0] for p in pieces)))
    largest = max((n.nbytes for n in ordered), default=0)
    balance(groups, load, w, largest)
    for g in groups:
        for (_, i), rank in zip(g.pieces, g.piece_at, strict=True):
            reader[i] = rank
    return list(zip(ordered, reader, strict=True))


def _sorted_needs(needs: Sequence[ReadNeed]) -> list[ReadNeed]:
    ordered = sorted(needs, key=lambda n: n.chunk)
    for a, b in pairwise(ordered):
        if a.chunk == b.chunk:
            raise PlanError(f"chunk {a.chunk!r} is listed twice: merge its ranks into one need")
    for n in ordered:
        check_size(f"chunk {n.chunk!r}", n.nbytes)
    return ordered


def _chain(reader: int, ranks: tuple[int, ...]) -> tuple[int, ...]:
    """The reader, then the needers above it ascending, then those below it ascending
    (a rotation of the sorted needers: slices, since a chain can be world_size long)."""
    at = bisect_left(ranks, reader)
    return ranks[at:] + ranks[:at]
