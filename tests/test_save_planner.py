"""TurboSavePlanner across real gloo processes: each distinct plan reaches the coordinator
once, its checkpoints load bit-exact through DCP's own load planner (resharded too), and
DCP's planner and writers and ours mix in either direction."""
from __future__ import annotations

import itertools
import json

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from test_dcp_distributed import CHUNK, build_state, check_state, load_rank, save_rank
from torch.distributed.checkpoint import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    FileSystemReader,
    FileSystemWriter,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import ckptturbo as ct
from ckptturbo.plan.digests import PlanDigest
from ckptturbo.runs import Location
from ckptturbo.testing.launcher import run_distributed


def _ct_save(rank: int, world: int, url: str) -> None:
    ct.save(build_state(world, zeros=False), url, chunk_size=CHUNK,
            pack_threshold=64 << 10).durable.result(timeout=120)


def test_ct_save_plans_with_ours_and_loads_resharded_with_dcps(tmp_path):
    """ct.save with its default, TurboSavePlanner (bound to its group); dcp.load with DCP's
    default load planner reads the checkpoint bit-exact at 3, 2 and 1 ranks (FSDP2, HSDP,
    DDP items)."""
    url = str(tmp_path / "run" / "step-1")
    run_distributed(_ct_save, 4, url, timeout=240)
    for world in (3, 2):
        run_distributed(load_rank, world, url, timeout=240)
    sd = build_state(1, zeros=True)
    dcp.load(sd, storage_reader=ct.TurboReader(url))
    check_state(sd)


def _ct_load(rank: int, world: int, url: str, broadcast: bool) -> None:
    """ct.load with ckptturbo's own load planner (its default; given without a group on
    rank 0, which ct.load binds), bit-exact."""
    sd = build_state(world, zeros=True)
    ct.load(sd, url, broadcast=broadcast, planner=ct.TurboLoadPlanner() if rank == 0 else None)
    check_state(sd)


def test_ct_load_plans_with_ours_checkpoint_of_dcps_planner(tmp_path):
    """A checkpoint planned by DCP's planner (dcp.save + TurboWriter) loads through ct.load
    with ckptturbo's own planner, bit-exact, resharded, chained or not."""
    url = str(tmp_path / "run" / "step-1")
    run_distributed(save_rank, 4, url, timeout=240)
    run_distributed(_ct_load, 3, url, True, timeout=240)
    run_distributed(_ct_load, 2, url, False, timeout=240)


class _OwnSavePlanner(DefaultSavePlanner):
    """A caller's planner of DCP's kind."""


def _mixed_kinds(rank: int, world: int, root: str) -> list[str]:
    """Ranks 0 and 1 save and load with the default planners (ours), the others pass
    DCP's: each rank's save and load must fail with PlanError, not hang. Planners of
    DCP's kind that differ (DCP's and a caller's) plan together."""
    sd = {"w": torch.ones(8, 8), "step": 3}
    errors = []
    theirs = rank >= world // 2
    try:
        ct.save(sd, f"{root}/mixed", planner=DefaultSavePlanner() if theirs else None
                ).durable.result(timeout=60)
    except ct.PlanError as exc:
        errors.append(str(exc))
    ct.save(sd, f"{root}/ok").durable.result(timeout=60)
    ct.save(sd, f"{root}/dcp-kind", planner=_OwnSavePlanner() if theirs else
            DefaultSavePlanner()).durable.result(timeout=60)
    try:
        ct.load(sd, f"{root}/ok", planner=DefaultLoadPlanner() if theirs else None)
    except ct.PlanError as exc:
        errors.append(str(exc))
    return errors


def test_ranks_that_mix_planner_kinds_fail_fast_on_every_rank(tmp_path):
    out = run_distributed(_mixed_kinds, 4, str(tmp_path / "run"), timeout=120)
    for errors in out:
        assert len(errors) == 2, errors
        assert "TurboSavePlanner" in errors[0] and "DefaultSavePlanner" in errors[0]
        assert "TurboLoadPlanner" in errors[1] and "DefaultLoadPlanner" in errors[1]


def _replicated(world: int) -> dict:
    """A DDP state with a sharded corner: every rank's plan is equal but for ``fsdp.w``
    on a 2 x (world/2) mesh, so ranks of one shard column share a plan (HSDP's pattern)."""
    g = torch.Generator().manual_seed(5)
    sd = {"w": torch.randn(300, 200, generator=g), "b": torch.randn(200, generator=g),
          "step": 7}
    if world > 1:
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("rep", "shard"))
        sd["fsdp.w"] = distribute_tensor(torch.randn(64, 32, generator=g), mesh,
                                         [Replicate(), Shard(0)])
    return sd


def _local_plan(rank: int, world: int, sharded: bool) -> tuple[int, bool, str]:
    """What this rank's planner sends the coordinator: items, sender flag, digest."""
    planner = ct.TurboSavePlanner(dist.group.WORLD)
    sd = _replicated(world) if sharded else {"w": torch.ones(8, 8), "step": 3}
    planner.set_up_planner(sd, is_coordinator=rank == 0)
    plan = planner.create_local_plan()
    assert isinstance(plan.planner_data, PlanDigest)
    data = plan.planner_data
    return len(plan.items), data.sender, data.digest


def test_each_distinct_plan_is_sent_once():
    ddp = run_distributed(_local_plan, 4, False, timeout=120)
    assert len({d for _, _, d in ddp}) == 1
    assert [(n > 0, s) for n, s, _ in ddp] == [(True, True)] + [(False, False)] * 3
    hsdp = run_distributed(_local_plan, 4, True, timeout=120)
    # ranks 0 and 2 hold shard 0, ranks 1 and 3 shard 1
    assert hsdp[0][2] == hsdp[2][2] != hsdp[1][2] == hsdp[3][2]
    assert [s for _, s, _ in hsdp] == [True, True, False, False]


def _save_both_ways(rank: int, world: int, root: str) -> dict:
    """The same state saved through DCP's planner and through ours, to TurboWriter; and
    through ours to DCP's FileSystemWriter."""
    sd = _replicated(world)
    dcp.save(sd, storage_writer=ct.TurboWriter(f"{root}/dcp", chunk_size=16 << 10),
             planner=DefaultSavePlanner())
    ours = ct.TurboWriter(f"{root}/ours", chunk_size=16 << 10)
    dcp.save(sd, storage_writer=ours, planner=ct.TurboSavePlanner(dist.group.WORLD))
    dcp.save(sd, storage_writer=FileSystemWriter(f"{root}/fs"),
             planner=ct.TurboSavePlanner(dist.group.WORLD))
    return ours.last_stats


def _load_everywhere(rank: int, world: int, root: str) -> None:
    """Each checkpoint through each load planner, DCP's and ours, with each reader (chained
    reads from storage once, and every rank reading for itself)."""
    readers = [("dcp", lambda: ct.TurboReader(f"{root}/dcp", broadcast=True)),
               ("ours", lambda: ct.TurboReader(f"{root}/ours", broadcast=True)),
               ("ours", lambda: ct.TurboReader(f"{root}/ours", broadcast=False)),
               ("fs", lambda: FileSystemReader(f"{root}/fs"))]
    planners = (DefaultLoadPlanner, lambda: ct.TurboLoadPlanner(dist.group.WORLD))
    for (name, reader), planner in itertools.product(readers, planners):
        expected = _replicated(world)
        sd = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0)
              for k, v in expected.items()}
        dcp.load(sd, storage_reader=reader(), planner=planner())
        for key, value in expected.items():
            got = sd[key]
            if isinstance(value, torch.Tensor):
                assert torch.equal(got.full_tensor() if hasattr(got, "full_tensor") else got,
                                   value.full_tensor() if hasattr(value, "full_tensor")
                                   else value), (name, key)
            else:
                assert got == value, (name, key)


def _items(url: str) -> dict:
    """A manifest's item records as stored (format version 3: kind, dtype, shape, ...,
    boxes, then pieces and the chunks they name)."""
    return json.loads(Location(url).read_manifest().to_bytes())["items"]


def test_planners_and_writers_mix_and_make_the_same_checkpoint(tmp_path):
    root = str(tmp_path / "run")
    stats = run_distributed(_save_both_ways, 4, root, timeout=240)
    # balanced over every holder as with DCP's planner: each byte written once
    unique = Location(f"{root}/ours").read_manifest().unique_bytes
    assert sum(s.bytes_written + s.bytes_reused for s in stats) == unique
    # The same items, boxes and whole chunks; only the replicated object ("step") is
    # written by the first rank of its plan group (DCP's dedup spreads objects over all
    # ranks), so the chunk that packs small pieces differs (docs/usage.md, "Planners").
    ours, theirs = _items(f"{root}/ours"), _items(f"{root}/dcp")
    assert ours.keys() == theirs.keys()
    assert ours["w"] == theirs["w"]
    for key in ("b", "fsdp.w"):
        assert ours[key][:5] == theirs[key][:5], key
    run_distributed(_load_everywhere, 4, root, timeout=240)
    run_distributed(_load_everywhere, 2, root, timeout=240)


def _save_three_times(rank: int, world: int, root: str) -> list[int]:
    """One writer, three saves: the same layout twice, then one more tensor."""
    writer = ct.TurboWriter(f"{root}/a", chunk_size=16 << 10)
    hits = []
    for step, extra in enumerate((False, False, True)):
        sd = _replicated(world)
        if extra:
            sd["new"] = torch.arange(10.0)
        writer.reset(f"{root}/step-{step}")
        dcp.save(sd, storage_writer=writer, planner=ct.TurboSavePlanner(dist.group.WORLD))
        hits.append(writer.plan_cache_hits)
    return hits


def test_the_writer_reuses_a_grouped_plan_while_the_digests_stay(tmp_path):
    root = str(tmp_path / "run")
    hits = run_distributed(_save_three_times, 2, root, timeout=240)
    assert hits[0] == [0, 1, 1]  # the coordinator planned the first and the third save
    sd = {"new": torch.zeros(10), **{k: (torch.zeros_like(v) if isinstance(v, torch.Tensor)
                                         else 0) for k, v in _replicated(1).items()}}
    dcp.load(sd, storage_reader=ct.TurboReader(f"{root}/step-2"))
    assert torch.equal(sd["new"], torch.arange(10.0)) and torch.equal(sd["w"], _replicated(1)["w"])
