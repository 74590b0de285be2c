"""Input checks shared by the write and read planners: bad input is a PlanError naming it."""
from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import pairwise

from ..errors import PlanError


def check_weights(weights: Sequence[float] | None, world_size: int) -> list[float]:
    if not isinstance(world_size, int) or world_size <= 0:
        raise PlanError(f"world_size must be a positive integer, got {world_size!r}")
    if weights is None:
        return [1.0] * world_size
    if len(weights) != world_size:
        raise PlanError(f"got {len(weights)} weights for world_size {world_size}")
    for rank, x in enumerate(weights):
        if not (isinstance(x, (int, float)) and math.isfinite(x) and x > 0):
            raise PlanError(f"weight of rank {rank} must be finite and positive, got {x!r}")
    return [float(x) for x in weights]


def check_size(name: str, nbytes: object) -> None:
    if not isinstance(nbytes, int) or nbytes < 0:
        raise PlanError(f"{name}: size must be a non-negative integer, got {nbytes!r}")


def check_ranks(name: str, ranks: tuple[int, ...], world_size: int) -> None:
    if not ranks:
        raise PlanError(f"{name}: no ranks hold it")
    if not all(isinstance(q, int) for q in ranks):
        raise PlanError(f"{name}: ranks must be integers, got {ranks!r}")
    if any(b <= a for a, b in pairwise(ranks)):
        raise PlanError(f"{name}: ranks must be sorted and unique, got {ranks!r}")
    if ranks[0] < 0 or ranks[-1] >= world_size:
        raise PlanError(f"{name}: rank out of range for world_size {world_size}: {ranks!r}")


def group_members(
    ranks_of: list[tuple[int, ...]], what: str, ids: list[str], world_size: int
) -> dict[tuple[int, ...], list[int]]:
    """Indices of the entries of each distinct rank set, checking each set only once
    (a fully replicated item's holders are world_size long, and there may be thousands)."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, ranks in enumerate(ranks_of):
        groups.setdefault(ranks, []).append(i)
    for ranks, members in groups.items():
        check_ranks(f"{what} {ids[members[0]]!r}", ranks, world_size)
    return groups
