"""ct.save and ct.load on a small gloo group run DCP's protocol with ckptturbo's own rounds
(``dcp_protocol``): the same checkpoints as dcp.save/dcp.load (each loads through the
other), Stateful values handled as DCP handles them, none of torch's ring object
collectives on the way, and a failure on one rank raised on every rank."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import ckptturbo as ct
from ckptturbo.testing.launcher import run_distributed
from tests.test_dcp_distributed import CHUNK, build_state, check_state


class _Counter:
    """A Stateful value: DCP saves what ``state_dict`` returns and hands the loaded values
    to ``load_state_dict``."""

    def __init__(self, value: float) -> None:
        self.weights = torch.full((64,), value)
        self.loaded = 0

    def state_dict(self) -> dict:
        return {"weights": self.weights}

    def load_state_dict(self, state: dict) -> None:
        self.weights = state["weights"]
        self.loaded += 1


def _state(world: int, zeros: bool) -> dict:
    sd = build_state(world, zeros=zeros)
    sd["counter"] = _Counter(0.0 if zeros else 3.5)
    return sd


def _ring_collectives_counted() -> list[str]:
    """Names of torch's ring object collectives called from now on in this process (a
    record kept around the real functions, which still run)."""
    called: list[str] = []
    for name in ("all_gather_object", "gather_object", "scatter_object_list"):
        real = getattr(dist, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            called.append(_name)
            return _real(*args, **kwargs)

        setattr(dist, name, counted)
    return called


def _round_trip_rank(rank: int, world: int, root: str) -> tuple[list, list]:
    """Saves through ct.save and dcp.save, loads each through ct.load, and ct.save's
    through dcp.load; returns the object collectives each step called, and per load
    whether the Stateful value got the saved weights and how often it was loaded."""
    called = _ring_collectives_counted()
    ours, theirs = f"{root}/ours/step-1", f"{root}/dcps/step-1"
    marks = []
    ct.save(_state(world, zeros=False), ours, chunk_size=CHUNK).wait(timeout=120)
    marks.append(len(called))
    dcp.save(_state(world, zeros=False),
             storage_writer=ct.TurboWriter(theirs, chunk_size=CHUNK))
    marks.append(len(called))
    outcomes = []
    for url in (ours, theirs):
        sd = _state(world, zeros=True)
        counter = sd["counter"]
        ct.load(sd, url)
        check_state(sd)
        outcomes.append((torch.equal(counter.weights, torch.full((64,), 3.5)), counter.loaded))
    marks.append(len(called))
    sd = _state(world, zeros=True)
    dcp.load(sd, storage_reader=ct.TurboReader(ours))  # DCP's own protocol reads ours
    check_state(sd)
    outcomes.append((torch.equal(sd["counter"].weights, torch.full((64,), 3.5)),
                     sd["counter"].loaded))
    marks.append(len(called))
    steps = [sorted(set(called[a:b])) for a, b in zip([0, *marks], marks, strict=False)]
    return steps, outcomes


@pytest.mark.parametrize("world", [2, 3])
def test_ct_save_and_load_make_and_read_dcps_checkpoints_without_ring_collectives(
        tmp_path, world):
    results = run_distributed(_round_trip_rank, world, str(tmp_path), timeout=240)
    for rank, (steps, outcomes) in enumerate(results):
        ct_save, dcp_save, ct_loads, dcp_load = steps
        # ckptturbo's rounds instead of torch's object collectives; DCP's own calls them
        # (which shows the record works)
        assert ct_save == [] and ct_loads == [], (rank, steps)
        assert "gather_object" in dcp_save and "all_gather_object" in dcp_load, (rank, steps)
        assert outcomes == [(True, 1)] * 3, (rank, outcomes)


class _FailsOnRank1(ct.TurboSavePlanner):
    """A planner whose local step fails on rank 1 after the planners' digest exchange (as
    a storage layer's would), and whose global plan fails on the coordinator when told."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.where = where

    def create_local_plan(self):
        plan = super().create_local_plan()
        if self.where == "local" and dist.get_rank() == 1:
            raise ValueError("tensor 'ddp.w' has a shape this planner rejects")
        return plan

    def create_global_plan(self, all_plans):
        if self.where == "global":
            raise ValueError("tensor 'ddp.w' has a shape this planner rejects")
        return super().create_global_plan(all_plans)


def _failing_save_rank(rank: int, world: int, url: str, where: str) -> tuple[str, str]:
    handle = ct.save(_state(world, zeros=False), url, planner=_FailsOnRank1(where))
    try:
        handle.wait(timeout=120)
    except BaseException as exc:  # noqa: BLE001 - the outcome is what the test checks
        return type(exc).__name__, str(exc)
    return "ok", ""


@pytest.mark.parametrize("where", ["local", "global"])
def test_a_failure_on_one_rank_fails_the_save_on_every_rank_and_commits_nothing(tmp_path,
                                                                                 where):
    url = str(tmp_path / "run" / "step-1")
    outcomes = run_distributed(_failing_save_rank, 3, url, where, timeout=240)
    for rank, (kind, message) in enumerate(outcomes):
        assert kind == "CkptTurboError", (rank, kind, message)
        assert "tensor 'ddp.w' has a shape this planner rejects" in message, (rank, message)
    assert not ct.exists(url)


def _planning_fails_on_rank_1(rank: int, world: int, root: str, what: str
                              ) -> tuple[str, str, float]:
    """Rank 1's own planning step raises (a fault injected into ckptturbo's planning
    function in that process alone); the outcome and time of each rank's save or load."""
    import time

    from ckptturbo import planner as planner_module

    url = f"{root}/run/step-1"
    if what == "load":
        ct.save(_state(world, zeros=False), url, chunk_size=CHUNK).wait(timeout=120)
    if rank == 1:
        def broken(*args, **kwargs):
            raise ValueError("tensor 'ddp.w' cannot be planned here")

        name = "local_save_plan" if what == "save" else "materialise_meta"
        setattr(planner_module, name, broken)
    started = time.monotonic()
    try:
        if what == "save":
            ct.save(_state(world, zeros=False), f"{root}/run/step-2").wait(timeout=120)
        else:
            ct.load(_state(world, zeros=True), url)
    except BaseException as exc:  # noqa: BLE001 - the outcome is what the test checks
        return type(exc).__name__, str(exc), time.monotonic() - started
    return "ok", "", time.monotonic() - started


@pytest.mark.parametrize("what", ["save", "load"])
def test_a_rank_that_cannot_plan_fails_every_rank_at_once_naming_it(tmp_path, what):
    # its planner still joins the planners' digest exchange, with its failure, so that
    # no rank waits for the group's timeout in collectives that no longer match
    outcomes = run_distributed(_planning_fails_on_rank_1, 3, str(tmp_path), what, timeout=240)
    for rank, (kind, message, seconds) in enumerate(outcomes):
        assert kind == "CkptTurboError" or kind == "PlanError", (rank, kind, message)
        assert "tensor 'ddp.w' cannot be planned here" in message, (rank, message)
        assert seconds < 60, (rank, seconds)
    assert not ct.exists(str(tmp_path / "run" / "step-2"))
