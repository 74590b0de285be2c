"""The one multi-process launcher (ckptturbo.testing.launcher): groups and isolated
processes, per-rank setup, reported and expected failures, and the timeout."""
from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from ckptturbo.testing.launcher import RankFailure, run_distributed, run_isolated


def mark_setup(rank: int) -> None:
    os.environ["LAUNCHER_TEST_SETUP"] = f"set up rank {rank}"


def describe(rank: int, world: int, tag: str) -> dict:
    grouped = dist.is_initialized()
    total = None
    if grouped:
        t = torch.tensor([rank + 1])
        dist.all_reduce(t)
        total = int(t)
    return {"rank": rank, "world": world, "tag": tag, "grouped": grouped, "total": total,
            "setup": os.environ.get("LAUNCHER_TEST_SETUP"), "threads": torch.get_num_threads(),
            "pid": os.getpid()}


def fail_on_rank_one(rank: int, world: int) -> int:
    if rank == 1:
        raise KeyError("rank one fails")
    return rank


def fail_before_a_barrier(rank: int, world: int) -> None:
    """Rank 1 fails on its own; rank 0's barrier then breaks because rank 1 is gone."""
    if rank == 1:
        raise KeyError("rank one fails first")
    dist.barrier()


def sleep_forever(rank: int, world: int) -> None:
    time.sleep(600)


def test_ranks_join_a_group_and_run_their_setup():
    out = run_distributed(describe, 3, "x", timeout=60, setup=mark_setup)
    assert [o["rank"] for o in out] == [0, 1, 2]
    assert all(o["grouped"] and o["total"] == 6 and o["world"] == 3 and o["tag"] == "x"
               for o in out)
    assert [o["setup"] for o in out] == [f"set up rank {r}" for r in range(3)]
    assert len({o["pid"] for o in out} | {os.getpid()}) == 4  # real, separate processes


def test_isolated_process_has_no_group_and_every_cpu():
    out = run_isolated(describe, "alone", timeout=60)
    assert out["grouped"] is False and out["world"] == 1 and out["tag"] == "alone"
    assert out["threads"] == (os.cpu_count() or 1) and out["pid"] != os.getpid()


def test_first_failure_is_raised_with_its_type_and_remote_traceback():
    with pytest.raises(KeyError, match="rank one fails") as info:
        run_distributed(fail_on_rank_one, 2, timeout=60)
    assert "fail_on_rank_one" in str(info.value.__cause__)


def test_the_failure_that_broke_the_group_is_raised_not_its_fallout():
    """A peer's broken connection on rank 0 is the fallout of rank 1's own error: the
    launcher raises rank 1's, and names rank 0's too."""
    with pytest.raises(KeyError, match="rank one fails first") as info:
        run_distributed(fail_before_a_barrier, 2, timeout=60)
    assert "fail_before_a_barrier" in str(info.value.__cause__)


def test_expected_failures_are_returned():
    out = run_distributed(fail_on_rank_one, 3, timeout=60, expect_failures=True)
    assert out[0] == 0 and out[2] == 2
    assert isinstance(out[1], RankFailure) and isinstance(out[1].error, KeyError)
    assert out[1].rank == 1 and "rank one fails" in out[1].traceback


def test_a_hanging_rank_is_killed_at_the_timeout():
    began = time.monotonic()
    out = run_distributed(sleep_forever, 2, timeout=3, backend=None, expect_failures=True)
    assert time.monotonic() - began < 20
    assert all(isinstance(o, RankFailure) and "timeout" in o.traceback for o in out)
