"""agreement.gather and agree on real gloo groups: every rank's value in rank order, whatever
its size, and a failure on one rank raised on every rank."""
from __future__ import annotations

import pytest
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from ckptturbo import agreement
from ckptturbo.errors import CkptTurboError
from ckptturbo.testing.launcher import RankFailure, run_distributed


def _value(rank: int, size: int) -> dict:
    return {"rank": rank, "blob": bytes([rank % 256]) * size, "nested": [rank, None, (rank,)]}


def _gather_rank(rank: int, world: int, sizes: list[int]) -> list[bool]:
    """For each size of ``sizes`` (per rank: size x (rank + 1)), whether gather returned
    every rank's value, in order; once on the default group, once on a subgroup of the
    odd ranks (its own rank 0 gathers)."""
    out = []
    for size in sizes:
        got = agreement.gather(dist.group.WORLD, _value(rank, size * (rank + 1)))
        out.append(got == [_value(r, size * (r + 1)) for r in range(world)])
    odd = dist.new_group([r for r in range(world) if r % 2])
    if rank % 2:
        got = agreement.gather(odd, _value(rank, 10))
        out.append(got == [_value(r, 10) for r in range(world) if r % 2])
    return out


@pytest.mark.parametrize("world", [3, 4])
def test_gather_returns_every_ranks_value_in_order_small_or_over_the_slot(world):
    # 0: in the slot; just under and over it (the second round, sized for the largest);
    # over TABLE_BYTES at 4 ranks: all_gather_object
    sizes = [0, agreement.SLOT_BYTES - 200, agreement.SLOT_BYTES * 3,
             agreement.TABLE_BYTES // 8]
    results = run_distributed(_gather_rank, world, sizes, timeout=180)
    for rank, oks in enumerate(results):
        assert all(oks) and len(oks) == len(sizes) + rank % 2, (rank, oks)


def _agree_rank(rank: int, world: int) -> list[int]:
    def step() -> int:
        if rank == 1:
            raise ValueError("rank 1's step failed: disk full")
        return rank

    agreement.agree(dist.group.WORLD, "testing agreement", lambda: rank)
    return agreement.agree(dist.group.WORLD, "writing the shards", step)


def test_a_failure_on_one_rank_is_raised_on_every_rank_naming_it():
    results = run_distributed(_agree_rank, 3, timeout=120, expect_failures=True)
    assert all(isinstance(r, RankFailure) for r in results), results
    assert isinstance(results[1].error, ValueError), results[1]
    for rank in (0, 2):
        error = results[rank].error
        assert isinstance(error, CkptTurboError), results[rank]
        assert "writing the shards failed on rank 1: ValueError: rank 1's step failed" in \
            str(error), str(error)


def _decide_rank(rank: int, world: int, small_group: int) -> list:
    agreement.SMALL_GROUP = small_group  # 0: the large group's way, through rank 0 alone
    seen: list[int] = []

    def rule(values: list[str]) -> dict[str, int]:
        seen.append(rank)
        return {value: values.index(value) for value in values}

    firsts = agreement.decide(dist.group.WORLD, "ab"[rank % 2], rule)
    everyone = agreement.gather(dist.group.WORLD, rank * 10)
    return [firsts, everyone, seen]


@pytest.mark.parametrize("small_group", [agreement.SMALL_GROUP, 0])
def test_decide_gives_every_rank_the_rules_outcome_on_small_and_large_groups(small_group):
    results = run_distributed(_decide_rank, 3, small_group, timeout=120)
    for rank, (firsts, everyone, seen) in enumerate(results):
        assert firsts == {"a": 0, "b": 1}, (rank, firsts)
        assert everyone == [0, 10, 20], (rank, everyone)
        # a small group applies the rule on every rank, a large one on rank 0 alone
        assert seen == ([rank] if small_group or rank == 0 else []), (rank, seen)


def _reduce_scatter_rank(rank: int, world: int, sizes: list[int]) -> list[bool]:
    """For each size: every rank sends a value of size x (rank + 1) bytes, rank 0 makes a
    part per rank of the same sizes reversed, and each rank checks it got its own part;
    once more on a subgroup of the odd ranks."""
    out = []
    for size in sizes:
        def parts(values: list[dict], size: int = size) -> list[dict]:
            assert rank == 0 and values == [_value(r, size * (r + 1)) for r in range(world)]
            return [_value(r, size * (world - r)) for r in range(world)]

        got = agreement.reduce_scatter(dist.group.WORLD, "plan",
                                       lambda size=size: _value(rank, size * (rank + 1)), parts)
        out.append(got == _value(rank, size * (world - rank)))
    odd = dist.new_group([r for r in range(world) if r % 2])
    if rank % 2:
        got = agreement.reduce_scatter(odd, "plan", lambda: rank, lambda values: values[::-1])
        mine = [r for r in range(world) if r % 2]
        out.append(got == mine[::-1][dist.get_rank(odd)])
    return out


@pytest.mark.parametrize("world", [3, 4])
def test_reduce_scatter_gives_each_rank_its_part_small_or_over_the_slot(world):
    sizes = [0, agreement.SLOT_BYTES - 200, agreement.SLOT_BYTES * 3]
    results = run_distributed(_reduce_scatter_rank, world, sizes, timeout=180)
    for rank, oks in enumerate(results):
        assert all(oks) and len(oks) == len(sizes) + rank % 2, (rank, oks)


class _Unpicklable(Exception):
    def __reduce__(self):
        raise TypeError("cannot pickle this exception")


def _failing_rounds_rank(rank: int, world: int) -> list[tuple[str, dict[int, str]]]:
    """Each round fails somewhere; every rank reports the step and failures it raised."""
    def fail_on(failing: int, exc: Exception):
        def step(*_):
            if rank == failing:
                raise exc
            return [rank] * world
        return step

    rounds = [
        lambda: agreement.reduce_scatter(dist.group.WORLD, "plan",
                                         fail_on(1, ValueError("no such key: 'w'")), list),
        lambda: agreement.reduce_scatter(dist.group.WORLD, "plan", lambda: rank,
                                         fail_on(0, KeyError("global plan failed"))),
        lambda: agreement.all_succeed(dist.group.WORLD, "read",
                                      fail_on(2, _Unpicklable("a socket went away"))),
        lambda: agreement.all_succeed(dist.group.WORLD, "read", lambda: None),
        lambda: agreement.reduce_scatter(dist.group.WORLD, "plan", lambda: rank,
                                         lambda values: values[:1]),
    ]
    seen = []
    for round_ in rounds:
        try:
            round_()
            seen.append(("ok", {}))
        except CheckpointException as exc:
            seen.append((str(exc.args[0]) if exc.args else "", {
                r: f"{type(e).__name__}: {e}" for r, (e, _) in exc.failures.items()}))
    return seen


def test_a_failure_in_dcps_rounds_is_a_checkpoint_exception_on_every_rank():
    results = run_distributed(_failing_rounds_rank, 3, timeout=120)
    for rank, seen in enumerate(results):
        assert seen[0] == ("plan", {1: "ValueError: no such key: 'w'"}), (rank, seen[0])
        # the reducer's own exception (the reduce ran on rank 0 only, not the local step)
        assert seen[1] == ("plan", {0: "KeyError: 'global plan failed'"}), (rank, seen[1])
        # an exception that does not pickle travels as a CkptTurboError with its text
        assert seen[2] == ("read", {2: "CkptTurboError: _Unpicklable: a socket went away"}), \
            (rank, seen[2])
        assert seen[3] == ("ok", {}), (rank, seen[3])
        # a reduction that does not give every rank a part fails every rank, none waits
        assert seen[4] == ("plan", {0: "CkptTurboError: the plan round's reduction gave 1 "
                                       "parts for 3 ranks"}), (rank, seen[4])
