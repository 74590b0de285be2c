"""Steps every rank runs together, whose outcome every rank must share.

After DCP's own collectives (a tiered save's commit, a tiered load's choice of checkpoint)
ranks do local I/O and then meet again. A rank that raised alone would leave the others
waiting in the next collective until a timeout, so each such step ends with the ranks
exchanging their outcome: every rank gets every result, or every rank raises.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

from .errors import CkptTurboError

T = TypeVar("T")


def gather(group: Any, value: Any) -> list[Any]:
    """Every rank's ``value``, in rank order (``group`` None: this process alone)."""
    if group is None:
        return [value]
    out: list[Any] = [None] * dist.get_world_size(group)
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
