"""The writer's plan cache across a changed world: the part of a grouped save's plan that
depends only on the distinct local plans (``save_groups.DistinctPlans``) is kept and
reused when the same distinct plans come from another world (fewer ranks, a subgroup,
plans on other ranks), and dropped, with a log line, when a distinct plan is new."""
from __future__ import annotations

import logging
import pickle

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.planner import SavePlan

import ckptturbo as ct
from ckptturbo.errors import CkptTurboError
from ckptturbo.plan.digests import first_ranks
from ckptturbo.planner import grouped_plan, save_digest
from ckptturbo.save_groups import assign_grouped, distinct_plans
from ckptturbo.testing.launcher import run_distributed

CHUNK = 16 << 10


def _state(part: int, wide: bool = False) -> dict:
    """A DDP-like state (``w``, ``b``, ``step`` on every rank) with one part of a sharded
    corner (``part.0`` or ``part.1``): ranks of one part make the same local plan, as the
    replicas of an HSDP shard do. ``wide``: ``w`` one column wider (a new shard shape)."""
    g = torch.Generator().manual_seed(11)
    sd: dict = {"w": torch.randn(300, 201 if wide else 200, generator=g),
                "b": torch.randn(200, generator=g), "step": 7}
    sd[f"part.{part}"] = torch.randn(64, 32, generator=torch.Generator().manual_seed(20 + part))
    return sd


def _sent(parts: list[int], wide: bool = False) -> list[SavePlan]:
    """The plans the coordinator gets from ranks holding ``parts`` (one per rank) under
    ``TurboSavePlanner``, made as each rank makes them: each distinct plan sent whole by
    its first rank with its holdings, a digest from the others, pickled as they travel."""
    local = []
    for part in parts:
        planner = ct.TurboSavePlanner()
        planner.set_up_planner(_state(part, wide), is_coordinator=False)
        local.append(planner.create_local_plan())
    digests = [save_digest(p) for p in local]
    firsts = set(first_ranks(digests).values())
    writer = ct.TurboWriter("unused")
    writer.set_up_storage_writer(False)
    sent = [pickle.loads(pickle.dumps(writer.prepare_local_plan(
        grouped_plan(plan, digest, rank in firsts))))
        for rank, (plan, digest) in enumerate(zip(local, digests, strict=True))]
    return sent


def _coordinator_input(parts: list[int], wide: bool = False) -> list[SavePlan]:
    """What the writer's coordinator gets: :func:`_sent`, then the planner's global plan
    (DCP's dedup over the distinct plans)."""
    return ct.TurboSavePlanner().create_global_plan(_sent(parts, wide))[0]


def _planned(plans: list[SavePlan]) -> list[tuple]:
    """What a global plan hands each rank, but the storage layer's data (this save's)."""
    return [(p.items, p.planner_data.digest, p.planner_data.sender) for p in plans]


def test_the_planner_keeps_the_global_plan_of_the_same_distinct_plans():
    """TurboSavePlanner's global plan over the distinct plans (DCP's dedup and metadata)
    is made once for the same distinct plans, from another world too (a fresh planner, as
    ct.save makes one per save), and again for a new distinct plan; what it hands back
    equals a plan made afresh, with this save's storage data."""
    ct.TurboSavePlanner._last_distinct = None
    _, four = ct.TurboSavePlanner().create_global_plan(_sent([0, 1, 0, 1]))
    kept = ct.TurboSavePlanner._last_distinct
    sent = _sent([1, 0, 0])
    plans, three = ct.TurboSavePlanner().create_global_plan(sent)
    assert ct.TurboSavePlanner._last_distinct is not kept  # digests in another order
    plans, three = ct.TurboSavePlanner().create_global_plan(_sent([0, 1, 1]))
    kept = ct.TurboSavePlanner._last_distinct
    sent = _sent([0, 0, 1, 1, 1])
    plans, again = ct.TurboSavePlanner().create_global_plan(sent)
    assert ct.TurboSavePlanner._last_distinct is kept and again is three
    assert [p.storage_data for p in plans] == [p.storage_data for p in sent]
    ct.TurboSavePlanner._last_distinct = None
    fresh, metadata = ct.TurboSavePlanner().create_global_plan(_sent([0, 0, 1, 1, 1]))
    assert _planned(plans) == _planned(fresh) and again == metadata
    _, wide = ct.TurboSavePlanner().create_global_plan(_sent([0, 0, 1, 1, 1], wide=True))
    assert wide != metadata and wide.state_dict_metadata["w"].size == torch.Size([300, 201])


def _assigned(plans: list[SavePlan], **options) -> list[tuple]:
    out = assign_grouped(plans, chunk_size=CHUNK, weights=None, save_id="s", **options)
    return [(a.rows, a.replicated, a.signature) for a in out]


@pytest.mark.parametrize("balance", [True, False])
def test_the_kept_part_gives_the_same_assignment_in_a_changed_world(balance):
    """Kept from 6 ranks, used for 3 (the distinct plans numbered the other way round) and
    for 2 (each plan on one rank: its replica flags differ): the same result as planning
    from scratch; for other distinct plans it refuses."""
    kept = distinct_plans(_coordinator_input([0, 1, 0, 1, 0, 1]))
    for parts in ([1, 0, 0], [0, 1]):
        plans = _coordinator_input(parts)
        for check in (True, False):
            fresh = _assigned(plans, balance=balance, check_replicas=check)
            assert _assigned(plans, balance=balance, check_replicas=check,
                             distinct=kept) == fresh, (parts, check)
    with pytest.raises(CkptTurboError, match="other plans than this save's"):
        _assigned(_coordinator_input([0, 1], wide=True), balance=balance, check_replicas=True,
                  distinct=kept)


def test_the_writer_reuses_the_distinct_plans_and_says_why(caplog):
    writer = ct.TurboWriter("memory://plan-cache/a")
    caplog.set_level(logging.INFO, logger="ckptturbo.writer")
    writer.prepare_global_plan(_coordinator_input([0, 1, 0, 1]))
    writer.prepare_global_plan(_coordinator_input([0, 1, 0]))
    assert (writer.plan_cache_hits, writer.plan_cache_partial_hits) == (0, 1)
    assert ("the world changed from 4 to 3 ranks, with the same 2 distinct local plans: "
            "reusing their plan, assigning writes again") in caplog.text
    writer.prepare_global_plan(_coordinator_input([0, 1, 0]))
    assert (writer.plan_cache_hits, writer.plan_cache_partial_hits) == (1, 1)
    writer.prepare_global_plan(_coordinator_input([1, 0, 0]))  # plans on other ranks
    assert (writer.plan_cache_hits, writer.plan_cache_partial_hits) == (1, 2)
    assert "2 of 3 ranks' local plans changed, with the same 2 distinct" in caplog.text
    writer.prepare_global_plan(_coordinator_input([1, 0, 0], wide=True))
    assert (writer.plan_cache_hits, writer.plan_cache_partial_hits) == (1, 2)
    assert ("the last plan does not fit (3 of 3 ranks' local plans changed; 2 of 2 distinct "
            "local plans new, 2 gone: the shard shapes or the state changed); planning "
            "again") in caplog.text


class _Lines(logging.Handler):
    """The writer's log lines on a rank."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _save_in_changed_worlds(rank: int, world: int, root: str) -> dict:
    """One writer per rank for three saves: the whole world; a subgroup of ranks 0-2 with
    the same distinct local plans (rank 3 stays out); the whole world with ``w`` wider."""
    lines = _Lines()
    logger = logging.getLogger("ckptturbo.writer")
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    writer = ct.TurboWriter(f"{root}/step-0", chunk_size=CHUNK)
    subgroup = dist.new_group([0, 1, 2])  # every rank makes it
    counts = []
    for step, (group, wide) in enumerate(((dist.group.WORLD, False), (subgroup, False),
                                          (dist.group.WORLD, True))):
        if group is subgroup and rank == 3:
            continue
        dcp.save(_state(rank % 2, wide), checkpoint_id=f"{root}/step-{step}",
                 storage_writer=writer, planner=ct.TurboSavePlanner(group), process_group=group)
        counts.append((writer.plan_cache_hits, writer.plan_cache_partial_hits))
    logger.removeHandler(lines)
    return {"counts": counts, "lines": lines.lines}


def _loaded(url: str, wide: bool) -> dict:
    sd = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0
          for k, v in {**_state(0, wide), **_state(1, wide)}.items()}
    ct.load(sd, url)
    return sd


def test_a_subgroup_save_reuses_the_plan_and_a_new_shape_replans(tmp_path):
    root = str(tmp_path / "run")
    out = run_distributed(_save_in_changed_worlds, 4, root, timeout=120)
    assert out[0]["counts"] == [(0, 0), (0, 1), (0, 1)]
    lines = [line for line in out[0]["lines"] if "plan" in line]
    assert lines[0].endswith("the world changed from 4 to 3 ranks, with the same 2 distinct "
                             "local plans: reusing their plan, assigning writes again")
    assert "the world changed from 3 to 4 ranks; 2 of 2 distinct local plans new, 2 gone" \
        in lines[1] and lines[1].endswith("planning again")
    for step, wide in enumerate((False, False, True)):
        sd = _loaded(f"{root}/step-{step}", wide)
        for key, value in {**_state(0, wide), **_state(1, wide)}.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(sd[key], value), (step, key)
            else:
                assert sd[key] == value, (step, key)
